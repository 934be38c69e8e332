"""The worker lifecycle: one per sidecar process, from start-up through serving to a clean or failed exit."""

# Theory of operation
# ===================
#
# Everything that changes the worker's lifecycle lives in the tables below; the worker code (`sidecar/worker.py`)
# only *reports* what happened by firing events, and reacts to states through observers.  Transitions written by
# hand anywhere else are invisible to `docs/state-machines.md` (generated from these tables by
# `scripts/gen_state_docs.py`) -- so there must be none.  This file does not know about trio, gRPC or Dynamo; it
# names what the worker is doing, not how.
#
# The happy path is a straight line, one state per start-up phase, each left by exactly one event fired when the
# phase's work has *finished* (nursery.start()/task_status.started() style, so "serving" is never claimed early):
#
#   starting -connect-> connecting -connected-> discovering -discovered-> waiting_ready -ready-> registering
#            -registered-> serving
#
# After that the worker must survive the engine (Dynamo's Rust sidecar exits on the first failed health poll and
# never reconnects; we do not):
#
# * `degrade`:     serving, but the engine's Health is not READY or Health RPCs fail, or the engine announced that
#                  it is stopping (GOAWAY), or a request's inactivity timeout found the engine not producing at all
#                  (Health may say READY then), or the registration watchdog found a discovery entry it cannot
#                  write back.  The worker withdraws its Dynamo endpoint instance so the router stops sending it
#                  work; in-flight requests continue (after a GOAWAY, until the engine closes its connections; then
#                  `engine_lost`).  Also from registering after a reconnect, when the registration cannot be
#                  published: the watchdog keeps the worker out until it can write every entry.
# * `stall`:       serving, but the engine stopped answering: Health polls time out while no stream delivers
#                  anything (a stopped process, a GC pause, a wedged host).  The worker withdraws its instance as for
#                  `degrade`, but the engine may resume: every stream in flight -- and a request that still arrives,
#                  routed before the withdrawal landed -- waits for it up to its own inactivity timeout and then fails
#                  migratably; a stream the engine resumes completes.  Health READY again is `recover`; Health NOT
#                  READY is `degrade`; a refused or lost connection is `engine_lost`.
# * `recover`:     Health is READY again (after "engine not producing": a canary generation was answered) ->
#                  `registering` re-registers, then `registered` -> serving.
# * `engine_lost`: the channel to the engine is gone (restart, crash, network: a failed poll with nothing accepting
#                  connections on the engine's port is one at once), or another engine answers on it (a new instance
#                  id, a quick restart).  In-flight requests are failed with a migratable error (after a restart
#                  noticed by its instance id, those on the new engine are left alone), the registration is
#                  withdrawn, the worker probes the engine's port until it accepts and asks it again at once (backed
#                  off only while the port accepts and the engine does not answer); on `reconnected` it goes back
#                  through discovering (which refuses a changed role or model), waiting_ready and registering -- the
#                  same checks as a cold start, and the model card is registered again with what the engine reports
#                  (removed and published again when it changed: Dynamo refuses to rewrite a card in place).  A claim
#                  of a new engine that finds the same one waits out of routing; the 5th in a row is a `fail`.
#
# Shutdown has two doors.  `drain` (SIGTERM, from any non-terminal state): stop accepting, deregister, put a
# deadline on the in-flight requests, abort stragglers; `drained` when the request nursery is empty.  `stop` is the
# short door used when there is nothing to drain -- a shutdown requested before the worker ever registered -- and the
# forced exit from `draining` (a second signal).  `fail` from any non-terminal state is the one error exit: a fatal
# start-up refusal (bad schema, wrong model, deadline passed), reconnecting given up, or a bug.
#
# Idempotence is explicit (NO_OPS): a repeated SIGTERM is a `drain` while draining or after the end, and a repeated
# stop request is a `stop` after the end; both are no-ops, everything else that is not in TRANSITIONS raises
# IllegalTransition.  There is no per-request or per-poll transition here: health polls that change nothing fire
# nothing.

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from ._base import Lifecycle, MachineKind, StateDoc

if TYPE_CHECKING:
    from transitions.core import TransitionConfigDict

__all__ = [
    "NO_OPS",
    "STATES",
    "STATE_DOCS",
    "TERMINAL",
    "TRANSITIONS",
    "WORKER",
    "WorkerEvent",
    "WorkerLifecycle",
    "WorkerObserver",
    "WorkerState",
]

WorkerState = Literal[
    "starting",
    "connecting",
    "discovering",
    "waiting_ready",
    "registering",
    "serving",
    "degraded",
    "stalled",
    "reconnecting",
    "draining",
    "stopped",
    "failed",
]
WorkerEvent = Literal[
    "connect",
    "connected",
    "discovered",
    "ready",
    "registered",
    "degrade",
    "stall",
    "recover",
    "engine_lost",
    "reconnected",
    "drain",
    "drained",
    "stop",
    "fail",
]

STATES: tuple[WorkerState, ...] = (
    "starting",
    "connecting",
    "discovering",
    "waiting_ready",
    "registering",
    "serving",
    "degraded",
    "stalled",
    "reconnecting",
    "draining",
    "stopped",
    "failed",
)

TERMINAL: frozenset[WorkerState] = frozenset({"stopped", "failed"})

# Every state the worker can still leave; `drain` and `fail` are allowed from all of them.
_ACTIVE: list[WorkerState] = [state for state in STATES if state not in TERMINAL]
# Phases before the first registration: nothing can be in flight, so a shutdown may skip draining.
_BEFORE_REGISTRATION: list[WorkerState] = ["starting", "connecting", "discovering", "waiting_ready"]

TRANSITIONS: list[TransitionConfigDict] = [
    # Config parsed, edge thread up; the worker starts opening its channel pool to the engine.
    {"trigger": "connect", "source": "starting", "dest": "connecting"},
    # At least one channel answered.  Retries with backoff happen *inside* connecting, bounded by the start-up
    # deadline; giving up is `fail`.
    {"trigger": "connected", "source": "connecting", "dest": "discovering"},
    # GetServerInfo + GetModelInfo accepted (schema, role, model, capabilities).  A refusal is `fail`, not a retry:
    # a wrong engine does not become right by asking again.
    {"trigger": "discovered", "source": "discovering", "dest": "waiting_ready"},
    # Health reported READY.  Engines open their port before the model has loaded, so readiness is its own phase.
    {"trigger": "ready", "source": "waiting_ready", "dest": "registering"},
    # Dynamo endpoint served and model registered: the frontend may route to us from now on.
    {"trigger": "registered", "source": "registering", "dest": "serving"},
    # Health not READY or Health RPCs failing while the channel is up, a GOAWAY (the engine is stopping), an engine
    # not producing, or a discovery entry the registration watchdog cannot write back: withdraw from routing, keep
    # in-flight work (the Rust sidecar exits here).  From registering: the engine is back after a loss but its
    # registration cannot be published (the watchdog holds the worker out): not routable, so not serving.
    # From stalled: the engine answers again but not READY, or says it is going away.
    {"trigger": "degrade", "source": ["serving", "registering", "stalled"], "dest": "degraded"},
    # Health polls time out while no stream delivers anything: withdraw from routing, keep every stream (and admit
    # a request still routed here) until its own inactivity timeout -- the engine may resume.
    {"trigger": "stall", "source": "serving", "dest": "stalled"},
    # Health READY again: re-register (through `registering`, so "serving" always means "registered").
    {"trigger": "recover", "source": ["degraded", "stalled"], "dest": "registering"},
    # The engine went away.  Allowed once connected: a restart can happen in any later phase, and reconnecting
    # re-runs discovery, so a half-done phase is simply redone.  Before the first `registered` the worker code may
    # prefer `fail` (start-up refusal); the table allows both.
    {
        "trigger": "engine_lost",
        "source": ["discovering", "waiting_ready", "registering", "serving", "degraded", "stalled"],
        "dest": "reconnecting",
    },
    # Channel back: rediscover, because a restarted engine may have changed role or model (refused there -> fail).
    {"trigger": "reconnected", "source": "reconnecting", "dest": "discovering"},
    # SIGTERM or an operator request, from anywhere still running: deregister, stop accepting, deadline on
    # in-flight requests.  (`drain` while draining is a no-op, see NO_OPS, not a self-loop that restarts the drain.)
    {"trigger": "drain", "source": [s for s in _ACTIVE if s != "draining"], "dest": "draining"},
    # The request nursery is empty (finished, or cancelled by the drain deadline and aborted).
    {"trigger": "drained", "source": "draining", "dest": "stopped"},
    # Shutdown before anything was registered (nothing to drain), or a forced exit while draining (second signal).
    {"trigger": "stop", "source": [*_BEFORE_REGISTRATION, "draining"], "dest": "stopped"},
    # The one error exit: start-up refusal, reconnect given up, or a bug.  The reason names which.
    {"trigger": "fail", "source": _ACTIVE, "dest": "failed"},
]

NO_OPS: dict[tuple[WorkerState, WorkerEvent], str] = {
    # Operators and orchestrators repeat SIGTERM; the first one started the drain, the next ones change nothing.
    ("draining", "drain"): "a repeated SIGTERM while draining; the drain already in progress continues",
    # A signal can arrive while the process is already on its way out.
    ("stopped", "drain"): "SIGTERM after the worker stopped; it is already exiting",
    ("failed", "drain"): "SIGTERM after the worker failed; it is already exiting with an error",
    # The shutdown path may request stop once more after a stop/drain finished.
    ("stopped", "stop"): "a repeated stop request after the worker stopped",
    ("failed", "stop"): "a stop request after the worker failed; the failure stands",
}

STATE_DOCS: dict[WorkerState, StateDoc] = {
    "starting": StateDoc(
        meaning="The process is up and its configuration parsed; nothing has been contacted yet.",
        operator_sees="First log lines; the worker's /health (DYN_SYSTEM_PORT) answers 503 notready.",
        action="Nothing. A worker that stays here for more than a second is stuck before any I/O: check its logs.",
    ),
    "connecting": StateDoc(
        meaning="Opening the gRPC channel pool to the engine, retrying with backoff until the start-up deadline.",
        operator_sees="Throttled connection-error logs naming the endpoint; /health 503.",
        action="Normal while the engine starts. If it lasts, check the engine endpoint flag, that the engine "
        "process is up and listening, and the network between the containers.",
    ),
    "discovering": StateDoc(
        meaning="Reading GetServerInfo and GetModelInfo and checking schema, role, model and capabilities.",
        operator_sees="A log line with engine name, schema release and model; /health 503.",
        action="Nothing; a refusal moves to failed with the reason logged.",
    ),
    "waiting_ready": StateDoc(
        meaning="Polling the engine's Health until it reports READY (the model may still be loading).",
        operator_sees="Periodic 'engine not ready' logs with the reported health state; /health 503.",
        action="Normal for minutes while weights load. If it ends in failed, raise the start-up deadline or check "
        "the engine's own logs.",
    ),
    "registering": StateDoc(
        meaning="Serving the Dynamo endpoint and registering the model, first at start-up or again after recovery.",
        operator_sees="A registration log line; the model is about to appear in the frontend's /v1/models.",
        action="Nothing. If it lasts, check Dynamo discovery (etcd/NATS or file discovery) connectivity.",
    ),
    "serving": StateDoc(
        meaning="Registered with Dynamo and the engine is healthy: requests are accepted and routed here.",
        operator_sees="/health 200 ready; the model listed in /v1/models; request metrics moving.",
        action="Nothing.",
    ),
    "degraded": StateDoc(
        meaning="The engine is reachable but not healthy (Health not READY or Health RPCs failing), it announced "
        "that it is stopping (GOAWAY), or it stopped producing (a request's inactivity timeout with nothing from the "
        "engine for any request, while Health may still say READY); or the registration watchdog found a discovery "
        "entry of this worker it cannot write back. The endpoint instance is withdrawn so no new requests are "
        "routed here; in-flight requests continue.",
        operator_sees="A warning with the reason (health state, RPC error, 'the engine is going away', 'engine not "
        "producing'), or an error naming the discovery entry that cannot be published again; /health 503; traffic "
        "moves to other workers, or new requests get 503 if there are none.",
        action="Check the engine (overload, GPU error, model reload, a wedged generation loop). The worker "
        "re-registers by itself when Health is READY again -- after 'engine not producing', when a one-token canary "
        "generation is answered; after a GOAWAY, when the engine is back. For a discovery entry: free its path "
        "(permissions, something else holding it); the watchdog restores it at its next check and the worker "
        "serves again, or exits 1 after 12 failed checks.",
    ),
    "stalled": StateDoc(
        meaning="The engine stopped answering: Health polls time out and no stream delivers anything (a stopped or "
        "paused process, a long pause, an overloaded host). The endpoint instance is withdrawn so no new requests are "
        "routed here; every request in flight, and one that still arrives (routed before the withdrawal landed), "
        "waits for the engine up to its --request-inactivity-timeout-secs and then fails with a migratable error. "
        "A stream the engine resumes completes.",
        operator_sees="A warning 'engine not answering' with the number of requests waiting; /health 503; traffic "
        "moves to other workers, or new requests get 503 if there are none; requests that wait end at their "
        "inactivity timeout (migrated with --migration-limit).",
        action="Check the engine process (stopped, swapping, a long pause, its host). The worker serves again by "
        "itself as soon as the engine's Health answers READY; if its connection drops instead, the worker "
        "reconnects.",
    ),
    "reconnecting": StateDoc(
        meaning="The connection to the engine was lost, or a restarted engine answers (a new instance id); "
        "registration withdrawn, in-flight requests failed with a migratable error; a connect to the engine's port "
        "every 25 ms while it refuses, GetServerInfo as soon as it accepts (backed off, 1 s doubling, while the port "
        "accepts and the engine does not answer yet).",
        operator_sees="A line naming the lost connection, 'engine at … not reachable: nothing accepts connections "
        "there; probing every 25 ms', "
        "then 'engine back: serving again N ms after it accepted a connection'; /health 503 meanwhile; clients of "
        "in-flight requests migrate (if the frontend's migration limit allows) or get an error.",
        action="Check whether the engine restarted or crashed. The worker rediscovers and re-registers by itself "
        "when the engine is back (a model card with other limits or capabilities replaces the old one whole); it "
        "fails if the engine changed role or model, or after 5 claims in a row of a new engine that turned out to be "
        "the same one (two engines behind one address?).",
    ),
    "draining": StateDoc(
        meaning="Shutting down gracefully: deregistered, no new requests, in-flight requests finishing under the "
        "drain deadline; stragglers are cancelled and aborted in the engine at the deadline.",
        operator_sees="A drain log line with the in-flight count and deadline; /health 503; the model leaves "
        "/v1/models.",
        action="Wait for the drain deadline. A repeated SIGTERM changes nothing; a stop request (e.g. a second "
        "SIGINT) ends the drain at once.",
    ),
    "stopped": StateDoc(
        meaning="Clean exit: everything drained or nothing was started.",
        operator_sees="A final log line; the process exits with status 0.",
        action="Nothing.",
    ),
    "failed": StateDoc(
        meaning="Fatal error: a start-up refusal (schema, role, model, capability, deadline), reconnecting given "
        "up, or a bug.",
        operator_sees="An error log with the reason; the process exits non-zero and the orchestrator restarts it.",
        action="Read the reason. Configuration refusals need a flag or engine fix; repeated failures after "
        "reconnecting point at the engine.",
    ),
}

WORKER: MachineKind[WorkerLifecycle, WorkerState, WorkerEvent] = MachineKind(
    "worker",
    states=STATES,
    transitions=TRANSITIONS,
    initial="starting",
    terminal=TERMINAL,
    no_ops=NO_OPS,
    docs=STATE_DOCS,
    summary=__doc__ or "",
)
"""The worker machine kind: the shared machine, observers and live counts."""

WorkerObserver = Callable[["WorkerLifecycle", WorkerEvent, WorkerState, WorkerState], None]
"""An observer of worker state changes: ``observer(model, event, source, dest)``."""


class WorkerLifecycle(Lifecycle[WorkerState, WorkerEvent]):
    """The worker's lifecycle state (one per process); fire events with :meth:`fire`."""

    __slots__ = ()

    _kind = WORKER
