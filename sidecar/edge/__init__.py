"""The asyncio edge: one dedicated uvloop thread and the trio ⇄ asyncio bridge.

The only package where trio meets asyncio. grpclib (towards the engine) and Dynamo's bindings (towards the frontend)
run on the edge loop; everything else is trio and reaches them through an :class:`Edge`::

    async with open_edge() as edge:
        info = await edge.run(stub.GetServerInfo, request)             # trio -> asyncio, one call
        async with edge.open_stream(generate, request) as batches:     # trio consumes an asyncio iterator
            async for batch in batches: ...                            # non-empty lists, bounded, errors intact
        edge.to_loop(fn, *args)                                        # trio -> loop, a posted callable (no wait)
        # on the edge thread: edge.to_trio(fn, *args) posts into trio; await edge.trio_call(nursery, fn, *args)

Rules the bridge keeps (measured: batched, it costs nothing against native asyncio; one item per hop costs 40-90 µs
more): items cross in batches, one thread hop per batch and never per item; callbacks posted into trio never raise;
asyncio objects are created on the edge thread only; cleanup on either side is shielded and time-bounded.
"""

from ._census import loop_tasks as loop_tasks
from ._errors import BridgeCancelled as BridgeCancelled
from ._errors import EdgeClosed as EdgeClosed
from ._errors import EdgeError as EdgeError
from ._thread import Edge as Edge
from ._thread import open_edge as open_edge
from ._to_asyncio import BatchStream as BatchStream
from ._to_asyncio import Feed as Feed
from ._to_asyncio import FeedStream as FeedStream
