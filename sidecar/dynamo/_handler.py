"""The asyncio request handler Dynamo calls, bridging each request to a trio handler task.

Per request, on the edge loop thread::

    Dynamo ──▶ generate(request, context)              the asyncio async generator Dynamo iterates
                  ▲ queue (one batch: backpressure)
               pump task ── edge.trio_stream ──▶ trio handler task in the worker's request nursery
                  ▲ cancel
               context.async_killed_or_stopped()    (a done-callback, not code inside the generator)

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


#: Batches the trio handler may run ahead of Dynamo's reads (bridge backpressure), plus one in the queue.
_HIGH_WATER: Final = 8

_END: Final = _End()
_STOPPED: Final = _Stopped()

_Item = list[dict[str, Any]] | _End | _Stopped | Exception


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
    queue: asyncio.Queue[_Item],
) -> None:
    stream = edge.trio_stream(nursery, handler, request, ctx, high_water=_HIGH_WATER)
    outcome: _Item = _END
    try:
        async for batches in stream:
            flat = [chunk for batch in batches for chunk in batch]
            if flat:
                await queue.put(flat)
    except asyncio.CancelledError:
        # The context was stopped or killed (or the loop is shutting down): the bridge has already cancelled the
        # trio task. Drop what Dynamo has not read and leave a marker for a generator that is still reading.
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(_STOPPED)
        raise
    except Exception as error:
        outcome = _to_dynamo(error)
        outcome.__cause__ = error
    finally:
        with suppress(Exception):
            await stream.aclose()
    await queue.put(outcome)


def make_handler(
    edge: Edge, nursery: trio.Nursery, handler: RequestHandler
) -> Callable[[dict[str, Any], Context], AsyncIterator[dict[str, Any]]]:
    """The asyncio async generator function to pass to ``serve_endpoint``: each call runs ``handler`` in ``nursery``."""

    async def generate(request: dict[str, Any], context: Context) -> AsyncIterator[dict[str, Any]]:
        ctx = request_context(request, context)
        queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=1)
        loop = asyncio.get_running_loop()
        pump = loop.create_task(_pump(edge, nursery, handler, request, ctx, queue), name=f"dynamo-req-{ctx.request_id}")
        stop = asyncio.ensure_future(context.async_killed_or_stopped())
        stop.add_done_callback(lambda _: pump.cancel())
        pump.add_done_callback(lambda _: stop.cancel())
        try:
            while True:
                item = await queue.get()
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
