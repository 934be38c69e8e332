"""The asyncio request handler in-process: the real edge, a fake Dynamo context, no frontend.

Covers what the e2e tests cannot force: Dynamo leaving the generator suspended after a stop (the stop must still
cancel the trio task), and the exact exception each failure becomes.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import dynamo.llm.exceptions as dx
import pytest
import trio

from sidecar.dynamo import CANCELLED_CHUNK, ChunkSink, Registration, RequestContext
from sidecar.dynamo._bindings import dynamo_exception
from sidecar.dynamo._handler import make_handler
from sidecar.edge import Edge, open_edge
from sidecar.errors import (
    DynamoErrorKind,
    EngineFailure,
    EngineGone,
    EngineRpcError,
    GrpcCode,
    ProtocolViolation,
    RequestRejected,
    SidecarError,
    Violation,
    WorkerDraining,
)
from tests.helpers.handlers import cancel_on_stop
from tests.helpers.waits import wait_until

TIMEOUT = 10


class FakeContext:
    """What the handler uses of ``dynamo._core.Context``; create it on the edge loop."""

    def __init__(self) -> None:
        self.stopped: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def id(self) -> str:
        return "req-1"

    def is_stopped(self) -> bool:
        return self.stopped.done()

    def trace_headers(self) -> dict[str, str] | None:
        return {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "x-request-id": "x"}

    def async_killed_or_stopped(self) -> asyncio.Future[bool]:
        return self.stopped

    def stop(self) -> None:
        if not self.stopped.done():
            self.stopped.set_result(True)


class Probe:
    """A trio handler with knobs, recording what happened to its task. Like the worker's, it delivers its chunks to
    the outbox on the edge loop and ends it there; a stop from Dynamo cancels its scope."""

    def __init__(self, batches: int = 3, error: BaseException | None = None, forever: bool = False) -> None:
        self.batches = batches
        self.error = error
        self.forever = forever
        self.cancelled = trio.Event()
        self.finished = trio.Event()
        self.ctx: RequestContext | None = None
        self.edge: Edge | None = None

    async def __call__(self, request: dict[str, Any], ctx: RequestContext, outbox: ChunkSink) -> None:
        self.ctx = ctx
        edge = self.edge
        assert edge is not None
        try:
            with trio.CancelScope() as scope:
                edge.to_loop(cancel_on_stop, edge, outbox, scope)
                i = 0
                while self.forever or i < self.batches:
                    edge.to_loop(outbox.deliver, [{"token_ids": [2 * i]}, {"token_ids": [2 * i + 1]}])
                    i += 1
                    await trio.sleep(0.005)  # not a synchronisation: the fake engine's pace
                if self.error is not None:
                    raise self.error
                edge.to_loop(outbox.end)
            if scope.cancelled_caught:
                self.cancelled.set()
        except trio.Cancelled:
            self.cancelled.set()
            raise
        finally:
            self.finished.set()


async def start(edge: Edge, nursery: trio.Nursery, probe: Probe) -> tuple[Any, FakeContext]:
    """Create the generator and its context on the edge loop."""

    probe.edge = edge

    async def create() -> tuple[Any, FakeContext]:
        ctx = FakeContext()
        return make_handler(edge, nursery, probe)[0]({"token_ids": [1]}, ctx), ctx

    return await edge.run(create)


async def take(edge: Edge, agen: Any, n: int | None = None) -> tuple[list[dict[str, Any]], BaseException | None]:
    """Read ``n`` chunks (or to the end) on the edge loop; returns the chunks and what ended the read."""

    async def read() -> tuple[list[dict[str, Any]], BaseException | None]:
        out: list[dict[str, Any]] = []
        try:
            while n is None or len(out) < n:
                out.append(await agen.__anext__())
        except StopAsyncIteration:
            return out, None
        except Exception as error:
            return out, error
        return out, None

    return await edge.run(read)


async def test_chunks_are_flattened_in_order_and_the_context_is_passed() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge, trio.open_nursery() as nursery:
            probe = Probe(batches=3)
            agen, _ = await start(edge, nursery, probe)
            chunks, error = await take(edge, agen)
            assert error is None
            # The two chunks of a batch arrive together, so they are coalesced (sidecar.convert.coalesce).
            assert [t for c in chunks for t in c["token_ids"]] == list(range(6))
            assert len(chunks) <= 3
            assert probe.ctx is not None
            assert probe.ctx.request_id == "req-1"
            assert probe.ctx.trace_headers == {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
            assert not probe.cancelled.is_set()


async def test_a_stop_cancels_the_trio_task_even_if_dynamo_never_touches_the_generator_again() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge, trio.open_nursery() as nursery:
            probe = Probe(forever=True)
            agen, ctx = await start(edge, nursery, probe)
            chunks, _ = await take(edge, agen, 1)
            assert chunks == [{"token_ids": [0, 1]}]  # the first batch, coalesced
            # The generator stays suspended at its yield, as the binding sometimes leaves it after a stop.
            t0 = trio.current_time()
            await edge.run(_call_soon, ctx.stop)
            with trio.fail_after(1):
                await probe.cancelled.wait()
            assert trio.current_time() - t0 < 0.5
            await edge.run(agen.aclose)


async def _call_soon(fn: Any) -> None:
    fn()


async def test_a_stop_while_dynamo_waits_ends_the_stream_with_a_cancelled_chunk() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge, trio.open_nursery() as nursery:
            probe = Probe(forever=True)
            agen, ctx = await start(edge, nursery, probe)

            async def read_then_stop() -> list[dict[str, Any]]:
                out = [await agen.__anext__()]
                asyncio.get_running_loop().call_later(0.05, ctx.stop)
                async for chunk in agen:
                    out.append(chunk)
                return out

            chunks = await edge.run(read_then_stop)
            assert chunks[-1] == CANCELLED_CHUNK
            with trio.fail_after(1):
                await probe.cancelled.wait()


async def test_closing_the_generator_cancels_the_trio_task() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge, trio.open_nursery() as nursery:
            probe = Probe(forever=True)
            agen, _ = await start(edge, nursery, probe)
            await take(edge, agen, 3)
            await edge.run(agen.aclose)
            with trio.fail_after(1):
                await probe.cancelled.wait()


async def test_dropping_the_iterator_before_its_end_cancels_the_trio_task() -> None:
    """Dynamo 1.6.1 drops the iterator without stopping the context when it cannot publish a chunk to a frontend
    that gave up on the request (seen in the etcd soak: a request the NATS request plane delivered after a partition,
    its first publish failing at once). Failed before: the request ran to its end for nobody and counted finished."""
    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge, trio.open_nursery() as nursery:
            probe = Probe(forever=True)
            agen, _ = await start(edge, nursery, probe)
            await take(edge, agen, 1)
            del agen  # Dynamo's only reference: no aclose, no stop of the context
            gc.collect()
            with trio.fail_after(1):
                await probe.cancelled.wait()


async def test_a_stop_dynamo_reads_before_the_producer_looks_still_stops_the_producer() -> None:
    """A stop that comes before the producer registers for it, and that Dynamo reads (the cancelled chunk) before the
    producer looks, still reads as stopped to the producer. Seen in the etcd soak: a late-delivered request whose
    connect-back was reset at once -- Dynamo stopped the context and pulled the cancelled chunk while trio was still
    admitting the request. Failed before: ``stopped`` turned False once the chunk was read, and the request ran to its
    end for nobody and counted finished."""
    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge, trio.open_nursery() as nursery:
            admitted = trio.Event()
            probe = Probe(forever=True)

            async def late(request: dict[str, Any], ctx: RequestContext, outbox: ChunkSink) -> None:
                await admitted.wait()  # trio still admitting the request
                await probe(request, ctx, outbox)

            probe.edge = edge

            async def create() -> tuple[Any, FakeContext]:
                ctx = FakeContext()
                return make_handler(edge, nursery, late)[0]({"token_ids": [1]}, ctx), ctx

            agen, ctx = await edge.run(create)
            await edge.run(_call_soon, ctx.stop)
            chunks, error = await take(edge, agen)
            assert (chunks, error) == ([CANCELLED_CHUNK], None)
            admitted.set()
            with trio.fail_after(1):
                await probe.cancelled.wait()


@pytest.mark.parametrize(
    ("error", "expected", "message"),
    [
        (RequestRejected("messages", "no media"), dx.InvalidArgument, "messages: no media"),
        (EngineGone("engine restarted"), dx.Disconnected, "engine restarted"),
        (WorkerDraining("draining"), dx.EngineShutdown, "draining"),
        (
            EngineRpcError("Generate", GrpcCode.UNAVAILABLE, "refused"),
            dx.Disconnected,
            "Generate: UNAVAILABLE: refused",
        ),
        (
            EngineRpcError("Generate", GrpcCode.DEADLINE_EXCEEDED, ""),
            dx.ConnectionTimeout,
            "Generate: DEADLINE_EXCEEDED",
        ),
        (EngineFailure(5, "busy", retryable=True), dx.Disconnected, "OpenEngine [OVERLOADED]: busy"),
        (EngineFailure(10, "", retryable=False), dx.Cancelled, "OpenEngine [CANCELLED]"),
        (ProtocolViolation(Violation.EMPTY_EVENT, "x"), dx.Unknown, "engine protocol violation (empty_event): x"),
        (RuntimeError("oops"), dx.Unknown, "RuntimeError: oops"),
        (TimeoutError("slow"), dx.Unknown, "TimeoutError: slow"),  # never a migratable 504 by accident
    ],
)
async def test_failures_become_dynamo_exceptions_after_the_chunks_sent_before_them(
    error: Exception, expected: type[Exception], message: str
) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge, trio.open_nursery() as nursery:
            agen, _ = await start(edge, nursery, Probe(batches=1, error=error))
            chunks, raised = await take(edge, agen)
            assert [t for c in chunks for t in c["token_ids"]] == [0, 1]
            assert type(raised) is expected
            assert str(raised) == message
            # Dynamo prints what it gets with every cause's traceback: the cause stays in our own log line only.
            assert raised.__cause__ is None


async def test_a_failure_reaches_dynamo_without_a_single_frame() -> None:
    """Dynamo prints each exception with PyErr_Display: one line only if the exception carries no traceback, which
    an exception raised inside an async generator always does (four chained ones with its causes)."""
    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge, trio.open_nursery() as nursery:
            responses, _ = await start(edge, nursery, Probe(batches=1, error=EngineGone("engine lost")))

            async def last_future() -> asyncio.Future[Any]:
                while True:
                    future: asyncio.Future[Any] = responses.__anext__()
                    await asyncio.wait({future})  # as Dynamo does: it is never raised through a Python frame
                    if future.exception() is not None:
                        return future

            future = await edge.run(last_future)
            error = future.exception()
            assert type(error) is dx.Disconnected
            assert error.__traceback__ is None
            assert error.__cause__ is None
            assert error.__context__ is None


async def test_a_trio_task_cancelled_from_outside_is_migrated_as_engine_shutdown() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge, trio.open_nursery() as outer:
            async with trio.open_nursery() as requests:
                probe = Probe(forever=True)
                agen, _ = await start(edge, requests, probe)
                await take(edge, agen, 1)
                requests.cancel_scope.cancel(reason="drain deadline")
            _, raised = await take(edge, agen)
            assert type(raised) is dx.EngineShutdown
            assert "drain deadline" in str(raised)
            outer.cancel_scope.cancel()


class Tokens:
    """A trio handler delivering one single-token chunk at a time, the last one with a finish reason."""

    def __init__(self, edge: Edge, count: int, pause: float) -> None:
        self.edge = edge
        self.count = count
        self.pause = pause
        self.yielded = 0

    async def __call__(self, request: dict[str, Any], ctx: RequestContext, outbox: ChunkSink) -> None:
        for i in range(self.count):
            chunk: dict[str, Any] = {"token_ids": [i], "index": 0}
            if i == self.count - 1:
                chunk["finish_reason"] = "length"
            self.edge.to_loop(outbox.deliver, [chunk])
            self.yielded += 1
            await trio.sleep(self.pause)  # not a synchronisation: the fake engine's pace
        self.edge.to_loop(outbox.end)


async def test_a_consumer_that_keeps_up_gets_every_chunk_alone() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge, trio.open_nursery() as nursery:

            async def create() -> Any:
                return make_handler(edge, nursery, Tokens(edge, 5, pause=0.02))[0]({"token_ids": [1]}, FakeContext())

            agen = await edge.run(create)
            chunks, error = await take(edge, agen)
            assert error is None
            assert [c["token_ids"] for c in chunks] == [[0], [1], [2], [3], [4]]
            assert chunks[-1]["finish_reason"] == "length"


async def test_chunks_pending_while_dynamo_is_busy_are_coalesced_in_order() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge, trio.open_nursery() as nursery:
            tokens = Tokens(edge, 50, pause=0)

            async def read_slowly() -> list[dict[str, Any]]:
                agen = make_handler(edge, nursery, tokens)[0]({"token_ids": [1]}, FakeContext())
                out = [await agen.__anext__()]
                # Dynamo busy: the other 49 tokens pile up (the engine has produced them all).
                await wait_until(lambda: tokens.yielded == 50, timeout=10)
                out.extend([chunk async for chunk in agen])
                return out

            chunks = await edge.run(read_slowly)
            assert [t for c in chunks for t in c["token_ids"]] == list(range(50))
            assert len(chunks) < 10  # typically 2: the first token alone, then the 49 that piled up
            assert chunks[-1]["finish_reason"] == "length"
            assert all("finish_reason" not in c for c in chunks[:-1])


@pytest.mark.parametrize("kind", list(DynamoErrorKind))
def test_every_error_kind_names_a_dynamo_exception_class(kind: DynamoErrorKind) -> None:
    error = SidecarError("m")
    error.kind = kind
    assert type(dynamo_exception(error)).__name__ == kind.value
    assert hasattr(dx, kind.value)


def test_registration_validation() -> None:
    Registration(model_path="/m", served_model_name="x", worker_type="prefill", endpoint_types=(), needs=(("decode",),))
    with pytest.raises(ValueError, match="endpoint_types"):
        Registration(model_path="/m", served_model_name="x", endpoint_types=())
    with pytest.raises(ValueError, match="worker_type"):
        Registration(model_path="/m", served_model_name="x", worker_type="both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs"):
        Registration(model_path="/m", served_model_name="x", needs=(("nobody",),))  # type: ignore[arg-type]
