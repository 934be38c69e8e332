"""The request lifecycle: one per generation request, from arrival to exactly one terminal state."""

# Theory of operation
# ===================
#
# Everything that changes a request's lifecycle lives in the tables below; the request task
# (`sidecar/requests.py`) reports what happened by firing events and reacts through observers.  Hand-written
# transitions elsewhere would be invisible to `docs/state-machines.md`, generated from these tables -- so there are
# none.  No trio, gRPC or Dynamo here.
#
#   received -submit-> submitted -first_token-> streaming -finish-> finished
#   received -reject-> rejected                      (refused before any RPC: HTTP 400, nothing sent to the engine)
#   submitted -finish-> finished                     (the stream's first event is already terminal)
#   streaming -close-> stopping -finish|cancel->     (the frontend closed the stream after a chunk that may have
#                                                     completed the answer: the engine's next event decides)
#   any live state -cancel-> cancelled               (client stop, drain deadline, worker shutdown)
#   any live state -fail-> failed                    (engine error, protocol violation, engine lost, a bug)
#
# Disaggregated prefill/decode (context-first, docs/disaggregation.md):
#
#   prefill leg:  received -submit-> submitted [-first_token-> streaming] -handoff-> prefill_ready -finish-> finished
#                 (a legitimate early stop -- EOS at the first token -- is a plain `finish` with the tokens)
#   decode leg:   received -submit_decode-> decoding -first_token-> streaming -finish-> finished
#                 decoding -defer-> cancel_deferred -first_token-> cancelled
#
# A decode leg carrying a handoff must not be dropped while the KV cache is in flight: the prefill engine would keep
# the session's blocks pinned (TensorRT-LLM cannot abort a KV session).  So a *client* stop in `decoding` is `defer`,
# not `cancel`: the request waits in `cancel_deferred` until the engine's first response (the transfer landed), and
# that `first_token` ends it in `cancelled` (the request task then aborts it on the engine).  `cancel` itself -- the
# worker ending the request (drain deadline, engine lost) -- is never deferred: "engine shutdown still wins".  A
# decode worker's request without a handoff (conditional disaggregation bypass) runs as `submit` like any other.
#
# The invariant: every request ends in exactly one of rejected, finished, cancelled or
# failed.  The task shape that guarantees it: do the work and fire edges inside the task's cancel scope;
# `except Exception: fire("fail", reason=...)`; `finally: fire("cancel", reason=...)` -- a no-op once terminal, it maps
# an outer cancellation (client disconnect, drain deadline) onto the lifecycle -- then a shielded, time-bounded
# engine Abort if the engine stream had not ended.
#
# Cost.  The machine is shared and models are never registered: creating a request model costs ~0.5 µs and ~80 bytes,
# a transition ~30 µs.  That is fine a handful of times per request and far too much per token: `first_token` is
# fired once, tokens themselves never touch the machine.
#
# Idempotence is explicit (NO_OPS): `cancel` on a request that already reached a terminal state is a no-op (fire()
# returns False), because a client stop or a drain deadline can race with the engine's last event, and it lets the
# `finally` above fire `cancel` without checking first.  Anything else outside TRANSITIONS raises IllegalTransition
# (e.g. a second `finish` means the stream was read after its terminal event -- a bug).
#
# Growing the machine is a table edit: add the states to `RequestState`, `STATES` and `STATE_DOCS`, add their rows
# to TRANSITIONS (each non-terminal state lists its `cancel` row explicitly), and the `fail` row picks them up through
# `_ACTIVE`.  The tests then check the new edges, the terminal invariant and the generated docs.

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from ._base import Lifecycle, MachineKind, StateDoc

if TYPE_CHECKING:
    from transitions.core import TransitionConfigDict

__all__ = [
    "NO_OPS",
    "REQUEST",
    "STATES",
    "STATE_DOCS",
    "TERMINAL",
    "TRANSITIONS",
    "RequestEvent",
    "RequestLifecycle",
    "RequestObserver",
    "RequestState",
]

RequestState = Literal[
    "received",
    "submitted",
    "decoding",
    "cancel_deferred",
    "streaming",
    "stopping",
    "prefill_ready",
    "finished",
    "rejected",
    "cancelled",
    "failed",
]
RequestEvent = Literal[
    "reject", "submit", "submit_decode", "first_token", "defer", "close", "handoff", "finish", "cancel", "fail"
]

STATES: tuple[RequestState, ...] = (
    "received",
    "submitted",
    "decoding",
    "cancel_deferred",
    "streaming",
    "stopping",
    "prefill_ready",
    "finished",
    "rejected",
    "cancelled",
    "failed",
)

TERMINAL: frozenset[RequestState] = frozenset({"finished", "rejected", "cancelled", "failed"})

# Every state a request can still leave: any exception there must be able to end it in `failed`.
_ACTIVE: list[RequestState] = [state for state in STATES if state not in TERMINAL]

TRANSITIONS: list[TransitionConfigDict] = [
    # Local validation refused the request (unsupported option, missing capability, bad input): HTTP 400 before
    # any RPC, so the engine never hears of it and nothing needs aborting.
    {"trigger": "reject", "source": "received", "dest": "rejected"},
    # The Generate RPC is open: from here on the engine may hold state for this request and an exit must Abort.
    # Aggregated requests, prefill legs, and a decode worker's requests without a handoff.
    {"trigger": "submit", "source": "received", "dest": "submitted"},
    # The Generate RPC of a decode leg carrying a prefill handoff is open: the engine is pulling the KV cache.
    {"trigger": "submit_decode", "source": "received", "dest": "decoding"},
    # First response event that is not terminal.  Fired once per request -- never per token.  In `cancel_deferred`
    # it means the KV transfer has landed: the client's deferred stop now takes effect (the task aborts the request).
    {"trigger": "first_token", "source": ["submitted", "decoding"], "dest": "streaming"},
    {"trigger": "first_token", "source": "cancel_deferred", "dest": "cancelled"},
    # The client stopped a decode leg while its KV cache is in flight: wait for the first response, then abort.
    {"trigger": "defer", "source": "decoding", "dest": "cancel_deferred"},
    # The frontend closed the stream right after a chunk that may have completed the answer (it ends the stream at
    # EOS, stop tokens and stop strings itself): the engine's next event, waited for one hold at most, tells a
    # complete answer (its terminal: `finish`, nothing to abort) from a client that left (`cancel`, then Abort).
    {"trigger": "close", "source": "streaming", "dest": "stopping"},
    # A prefill leg's terminal PrefillReady: the handoff is ready and waits for the end of the stream.
    {"trigger": "handoff", "source": ["submitted", "streaming"], "dest": "prefill_ready"},
    # Terminal response event (and, for a prefill leg, the end of the stream after PrefillReady).  From `submitted`
    # and `decoding` too: a zero-token answer (max_tokens reached at once, immediate stop) has a terminal first event.
    {
        "trigger": "finish",
        "source": ["submitted", "decoding", "streaming", "stopping", "prefill_ready"],
        "dest": "finished",
    },
    # Drain deadline, worker shutdown, the request task ending -- and a client stop, except in `decoding` (`defer`).
    # Listed per state: `cancel` is never deferred.
    {
        "trigger": "cancel",
        "source": ["received", "submitted", "decoding", "cancel_deferred", "streaming", "stopping", "prefill_ready"],
        "dest": "cancelled",
    },
    # Engine error, protocol violation, lost engine or a bug: from every non-terminal state, so the request task's
    # `except Exception: fire("fail")` is always legal.
    {"trigger": "fail", "source": _ACTIVE, "dest": "failed"},
]

NO_OPS: dict[tuple[RequestState, RequestEvent], str] = {
    # The client's stop (or a drain deadline) raced with the end of the request; the first terminal state stands.
    ("finished", "cancel"): "cancel after the request finished: the finished result stands",
    ("rejected", "cancel"): "cancel after the request was rejected: the rejection stands",
    ("cancelled", "cancel"): "a repeated cancel (e.g. client stop and drain deadline together)",
    ("failed", "cancel"): "cancel after the request failed: the failure stands",
}

STATE_DOCS: dict[RequestState, StateDoc] = {
    "received": StateDoc(
        meaning="Handed to the worker by Dynamo; being validated and converted. No RPC yet.",
        operator_sees="Counted in the live request-state view; normally gone within a millisecond.",
        action="Nothing. Many requests stuck here point at a blocked request task, not at the engine.",
    ),
    "submitted": StateDoc(
        meaning="The Generate RPC is open; waiting for the engine's first response event (queueing and prefill).",
        operator_sees="Time to first token; the engine's queued/running counts in GetLoad.",
        action="Nothing. A large, growing count means the engine is saturated (queueing): scale out or lower the load.",
    ),
    "decoding": StateDoc(
        meaning="A decode leg with a prefill handoff: the Generate RPC is open and the engine is pulling the KV cache "
        "from the prefill engine; no token yet.",
        operator_sees="Time to first token of disaggregated requests (KV transfer + first step).",
        action="Nothing. Many requests stuck here point at the KV transfer between the engines: check their "
        "transceivers (same backend, reachable endpoints) and the prefill engine's load.",
    ),
    "cancel_deferred": StateDoc(
        meaning="The client stopped a decode leg while its KV cache was in flight; the request goes on until the "
        "engine's first response (the transfer landed), then is aborted, so the prefill engine's KV blocks are not "
        "stranded. Bounded by --request-inactivity-timeout-secs.",
        operator_sees="A log line per deferred cancel; the request counts as cancelled once the transfer lands.",
        action="Nothing. If requests linger here, the KV transfer is slow or stuck (see `decoding`).",
    ),
    "streaming": StateDoc(
        meaning="The engine is producing tokens; chunks are flowing to the frontend.",
        operator_sees="In-flight request count; token throughput.",
        action="Nothing.",
    ),
    "stopping": StateDoc(
        meaning="The frontend closed the stream right after a chunk that may have completed the answer (it ends "
        "the stream at EOS, stop tokens and stop strings itself); the engine's next event, waited for at most 0.25 s, "
        "decides: its terminal makes the request finished (nothing to abort), anything else cancelled (aborted).",
        operator_sees="Normally gone within one inter-token interval.",
        action="Nothing.",
    ),
    "prefill_ready": StateDoc(
        meaning="A prefill leg's PrefillReady arrived: the handoff (KV session) is mapped and waits for the end of the "
        "stream before it goes to the frontend, which chains the request into a decode worker.",
        operator_sees="Normally gone within a millisecond.",
        action="Nothing. A prefill leg cancelled here leaves a KV session on the prefill engine that no decode will "
        "claim (logged); the engine releases it on its own timeout.",
    ),
    "finished": StateDoc(
        meaning="The engine's terminal event arrived and the final chunk (with usage) was sent.",
        operator_sees="Total of successful requests.",
        action="Nothing.",
    ),
    "rejected": StateDoc(
        meaning="Refused locally before any RPC (invalid argument or a capability the engine lacks).",
        operator_sees="Total of rejected requests; the client got HTTP 400 with the reason; a log line at debug.",
        action="A rising rate means clients send options this engine does not support: check the reasons.",
    ),
    "cancelled": StateDoc(
        meaning="Stopped before its end: client disconnect or stop, drain deadline, or shutdown; the engine "
        "request was aborted.",
        operator_sees="Total of cancelled requests; Dynamo's cancellation metric.",
        action="Nothing, unless it spikes during drains: then the drain deadline is shorter than typical requests.",
    ),
    "failed": StateDoc(
        meaning="Ended by an error: engine error, protocol violation, lost engine, or a bug.",
        operator_sees="Total of failed requests; an error log with the reason; the client got an error or was "
        "migrated to another worker.",
        action="Read the reasons. Engine errors point at the engine; protocol violations at an engine/schema "
        "mismatch; anything else is a sidecar bug worth reporting.",
    ),
}

REQUEST: MachineKind[RequestLifecycle, RequestState, RequestEvent] = MachineKind(
    "request",
    states=STATES,
    transitions=TRANSITIONS,
    initial="received",
    terminal=TERMINAL,
    no_ops=NO_OPS,
    docs=STATE_DOCS,
    summary=__doc__ or "",
)
"""The request machine kind: the shared machine, observers and live counts."""

RequestObserver = Callable[["RequestLifecycle", RequestEvent, RequestState, RequestState], None]
"""An observer of request state changes: ``observer(model, event, source, dest)``."""


class RequestLifecycle(Lifecycle[RequestState, RequestEvent]):
    """One request's lifecycle state; fire events with :meth:`fire`.  No history is kept (observers can)."""

    __slots__ = ("request_id",)

    _kind = REQUEST

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__()

    def __repr__(self) -> str:
        return f"<RequestLifecycle {self.request_id} {self.state}>"
