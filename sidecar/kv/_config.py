"""Settings of the routing signals and the plan discovery produces."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

from ._convert import GrpcSource, ZmqSource

if TYPE_CHECKING:
    from collections.abc import Mapping

    from sidecar.dynamo import Registration

    from ._convert import KvSource

__all__ = ["KvEventsMode", "RoutingConfig", "RoutingPlan"]

KvEventsMode = Literal["auto", "off"]


@dataclasses.dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How load is polled and KV events are followed (flags ``--kv-events``, ``--load-poll-interval-secs``,
    ``--load-max-age-secs``; the rest are fixed defaults tests may change)."""

    #: ``auto``: use the engine's KV event sources when it advertises them (and register for KV routing).
    kv_events: KvEventsMode = "auto"
    load_poll_interval_s: float = 1.0
    #: Deadline of one GetLoad poll.
    load_timeout_s: float = 2.0
    #: A snapshot whose timestamp is older than this is not published (TensorRT-LLM's sidecar uses 5 s).
    load_max_age_s: float = 5.0
    #: ... nor one stamped further in the future (clock skew between engine and worker hosts).
    load_max_future_s: float = 1.0
    #: Deadline of GetKvEventSources at start-up.
    discovery_timeout_s: float = 10.0
    #: Ask for a snapshot when subscribing (downgraded per rank when the engine refuses it).
    snapshot: bool = True
    #: First resync backoff; doubled after each resync up to ``resync_backoff_max_s`` (jittered ±20 %).
    resync_backoff_s: float = 0.1
    resync_backoff_max_s: float = 5.0
    #: A subscription that streamed this long before it broke starts again from the first backoff.
    healthy_stream_s: float = 30.0
    #: The engine is reached over TLS (``--grpc-tls-ca``): its KV events must not cross the network in plaintext ZMQ
    #: (they carry the token ids of every prompt) unless ``allow_plaintext_zmq`` (``--kv-events-allow-plaintext``).
    engine_tls: bool = False
    allow_plaintext_zmq: bool = False

    def __post_init__(self) -> None:
        for name in ("load_poll_interval_s", "load_timeout_s", "load_max_age_s", "discovery_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.load_max_future_s < 0 or self.resync_backoff_s < 0 or self.resync_backoff_max_s < 0:
            raise ValueError("durations must be >= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class RoutingPlan:
    """What start-up discovery decided: the ranks this worker serves, the block size, one KV event source per rank.

    ``sources`` is empty when KV events are off (not advertised, refused, ``--kv-events off``); load is published
    either way.
    """

    ranks: tuple[int, ...]
    block_size: int | None
    total_kv_blocks: int | None = None
    sources: Mapping[int, KvSource] = dataclasses.field(default_factory=dict)

    @property
    def kv_events(self) -> bool:
        """Whether KV events reach Dynamo (the worker then registers for KV-aware routing)."""
        return bool(self.sources) and bool(self.block_size)

    @property
    def grpc_ranks(self) -> tuple[int, ...]:
        """Ranks whose events this worker forwards from ``SubscribeKvEvents``."""
        return tuple(rank for rank, source in self.sources.items() if isinstance(source, GrpcSource))

    @property
    def zmq_sources(self) -> tuple[ZmqSource, ...]:
        """Ranks whose events Dynamo's own ZMQ listener relays."""
        return tuple(source for source in self.sources.values() if isinstance(source, ZmqSource))

    @property
    def index_limit(self) -> int:
        """Bound of a rank's index of published blocks (a multiple of the pool, so a healthy engine never hits it)."""
        return max(4 * (self.total_kv_blocks or 0), 1 << 16)

    def registration(self, registration: Registration) -> Registration:
        """``registration`` in KV-routing mode with the engine's block size when events flow; else unchanged."""
        if not self.kv_events:
            return registration
        return dataclasses.replace(registration, router_mode="kv", kv_block_size=self.block_size, kv_events=True)

    def describe(self) -> str:
        """One line for the log: how each rank's events travel."""
        if not self.kv_events:
            return "KV events off: load only"
        parts = []
        for rank in sorted(self.sources):
            source = self.sources[rank]
            parts.append(
                f"rank {rank} via SubscribeKvEvents"
                if isinstance(source, GrpcSource)
                else f"rank {rank} via Dynamo's ZMQ listener at {source.endpoint}"
            )
        return f"KV events on (block size {self.block_size}): " + ", ".join(parts)
