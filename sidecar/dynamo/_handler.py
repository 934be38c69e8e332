"""The asyncio request handler Dynamo calls, handing each request to a trio task and its chunks to Dynamo.

Per request, on the edge loop thread::

    Dynamo ──▶ generate(request, context) → outbox      the asyncio async iterator Dynamo iterates (via _Reader)
                  ▲ deliver / end / fail                 the request's data path (sidecar.datapath), on this thread
               edge.to_trio ──▶ handler(request, ctx, outbox)   a trio task in the worker's request nursery
                  ▲ stop
               context.async_killed_or_stopped()        (a done-callback, not code inside the iterator)

The trio task owns the request's lifecycle; its chunks reach the outbox on this thread, without a thread crossing per
chunk (``sidecar.datapath``). Coalescing: chunks that arrive while Dynamo is busy with the previous one merge into the
pending chunk of their output (``sidecar.convert.coalesce``); the iterator hands Dynamo everything pending at once.
A reader that keeps up gets every chunk alone, at once; nothing is held back on purpose. Only a consumer that stops
reading holds the producer back: past :data:`_MAX_PENDING_TOKENS` pending tokens the outbox reports no room, and the
data path stops acknowledging the engine's data (HTTP/2 flow control stops the engine).

Why callbacks instead of a loop inside the iterator: Dynamo's cancellation is cooperative, and after a client
disconnect the binding (1.6.1) pulls about one more item, then either throws ``GeneratorExit`` in or leaves the
iterator suspended forever without closing it, so nothing that must happen on a stop may live in an iterator's body or
``finally``. The stop future's callback tells the producer (``on_stop``), which tells the trio task.

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
import time
from contextlib import suppress
from typing import TYPE_CHECKING, Any, Final

import trio

from sidecar.convert.coalesce import PendingChunks
from sidecar.edge import EdgeClosed, EdgeError
from sidecar.errors import SidecarError, WorkerDraining

from ._bindings import dynamo_exception
from ._egress import Egress, wire_bytes
from ._types import RequestContext

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from sidecar.edge import Edge

    from ._bindings import Context
    from ._egress import ResponseSender
    from ._types import RequestHandler

__all__ = ["CANCELLED_CHUNK", "make_handler"]

logger: Final = logging.getLogger("sidecar.dynamo")

#: The last chunk a stopped request yields, if Dynamo still reads (``stop_generating`` from the frontend).
CANCELLED_CHUNK: Final[dict[str, Any]] = {"token_ids": [], "finish_reason": "cancelled"}


class _End:
    __slots__ = ()


class _Stopped:
    __slots__ = ()


class _StopSaid:
    """Stopped, and Dynamo has read the cancelled chunk: the stream is over for Dynamo, still stopped for the
    producer (who may only look now: a stop can come while trio is admitting the request)."""

    __slots__ = ()


#: Tokens that may wait for Dynamo before the outbox reports no room (a consumer that stopped reading, not a slow
#: one).
_MAX_PENDING_TOKENS: Final = 4096

_END: Final = _End()
_STOPPED: Final = _Stopped()
_STOP_SAID: Final = _StopSaid()

_Outcome = _End | _Stopped | _StopSaid | Exception


class _Outbox:
    """What one request has for Dynamo: pending chunks (coalesced), then how the stream ended; Dynamo's side, read
    through the :class:`_Reader` Dynamo holds (``next_chunk`` returns a future, see the module docstring); and the
    producer's side (:class:`~sidecar.dynamo.ChunkSink`: ``deliver``, ``end``, ``fail``, ``has_room``, ``when_room``,
    ``on_stop``).

    Loop thread only, but for ``next_chunk``: Dynamo calls it (through ``_Reader.__anext__``) on one of its own
    threads (holding the GIL) and awaits the result on the loop. It therefore only pops a chunk the loop already set
    aside (``_ready``: a list, whose ``pop(0)`` is one atomic call; an empty deque would cost 760 bytes per request) or
    hands the new future to the loop. One producer, one consumer (Dynamo, one ``next_chunk`` at a time).
    """

    __slots__ = ("_direct_left", "_egress", "_gone", "_loop", "_on_room", "_pushed", "_queued", "_reader", "_ready",
                 "_sender", "on_stop", "outcome", "pending", "stop_future")  # fmt: skip

    def __init__(
        self, loop: asyncio.AbstractEventLoop, sender: ResponseSender | None = None, egress: Egress | None = None
    ) -> None:
        self._loop = loop
        # Push mode (both set): the egress threads send what is pending to Dynamo's ResponseSender (sidecar.dynamo.
        # _egress); pull mode (neither): Dynamo takes it through next_chunk.
        self._sender = sender
        self._egress = egress if sender is not None else None
        self._queued = False  # push: queued for, or held by, an egress thread (under egress.lock)
        # push: bytes the loop may still send itself before the stream could be full (0: the egress threads send)
        self._direct_left = egress.direct_bytes if egress is not None else 0
        self._pushed = False  # push: everything is sent, the end included (loop thread)
        self._gone = False  # push: Dynamo's side of the stream is gone (a send raised); egress thread only
        self.pending = PendingChunks()
        self.outcome: _Outcome | None = None
        # Chunks taken from `pending` in one merge and not handed out yet (Dynamo takes one per next_chunk).
        self._ready: list[dict[str, Any]] = []
        self._reader: asyncio.Future[dict[str, Any]] | None = None  # Dynamo's pending next_chunk
        self._on_room: Callable[[], None] | None = None
        self.stop_future: asyncio.Future[Any] | None = None
        #: The producer's: called once, on the loop, when Dynamo stops reading before the end.
        self.on_stop: Callable[[], None] | None = None

    # the producer's side (ChunkSink)

    @property
    def stopped(self) -> bool:
        return self.outcome is _STOPPED or self.outcome is _STOP_SAID

    @property
    def has_room(self) -> bool:
        return self.outcome is not None or self.pending.tokens < _MAX_PENDING_TOKENS

    def deliver(self, chunks: list[dict[str, Any]]) -> None:
        if self.outcome is None:
            egress = self._egress
            if egress is None:
                self.pending.extend(chunks)
                if self._reader is not None:
                    self._serve_reader()
                return
            if self._direct_left:
                cost = wire_bytes(chunks)
                if cost < self._direct_left:
                    # Sent on the loop: Dynamo's channel and TCP's buffers hold more than this request has sent in
                    # all, so the send cannot block (sidecar.dynamo._egress); no thread hand-over.
                    self._direct_left -= cost
                    self._send_now(chunks)
                    return
                self._direct_left = 0  # from here on the egress threads send this request's chunks, in order
            with egress.lock:
                self.pending.extend(chunks)
                queued, self._queued = self._queued, True
            if not queued:
                egress.schedule(self)

    def when_room(self, callback: Callable[[], None]) -> None:
        if self.has_room:
            callback()
        else:
            self._on_room = callback

    def end(self) -> None:
        if self.outcome is None:
            self._settle(_END)

    def fail(self, error: BaseException) -> None:
        if self.outcome is None:
            # No __cause__: Dynamo prints the exception it gets with every cause's traceback. The request's own log
            # line (sidecar.requests) names what happened; the exception's message carries it to the client.
            self._settle(_to_dynamo(error))

    def stop(self, reason: str) -> None:
        """The context was stopped or killed, or Dynamo closed or dropped the iterator: tell the producer, drop what
        Dynamo has not read and leave a marker for a reader that is still reading."""
        if self.outcome is not None:
            return  # the request already ended (or was stopped): what is pending is its whole answer
        logger.debug("request stopped by Dynamo: %s", reason)
        if self._egress is None:
            self.pending.take()
        else:
            with self._egress.lock:
                self.pending.take()
        self._ready.clear()
        self._settle(_STOPPED)
        on_stop, self.on_stop = self.on_stop, None
        if on_stop is not None:
            try:
                on_stop()
            except Exception:
                logger.exception("telling the request about its stop failed")
        self._room()

    def stopped_by_dynamo(self, future: asyncio.Future[Any]) -> None:
        """The stop future's callback: the context was stopped or killed (a future we cancelled says nothing)."""
        if not future.cancelled():
            self.stop("the request was stopped or killed")

    def _settle(self, outcome: _Outcome) -> None:
        self.outcome = outcome
        if self.stop_future is not None:
            self.stop_future.cancel()  # frees Dynamo's stop future (a pyo3 future per request)
        egress = self._egress
        if egress is None:
            self._serve_reader()
            return
        if self._direct_left:  # nothing went through the egress threads: the end is sent here too
            self._send_end(outcome)
            self._push_done()
            return
        with egress.lock:  # the end goes out after everything pending, from the egress thread
            queued, self._queued = self._queued, True
        if not queued:
            egress.schedule(self)

    # push mode: the egress thread's side (Pushable)

    def push_pending(self, egress: Egress) -> None:
        sender = self._sender
        assert sender is not None
        lock = egress.lock
        pending = self.pending
        while True:
            with lock:
                chunks = pending.take() if pending else None
                outcome = self.outcome
                if chunks is None and outcome is None:
                    self._queued = False
                    return
            if chunks is None:
                break
            if self._on_room is not None:
                self._loop.call_soon_threadsafe(self._room)
            if self._gone:
                continue
            egress.sending(time.monotonic())
            try:
                self._send_now(chunks)
            finally:
                egress.sending(None)
        # The end, once: the queued flag stays set, nothing is delivered after an outcome.
        assert outcome is not None
        self._send_end(outcome)
        with suppress(RuntimeError):  # the loop has closed
            self._loop.call_soon_threadsafe(self._push_done)

    def _send_now(self, chunks: list[dict[str, Any]]) -> None:
        if self._gone:
            return
        sender = self._sender
        assert sender is not None
        try:
            for chunk in chunks:
                sender.send(chunk)
        except RuntimeError:
            # Dynamo's side of the stream is gone (it stops the context too: the stop reaches the producer).
            self._gone = True

    def _send_end(self, outcome: _Outcome) -> None:
        sender = self._sender
        if self._gone or sender is None:
            return
        with suppress(RuntimeError):
            if outcome is _STOPPED or outcome is _STOP_SAID:
                # A stopped request says so once, as the pull path's reader does (Dynamo's stop_generating).
                sender.send(dict(CANCELLED_CHUNK))
            if not isinstance(outcome, Exception):
                # Not on a failure: the exception the reader raises ends the stream with its typed error; closing
                # first would end it as a success.
                sender.close()

    # push mode: Dynamo's side (through _PushReader)

    def _push_done(self) -> None:
        self._pushed = True
        reader, self._reader = self._reader, None
        if reader is not None:
            self._end_push(reader)

    def park_push(self, reader: asyncio.Future[dict[str, Any]]) -> None:
        if self._pushed:
            self._end_push(reader)
        else:
            self._reader = reader

    def _end_push(self, reader: asyncio.Future[dict[str, Any]]) -> None:
        if reader.done():
            return
        outcome = self.outcome
        if isinstance(outcome, Exception):
            self.outcome = _END
            reader.set_exception(outcome)  # never raised here: it reaches Dynamo without a frame
        else:
            reader.set_exception(StopAsyncIteration())

    # Dynamo's side (through _Reader)

    def next_chunk(self) -> asyncio.Future[dict[str, Any]]:
        reader = self._loop.create_future()
        try:
            # Safe off the loop: nobody waits on this future yet, so setting it schedules nothing.
            reader.set_result(self._ready.pop(0))
        except IndexError:
            self._loop.call_soon_threadsafe(self._park, reader)
        return reader

    def _park(self, reader: asyncio.Future[dict[str, Any]]) -> None:
        if not self._resolve(reader):
            self._reader = reader

    async def aclose(self) -> None:
        """What an async generator's ``aclose`` did: the request is over for the reader, so stop it."""
        self.stop("the asyncio consumer closed the stream")

    def dropped(self) -> None:
        """Dynamo let go of the iterator (:class:`_Reader`): if that was before the end, nobody reads this request
        any more, so stop it. Any thread may run this (a finalizer), hence ``call_soon_threadsafe``; ``stop`` checks
        the outcome again on the loop."""
        if self.outcome is None:
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
            self._room()
        try:
            chunk = self._ready.pop(0)  # try, not a test first: Dynamo's thread pops too
        except IndexError:
            pass
        else:
            reader.set_result(chunk)
            return True
        outcome = self.outcome
        if outcome is None:
            return False
        if outcome is _STOPPED:
            # A generator that is still read after a stop says so once (Dynamo's stop_generating), then ends.
            self.outcome = _STOP_SAID
            reader.set_result(dict(CANCELLED_CHUNK))
        elif isinstance(outcome, Exception):
            self.outcome = _END
            reader.set_exception(outcome)  # never raised here: it reaches Dynamo without a frame
        else:
            reader.set_exception(StopAsyncIteration())
        return True

    def _room(self) -> None:
        on_room = self._on_room
        if on_room is not None and self.has_room:
            self._on_room = None
            on_room()


class _Reader:
    """The async iterator Dynamo holds -- and only Dynamo: the producer, the trio task and the loop hold the
    :class:`_Outbox` behind it, so this object dies exactly when Dynamo lets go. Dynamo 1.6.1 does so without
    stopping the context when it cannot publish a chunk to a frontend that gave up on the request (a request the NATS
    request plane delivered after a partition: its first publish fails at once); its finalizer then stops the
    request, which would otherwise run to its end for nobody and count as finished."""

    __slots__ = ("_outbox",)

    def __init__(self, outbox: _Outbox) -> None:
        self._outbox = outbox

    def __aiter__(self) -> _Reader:
        return self

    def __anext__(self) -> asyncio.Future[dict[str, Any]]:
        return self._outbox.next_chunk()

    async def aclose(self) -> None:
        await self._outbox.aclose()

    def __del__(self) -> None:
        self._outbox.dropped()


class _PushReader:
    """Push mode: the async iterator Dynamo advances once per request; its one ``__anext__`` ends (raises) when
    everything has been sent. Held only by Dynamo, as :class:`_Reader` is (its finalizer stops the request)."""

    __slots__ = ("_event_loop", "_outbox")

    def __init__(self, outbox: _Outbox, loop: asyncio.AbstractEventLoop) -> None:
        self._outbox = outbox
        self._event_loop = loop

    def __aiter__(self) -> _PushReader:
        return self

    def __anext__(self) -> asyncio.Future[dict[str, Any]]:
        reader: asyncio.Future[dict[str, Any]] = self._event_loop.create_future()
        self._event_loop.call_soon_threadsafe(self._outbox.park_push, reader)
        return reader

    async def aclose(self) -> None:
        await self._outbox.aclose()

    def __del__(self) -> None:
        self._outbox.dropped()


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
    edge: Edge, nursery: trio.Nursery, handler: RequestHandler, *, push: bool = True, egress: Egress | None = None
) -> tuple[Callable[..., AsyncIterator[dict[str, Any]]], Egress]:
    """The function to pass to ``serve_endpoint`` and its egress threads (close them when it has returned): each
    call starts ``handler`` in ``nursery`` (one trio task per request) and returns the async iterator of the
    request's chunks. With ``push`` the function names ``response_sender``, which puts Dynamo in push mode (module
    docstring of ``sidecar.dynamo._egress``); Dynamo's own in-process calls (its health canary) come without a
    sender and take the pull path."""

    loop = edge.loop
    if egress is None:
        egress = Egress(loop)

    def generate_pull(request: dict[str, Any], context: Context) -> _Reader:
        # Called on one of Dynamo's threads, not on the loop: everything that needs the loop starts there.
        outbox = _Outbox(loop)
        loop.call_soon_threadsafe(_start, outbox, request, context)
        return _Reader(outbox)

    def generate(
        request: dict[str, Any], context: Context, response_sender: ResponseSender | None = None
    ) -> _Reader | _PushReader:
        if response_sender is None:
            return generate_pull(request, context)
        outbox = _Outbox(loop, response_sender, egress)
        loop.call_soon_threadsafe(_start, outbox, request, context)
        return _PushReader(outbox, loop)

    def _start(outbox: _Outbox, request: dict[str, Any], context: Context) -> None:
        try:
            ctx = request_context(request, context)
            stop = outbox.stop_future = asyncio.ensure_future(context.async_killed_or_stopped())
            stop.add_done_callback(outbox.stopped_by_dynamo)
            if not edge.to_trio(_spawn, outbox, request, ctx):
                outbox.fail(EdgeClosed("the trio run has finished"))
        except Exception as error:
            outbox.fail(error)

    def _spawn(outbox: _Outbox, request: dict[str, Any], ctx: RequestContext) -> None:
        # trio thread (a posted callable: must not raise)
        try:
            nursery.start_soon(_run, outbox, request, ctx, name=f"request {ctx.request_id}")
        except RuntimeError as exc:  # "Nursery is closed to new arrivals"
            edge.to_loop(outbox.fail, EdgeClosed(f"cannot start the request in trio: {exc}"))

    async def _run(outbox: _Outbox, request: dict[str, Any], ctx: RequestContext) -> None:
        try:
            await handler(request, ctx, outbox)
        except trio.Cancelled as exc:
            edge.to_loop(outbox.fail, EdgeClosed(f"the request's task was cancelled: {exc}"))
            raise
        except SidecarError as exc:  # an expected refusal before the request started (the worker is not serving)
            edge.to_loop(outbox.fail, exc)
        except Exception as exc:  # the handler settles the outbox itself; this is the backstop for a bug
            logger.exception("request %s: the handler failed", ctx.request_id)
            edge.to_loop(outbox.fail, exc)
        else:
            edge.to_loop(_backstop, outbox)

    return (generate if push else generate_pull), egress


def _backstop(outbox: _Outbox) -> None:
    # After the handler's own outcome (posted first: the posts are FIFO), only a handler that forgot to settle the
    # outbox leaves it open; a stream ending without a finish_reason would read as a truncated success.
    if outbox.outcome is None:
        logger.error("a request handler returned without ending its stream")
        outbox.fail(RuntimeError("the request ended without an outcome"))
