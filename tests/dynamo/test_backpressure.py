"""The outbox's bound against an engine behind HTTP/2 flow control: a consumer that stops reading holds the engine.

In trio's virtual time, the real request task (``sidecar.requests``), data path (``sidecar.datapath``) and outbox
(``sidecar.dynamo._handler._Outbox``, what Dynamo reads) run against :class:`FlowControlledEngine`: an engine whose
sends wait for window once it has ``window`` messages the sidecar has not acknowledged, fed through the producer
contract of the sidecar's direct receive path (``sidecar.engine._direct``: every message received is pushed;
acknowledged after a push with room; after a push without room the acknowledgement waits until the sink's ``hold``
calls back). That the real producer keeps this contract with a real HTTP/2 peer is
``tests/engine/test_start_generate.py``'s; what it holds the engine back *for* is the outbox's room, tested here.

The outbox's reader is Dynamo's side (``next_chunk``), read here by the test as Dynamo would. A state where the engine
waits for window while the producer holds its acknowledgements changes only when Dynamo reads again or stops the
request, so the tests wait for every task to be blocked (``trio.testing.wait_all_tasks_blocked``), not for a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from openengine.v1 import generation_pb2 as pb
from openengine_bp.openengine.v1 import AbortResponse, AbortStatus
from sidecar.dynamo import RequestContext
from sidecar.dynamo._handler import _MAX_PENDING_TOKENS, _Outbox
from sidecar.requests import RequestServer, ServingContext
from tests.helpers.scripted_engine import RID, Recorder, TrioEdge, caps, finished, recorder, token

__all__ = ["recorder"]  # the fixture, imported for this module's tests

Clock = trio.testing.MockClock

#: Messages the engine may send beyond what the sidecar acknowledged (one token per message): the stream window.
WINDOW = 256
#: An answer far longer than the outbox's bound and the window together.
ANSWER = 20_000


class _Future:
    """What ``_Outbox.next_chunk`` hands Dynamo (an asyncio future there), settled and awaited in trio."""

    def __init__(self) -> None:
        self._settled = trio.Event()
        self._value: dict[str, Any] | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._settled.is_set()

    def set_result(self, value: dict[str, Any]) -> None:
        self._value = value
        self._settled.set()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._settled.set()

    async def get(self) -> dict[str, Any] | None:
        """The chunk; None at the end of the stream."""
        await self._settled.wait()
        if isinstance(self._error, StopAsyncIteration):
            return None
        if self._error is not None:
            raise self._error
        return self._value


class _OutboxLoop:
    """What the outbox uses of its asyncio loop (Dynamo's side only), on trio: the loop of these tests is trio."""

    def __init__(self) -> None:
        self._token = trio.lowlevel.current_trio_token()

    def create_future(self) -> _Future:
        return _Future()

    def call_soon_threadsafe(self, fn: Callable[..., object], *args: Any) -> None:
        self._token.run_sync_soon(fn, *args)


async def read(outbox: _Outbox) -> dict[str, Any] | None:
    """One ``next_chunk`` as Dynamo's reader does it: the chunk, or None at the end."""
    future: _Future = outbox.next_chunk()  # type: ignore[assignment]
    return await future.get()


class _Stream:
    """One ``Generate`` stream of :class:`FlowControlledEngine`: the engine's sends and the sidecar's producer."""

    def __init__(self, engine: FlowControlledEngine, request: pb.GenerateRequest, sink: Any) -> None:
        self.engine = engine
        self.request_id = request.request_id
        self.sink = sink
        self.scope = trio.CancelScope()
        self.unacknowledged = 0  # messages sent the sidecar has not acknowledged (the window they use)
        self.acks_held = False  # the producer waits for the sink's room before acknowledging
        self.window_opened = trio.Event()
        self.over = False

    async def run(self) -> None:
        engine = self.engine
        with self.scope:
            sent = 0
            while True:
                terminal = sent >= engine.answer
                while self.unacknowledged >= engine.window:
                    engine.waiting_for_window = True
                    self.window_opened = trio.Event()
                    await self.window_opened.wait()
                engine.waiting_for_window = False
                await trio.lowlevel.checkpoint()  # the engine's pace: the rest of the world runs between two sends
                if terminal:
                    message = finished(0, pb.FINISH_REASON_LENGTH, usage=(3, sent))
                else:
                    message = token(0, sent, text="a")
                    sent += 1
                engine.sent = sent
                self.unacknowledged += 1
                self._received([message])
                if terminal:
                    break
            self.over = True
            engine.live.pop(self.request_id, None)
            self.sink.end()

    # The producer's side, as ``sidecar.engine._direct.DirectStream.flush`` / ``_room`` do it.

    def _received(self, messages: list[pb.GenerateResponse]) -> None:
        room = self.sink.push(messages)
        if self.acks_held:
            return
        if room:
            self._acknowledge()
        else:
            self.acks_held = True
            self.engine.holds += 1
            self.sink.hold(self._room)

    def _room(self) -> None:
        self.acks_held = False
        self._acknowledge()

    def _acknowledge(self) -> None:
        self.unacknowledged = 0
        self.window_opened.set()

    def reset(self) -> None:
        """``on_cancel``: RST_STREAM; the engine drops the request."""
        if not self.over:
            self.over = True
            self.engine.resets += 1
            self.engine.live.pop(self.request_id, None)
            self.scope.cancel()


class FlowControlledEngine:
    """The engine client of these tests: streams ``answer`` single-token messages, then its terminal, and never has
    more than ``window`` messages unacknowledged (see the module docstring). Records what the engine sees."""

    def __init__(self, answer: int = ANSWER, window: int = WINDOW) -> None:
        self.answer = answer
        self.window = window
        self.sent = 0  # token messages sent on the (latest) stream
        self.waiting_for_window = False
        self.holds = 0  # times the producer held its acknowledgements back for the sink's room
        self.resets = 0
        self.live: dict[str, _Stream] = {}  # requests the engine is working on
        self.aborts: list[tuple[str, float]] = []  # (request id, virtual time)
        self._edge: TrioEdge | None = None

    @property
    def edge(self) -> TrioEdge:
        if self._edge is None:
            self._edge = TrioEdge()
        return self._edge

    def finish_next(self) -> None:
        """The engine's next message is its terminal (it has reached the end of its answer)."""
        self.answer = self.sent

    def start_generate(self, request: pb.GenerateRequest, sink: Any, *, metadata: Any = ()) -> None:
        stream = _Stream(self, request, sink)
        self.live[stream.request_id] = stream
        sink.on_cancel = stream.reset
        trio.lowlevel.spawn_system_task(stream.run)

    async def abort(self, request_id: str, *, timeout_s: float | None = None) -> AbortResponse:
        await trio.lowlevel.checkpoint()  # an RPC: an unshielded, cancelled caller never gets here
        self.aborts.append((request_id, trio.current_time()))
        stream = self.live.pop(request_id, None)
        if stream is None:
            return AbortResponse(status=AbortStatus.ALREADY_FINISHED)
        stream.scope.cancel()
        return AbortResponse(status=AbortStatus.ABORTED)


def server(engine: FlowControlledEngine) -> RequestServer:
    srv = RequestServer()
    srv.attach(
        ServingContext(
            client=engine,  # type: ignore[arg-type]
            caps=caps(),
            model="tiny",
            context_length=1_000_000,
            abort_timeout_s=1.0,
            inactivity_timeout_s=30.0,
        )
    )
    return srv


def body(*, stop: list[str] | None = None) -> dict[str, Any]:
    conditions: dict[str, Any] = {"max_tokens": ANSWER + 10}
    if stop is not None:
        conditions["stop"] = stop
    return {"token_ids": [5, 6, 7], "stop_conditions": conditions}


async def _request(srv: RequestServer, request: dict[str, Any], outbox: _Outbox, done: trio.Event) -> None:
    try:
        await srv.handle(request, RequestContext(request_id=RID), outbox)
    finally:
        done.set()


def tokens_of(chunks: list[dict[str, Any]]) -> list[int]:
    return [t for chunk in chunks for t in chunk["token_ids"]]


async def test_a_consumer_that_stops_reading_holds_the_engine_back_at_the_outbox_bound(
    autojump_clock: Clock, recorder: Recorder
) -> None:
    """Rule: when Dynamo stops reading (a client that stops reading its SSE stream, once the frontend's buffers are
    full), at most the outbox's bound (4,096 tokens) plus one stream window waits in the sidecar, and the engine's
    stream is held by flow control; when Dynamo reads again, the rest flows and the answer is whole."""
    engine = FlowControlledEngine()
    srv = server(engine)
    outbox = _Outbox(_OutboxLoop())  # type: ignore[arg-type]
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_request, srv, body(), outbox, done)
        chunks: list[dict[str, Any]] = []
        for _ in range(3):  # Dynamo reads a little, then stops reading
            chunk = await read(outbox)
            assert chunk is not None
            chunks.append(chunk)
        taken = len(tokens_of(chunks))
        await trio.testing.wait_all_tasks_blocked()  # nothing moves until Dynamo reads again

        assert engine.sent < engine.answer, (
            f"the engine wrote all {engine.sent} tokens of its answer to a consumer that stopped reading after "
            f"{taken}: nothing held it back"
        )
        assert not done.is_set(), "the request is still being served"
        assert engine.waiting_for_window, "the engine's stream is held by flow control"
        assert engine.holds == 1, "the producer held the engine's acknowledgements back for the outbox's room"
        pending = outbox.pending.tokens
        assert _MAX_PENDING_TOKENS <= pending <= _MAX_PENDING_TOKENS + WINDOW, (
            f"{pending} tokens wait for Dynamo: the outbox's bound is {_MAX_PENDING_TOKENS}, plus one window"
        )
        assert engine.sent - taken == pending, "everything the engine sent is in the outbox or was read"

        while (chunk := await read(outbox)) is not None:  # Dynamo reads again
            chunks.append(chunk)
        await done.wait()
    assert tokens_of(chunks) == list(range(ANSWER)), "the whole answer, in order"
    assert chunks[-1]["finish_reason"] == "length"
    assert recorder.final == "finished"
    assert engine.aborts == []
    assert engine.live == {}


async def _fill_then_stop(
    engine: FlowControlledEngine, request: dict[str, Any], recorder: Recorder
) -> tuple[_Outbox, float, int]:
    """Run ``request`` with a consumer that never reads until the engine is held, then stop it as Dynamo does;
    returns the outbox, the virtual time of the stop and the tokens the engine had sent by then."""
    srv = server(engine)
    outbox = _Outbox(_OutboxLoop())  # type: ignore[arg-type]
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_request, srv, request, outbox, done)
        await trio.testing.wait_all_tasks_blocked()
        assert engine.waiting_for_window, "precondition: the engine waits for window"
        assert engine.holds == 1, "precondition: the producer holds the engine back"
        assert outbox.pending.tokens >= _MAX_PENDING_TOKENS, "precondition: the outbox is full"
        stopped_at, held_at = trio.current_time(), engine.sent
        outbox.stop("the request was stopped or killed")  # the context's stop, as Dynamo delivers it
        await done.wait()
    assert srv.in_flight == 0
    return outbox, stopped_at, held_at


@pytest.mark.parametrize("stop_strings", [False, True], ids=["plain", "stop strings"])
async def test_a_client_that_stops_while_the_outbox_is_full_releases_the_engine_stream_at_once(
    autojump_clock: Clock, recorder: Recorder, stop_strings: bool
) -> None:
    """Rule: a stop while the outbox is full (4,096 tokens pending, the engine held by flow control) ends the request
    at once: the producer's hold is released, so the engine's next event reaches the data path (with stop strings
    any chunk may end the answer, and that event decides between a finish and a stop), the request is cancelled,
    its stream reset and Abort sent at the moment of the stop, and the engine holds nothing afterwards."""
    engine = FlowControlledEngine()
    outbox, stopped_at, held_at = await _fill_then_stop(engine, body(stop=["zzz"] if stop_strings else None), recorder)
    assert outbox.pending.tokens == 0, "what Dynamo had not read was dropped at the stop"
    assert recorder.final == "cancelled"
    assert engine.aborts == [(RID, stopped_at)], (
        f"Abort at {engine.aborts[0][1] if engine.aborts else None}, the stop at {stopped_at}: "
        "the stop must take effect at once, not after waiting for an engine event that flow control holds back"
    )
    assert engine.resets == 1, "the engine stream was reset"
    assert engine.live == {}, "the engine holds nothing"
    assert engine.sent > held_at, "after the stop the engine got window again: its next events reached the path"
