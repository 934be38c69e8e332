"""The asyncio request handler Dynamo calls, bridging each request to a trio handler task.

Per request, on the edge loop thread::

    Dynamo ──▶ generate(request, context) → outbox     the asyncio async iterator Dynamo iterates
                  ▲ pending chunks (coalesced; bounded in tokens)
               edge.trio_feed ──▶ trio handler task in the worker's request nursery
                  ▲ cancel
               context.async_killed_or_stopped()       (a done-callback, not code inside the iterator)

Adaptive coalescing across this hop: the trio task's batches land in the outbox as they arrive (the outbox is the
bridge's sink: no asyncio task wakes per batch), merged into the pending chunk of their output
(``sidecar.convert.coalesce``) while Dynamo is busy with the previous chunk; the iterator hands Dynamo everything
pending at once. Busy is also judged globally: Dynamo's cost is per chunk, and a saturated Dynamo still comes back
for each request's next chunk at once, so the outboxes of one handler share a gate (:class:`_DynamoGate`) that lets
at most ``max(2, in flight / 16)`` chunks be in Dynamo's hands, each slot held at least 2 ms; past that a request's
next chunk waits its turn (first come, first served) and what arrives meanwhile joins it. When Dynamo keeps up,
nothing waits and every chunk goes out alone, with no added delay. Only a consumer that stops reading holds the trio
task back: past :data:`_MAX_PENDING_TOKENS` pending tokens the outbox stops counting batches as taken, and the
bridge's bound then stops the trio task.

Why callbacks instead of a loop inside the iterator: Dynamo's cancellation is cooperative, and after a client
disconnect the binding (1.6.1) pulls about one more item, then either throws ``GeneratorExit`` in or leaves the
iterator suspended forever without closing it, so
nothing that must happen on a stop may live in an iterator's body or ``finally``. The stop future's callback cancels
the trio task (through the bridge) and ends the outbox.

Why an iterator whose ``__anext__`` returns a future instead of an async generator: Dynamo prints every exception a
handler raises with ``PyErr_Display`` (``map_python_exception`` in its bindings' ``engine.rs``), traceback included.
An exception raised inside a generator carries the generator's frame, and with its cause the whole chain: four
chained tracebacks for every request failed by an engine loss. A future failed with ``set_exception`` hands Dynamo
the exception without a single frame: one line, for the failures the worker expects (engine lost, drain deadline,
client gone). The worker's own log keeps one line per failure too, and a traceback only for bugs.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from typing import TYPE_CHECKING, Any, Final

from sidecar.convert.coalesce import PendingChunks
from sidecar.edge import EdgeError
from sidecar.errors import WorkerDraining

from ._bindings import dynamo_exception
from ._types import RequestContext

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    import trio

    from sidecar.edge import Edge, TrioFeed

    from ._bindings import Context
    from ._types import RequestHandler

__all__ = ["CANCELLED_CHUNK", "make_handler"]

logger: Final = logging.getLogger("sidecar.dynamo")

#: The last chunk a stopped request yields, if Dynamo still reads (``stop_generating`` from the frontend).
CANCELLED_CHUNK: Final[dict[str, Any]] = {"token_ids": [], "finish_reason": "cancelled"}


class _End:
    __slots__ = ()


class _Stopped:
    __slots__ = ()


#: Batches the trio handler may run ahead of the outbox (bridge backpressure).
_HIGH_WATER: Final = 8
#: Tokens that may wait for Dynamo before the outbox holds the trio task back (a consumer that stopped reading, not a
#: slow one).
_MAX_PENDING_TOKENS: Final = 4096

#: Chunks Dynamo may hold at once (handed over, its reader not back yet): at least this many, else one per this many
#: requests in flight. Past that, a request's next chunk waits its turn (first come, first served) and what arrives
#: meanwhile joins it: Dynamo's cost is per chunk, so a saturated Dynamo gets fewer, larger chunks -- coalescing by
#: Dynamo's global pace, where the per-request reader alone only sees its own. Below it nothing waits.
_GATE_MIN: Final = 2
_GATE_SHARE: Final = 16
#: A slot stays taken at least this long after its chunk was handed over, even if the reader is back sooner (Dynamo's
#: work for a chunk goes on after its reader returns): at most ``limit / hold`` chunks per second reach Dynamo once it
#: is busy, i.e. 2,000/s at 64 requests in flight. Under that rate nothing waits.
_GATE_HOLD_S: Final = 0.002
#: A chunk Dynamo has held this long no longer counts (a slow client's stream, not Dynamo's backlog): a few stalled
#: readers can never hold everyone else back.
_GATE_EXPIRE_S: Final = 0.05

_END: Final = _End()
_STOPPED: Final = _Stopped()

_Outcome = _End | _Stopped | Exception


class _DynamoGate:
    """Admission of chunks to Dynamo, shared by the outboxes of one handler (loop thread only; see _GATE_MIN)."""

    __slots__ = ("_in_hands", "_loop", "_returned", "_timer", "_waiting", "active")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._in_hands: dict[_Outbox, float] = {}  # handed a chunk at (loop.time())
        self._returned: set[_Outbox] = set()  # ... whose reader is back already (the slot frees after the hold)
        self._waiting: dict[_Outbox, None] = {}  # readers waiting for their turn, first come first
        self._timer: asyncio.TimerHandle | None = None
        self.active = 0  # requests started and not finished

    def _may_serve(self) -> bool:
        in_hands = self._in_hands
        if in_hands:
            now = self._loop.time()
            for outbox, at in list(in_hands.items()):
                age = now - at
                if age >= _GATE_EXPIRE_S or (age >= _GATE_HOLD_S and outbox in self._returned):
                    del in_hands[outbox]
                    self._returned.discard(outbox)
        return len(in_hands) < max(_GATE_MIN, self.active // _GATE_SHARE)

    def handed(self, outbox: _Outbox) -> None:
        """``outbox`` just handed Dynamo a chunk."""
        self._in_hands.pop(outbox, None)
        self._returned.discard(outbox)
        self._in_hands[outbox] = self._loop.time()

    def returned(self, outbox: _Outbox) -> None:
        """``outbox``'s reader is back (Dynamo is done with its last chunk)."""
        if outbox in self._in_hands:
            self._returned.add(outbox)
            if self._waiting:
                self._admit()

    def request(self, outbox: _Outbox) -> None:
        """``outbox`` has a waiting reader and something for it: serve it now, or when its turn comes."""
        if outbox in self._waiting:
            return
        if not self._waiting and self._may_serve():
            outbox._serve_reader()
            return
        self._waiting[outbox] = None
        if self._timer is None:
            self._timer = self._loop.call_later(_GATE_HOLD_S, self._tick)

    def forget(self, outbox: _Outbox) -> None:
        self._in_hands.pop(outbox, None)
        self._returned.discard(outbox)
        self._waiting.pop(outbox, None)
        if self._waiting:
            self._admit()

    def _admit(self) -> None:
        waiting = self._waiting
        while waiting and self._may_serve():
            outbox = next(iter(waiting))
            del waiting[outbox]
            outbox._serve_reader()

    def _tick(self) -> None:
        # Slots also free by time (the hold, the expiry): look again while readers wait.
        self._timer = None
        self._admit()
        if self._waiting:
            self._timer = self._loop.call_later(_GATE_HOLD_S, self._tick)


class _Outbox:
    """What one request's trio task has for Dynamo: pending chunks (coalesced), then how the stream ended; the async
    iterator Dynamo reads them from (``__anext__`` returns a future, see the module docstring); and the bridge's sink
    (``_deliver``, ``_fail``, ``_end``, ``_finished``, ``taken``: ``sidecar.edge.LoopSink``) the trio task feeds.

    Loop thread only, but for ``__anext__``: Dynamo calls it on one of its own threads (holding the GIL) and awaits
    the result on the loop. It therefore only pops a chunk the loop already set aside (``_ready``: a list, whose
    ``pop(0)`` is one atomic call; an empty deque would cost 760 bytes per request) or hands the new future to the
    loop. One producer (the trio task), one consumer (Dynamo,
    one ``__anext__`` at a time).
    """

    __slots__ = ("_gate", "_loop", "_owed", "_reader", "_ready", "_trio_done", "feed", "outcome",
                 "pending", "stop_future", "taken")  # fmt: skip

    def __init__(self, loop: asyncio.AbstractEventLoop, gate: _DynamoGate) -> None:
        self._loop = loop
        self._gate = gate
        self.pending = PendingChunks()
        self.outcome: _Outcome | None = None
        # Chunks taken from `pending` in one merge and not handed out yet (Dynamo takes one per __anext__).
        self._ready: list[dict[str, Any]] = []
        self._reader: asyncio.Future[dict[str, Any]] | None = None  # Dynamo's pending __anext__
        self.feed: TrioFeed[list[dict[str, Any]]] | None = None
        self.stop_future: asyncio.Future[Any] | None = None
        self._trio_done = False
        # The bridge's backpressure: batches accepted (read by trio), and batches held while too much is pending.
        self.taken = 0
        self._owed = 0

    # the bridge's side (LoopSink)

    def _deliver(self, batches: list[list[dict[str, Any]]]) -> None:
        if self.outcome is not None:
            return
        pending = self.pending
        for chunks in batches:
            pending.extend(chunks)
        if pending.tokens < _MAX_PENDING_TOKENS:
            self.taken += len(batches)
            if self.feed is not None:
                self.feed.credit()  # read after writing `taken`: a pump that waits for room wakes up
        else:
            self._owed += len(batches)  # a reader that stopped reading holds the trio task back
        if self._reader is not None:
            self._gate.request(self)

    def _fail(self, error: BaseException) -> None:
        if self.outcome is None:
            # No __cause__: Dynamo prints the exception it gets with every cause's traceback. The request's own log
            # line (sidecar.requests) names what happened; the exception's message carries it to the client.
            self.end(_to_dynamo(error))

    def _end(self) -> None:
        if self.outcome is None:
            self.end(_END)

    def _finished(self) -> None:
        self._trio_done = True
        self._gate.active -= 1
        if self.stop_future is not None:
            self.stop_future.cancel()
        if self.outcome is None:  # the trio task was stopped from here: the stop already set the outcome
            self.end(_END)

    def stop(self, reason: str) -> None:
        """The context was stopped or killed, or Dynamo closed the iterator: cancel the trio task, drop what Dynamo
        has not read and leave a marker for a reader that is still reading."""
        if self._trio_done or self.outcome is not None:
            return  # the request already ended (or was stopped): what is pending is its whole answer
        if self.feed is not None:
            self.feed.cancel(reason)
        self.end(_STOPPED)

    def end(self, outcome: _Outcome) -> None:
        """The stream is over: ``outcome`` follows the pending chunks (``_STOPPED`` drops them)."""
        if outcome is _STOPPED:
            self.pending.take()
            self._ready.clear()
        self.outcome = outcome
        self._gate.forget(self)  # the end is served at once
        self._serve_reader()

    # Dynamo's side

    def __aiter__(self) -> _Outbox:
        return self

    def __anext__(self) -> asyncio.Future[dict[str, Any]]:
        reader = self._loop.create_future()
        try:
            # Safe off the loop: nobody waits on this future yet, so setting it schedules nothing.
            reader.set_result(self._ready.pop(0))
        except IndexError:
            self._loop.call_soon_threadsafe(self._park, reader)
        return reader

    def _park(self, reader: asyncio.Future[dict[str, Any]]) -> None:
        gate = self._gate
        gate.returned(self)
        if reader.done():
            return  # Dynamo cancelled its wait
        if self.outcome is None and self.pending and not self._ready:
            self._reader = reader  # something to send: when its turn comes
            gate.request(self)
        elif not self._resolve(reader):
            self._reader = reader

    async def aclose(self) -> None:
        """What an async generator's ``aclose`` did: the request is over for the reader, so stop its task."""
        self.stop("the asyncio consumer closed the stream")

    def __del__(self) -> None:
        # Dynamo dropped the iterator before its end without stopping the context (not seen, but then nobody would
        # ever stop the trio task): take the request down. Any thread may run this, hence call_soon_threadsafe.
        if not self._trio_done and self.feed is not None:
            with suppress(RuntimeError):  # the loop has closed
                self._loop.call_soon_threadsafe(self.stop, "the asyncio consumer dropped the stream")

    def _serve_reader(self) -> None:
        reader = self._reader
        if reader is not None and self._resolve(reader):
            self._reader = None

    def _resolve(self, reader: asyncio.Future[dict[str, Any]]) -> bool:
        """Settle ``reader`` with the next chunk or the end, if there is one yet; ``False`` means wait."""
        if reader.done():  # Dynamo cancelled its wait
            return True
        if not self._ready and self.pending:
            self._ready.extend(self.pending.take())
            if self._owed:
                self.taken += self._owed
                self._owed = 0
                if self.feed is not None:
                    self.feed.credit()
        try:
            chunk = self._ready.pop(0)  # try, not a test first: Dynamo's thread pops too
        except IndexError:
            pass
        else:
            reader.set_result(chunk)
            self._gate.handed(self)
            return True
        outcome = self.outcome
        if outcome is None:
            return False
        if outcome is _STOPPED:
            # A generator that is still read after a stop says so once (Dynamo's stop_generating), then ends.
            self.outcome = _END
            reader.set_result(dict(CANCELLED_CHUNK))
        elif isinstance(outcome, Exception):
            self.outcome = _END
            reader.set_exception(outcome)  # never raised here: it reaches Dynamo without a frame
        else:
            reader.set_exception(StopAsyncIteration())
        return True


def request_context(request: dict[str, Any], context: Context) -> RequestContext:
    """Dynamo's context id, W3C trace headers and ``nvext.annotations`` for the trio handler."""
    headers = context.trace_headers() or {}
    trace = {k: v for k, v in headers.items() if k in ("traceparent", "tracestate")}
    raw = request.get("annotations") or ()
    annotations = tuple(str(a) for a in raw) if isinstance(raw, list | tuple) else ()
    return RequestContext(request_id=context.id(), trace_headers=trace, annotations=annotations)


def _to_dynamo(error: BaseException) -> Exception:
    # The trio task was cancelled from outside (drain deadline, worker teardown) or the edge is closing: this
    # worker is going away, so tell the frontend to migrate the request (EngineShutdown) instead of a 500.
    if isinstance(error, EdgeError):
        return dynamo_exception(WorkerDraining(f"request ended by worker shutdown: {error}"))
    return dynamo_exception(error)


def make_handler(
    edge: Edge, nursery: trio.Nursery, handler: RequestHandler
) -> Callable[[dict[str, Any], Context], AsyncIterator[dict[str, Any]]]:
    """The function to pass to ``serve_endpoint``: each call starts ``handler`` in ``nursery`` and returns the async
    iterator of the request's chunks."""

    loop = edge.loop

    gate = _DynamoGate(loop)

    def generate(request: dict[str, Any], context: Context) -> _Outbox:
        # Called on one of Dynamo's threads, not on the loop: everything that needs the loop starts there.
        outbox = _Outbox(loop, gate)
        loop.call_soon_threadsafe(_start, outbox, request, context)
        return outbox

    def _start(outbox: _Outbox, request: dict[str, Any], context: Context) -> None:
        try:
            ctx = request_context(request, context)
            gate.active += 1  # until the bridge reports the trio side _finished (it always does)
            outbox.feed = edge.trio_feed(nursery, outbox, handler, request, ctx, high_water=_HIGH_WATER)
            if outbox._trio_done:  # the trio run or the nursery is gone: the outbox has its error already
                return
            stop = outbox.stop_future = asyncio.ensure_future(context.async_killed_or_stopped())
            stop.add_done_callback(lambda _: outbox.stop("the request was stopped or killed"))
        except Exception as error:
            if outbox.outcome is None:
                outbox.end(_to_dynamo(error))

    return generate
