"""Routing signals: the engine's load and KV cache events, published to Dynamo's router; KV-aware routing.

Two steps around registration (the worker wires them, see ``docs/kv-events.md``)::

    plan = await discover_routing(client, discovery.caps, routing_config(config))   # before register
    await dynamo.register(plan.registration(registration))      # router_mode "kv" + block size when events flow
    ...                                                          # serve
    signals = await nursery.start(run_routing_signals, client, dynamo, plan, routing_config(config))

* Load: ``GetLoad(include_per_rank=true)`` every ``--load-poll-interval-secs``; per-rank KV usage to
  ``WorkerMetricsPublisher``; stale or inconsistent snapshots are refused and counted, a failed poll publishes nothing.
* KV events: per rank, either ``SubscribeKvEvents`` forwarded to ``KvEventPublisher`` (validated, ids as signed
  64-bit, resynchronised on any gap, repeat, error or drop; one :class:`~statemachines.KvSubscriptionLifecycle` per
  rank), or the engine's ZMQ publisher relayed by Dynamo's own listener.
"""

from typing import TYPE_CHECKING

from ._config import KvEventsMode as KvEventsMode
from ._config import RoutingConfig as RoutingConfig
from ._config import RoutingPlan as RoutingPlan
from ._convert import GrpcSource as GrpcSource
from ._convert import KvSource as KvSource
from ._convert import RankIndex as RankIndex
from ._convert import ZmqSource as ZmqSource
from ._load import EngineIdentity as EngineIdentity
from ._signals import DynamoPublishers as DynamoPublishers
from ._signals import RoutingSignals as RoutingSignals
from ._signals import discover_routing as discover_routing
from ._signals import run_routing_signals as run_routing_signals
from ._subscription import RankSubscription as RankSubscription
from ._types import KvPublisher as KvPublisher
from ._types import LoadPublisher as LoadPublisher
from ._types import PublisherFactory as PublisherFactory
from ._types import RoutingClient as RoutingClient

if TYPE_CHECKING:
    from sidecar.config import SidecarConfig

__all__ = [
    "DynamoPublishers",
    "EngineIdentity",
    "GrpcSource",
    "KvEventsMode",
    "KvPublisher",
    "KvSource",
    "LoadPublisher",
    "PublisherFactory",
    "RankIndex",
    "RankSubscription",
    "RoutingClient",
    "RoutingConfig",
    "RoutingPlan",
    "RoutingSignals",
    "ZmqSource",
    "discover_routing",
    "routing_config",
    "run_routing_signals",
]


def routing_config(config: "SidecarConfig") -> RoutingConfig:
    """The routing settings of a parsed command line (``--kv-events``, ``--load-poll-interval-secs``,
    ``--load-max-age-secs``)."""
    return RoutingConfig(
        kv_events=config.kv_events,
        load_poll_interval_s=config.load_poll_interval_s,
        load_max_age_s=config.load_max_age_s,
        engine_tls=config.grpc_tls_ca is not None,
        allow_plaintext_zmq=config.kv_events_allow_plaintext,
    )
