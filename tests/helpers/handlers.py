"""Trio request handlers for tests of the Dynamo adapter, written as async generators of chunk batches.

The adapter's :data:`~sidecar.dynamo.RequestHandler` delivers a request's chunks to its outbox on the edge loop and
ends it there (the worker's own handler does so from its data path, ``sidecar.datapath``). :func:`batches_handler`
turns a generator of batches into one: each batch is delivered as it comes, the end ends the outbox, an exception
fails it (the adapter's doing), and a stop from Dynamo cancels the generator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from sidecar.dynamo import ChunkSink, RequestContext, RequestHandler
    from sidecar.edge import Edge

__all__ = ["batches_handler", "cancel_on_stop"]


def batches_handler(
    edge: Edge, fn: Callable[[dict[str, Any], RequestContext], AsyncIterator[list[dict[str, Any]]]]
) -> RequestHandler:
    """The adapter's handler for ``fn``, a trio async generator function yielding batches of chunks."""

    async def handler(request: dict[str, Any], ctx: RequestContext, outbox: ChunkSink) -> None:
        with trio.CancelScope() as scope:
            edge.to_loop(cancel_on_stop, edge, outbox, scope)
            async for batch in fn(request, ctx):
                edge.to_loop(outbox.deliver, batch)
            edge.to_loop(outbox.end)

    return handler


def cancel_on_stop(edge: Edge, outbox: ChunkSink, scope: trio.CancelScope) -> None:
    """Edge loop: a stop from Dynamo (``outbox.on_stop``, or one that came already) cancels ``scope`` in trio."""

    def stop() -> None:
        edge.to_trio(scope.cancel)

    outbox.on_stop = stop
    if outbox.stopped:
        stop()
