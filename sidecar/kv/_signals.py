"""Start-up discovery of the routing signals and the one trio task that runs them while the worker serves."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
from functools import partial
from typing import TYPE_CHECKING, Final

import trio

from sidecar.errors import EngineRpcError, GrpcCode

from ._config import RoutingConfig, RoutingPlan
from ._convert import UnusableSources, ZmqSource, plan_sources
from ._load import EngineIdentity, poll_load
from ._subscription import RankSubscription

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from sidecar.convert import Capabilities
    from sidecar.dynamo import DynamoWorker

    from ._types import KvPublisher, LoadPublisher, PublisherFactory, RoutingClient

__all__ = ["DynamoPublishers", "RoutingSignals", "discover_routing", "run_routing_signals"]

log: Final = logging.getLogger("sidecar.kv")

#: Bound on closing the publishers when the task ends.
_CLOSE_TIMEOUT_S: Final = 5.0


async def discover_routing(
    client: RoutingClient, caps: Capabilities, config: RoutingConfig | None = None
) -> RoutingPlan:
    """Decide, before registration, whether this worker forwards KV events (and so registers for KV routing).

    Never refuses start-up: without usable sources the worker serves with load metrics only, and says why.
    """
    config = config or RoutingConfig()
    start = caps.data_parallel_start_rank or 0
    size = caps.data_parallel_size or 1
    plan = RoutingPlan(
        ranks=tuple(range(start, start + size)), block_size=caps.kv_block_size, total_kv_blocks=caps.total_kv_blocks
    )
    if config.kv_events == "off":
        log.info("KV events off (--kv-events off): Dynamo routes to this worker by load only")
        return plan
    if not caps.kv_block_size or caps.kv_block_size <= 0:
        log.warning("the engine reports no kv_block_size: KV events off (Dynamo needs the block size to use them)")
        return plan
    try:
        response = await client.get_kv_event_sources(timeout_s=config.discovery_timeout_s)
    except EngineRpcError as exc:
        if exc.code is GrpcCode.UNIMPLEMENTED:
            log.info("the engine offers no KV events (GetKvEventSources is UNIMPLEMENTED): routing by load only")
        else:
            log.warning("GetKvEventSources failed (%s): KV events off, routing by load only", exc)
        return plan
    try:
        sources, warnings = plan_sources(response.sources, plan.ranks)
    except UnusableSources as exc:
        log.error("KV events off: %s", exc)
        return plan
    for warning in warnings:
        log.warning("KV event sources: %s", warning)
    exposed = [s for s in sources.values() if isinstance(s, ZmqSource) and not _is_loopback_zmq(s.endpoint)]
    if config.engine_tls and exposed:
        where = ", ".join(f"rank {s.rank} at {s.endpoint}" for s in exposed)
        if not config.allow_plaintext_zmq:
            log.error(
                "KV events off: the engine is reached over TLS but publishes KV events over plaintext ZMQ from a "
                "non-loopback address (%s), which would carry every prompt's token ids readable across the network; "
                "routing by load only (--kv-events-allow-plaintext accepts it)",
                where,
            )
            return plan
        log.warning(
            "KV events over plaintext ZMQ from %s although the engine is reached over TLS "
            "(--kv-events-allow-plaintext)",
            where,
        )
    plan = dataclasses.replace(plan, sources=sources)
    log.info("%s", plan.describe())
    return plan


def _is_loopback_zmq(endpoint: str) -> bool:
    """Whether the ZMQ ``tcp://host:port`` endpoint stays on this host."""
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class DynamoPublishers:
    """Dynamo's publishers for one worker (``sidecar.dynamo``), the production :class:`PublisherFactory`."""

    def __init__(self, dynamo: DynamoWorker) -> None:
        self._dynamo = dynamo

    async def kv(self, rank: int, block_size: int, relay: ZmqSource | None) -> KvPublisher:
        from sidecar.dynamo import open_kv_event_sink

        if relay is None:
            return await open_kv_event_sink(self._dynamo, rank=rank, kv_block_size=block_size)
        return await open_kv_event_sink(
            self._dynamo, rank=rank, kv_block_size=block_size, zmq_endpoint=relay.endpoint, zmq_topic=relay.topic
        )

    async def load(self) -> LoadPublisher:
        from sidecar.dynamo import open_load_sink

        return await open_load_sink(self._dynamo)


class RoutingSignals:
    """The running signals of one worker: its rank subscriptions (for tests and the live view)."""

    def __init__(self) -> None:
        self.subscriptions: dict[int, RankSubscription] = {}
        self.relays: dict[int, KvPublisher] = {}


async def run_routing_signals(
    client: RoutingClient,
    dynamo: DynamoWorker | None,
    plan: RoutingPlan,
    config: RoutingConfig | None = None,
    *,
    publishers: PublisherFactory | None = None,
    identity: EngineIdentity | None = None,
    in_flight: Callable[[], Sequence[int]] | None = None,
    task_status: trio.TaskStatus[RoutingSignals] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Publish load and KV events to Dynamo until cancelled. Start it with ``nursery.start`` once registered.

    ``task_status.started(signals)`` fires when every publisher exists, the first load poll is done and every
    subscription task runs. Never raises except ``Cancelled``: each part degrades on its own (load unknown, a rank
    resynchronising or failed) and logs why; the worker keeps serving. ``identity`` and ``in_flight`` go to the load
    poller (:func:`~sidecar.kv._load.poll_load`: engine restarts, the estimate for an engine without KV usage).
    """
    config = config or RoutingConfig()
    if publishers is None:
        if dynamo is None:
            raise ValueError("run_routing_signals needs a DynamoWorker or a publisher factory")
        publishers = DynamoPublishers(dynamo)
    signals = RoutingSignals()
    sinks: list[KvPublisher] = []
    try:
        async with trio.open_nursery() as nursery:
            load = await publishers.load()
            poller = partial(poll_load, identity=identity, in_flight=in_flight, block_size=plan.block_size)
            await nursery.start(poller, client, load, plan.ranks, config)
            if plan.kv_events:
                assert plan.block_size is not None
                for source in plan.zmq_sources:
                    relay = await publishers.kv(source.rank, plan.block_size, source)
                    sinks.append(relay)
                    signals.relays[source.rank] = relay
                    log.info(
                        "KV events rank %d: Dynamo relays the engine's ZMQ events from %s", source.rank, source.endpoint
                    )
                for rank in plan.grpc_ranks:
                    sink = await publishers.kv(rank, plan.block_size, None)
                    sinks.append(sink)
                    subscription = RankSubscription(
                        client, sink, rank, plan.block_size, config, index_limit=plan.index_limit
                    )
                    signals.subscriptions[rank] = subscription
                    nursery.start_soon(subscription.run)
            task_status.started(signals)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_TIMEOUT_S):
            for sink in sinks:
                try:
                    await sink.close()
                except Exception as exc:
                    log.warning("closing a KV event publisher failed: %r", exc)
