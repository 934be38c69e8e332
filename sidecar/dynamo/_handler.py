"""The asyncio request handler Dynamo calls, bridging each request to a trio handler task.

Per request, on the edge loop thread::

    Dynamo ──▶ generate(request, context)              the asyncio async generator Dynamo iterates
                  ▲ outbox (pending chunks, coalesced; bounded in tokens)
               pump task ── edge.trio_stream ──▶ trio handler task in the worker's request nursery
                  ▲ cancel
               context.async_killed_or_stopped()    (a done-callback, not code inside the generator)

Adaptive coalescing across this hop: the pump never waits for Dynamo to take a chunk. What arrives while Dynamo is
busy with the previous chunk is merged into the pending chunk of its output (``sidecar.convert.coalesce``), and the
generator hands Dynamo everything pending at once. When Dynamo keeps up, nothing is pending and every chunk goes out
alone, with no added delay (there is no timer). Only a consumer that stops reading makes the pump wait, once
:data:`_MAX_PENDING_TOKENS` tokens are pending; the bridge's own bound then holds the trio task.

Why a pump task and a callback instead of a loop inside ``generate``: Dynamo's cancellation is cooperative, and
after a client disconnect the binding may leave ``generate`` suspended forever without closing it
(``dynamo-runtime.md`` §3.7), so nothing that must happen on a stop may live in the generator's body or
``finally``. The stop future's callback cancels the pump task, which the bridge turns into cancellation of the trio
task. The pump is also the only consumer of the bridge stream, so it can never be closed while being iterated.
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

    from sidecar.edge import Edge

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


#: Batches the trio handler may run ahead of the pump (bridge backpressure).
_HIGH_WATER: Final = 8
#: Tokens that may wait for Dynamo before the pump stops reading (a consumer that stopped reading, not a slow one).
_MAX_PENDING_TOKENS: Final = 4096

_END: Final = _End()
_STOPPED: Final = _Stopped()

_Outcome = _End | _Stopped | Exception


class _Outbox:
    """What one request's pump has for its generator: pending chunks (coalesced), then how the stream ended.

    Loop thread only. One producer (the pump), one consumer (the generator).
    """

    __slots__ = ("_loop", "_reader", "_writer", "outcome", "pending")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.pending = PendingChunks()
        self.outcome: _Outcome | None = None
        self._reader: asyncio.Future[None] | None = None  # the generator waits for chunks or an outcome
        self._writer: asyncio.Future[None] | None = None  # the pump waits for room

    def put(self, chunks: list[dict[str, Any]]) -> None:
        self.pending.extend(chunks)
        self._wake_reader()

    def end(self, outcome: _Outcome) -> None:
        """The stream is over: ``outcome`` follows the pending chunks (``_STOPPED`` drops them)."""
        if outcome is _STOPPED:
            self.pending.take()
        self.outcome = outcome
        self._wake_reader()

    async def room(self) -> None:
        """Return once fewer than :data:`_MAX_PENDING_TOKENS` tokens wait for the generator."""
        while self.pending.tokens >= _MAX_PENDING_TOKENS:
            self._writer = self._loop.create_future()
            try:
                await self._writer
            finally:
                self._writer = None

    async def get(self) -> list[dict[str, Any]] | _Outcome:
        """Everything pending (merged), else the outcome, else wait for one of them."""
        while True:
            if self.pending:
                chunks = self.pending.take()
                if self._writer is not None and not self._writer.done():
                    self._writer.set_result(None)
                return chunks
            if self.outcome is not None:
                return self.outcome
            self._reader = self._loop.create_future()
            try:
                await self._reader
            finally:
                self._reader = None

    def _wake_reader(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.set_result(None)


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


async def _pump(
    edge: Edge,
    nursery: trio.Nursery,
    handler: RequestHandler,
    request: dict[str, Any],
    ctx: RequestContext,
    outbox: _Outbox,
) -> None:
    stream = edge.trio_stream(nursery, handler, request, ctx, high_water=_HIGH_WATER)
    outcome: _Outcome = _END
    try:
        async for batches in stream:
            for batch in batches:
                outbox.put(batch)
            await outbox.room()
    except asyncio.CancelledError:
        # The context was stopped or killed (or the loop is shutting down): the bridge has already cancelled the
        # trio task. Drop what Dynamo has not read and leave a marker for a generator that is still reading.
        outbox.end(_STOPPED)
        raise
    except Exception as error:
        outcome = _to_dynamo(error)
        outcome.__cause__ = error
    finally:
        with suppress(Exception):
            await stream.aclose()
    outbox.end(outcome)


def make_handler(
    edge: Edge, nursery: trio.Nursery, handler: RequestHandler
) -> Callable[[dict[str, Any], Context], AsyncIterator[dict[str, Any]]]:
    """The asyncio async generator function to pass to ``serve_endpoint``: each call runs ``handler`` in ``nursery``."""

    async def generate(request: dict[str, Any], context: Context) -> AsyncIterator[dict[str, Any]]:
        ctx = request_context(request, context)
        loop = asyncio.get_running_loop()
        outbox = _Outbox(loop)
        pump = loop.create_task(
            _pump(edge, nursery, handler, request, ctx, outbox), name=f"dynamo-req-{ctx.request_id}"
        )
        stop = asyncio.ensure_future(context.async_killed_or_stopped())
        stop.add_done_callback(lambda _: pump.cancel())
        pump.add_done_callback(lambda _: stop.cancel())
        try:
            while True:
                item = await outbox.get()
                if isinstance(item, list):
                    for chunk in item:
                        yield chunk
                elif item is _END:
                    return
                elif item is _STOPPED:
                    yield dict(CANCELLED_CHUNK)
                    return
                else:
                    assert isinstance(item, Exception)
                    raise item
        finally:
            # Reached when Dynamo closes the generator early; a no-op after a normal end. Not relied upon: a
            # generator left suspended never gets here, and the stop callback covers that case.
            pump.cancel()

    return generate
