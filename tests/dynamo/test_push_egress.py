"""Push egress in-process: the real edge and handler, a fake ``ResponseSender`` with Dynamo 1.6.1's contract.

The rules (``sidecar.dynamo._egress``):

* Dynamo advances a push-mode iterator once; every chunk reaches ``response_sender.send`` in order, then ``close``,
  then that one ``__anext__`` ends. A failure sends the chunks before it and ends with the typed exception, without
  ``close`` (closing first would end the stream as a success).
* A stop says so once (the cancelled chunk), closes, and cancels the trio task; a consumer that is gone (``send``
  raising) gets nothing more.
* A send may block (the request's channel full: its frontend does not read). No blocked send ever stops the edge loop
  or another request: the loop sends a request's chunks itself only while the request has sent less than TCP alone
  would hold; past that, egress threads send, and a blocked one parks while another takes the queue. The request
  whose send is blocked keeps its chunks pending, merged, up to the outbox's bound: then its engine stream is held.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import dynamo.llm.exceptions as dx
import pytest
import trio

from sidecar.dynamo import CANCELLED_CHUNK, ChunkSink, RequestContext
from sidecar.dynamo._egress import Egress, wire_bytes
from sidecar.dynamo._handler import _MAX_PENDING_TOKENS, make_handler
from sidecar.edge import Edge, open_edge
from sidecar.errors import EngineGone
from tests.dynamo.test_handler import FakeContext, Probe, Tokens
from tests.helpers.waits import wait_until

TIMEOUT = 10


class FakeSender:
    """Dynamo's ``ResponseSender`` as the handler sees it: ``send`` raises after ``close`` or once the consumer is
    gone, and blocks (with the GIL released, as Dynamo's does) while ``released`` is clear."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.threads: list[str] = []
        self.closes = 0
        self.gone = False
        self.released = threading.Event()
        self.released.set()
        self.blocked = threading.Event()

    @property
    def closed(self) -> bool:
        return self.closes > 0

    def send(self, chunk: object) -> None:
        if self.closed:
            raise RuntimeError("response stream is closed; send() after close()")
        if self.gone:
            raise RuntimeError("response stream is closed; the consumer dropped the response stream")
        if not self.released.is_set():
            self.blocked.set()
            self.released.wait()
        assert isinstance(chunk, dict)
        self.sent.append(chunk)
        self.threads.append(threading.current_thread().name)

    def close(self) -> None:
        self.closes += 1

    def tokens(self) -> list[int]:
        return [t for c in self.sent for t in c["token_ids"]]


class Push:
    """One request served in push mode: its outbox's iterator (advanced once, as Dynamo does) and its sender."""

    def __init__(self, edge: Edge, generate: Any, handler_ctx: FakeContext, sender: FakeSender) -> None:
        self.edge = edge
        self.ctx = handler_ctx
        self.sender = sender
        self._iterator = generate
        self.done: asyncio.Future[Any] | None = None

    async def advance(self) -> None:
        """Dynamo's one ``__anext__`` (edge loop)."""

        async def call() -> None:
            self.done = self._iterator.__anext__()

        await self.edge.run(call)

    async def ended(self) -> BaseException:
        """What the one ``__anext__`` ended with (StopAsyncIteration for a success)."""

        async def wait() -> BaseException:
            assert self.done is not None
            await asyncio.wait({self.done})
            error = self.done.exception()
            assert error is not None, "a push-mode iterator never yields"
            return error

        return await self.edge.run(wait)


async def push(edge: Edge, nursery: trio.Nursery, handler: Any, egress: Egress | None = None) -> Push:
    """Start one request in push mode through ``make_handler`` (with ``egress``'s threads) and advance its
    iterator."""
    sender = FakeSender()

    async def create() -> Push:
        generate, _ = make_handler(edge, nursery, handler, egress=egress)
        ctx = FakeContext()
        return Push(edge, generate({"token_ids": [1]}, ctx, response_sender=sender), ctx, sender)

    request = await edge.run(create)
    await request.advance()
    return request


async def test_every_chunk_is_sent_in_order_then_the_stream_is_closed_and_the_iteration_ends() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge, trio.open_nursery() as nursery:
            probe = Probe(batches=3)
            probe.edge = edge
            request = await push(edge, nursery, probe)
            assert type(await request.ended()) is StopAsyncIteration
            assert request.sender.tokens() == list(range(6))
            assert request.sender.closes == 1
            assert probe.ctx is not None
            assert probe.ctx.request_id == "req-1"


async def test_a_failure_sends_the_chunks_before_it_and_ends_with_the_typed_error_without_closing() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge, trio.open_nursery() as nursery:
            probe = Probe(batches=1, error=EngineGone("engine lost"))
            probe.edge = edge
            request = await push(edge, nursery, probe)
            error = await request.ended()
            assert type(error) is dx.Disconnected
            assert str(error) == "engine lost"
            assert error.__traceback__ is None
            assert error.__cause__ is None
            assert request.sender.tokens() == [0, 1]
            assert request.sender.closes == 0


async def test_a_stop_says_so_once_closes_and_cancels_the_trio_task() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge, trio.open_nursery() as nursery:
            probe = Probe(forever=True)
            probe.edge = edge
            request = await push(edge, nursery, probe)
            await wait_until(lambda: len(request.sender.sent) >= 1, timeout=5)
            await edge.run(_call, request.ctx.stop)
            with trio.fail_after(1):
                await probe.cancelled.wait()
            assert type(await request.ended()) is StopAsyncIteration
            assert request.sender.sent[-1] == CANCELLED_CHUNK
            assert request.sender.sent.count(CANCELLED_CHUNK) == 1
            assert request.sender.closes == 1


async def test_a_consumer_that_is_gone_gets_nothing_more_and_its_stop_cancels_the_trio_task() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge, trio.open_nursery() as nursery:
            probe = Probe(forever=True)
            probe.edge = edge
            request = await push(edge, nursery, probe)
            await wait_until(lambda: len(request.sender.sent) >= 1, timeout=5)
            request.sender.gone = True  # the next send raises; Dynamo stops the context too
            await wait_until(lambda: len(request.sender.sent) >= 1, timeout=5)
            await edge.run(_call, request.ctx.stop)
            with trio.fail_after(1):
                await probe.cancelled.wait()
            assert type(await request.ended()) is StopAsyncIteration
            assert CANCELLED_CHUNK not in request.sender.sent


async def _call(fn: Any) -> None:
    fn()


class Held:
    """A trio handler delivering ``count`` one-token chunks as fast as the outbox takes them, waiting for room as the
    data path does (``has_room`` / ``when_room``); records whether it had to wait."""

    def __init__(self, edge: Edge, count: int) -> None:
        self.edge = edge
        self.count = count
        self.delivered = 0
        self.held = trio.Event()

    async def __call__(self, request: dict[str, Any], ctx: RequestContext, outbox: ChunkSink) -> None:
        for i in range(self.count):
            chunk: dict[str, Any] = {"token_ids": [i], "index": 0}
            if i == self.count - 1:
                chunk["finish_reason"] = "length"
            room = await self.edge.run(_deliver, outbox, chunk)
            self.delivered += 1
            if not room:
                self.held.set()
                room_again = trio.Event()

                def wake(event: trio.Event = room_again) -> None:
                    self.edge.to_trio(event.set)

                self.edge.to_loop(outbox.when_room, wake)
                await room_again.wait()
        self.edge.to_loop(outbox.end)


async def _deliver(outbox: ChunkSink, chunk: dict[str, Any]) -> bool:
    outbox.deliver([chunk])
    return outbox.has_room


async def test_a_blocked_send_stops_neither_the_loop_nor_another_request_and_holds_its_own_producer() -> None:
    """Request X's frontend stops reading (its sends block); request Y's chunks still go out at once, the loop runs,
    and X's producer is held at the outbox's bound; once X's frontend reads again, every token arrives in order."""
    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge, trio.open_nursery() as nursery:
            egress = Egress(edge.loop, direct_bytes=0, stall_s=0.01)  # every send from the egress threads
            x_handler = Held(edge, 3 * _MAX_PENDING_TOKENS)
            x = await push(edge, nursery, x_handler, egress)
            await wait_until(lambda: len(x.sender.sent) >= 1, timeout=5)
            x.sender.released.clear()
            await wait_until(x.sender.blocked.is_set, timeout=5)
            with trio.fail_after(5):
                await x_handler.held.wait()  # the outbox filled: the producer waits for room
            assert x_handler.delivered < 2 * _MAX_PENDING_TOKENS

            y = await push(edge, nursery, Tokens(edge, 20, pause=0), egress)
            assert type(await y.ended()) is StopAsyncIteration
            assert y.sender.tokens() == list(range(20))
            assert await edge.run(_loop_turns)
            assert egress.threads >= 2  # X's blocked send parks its thread

            x.sender.released.set()
            assert type(await x.ended()) is StopAsyncIteration
            assert x.sender.tokens() == list(range(3 * _MAX_PENDING_TOKENS))
            assert len(x.sender.sent) < x_handler.count  # what piled up while blocked went out merged
            egress.close()


async def _loop_turns() -> bool:
    await asyncio.sleep(0)
    return True


async def test_a_request_past_the_loops_budget_goes_on_from_the_egress_threads_in_order() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_edge() as edge, trio.open_nursery() as nursery:
            per_chunk = wire_bytes([{"token_ids": [0], "index": 0}])
            egress = Egress(edge.loop, direct_bytes=10 * per_chunk)
            request = await push(edge, nursery, Tokens(edge, 40, pause=0), egress)
            assert type(await request.ended()) is StopAsyncIteration
            assert request.sender.tokens() == list(range(40))
            threads = request.sender.threads
            assert threads[0] == "asyncio-edge"  # short answers never leave the loop
            assert threads[-1].startswith("dynamo-egress")
            first_egress = next(i for i, name in enumerate(threads) if name != "asyncio-edge")
            assert 0 < first_egress <= 10
            assert all(name.startswith("dynamo-egress") for name in threads[first_egress:])
            egress.close()


@pytest.mark.parametrize(
    ("chunk", "at_least"),
    [
        ({"token_ids": [1], "index": 0}, 16),
        ({"token_ids": list(range(50)), "index": 0}, 16 + 50 * 3),
        (
            {
                "token_ids": [1],
                "index": 0,
                "log_probs": [-0.1],
                "top_logprobs": [[{"token_id": 1, "logprob": -0.1}] * 20],
            },
            20 * 24,
        ),
    ],
)
def test_the_wire_estimate_is_never_below_the_encoded_size(chunk: dict[str, Any], at_least: int) -> None:
    """The loop's budget is safe only if the estimate bounds what msgpack puts on the stream (a map of a few keys,
    1-3 bytes per small int, ~20 bytes per logprob entry)."""
    assert wire_bytes([chunk]) >= at_least
