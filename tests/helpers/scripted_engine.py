"""One scripted, in-memory engine client for the request-task tests (``tests/test_requests.py``,
``tests/disagg/test_deferral.py``), in trio's virtual time.

:class:`ScriptedEngine` plays a scripted ``Generate`` stream and records what the engine side would observe: the
opened requests and their metadata, streams closed before their end, and aborts. Its ``abort`` reaches a
checkpoint **before** it records the id, as a real RPC would: an Abort sent from a cancelled task without a shield
never arrives, so a test asserting the abort catches an unshielded one.

The request's data path (``sidecar.datapath``) runs on the edge loop in production. Here its loop is trio itself
(:class:`TrioEdge`: posts are ``run_sync_soon``, timers are system tasks on trio's clock), so the same code runs in
virtual time; the engine's stream is played into the path (``start_generate``) and the outbox is :class:`TrioSink`,
which a test reads through :func:`serve` as a client that keeps up would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest
import trio

from openengine.v1 import generation_pb2 as pb
from openengine_bp.openengine.v1 import (
    AbortResponse,
    AbortStatus,
    DeploymentCapacity,
    GenerationCapabilities,
    HealthResponse,
    HealthState,
    LogprobCapabilities,
    ModelInfo,
    ServerInfo,
)
from sidecar.convert import Capabilities
from sidecar.dynamo import RequestContext
from sidecar.requests import RequestServer
from statemachines import REQUEST, RequestLifecycle

if TYPE_CHECKING:
    from sidecar.edge import Edge

__all__ = [
    "RID",
    "LoopSideGenerate",
    "Recorder",
    "ScriptedEngine",
    "Step",
    "TrioEdge",
    "TrioSink",
    "caps",
    "collect",
    "error",
    "finished",
    "recorder",
    "serve",
    "token",
]

RID = "req-1"

# A scripted engine answer: a pause (virtual seconds) then a batch, an exception, or None to hang forever.
Step = tuple[float, "list[pb.GenerateResponse] | BaseException | None"]


class _Timer:
    """A timer of :class:`TrioLoop`: a system task sleeping until ``when`` on trio's clock."""

    def __init__(self, when: float, callback: Callable[..., object], args: tuple[Any, ...]) -> None:
        self._scope = trio.CancelScope()
        trio.lowlevel.spawn_system_task(self._run, when, callback, args)

    async def _run(self, when: float, callback: Callable[..., object], args: tuple[Any, ...]) -> None:
        with self._scope:
            await trio.sleep_until(when)
            callback(*args)

    def cancel(self) -> None:
        self._scope.cancel()


class TrioLoop:
    """What a data path uses of its event loop (``sidecar.datapath.Loop``), on trio's (virtual) clock."""

    def time(self) -> float:
        return trio.current_time()

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> _Timer:
        return _Timer(when, callback, args)


class TrioEdge:
    """The edge of the request tests: the "loop" is trio itself; both directions post with ``run_sync_soon`` (in
    order, never inline, as the real crossings)."""

    def __init__(self) -> None:
        self.loop = TrioLoop()
        self._token = trio.lowlevel.current_trio_token()

    def to_loop(self, fn: Callable[..., object], *args: Any) -> bool:
        self._token.run_sync_soon(fn, *args)
        return True

    to_trio = to_loop


class TrioSink:
    """The outbox of the request tests (``sidecar.dynamo.ChunkSink``): every delivery is one batch for the reader,
    which keeps up (nothing is merged); :meth:`stop` is Dynamo stopping the request."""

    def __init__(self) -> None:
        self.on_stop: Callable[[], None] | None = None
        self._batches: list[list[dict[str, Any]]] = []
        self._outcome: BaseException | bool | None = None  # True: ended; an exception: failed
        self._stopped = False
        self._wake = trio.Event()

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def has_room(self) -> bool:
        return True

    def deliver(self, chunks: list[dict[str, Any]]) -> None:
        if self._outcome is None and not self._stopped:
            self._batches.append(list(chunks))
            self._wake.set()

    def when_room(self, callback: Callable[[], None]) -> None:
        callback()

    def end(self) -> None:
        if self._outcome is None:
            self._outcome = True
            self._wake.set()

    def fail(self, error: BaseException) -> None:
        if self._outcome is None:
            self._outcome = error
            self._wake.set()

    def stop(self) -> None:
        if self._outcome is None and not self._stopped:
            self._stopped = True
            if self.on_stop is not None:
                self.on_stop()

    async def read(self) -> AsyncIterator[list[dict[str, Any]]]:
        while True:
            if self._batches:
                yield self._batches.pop(0)
                continue
            outcome = self._outcome
            if isinstance(outcome, BaseException):
                raise outcome
            if outcome:
                return
            self._wake = trio.Event()
            await self._wake.wait()


class EdgeSink:
    """A :class:`TrioSink` behind a real edge (a server whose engine client runs on the edge loop): the data path
    calls this outbox on the loop, and each call is posted to trio in order; a stop from the reader reaches the
    producer's ``on_stop`` on the loop, as Dynamo's does."""

    def __init__(self, edge: Edge, inner: TrioSink) -> None:
        self.on_stop: Callable[[], None] | None = None
        self._edge = edge
        self._inner = inner
        self._stopped = False
        inner.on_stop = self._stop_from_trio

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def has_room(self) -> bool:
        return True

    def deliver(self, chunks: list[dict[str, Any]]) -> None:
        self._edge.to_trio(self._inner.deliver, list(chunks))

    def when_room(self, callback: Callable[[], None]) -> None:
        callback()

    def end(self) -> None:
        self._edge.to_trio(self._inner.end)

    def fail(self, error: BaseException) -> None:
        self._edge.to_trio(self._inner.fail, error)

    def _stop_from_trio(self) -> None:
        self._edge.to_loop(self._stop)

    def _stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            if self.on_stop is not None:
                self.on_stop()


async def serve(
    server: RequestServer, body: dict[str, Any], ctx: RequestContext | None = None, *, edge: Edge | None = None
) -> AsyncIterator[list[dict[str, Any]]]:
    """Run one request as the Dynamo adapter does (its task apart from the reader's) and yield its batches as a client
    that keeps up reads them; leaving early stops the request (the client went away) and waits for its end. With
    ``edge``, the server's data path runs on that real edge's loop (:class:`EdgeSink`)."""
    reader = TrioSink()
    sink: TrioSink | EdgeSink = reader if edge is None else EdgeSink(edge, reader)
    done = trio.Event()

    async def task() -> None:
        try:
            await server.handle(body, ctx if ctx is not None else RequestContext(request_id=RID), sink)
        except Exception as exc:  # what the adapter does with an exception (WorkerDraining: not serving)
            sink.fail(exc)
        finally:
            done.set()

    trio.lowlevel.spawn_system_task(task)
    try:
        async for batch in reader.read():
            yield batch
    finally:
        reader.stop()
        with trio.CancelScope(shield=True):
            await done.wait()


class LoopSideGenerate:
    """What a fake engine client with a trio ``generate`` (an async context manager of batches) needs for a request's
    data path: ``edge`` (a :class:`TrioEdge`) and the loop-side ``start_generate``, which plays its ``generate`` into
    the sink from a task of its own (leaving the stream early is the sink's ``on_cancel``)."""

    _edge: TrioEdge | None = None

    @property
    def edge(self) -> TrioEdge:
        if self._edge is None:
            self._edge = TrioEdge()
        return self._edge

    def generate(
        self, request: pb.GenerateRequest, *, metadata: Sequence[tuple[str, str]] = ()
    ) -> AbstractAsyncContextManager[AsyncIterator[list[pb.GenerateResponse]]]:
        raise NotImplementedError

    def start_generate(
        self, request: pb.GenerateRequest, sink: Any, *, metadata: Sequence[tuple[str, str]] = ()
    ) -> None:
        scope = trio.CancelScope()
        sink.on_cancel = scope.cancel
        trio.lowlevel.spawn_system_task(self._play, request, metadata, sink, scope)

    async def _play(
        self, request: pb.GenerateRequest, metadata: Sequence[tuple[str, str]], sink: Any, scope: trio.CancelScope
    ) -> None:
        with scope:
            try:
                async with self.generate(request, metadata=metadata) as stream:
                    async for batch in stream:
                        sink.push(batch)
            except Exception as exc:
                sink.fail(exc)
            else:
                sink.end()


class ScriptedEngine(LoopSideGenerate):
    """Plays a scripted Generate stream (the same script for every request) and records what the engine saw."""

    def __init__(self, script: Sequence[Step], *, health: HealthState = HealthState.READY) -> None:
        self.script = list(script)
        self.opened: list[pb.GenerateRequest] = []
        self.metadata: list[tuple[tuple[str, str], ...]] = []
        self.stream_closed_early = 0
        self.aborts: list[str] = []
        self.health_state = health
        #: Virtual time of each abort, in order (for "aborted at once" checks).
        self.abort_times: list[float] = []

    @asynccontextmanager
    async def generate(
        self, request: pb.GenerateRequest, *, metadata: Sequence[tuple[str, str]] = ()
    ) -> AsyncIterator[AsyncIterator[list[pb.GenerateResponse]]]:
        self.opened.append(request)
        self.metadata.append(tuple(metadata))
        stream = _ScriptedStream(self.script, request.request_id)
        try:
            yield stream
        finally:
            if not stream.finished:
                self.stream_closed_early += 1

    def start_generate(
        self, request: pb.GenerateRequest, sink: Any, *, metadata: Sequence[tuple[str, str]] = ()
    ) -> None:
        """The loop-side Generate: the script is played into ``sink``; a reset before its end is counted at once (the
        engine sees the RST_STREAM when the path closes, not when the playing task gets round to unwinding)."""
        self.opened.append(request)
        self.metadata.append(tuple(metadata))
        stream = _ScriptedStream(self.script, request.request_id)
        scope = trio.CancelScope()

        def reset() -> None:
            if not stream.finished:
                stream.finished = True
                self.stream_closed_early += 1
            scope.cancel()

        sink.on_cancel = reset
        trio.lowlevel.spawn_system_task(self._play_script, stream, sink, scope)

    @staticmethod
    async def _play_script(stream: _ScriptedStream, sink: Any, scope: trio.CancelScope) -> None:
        with scope:
            try:
                async for batch in stream:
                    sink.push(batch)
            except Exception as exc:
                stream.finished = True
                sink.fail(exc)
            else:
                sink.end()

    async def abort(self, request_id: str, *, timeout_s: float | None = None) -> AbortResponse:
        # A real Abort is an RPC: its first await is where an unshielded, cancelled caller stops.
        await trio.lowlevel.checkpoint()
        self.aborts.append(request_id)
        self.abort_times.append(trio.current_time())
        return AbortResponse(status=AbortStatus.ABORTED)

    async def health(self, *, timeout_s: float | None = None) -> HealthResponse:
        await trio.lowlevel.checkpoint()
        return HealthResponse(state=self.health_state)


class _ScriptedStream:
    """The engine side of one stream: each step is due at a fixed time after the open (the engine works whether or
    not the reader is waiting), and a read interrupted by cancellation loses nothing (as the bridge's stream)."""

    def __init__(self, script: Sequence[Step], request_id: str) -> None:
        self._steps = list(script)
        self._request_id = request_id
        self._due: list[float] = []
        at = trio.current_time()
        for delay, _ in self._steps:
            at += delay
            self._due.append(at)
        self._next = 0
        self.finished = False

    def __aiter__(self) -> _ScriptedStream:
        return self

    async def __anext__(self) -> list[pb.GenerateResponse]:
        if self._next >= len(self._steps):
            self.finished = True
            await trio.lowlevel.checkpoint()
            raise StopAsyncIteration
        await trio.sleep_until(self._due[self._next])
        _, item = self._steps[self._next]
        if item is None:
            await trio.sleep_forever()
        self._next += 1
        if isinstance(item, BaseException):
            raise item
        return [_with_id(r, self._request_id) for r in item]


def _with_id(response: pb.GenerateResponse, request_id: str) -> pb.GenerateResponse:
    """Scripts are written for :data:`RID`; another request (a canary, a second request) gets its own id."""
    if response.request_id != RID or request_id == RID:
        return response
    copy = pb.GenerateResponse()
    copy.CopyFrom(response)
    copy.request_id = request_id
    return copy


def caps() -> Capabilities:
    server = ServerInfo(
        engine_name="fake",
        schema_revision=1,
        minimum_client_revision=1,
        supported_models=["tiny"],
        capacity=DeploymentCapacity(kv_block_size=16, total_kv_blocks=100, max_running_requests=8),
    )
    model = ModelInfo(
        model_id="tiny",
        served_model_name="tiny",
        max_context_length=256,
        supports_token_ids_input=True,
        generation=GenerationCapabilities(
            max_num_sequences=2,
            output_logprobs=LogprobCapabilities(supported=True, max_top_n=5),
        ),
    )
    return Capabilities.from_discovery(server, model)


def token(index: int, *ids: int, text: str | None = None) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=RID)
    response.token.output_index = index
    for i in ids:
        response.token.tokens.add(token_id=i)
    if text is not None:
        response.token.text = text
    return response


def finished(
    index: int,
    reason: int = pb.FINISH_REASON_LENGTH,
    usage: tuple[int, int] | None = (3, 2),
    *,
    cached: int | None = None,
) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=RID)
    response.finished.output_index = index
    response.finished.reason = reason  # type: ignore[assignment]
    if usage is not None:
        response.usage.prompt_tokens, response.usage.completion_tokens = usage
        response.usage.total_tokens = sum(usage)
        if cached is not None:
            response.usage.cached_prompt_tokens = cached
    return response


def error(code: int, retryable: bool, message: str = "boom") -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=RID)
    response.error.code = code  # type: ignore[assignment]
    response.error.message = message
    response.error.retryable = retryable
    response.usage.prompt_tokens = 3
    return response


class Recorder:
    """Observes request transitions (the machine is shared: filter by our request id)."""

    def __init__(self, request_id: str = RID) -> None:
        self.request_id = request_id
        self.events: list[tuple[str, str]] = []

    def __call__(self, model: RequestLifecycle, event: str, source: str, dest: str) -> None:
        if model.request_id == self.request_id:
            self.events.append((event, dest))

    @property
    def final(self) -> str:
        return self.events[-1][1]


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    REQUEST.observers.append(rec)
    yield rec
    REQUEST.observers.remove(rec)


async def collect(server: RequestServer, body: dict[str, Any], request_id: str = RID) -> list[dict[str, Any]]:
    """Run one request to its end as a client that reads everything; returns every chunk."""
    out: list[dict[str, Any]] = []
    async for batch in serve(server, body, RequestContext(request_id=request_id)):
        out.extend(batch)
    return out
