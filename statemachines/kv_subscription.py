"""The KV-event subscription lifecycle: one per data-parallel rank, from the first subscribe to the worker's exit."""

# Theory of operation
# ===================
#
# A worker that routes by KV cache forwards its engine's KV events (blocks stored, removed, all cleared) to Dynamo's
# router, one `SubscribeKvEvents` stream per data-parallel rank (`sidecar/kv/_subscription.py`).  The router's view of
# this worker's cache is only as good as the stream: a lost batch leaves blocks attributed that the engine has long
# evicted, and the router then sends requests here for a prefix that is gone.  So every batch's `sequence_number`
# must follow the previous one exactly, and whenever that cannot be guaranteed the rank is *resynchronised*:
#
#   idle -subscribe-> subscribing -synced-> streaming
#   subscribing|streaming -resync-> resyncing -subscribe-> subscribing
#
# * `subscribe`: the stream is being opened (asking for a snapshot when the engine offers one).
# * `synced`: the first batch arrived (the snapshot, or the first live batch of an engine without snapshots); its
#   sequence number is the baseline, every later one must be exactly one more.
# * `resync`: a gap, a repeat, a terminal `EngineError`, a dropped stream, a stream that ended without an error, a
#   batch for another rank, an undecodable removal.  Entering `resyncing` publishes a clear-all for the rank to Dynamo
#   (nothing this worker told the router about that rank stands any more), then waits a backoff before `subscribe`.
#   Dynamo's Rust sidecar exits the worker process here instead.
#
# `stop` is the worker shutting down (any non-terminal state); `fail` ends the rank for good: the engine advertised a
# gRPC source but refuses to serve it (UNIMPLEMENTED), or a bug.  A failed rank publishes nothing more and has cleared
# what it published; the worker keeps serving (routing then falls back to load for that rank).
#
# Idempotence (NO_OPS): `stop` after the end.  Anything else outside TRANSITIONS raises IllegalTransition.
# There is no per-batch transition: batches that keep the sequence fire nothing.

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from ._base import Lifecycle, MachineKind, StateDoc

if TYPE_CHECKING:
    from transitions.core import TransitionConfigDict

__all__ = [
    "KV_SUBSCRIPTION",
    "NO_OPS",
    "STATES",
    "STATE_DOCS",
    "TERMINAL",
    "TRANSITIONS",
    "KvSubscriptionEvent",
    "KvSubscriptionLifecycle",
    "KvSubscriptionObserver",
    "KvSubscriptionState",
]

KvSubscriptionState = Literal["idle", "subscribing", "streaming", "resyncing", "stopped", "failed"]
KvSubscriptionEvent = Literal["subscribe", "synced", "resync", "stop", "fail"]

STATES: tuple[KvSubscriptionState, ...] = ("idle", "subscribing", "streaming", "resyncing", "stopped", "failed")

TERMINAL: frozenset[KvSubscriptionState] = frozenset({"stopped", "failed"})

_ACTIVE: list[KvSubscriptionState] = [state for state in STATES if state not in TERMINAL]

TRANSITIONS: list[TransitionConfigDict] = [
    # Open SubscribeKvEvents for the rank (with a snapshot when the engine offers one). From `resyncing` after the
    # rank's published blocks were cleared and the backoff has passed.
    {"trigger": "subscribe", "source": ["idle", "resyncing"], "dest": "subscribing"},
    # The first batch arrived: its sequence number is the baseline; from now on every batch must be the next one.
    {"trigger": "synced", "source": "subscribing", "dest": "streaming"},
    # The stream can no longer be trusted (gap, repeat, EngineError, dropped or ended stream, wrong rank, undecodable
    # removal): clear what this rank published, back off, subscribe again.
    {"trigger": "resync", "source": ["subscribing", "streaming"], "dest": "resyncing"},
    # Worker shutdown.
    {"trigger": "stop", "source": _ACTIVE, "dest": "stopped"},
    # The engine will not serve this rank's events (UNIMPLEMENTED for an advertised source), or a bug.
    {"trigger": "fail", "source": _ACTIVE, "dest": "failed"},
]

NO_OPS: dict[tuple[KvSubscriptionState, KvSubscriptionEvent], str] = {
    ("stopped", "stop"): "a repeated stop (worker shutdown racing the subscription's own exit)",
    ("failed", "stop"): "stop after the subscription failed: the failure stands",
}

STATE_DOCS: dict[KvSubscriptionState, StateDoc] = {
    "idle": StateDoc(
        meaning="Created for a data-parallel rank whose engine advertises a gRPC KV event source; not subscribed yet.",
        operator_sees="Counted in the live state view for a moment at start-up.",
        action="Nothing.",
    ),
    "subscribing": StateDoc(
        meaning="SubscribeKvEvents is open (or opening); waiting for the first batch -- the snapshot, or the first "
        "live batch of an engine that offers no snapshot. The router knows nothing of this rank's cache yet.",
        operator_sees="A log line per subscription; the resync counter if this follows a resync.",
        action="Nothing. A rank that stays here on an engine without snapshots is an idle rank (no batches yet).",
    ),
    "streaming": StateDoc(
        meaning="Batches arrive in sequence and every block stored or removed is forwarded to Dynamo's router.",
        operator_sees="KV event lag histogram; the frontend's KV router metrics move as requests run.",
        action="Nothing.",
    ),
    "resyncing": StateDoc(
        meaning="The stream broke its sequence (gap, repeat, engine error, drop, end, wrong rank). Everything this "
        "rank had published was cleared at Dynamo; waiting a backoff before subscribing again.",
        operator_sees="A warning with the reason; openengine_sidecar_kv_event_resyncs{reason}; routing for this rank "
        "ignores cache until the next snapshot.",
        action="Occasional resyncs are harmless. A steady rate points at the engine's event stream (dropped batches, "
        "restarts): check the engine's logs.",
    ),
    "stopped": StateDoc(
        meaning="The worker shut down; the subscription was closed.",
        operator_sees="Total of stopped subscriptions.",
        action="Nothing.",
    ),
    "failed": StateDoc(
        meaning="The engine refused to serve events for an advertised source (UNIMPLEMENTED) or a bug ended the task; "
        "the rank's published blocks were cleared and no more events are forwarded.",
        operator_sees="An error log with the reason; KV routing for that rank degrades to load-based routing.",
        action="Check that the engine really supports SubscribeKvEvents, or run the worker with --kv-events off.",
    ),
}

KV_SUBSCRIPTION: MachineKind[KvSubscriptionLifecycle, KvSubscriptionState, KvSubscriptionEvent] = MachineKind(
    "kv_subscription",
    states=STATES,
    transitions=TRANSITIONS,
    initial="idle",
    terminal=TERMINAL,
    no_ops=NO_OPS,
    docs=STATE_DOCS,
    summary=__doc__ or "",
)
"""The KV-event subscription machine kind: the shared machine, observers and live counts."""

KvSubscriptionObserver = Callable[
    ["KvSubscriptionLifecycle", KvSubscriptionEvent, KvSubscriptionState, KvSubscriptionState], None
]
"""An observer of subscription state changes: ``observer(model, event, source, dest)``."""


class KvSubscriptionLifecycle(Lifecycle[KvSubscriptionState, KvSubscriptionEvent]):
    """One rank's subscription state; fire events with :meth:`fire`."""

    __slots__ = ("rank",)

    _kind = KV_SUBSCRIPTION

    def __init__(self, rank: int) -> None:
        self.rank = rank
        super().__init__()

    def __repr__(self) -> str:
        return f"<KvSubscriptionLifecycle rank {self.rank} {self.state}>"
