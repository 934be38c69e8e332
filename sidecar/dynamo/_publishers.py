"""Routing signals towards Dynamo's router: KV events (``KvEventPublisher``) and load (``WorkerMetricsPublisher``).

Trio code opens one :class:`KvEventSink` per data-parallel rank and one :class:`LoadSink` per worker; every call into
the bindings runs on the edge loop thread (``edge.run``), one hop per batch of events, never per event.

Binding facts (ai-dynamo-runtime 1.6.1, checked against the installed ``_core.pyi`` and by experiment):

* ``KvEventPublisher(endpoint, kv_block_size=…, dp_rank=…, enable_local_indexer=…, zmq_endpoint=…, zmq_topic=…)``.
  Without ``zmq_endpoint`` events are pushed with ``publish_batch([{"type": "stored"|"removed", …}])`` (validated
  whole, then enqueued; event ids are assigned inside). With ``zmq_endpoint`` Dynamo subscribes to the engine's ZMQ
  publisher itself (vLLM/TensorRT-LLM msgpack) and nothing is pushed from here.
* Block ids must be **signed** 64-bit integers: an unsigned one fails the whole batch with ``ValueError``.
* A stored block whose token count is not ``kv_block_size`` is dropped by Dynamo with only a log line; callers check
  sizes first (``sidecar.kv``).
* There is no "cleared" input in Python: a clear-all is a ``removed`` of every id still attributed.
* ``enable_local_indexer=True`` keeps a worker-side index Dynamo's router can query to recover after it missed events
  (a restarted frontend); the model card advertises it (``ModelRuntimeConfig.enable_local_indexer``).
* ``WorkerMetricsPublisher.publish(dp_rank, kv_used_blocks=…)`` refuses a call without any figure ("requires at
  least one load metric"): load that is not known is simply not published.
* Each publisher writes discovery entries (file discovery: its event channel, the KV publisher also its event source
  and its recovery endpoint's instance) that the runtime never re-creates when they are lost: the worker's
  registration watchdog watches and restores them (``DynamoWorker.track_*``, ``_entries.py``) until the sink closes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Final

from dynamo.llm import KvEventPublisher, WorkerMetricsPublisher

if TYPE_CHECKING:
    from collections.abc import Sequence

    from sidecar.edge import Edge

    from ._bindings import Endpoint
    from ._worker import DynamoWorker

__all__ = ["KvEventSink", "LoadSink", "open_kv_event_sink", "open_load_sink"]

logger: Final = logging.getLogger("sidecar.dynamo")


class KvEventSink:
    """One rank's ``KvEventPublisher``. ``publish`` takes Dynamo's ``publish_batch`` dicts; ``close`` shuts it down."""

    def __init__(
        self, edge: Edge, publisher: KvEventPublisher, rank: int, relay: str | None, dynamo: DynamoWorker, owner: str
    ) -> None:
        self._edge = edge
        self._publisher = publisher
        self._dynamo = dynamo
        self._owner = owner
        self._closed = False
        self.rank = rank
        #: The engine's ZMQ endpoint Dynamo subscribes to, or ``None`` when events are pushed through :meth:`publish`.
        self.relay = relay

    async def publish(self, events: Sequence[dict[str, Any]]) -> None:
        """Publish an ordered list of ``{"type": "stored", …}`` / ``{"type": "removed", …}`` events in one call."""
        if events:
            await self._edge.run(_publish_batch, self._publisher, list(events))

    async def close(self) -> None:
        """Stop the publisher's background tasks (and the ZMQ listener of a relay). Idempotent."""
        if not self._closed:
            self._closed = True
            # First: the runtime removes the entries now, which must not look like a loss to restore.
            self._dynamo.untrack(self._owner)
            await self._edge.run(_shutdown, self._publisher)


class LoadSink:
    """The worker's ``WorkerMetricsPublisher``: per-rank KV usage for the router's load balancing."""

    def __init__(self, edge: Edge, publisher: WorkerMetricsPublisher) -> None:
        self._edge = edge
        self._publisher = publisher

    async def publish(self, figures: Sequence[tuple[int, int]]) -> None:
        """Publish ``(dp_rank, kv_used_blocks)`` for each rank, in one hop."""
        if figures:
            await self._edge.run(_publish_load, self._publisher, list(figures))


async def open_kv_event_sink(
    dynamo: DynamoWorker,
    *,
    rank: int,
    kv_block_size: int,
    zmq_endpoint: str | None = None,
    zmq_topic: str = "",
) -> KvEventSink:
    """Create rank ``rank``'s publisher on the edge loop (with a ZMQ relay when ``zmq_endpoint`` is given)."""
    edge = dynamo._edge
    publisher = await edge.run(_create_kv_publisher, dynamo._endpoint, rank, kv_block_size, zmq_endpoint, zmq_topic)
    owner = await dynamo.track_kv_publisher(rank)
    return KvEventSink(edge, publisher, rank, zmq_endpoint, dynamo, owner)


async def open_load_sink(dynamo: DynamoWorker) -> LoadSink:
    """Create the metrics publisher and its event-plane endpoint on the edge loop."""
    edge = dynamo._edge
    before = await dynamo.kv_metrics_channels()
    publisher = await edge.run(_create_load_publisher, dynamo._endpoint)
    await dynamo.track_load_publisher(before)
    return LoadSink(edge, publisher)


# -- edge-loop side -----------------------------------------------------------------------------------------------


async def _create_kv_publisher(
    endpoint: Endpoint, rank: int, block_size: int, zmq_endpoint: str | None, zmq_topic: str
) -> KvEventPublisher:
    return KvEventPublisher(
        endpoint,
        kv_block_size=block_size,
        dp_rank=rank,
        enable_local_indexer=True,
        zmq_endpoint=zmq_endpoint,
        zmq_topic=zmq_topic if zmq_endpoint is not None else None,
    )


async def _publish_batch(publisher: KvEventPublisher, events: list[dict[str, Any]]) -> None:
    publisher.publish_batch(events)  # type: ignore[arg-type]  # plain dicts of the TypedDict shapes


async def _shutdown(publisher: KvEventPublisher) -> None:
    publisher.shutdown()


async def _create_load_publisher(endpoint: Endpoint) -> WorkerMetricsPublisher:
    publisher = WorkerMetricsPublisher()
    await publisher.create_endpoint(endpoint)
    return publisher


async def _publish_load(publisher: WorkerMetricsPublisher, figures: list[tuple[int, int]]) -> None:
    for rank, used in figures:
        publisher.publish(rank, kv_used_blocks=used)
