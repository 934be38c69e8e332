"""The fault side of ``bench.chaos``: a seeded schedule, the injector, and the monitor that measures recovery.

**Schedule.** :func:`plan` draws the whole run's faults from the seed before anything starts: a fault every 1.5–5 s
of the run but the last ``QUIET_S``, each with a kind, a target and a duration; several overlap. The same seed
gives the same plan. At run time a fault whose target is still busy with an earlier one (or that would leave fewer
than one aggregated worker undisturbed) is skipped and reported as such.

**Kinds** (``FAULT_KINDS``): engine SIGKILL then restart on the same port; engine SIGSTOP/SIGCONT; engine graceful
stop with its grace (GOAWAY) then restart; an error window in which a share of the load carries a retryable or a
non-retryable ``EngineError`` directive; a discovery entry deleted, or the whole discovery tree (file discovery;
the frontends are then restarted one at a time, which Dynamo 1.6.1 needs to watch the tree again); a sidecar
SIGTERM (drain) then restart; a sidecar SIGKILL then restart; delay, loss and a blackholed connection on the
sidecar ↔ engine path; a frontend crashed (SIGKILL) or stopped after its load balancer drained it (SIGTERM), then
restarted; with etcd, etcd and NATS paused for less than the 30 s lease, and — where the hosts are network
namespaces — a worker's host partitioned from the control plane's, or an engine's from its sidecar's path (routes
through a dead next hop: packets vanish, nothing is reset). KV event stream gaps and drops are armed at each engine
start (``--kv-fault gap@N`` / ``drop@N``, batch numbers from the seed) and counted when the sidecar reports them
(its "resynchronising" line).

**Witnesses.** The schedule never restarts one sidecar (``w3``), one engine (``w2``) and one frontend (``fe2``);
every other fault still reaches them (their engine killed, paused, partitioned; errors; deleted entries). Each is a
life as long as the run: the process whose resources decide whether anything grows (``bench._chaos_resources``).

**Recovery** of a fault is the time from the moment it is lifted (engine restarted, SIGCONT sent, window closed,
entry deleted, link cleared) until the topology is whole again: every worker's ``/health`` is 200 (``serving``)
and every frontend lists every worker's current instance. With overlapping faults that is the time until all of
them are healed.
"""

from __future__ import annotations

import base64
import random
import re
import shutil
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import httpx
import trio

from bench._chaos_logs import Tally, records
from bench._chaos_topology import (
    AGG_WORKERS,
    FRONTENDS,
    LORA,
    PD_WORKERS,
    Managed,
    Topology,
    frontend_instances,
    frontend_models,
    worker_instance,
    worker_state,
)
from tests.cluster.network import cut, mend

#: How a process that exited without a fault asking it to is reported (a violation: it did not survive).
EXITED: Final = "exited by itself"
#: No fault starts in the last this many seconds of the load: the run ends healed.
QUIET_S: Final = 20.0
#: Faults start after the load has run this long.
LEAD_S: Final = 5.0
MONITOR_INTERVAL_S: Final = 0.25
LORA_CHECK_INTERVAL_S: Final = 2.0

#: kind → (weight with file discovery, weight with etcd).
FAULT_KINDS: Final[dict[str, tuple[int, int]]] = {
    "engine_kill": (3, 3),
    "engine_pause": (3, 3),
    "engine_goaway": (3, 3),
    "error_retryable": (2, 2),
    "error_fatal": (2, 2),
    "discovery_entry": (2, 2),
    "discovery_tree": (1, 0),
    "sidecar_term": (2, 2),
    "sidecar_kill": (2, 2),
    "net_delay": (2, 2),
    "net_loss": (2, 2),
    "net_blackhole": (2, 2),
    "etcd_pause": (0, 2),
    "nats_pause": (0, 2),
    "frontend_restart": (1, 1),
    "partition_cp": (0, 2),
    "partition_engine": (0, 2),
}
#: After a host's control plane (etcd) was out of reach, this long of reach before the next outage: Dynamo's lease
#: keep-alive retries back off to ~10 s, so outages in quick succession add up on the 30 s lease's clock and the
#: runtime gives the lease up (docs/distributed.md, "Repeated short outages are not short"). Seen: a worker cut from
#: etcd four times in 40 s (two partitions, two etcd pauses, none longer than 7 s) lost its lease and exited.
CP_REST_S: Final = 30.0
#: What the schedule never restarts (see the module docstring).
WITNESSES: Final = {"sidecar": "w3", "engine": "w2", "frontend": "fe2"}
#: Kinds that restart their target process.
_RESTARTING: Final = {"engine_kill": "engine", "engine_goaway": "engine", "sidecar_term": "sidecar",
                      "sidecar_kill": "sidecar"}  # fmt: skip
#: Faults observed rather than scheduled (armed at engine start).
OBSERVED_KINDS: Final = ("kv_gap", "kv_drop")
_KV_RESYNC: Final = re.compile(r"^\S+ .*KV events rank \d+: resynchronising \(")
_KV_INJECTED: Final = re.compile(r"^\S+ \S+ openengine-mock WARNING KV events: injecting '(\w+)' at batch #(\d+)")


@dataclass(frozen=True)
class PlannedFault:
    at: float
    kind: str
    target: str
    duration: float
    number: int


@dataclass
class FaultRecord:
    planned: PlannedFault
    injected: float | None = None
    lifted: float | None = None
    recovered: float | None = None
    skipped: str | None = None
    note: str = ""

    @property
    def kind(self) -> str:
        return self.planned.kind

    @property
    def recovery_s(self) -> float | None:
        if self.lifted is None or self.recovered is None:
            return None
        return max(0.0, self.recovered - self.lifted)


def plan(seed: int, load_s: float, control_plane: str) -> list[PlannedFault]:
    """The run's faults, from the seed alone."""
    rng = random.Random(f"faults-{seed}-{control_plane}")
    column = 0 if control_plane == "file" else 1
    kinds = [k for k, w in FAULT_KINDS.items() if w[column]]
    weights = [FAULT_KINDS[k][column] for k in kinds]
    faults: list[PlannedFault] = []
    at = LEAD_S
    while True:
        at += rng.uniform(1.5, 5.0)
        if at > load_s - QUIET_S:
            return faults
        kind = rng.choices(kinds, weights)[0]
        faults.append(PlannedFault(round(at, 3), kind, _target(rng, kind), round(_duration(rng, kind), 3), len(faults)))


def _target(rng: random.Random, kind: str) -> str:
    if kind.startswith(("engine_", "sidecar_")):
        spared = WITNESSES[_RESTARTING[kind]] if kind in _RESTARTING else None
        return rng.choice([w for w in AGG_WORKERS if w != spared]) if rng.random() < 0.8 else rng.choice(PD_WORKERS)
    if kind.startswith(("net_", "partition_engine")):
        return rng.choice(AGG_WORKERS)
    if kind == "partition_cp":
        return rng.choice(AGG_WORKERS) if rng.random() < 0.8 else "pd-decode"  # the pair's host: both its workers
    if kind == "frontend_restart":
        return next(f for f in FRONTENDS if f != WITNESSES["frontend"])
    if kind.startswith("error_"):
        return "load"
    if kind.startswith("discovery"):
        return "discovery"
    return kind.split("_")[0]  # etcd, nats


def _duration(rng: random.Random, kind: str) -> float:
    """Downtime, pause or window length in seconds (0 for instantaneous faults)."""
    return {
        "engine_kill": rng.uniform(0.3, 3.0),
        "engine_pause": rng.uniform(0.5, 6.0),
        "engine_goaway": rng.uniform(0.3, 2.0),
        "error_retryable": rng.uniform(3.0, 8.0),
        "error_fatal": rng.uniform(3.0, 8.0),
        "sidecar_term": rng.uniform(0.2, 2.0),
        "sidecar_kill": rng.uniform(0.2, 2.0),
        "net_delay": rng.uniform(2.0, 8.0),
        "net_loss": rng.uniform(2.0, 8.0),
        "net_blackhole": rng.uniform(1.0, 8.0),
        "etcd_pause": rng.uniform(2.0, 10.0),
        "nats_pause": rng.uniform(2.0, 10.0),
        "frontend_restart": rng.uniform(0.5, 3.0),
        # Well inside the lease: Dynamo's keep-alive retries back off to ~10 s, so a longer cut can lose it.
        "partition_cp": rng.uniform(2.0, 10.0),
        "partition_engine": rng.uniform(1.0, 8.0),
    }.get(kind, 0.0)


def kv_faults(seed: int, worker: str, life: int) -> list[str]:
    """``--kv-fault`` values for one engine life: a gap and a drop at batch numbers from the seed."""
    rng = random.Random(f"kv-{seed}-{worker}-{life}")
    first = rng.randint(8, 60)
    return [f"gap@{first}", f"drop@{first + rng.randint(10, 60)}"]


# ------------------------------------------------------------------------------------------------------ state


@dataclass
class ChaosState:
    """What the injector, the monitor and the load share."""

    topo: Topology
    clock: Callable[[], float]
    records: list[FaultRecord] = field(default_factory=list)
    #: Processes (and links, "discovery", "load") a fault is working on: the monitor leaves them alone.
    busy: set[str] = field(default_factory=set)
    #: Open error windows: directive kind → how many are open.
    windows: dict[str, int] = field(default_factory=dict)
    #: Frontends not to send to (being restarted).
    draining: set[str] = field(default_factory=set)
    inflight: dict[str, int] = field(default_factory=dict)
    #: ``(t, whole)`` samples of the monitor.
    timeline: list[tuple[float, bool]] = field(default_factory=list)
    #: Processes that exited without a fault asking them to, and other surprises.
    anomalies: list[str] = field(default_factory=list)
    disrupted: set[str] = field(default_factory=set)
    #: When each frontend was stopped by a fault (the run's clock): streams it carried then broke with it.
    frontend_stops: dict[str, list[float]] = field(default_factory=dict)
    #: Why partitions cannot run here (None: they can).
    partition_unavailable: str | None = None
    #: Host ("*": every host) -> until when its control plane must stay reachable (``CP_REST_S``).
    cp_rest_until: dict[str, float] = field(default_factory=dict)

    def record(self, planned: PlannedFault) -> FaultRecord:
        rec = FaultRecord(planned)
        self.records.append(rec)
        return rec


# --------------------------------------------------------------------------------------------------- injector


async def run_plan(state: ChaosState, faults: list[PlannedFault], seed: int) -> None:
    """Inject ``faults`` at their times (relative to ``state.clock``); returns once every fault is lifted."""
    rng = random.Random(f"inject-{seed}")
    async with trio.open_nursery() as nursery:
        for planned in faults:
            await trio.sleep(max(0.0, planned.at - state.clock()))
            rec = state.record(planned)
            lock = _lock_of(planned)
            if planned.kind.startswith("partition_") and state.partition_unavailable is not None:
                rec.skipped = state.partition_unavailable
                continue
            if lock & state.busy:
                rec.skipped = f"target busy ({', '.join(sorted(lock & state.busy))})"
                continue
            resting = _cp_resting(state, planned)
            if resting is not None:
                rec.skipped = resting
                continue
            worker = planned.target if planned.target in state.topo.workers else None
            others = {w for w in state.disrupted if w in AGG_WORKERS}
            if worker in AGG_WORKERS and worker not in others and _disrupting(planned.kind):  # noqa: SIM102
                if len(others) >= len(AGG_WORKERS) - 1:
                    rec.skipped = "would leave no aggregated worker undisturbed"
                    continue
            state.busy |= lock
            nursery.start_soon(_inject, state, rec, lock, random.Random(rng.random()))


def _lock_of(planned: PlannedFault) -> set[str]:
    kind, target = planned.kind, planned.target
    if kind.startswith("engine_"):
        return {f"{target}-engine"}
    if kind.startswith("sidecar_"):
        return {target}
    if kind.startswith(("net_", "partition_engine")):
        return {f"{target}-link"}
    if kind == "partition_cp":
        return {f"{_host_of(target)}-cp"}
    if kind == "discovery_tree":
        return {"discovery", *FRONTENDS}
    if kind.startswith("discovery"):
        return {"discovery"}
    if kind.startswith("error_"):
        return {kind}
    return {target}


def _cp_hosts(planned: PlannedFault) -> set[str]:
    """The hosts whose etcd lease a fault puts at risk ("*": all of them)."""
    if planned.kind == "etcd_pause":
        return {"*"}
    if planned.kind == "partition_cp":
        return {_host_of(planned.target)}
    return set()


def _cp_resting(state: ChaosState, planned: PlannedFault) -> str | None:
    """Why a control-plane outage must wait (another one is on, or one ended less than ``CP_REST_S`` ago)."""
    hosts = _cp_hosts(planned)
    if not hosts:
        return None
    now = state.clock()
    for key in state.busy:
        if ("*" in hosts and key.endswith("-cp")) or key == "etcd":
            return f"another control-plane outage is on ({key})"
    relevant = state.cp_rest_until if "*" in hosts else {h: state.cp_rest_until.get(h, 0.0) for h in {*hosts, "*"}}
    waiting = {h: until for h, until in relevant.items() if until > now}
    if waiting:
        return f"control plane of {', '.join(sorted(waiting))} out of reach less than {CP_REST_S:.0f} s ago"
    return None


def _host_of(worker: str) -> str:
    """The host a worker runs on (the pair shares one)."""
    return "pd" if worker in PD_WORKERS else worker


def _disrupting(kind: str) -> bool:
    return kind.startswith(("engine_", "sidecar_", "net_", "partition_"))


async def _inject(state: ChaosState, rec: FaultRecord, lock: set[str], rng: random.Random) -> None:
    planned = rec.planned
    target = planned.target
    if target in state.topo.workers and _disrupting(planned.kind):
        state.disrupted.add(target)
    try:
        await _FAULTS[planned.kind](state, rec, rng)
    except Exception as exc:  # a fault that could not be applied is reported, never fatal to the run
        rec.note += f" failed: {type(exc).__name__}: {exc}"
        state.anomalies.append(f"fault #{planned.number} {planned.kind} on {target}: {type(exc).__name__}: {exc}")
    finally:
        if rec.lifted is None:
            rec.lifted = state.clock()
        for host in _cp_hosts(planned):
            state.cp_rest_until[host] = state.clock() + CP_REST_S
        state.busy -= lock
        state.disrupted.discard(target)


async def _engine_kill(state: ChaosState, rec: FaultRecord, rng: random.Random) -> None:
    engine = state.topo.workers[rec.planned.target].engine
    rec.injected = state.clock()
    await engine.managed.stop(signal.SIGKILL, grace=0)
    await trio.sleep(rec.planned.duration)
    await _restart(engine.managed)
    rec.lifted = state.clock()


async def _engine_pause(state: ChaosState, rec: FaultRecord, rng: random.Random) -> None:
    engine = state.topo.workers[rec.planned.target].engine
    rec.injected = state.clock()
    engine.managed.send_signal(signal.SIGSTOP)
    try:
        await trio.sleep(rec.planned.duration)
    finally:
        engine.managed.send_signal(signal.SIGCONT)
    rec.lifted = state.clock()


async def _engine_goaway(state: ChaosState, rec: FaultRecord, rng: random.Random) -> None:
    """SIGTERM: grpc-core's ``stop(grace)`` (GOAWAY, open streams run for the mock's 2 s grace), then restart."""
    engine = state.topo.workers[rec.planned.target].engine
    rec.injected = state.clock()
    await engine.managed.stop(signal.SIGTERM, grace=10)
    await trio.sleep(rec.planned.duration)
    await _restart(engine.managed)
    rec.lifted = state.clock()


async def _restart(managed: Managed) -> None:
    """Start again on the same port; a port taken meanwhile (another process) is retried a few times."""
    for attempt in range(5):
        try:
            await managed.start()
            return
        except Exception:
            if attempt == 4:
                raise
            await managed.reap()
            await trio.sleep(1)


async def _error_window(state: ChaosState, rec: FaultRecord, rng: random.Random) -> None:
    kind = rec.planned.kind
    rec.injected = state.clock()
    state.windows[kind] = state.windows.get(kind, 0) + 1
    try:
        await trio.sleep(rec.planned.duration)
    finally:
        state.windows[kind] -= 1
    rec.lifted = state.clock()


async def _discovery_entry(state: ChaosState, rec: FaultRecord, rng: random.Random) -> None:
    topo = state.topo
    rec.injected = state.clock()
    if topo.cluster is not None:
        key = await _etcd_delete_instance(state, rng)
        rec.note = f"etcd key {key}"
    else:
        assert topo.file_kv is not None
        files = sorted(p for p in (topo.file_kv / "v1").rglob("*") if p.is_file() and ".tmp" not in p.name)
        if files:
            victim = rng.choice(files)
            victim.unlink(missing_ok=True)
            rec.note = str(victim.relative_to(topo.file_kv))
    rec.lifted = state.clock()


async def _discovery_tree(state: ChaosState, rec: FaultRecord, rng: random.Random) -> None:
    """``rm -rf "$DYN_FILE_KV"/v1/*``; then the operator's part: restart the frontends one at a time (Dynamo 1.6.1
    never watches a deleted directory again), each once the requests it carries are done (bounded)."""
    topo = state.topo
    assert topo.file_kv is not None
    rec.injected = state.clock()
    for child in sorted((topo.file_kv / "v1").iterdir()) if (topo.file_kv / "v1").is_dir() else []:
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
    rec.lifted = state.clock()
    for name, frontend in topo.frontends.items():
        state.draining.add(name)
        try:
            with trio.move_on_after(30):
                while state.inflight.get(name, 0):  # noqa: ASYNC110 (a counter the clients bump, polled)
                    await trio.sleep(0.1)
            await frontend.managed.stop(signal.SIGTERM, grace=10)
            await _restart(frontend.managed)
        finally:
            state.draining.discard(name)
    rec.note = "frontends restarted"


async def _sidecar_term(state: ChaosState, rec: FaultRecord, rng: random.Random) -> None:
    """SIGTERM: the sidecar drains (5 s at most) and exits; a supervisor starts it again."""
    sidecar = state.topo.workers[rec.planned.target].sidecar
    rec.injected = state.clock()
    await sidecar.stop(signal.SIGTERM, grace=30)
    code = sidecar.lives[-1].process.returncode
    if code not in (0, None):
        rec.note = f"exit status {code} after SIGTERM"
    await trio.sleep(rec.planned.duration)
    await sidecar.start(wait_ready=False)
    rec.lifted = state.clock()


async def _sidecar_kill(state: ChaosState, rec: FaultRecord, rng: random.Random) -> None:
    sidecar = state.topo.workers[rec.planned.target].sidecar
    rec.injected = state.clock()
    await sidecar.stop(signal.SIGKILL, grace=0)
    await trio.sleep(rec.planned.duration)
    await sidecar.start(wait_ready=False)
    rec.lifted = state.clock()


async def _net(state: ChaosState, rec: FaultRecord, rng: random.Random) -> None:
    link = state.topo.workers[rec.planned.target].link
    assert link is not None
    kind = rec.planned.kind
    rec.injected = state.clock()
    try:
        if kind == "net_delay":
            ms, jitter = rng.uniform(20, 200), rng.uniform(0, 50)
            link.delay(ms, jitter)
            rec.note = f"{link.kind}: delay {ms:.0f} ms ± {jitter:.0f} ms"
        elif kind == "net_loss":
            percent = rng.uniform(2, 15)
            link.loss(percent)
            rec.note = f"{link.kind}: loss {percent:.1f} %"
        else:
            rec.note = f"{link.kind}: blackholed {link.blackhole(rng)}"
        await trio.sleep(rec.planned.duration)
    finally:
        link.clear()
    rec.lifted = state.clock()


async def _cp_pause(state: ChaosState, rec: FaultRecord, rng: random.Random) -> None:
    cluster = state.topo.cluster
    assert cluster is not None
    process = cluster.etcd if rec.planned.kind == "etcd_pause" else cluster.nats
    assert process is not None
    rec.injected = state.clock()
    process.signal(signal.SIGSTOP)
    try:
        await trio.sleep(rec.planned.duration)
    finally:
        process.signal(signal.SIGCONT)
    rec.lifted = state.clock()


async def _frontend_restart(state: ChaosState, rec: FaultRecord, rng: random.Random) -> None:
    """A crash (SIGKILL: the clients still sending to it get connection errors until it is back) or a planned stop
    (its load balancer drains it first: no new requests, the ones in flight finish, bounded; then SIGTERM); then it
    is started again on the same port and must list every worker again."""
    name = rec.planned.target
    frontend = state.topo.frontends[name]
    crash = rng.random() < 0.5
    rec.injected = state.clock()
    if not crash:
        state.draining.add(name)
    try:
        if not crash:
            with trio.move_on_after(30):
                while state.inflight.get(name, 0):  # noqa: ASYNC110 (a counter the clients bump, polled)
                    await trio.sleep(0.1)
        state.frontend_stops.setdefault(name, []).append(state.clock())
        await frontend.managed.stop(signal.SIGKILL if crash else signal.SIGTERM, grace=0 if crash else 10)
        rec.note = "crashed (SIGKILL)" if crash else f"drained, then SIGTERM ({state.inflight.get(name, 0)} in flight)"
        await trio.sleep(rec.planned.duration)
        await _restart(frontend.managed)
    finally:
        state.draining.discard(name)
    rec.lifted = state.clock()


async def _partition(state: ChaosState, rec: FaultRecord, rng: random.Random) -> None:
    """Cut a worker's host from the control plane's (etcd and NATS), or an engine's host from its sidecar's path
    (the sidecar's host with netem; the proxy's leg in the root namespace otherwise), for the planned time."""
    topo = state.topo
    worker = topo.workers[rec.planned.target]
    if rec.planned.kind == "partition_cp":
        ends = (worker.host.name, "cp")
    else:
        ends = (worker.engine.host.name, worker.host.name if topo.network_mode == "netem" else "client")
    rec.injected = state.clock()
    try:
        cut(topo.network, *ends)
        rec.note = f"{ends[0]} ⇹ {ends[1]}"
        await trio.sleep(rec.planned.duration)
    finally:
        mend(topo.network, *ends)
    rec.lifted = state.clock()


async def _etcd_delete_instance(state: ChaosState, rng: random.Random) -> str:
    """Delete one worker's ``generate`` instance key in etcd (the entry its watchdog checks and restores)."""
    cluster = state.topo.cluster
    assert cluster is not None

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    async with httpx.AsyncClient(timeout=5) as http:
        prefix = "v1/instances/"
        listed = await http.post(
            f"{cluster.etcd_url}/v3/kv/range",
            json={"key": b64(prefix), "range_end": b64(prefix[:-1] + "0"), "keys_only": True},
        )
        keys = sorted(base64.b64decode(kv["key"]).decode() for kv in listed.json().get("kvs", []))
        keys = [k for k in keys if "/generate/" in k] or keys
        if not keys:
            return "(none)"
        key = rng.choice(keys)
        await http.post(f"{cluster.etcd_url}/v3/kv/deleterange", json={"key": b64(key)})
        return key


_FAULTS: Final = {
    "engine_kill": _engine_kill,
    "engine_pause": _engine_pause,
    "engine_goaway": _engine_goaway,
    "error_retryable": _error_window,
    "error_fatal": _error_window,
    "discovery_entry": _discovery_entry,
    "discovery_tree": _discovery_tree,
    "sidecar_term": _sidecar_term,
    "sidecar_kill": _sidecar_kill,
    "net_delay": _net,
    "net_loss": _net,
    "net_blackhole": _net,
    "etcd_pause": _cp_pause,
    "nats_pause": _cp_pause,
    "frontend_restart": _frontend_restart,
    "partition_cp": _partition,
    "partition_engine": _partition,
}


# ---------------------------------------------------------------------------------------------------- monitor


async def whole(state: ChaosState, http: httpx.AsyncClient) -> tuple[bool, dict[str, str]]:
    """Every worker serving, listed by every frontend, every model listed; also each worker's state (for the
    report)."""
    topo = state.topo
    states: dict[str, str] = {}
    ids: set[int] = set()
    ok = True
    for name, worker in topo.workers.items():
        states[name] = await worker_state(http, worker)
        if states[name] != "serving":
            ok = False
            continue
        instance = await worker_instance(http, worker)
        if instance is None:
            ok = False
        else:
            ids.add(instance)
    if not ok:
        return False, states
    for frontend in topo.frontends.values():
        listed = await frontend_instances(http, frontend)
        if listed is None or not ids <= listed or not await frontend_models(http, frontend) >= topo.models:
            return False, states
    return True, states


async def monitor(state: ChaosState, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Until cancelled: sample wholeness, restart what exited unasked (an anomaly), keep the LoRA adapter loaded
    on every aggregated worker (an operator's job when a worker and its engine both restarted), mark recoveries."""
    topo = state.topo
    next_lora = 0.0
    task_status.started()
    async with httpx.AsyncClient(timeout=5) as http:
        while True:
            await _supervise(state)
            is_whole, _ = await whole(state, http)
            t = state.clock()
            state.timeline.append((t, is_whole))
            if is_whole:
                for rec in state.records:
                    if rec.lifted is not None and rec.recovered is None and rec.skipped is None:
                        rec.recovered = t
            if t >= next_lora and topo.lora_root is not None:
                next_lora = t + LORA_CHECK_INTERVAL_S
                for name in AGG_WORKERS:
                    worker = topo.workers[name]
                    loras = await topo.list_loras(worker)
                    if loras is not None and LORA not in loras and name not in state.busy:
                        answer = await topo.load_lora(worker)
                        topo.lora_reloads += 1
                        if answer.get("status") != "ok":
                            state.anomalies.append(f"loading {LORA} on {name} again failed: {answer}")
            await trio.sleep(MONITOR_INTERVAL_S)


async def _supervise(state: ChaosState) -> None:
    for key, managed in _processes(state.topo):
        if key in state.busy or managed.process is None or managed.process.returncode is None:
            continue
        code = await managed.reap()
        state.anomalies.append(f"{managed.name} {EXITED} (status {code}) at {state.clock():.1f} s; restarted")
        await _restart(managed)


def _processes(topo: Topology) -> list[tuple[str, Managed]]:
    out = [(name, f.managed) for name, f in topo.frontends.items()]
    for name, worker in topo.workers.items():
        out += [(name, worker.sidecar), (f"{name}-engine", worker.engine.managed)]
    return out


def observed_kv_faults(topo: Topology, clock_of: Callable[[float], float], tally: Tally) -> list[FaultRecord]:
    """The KV event faults the engines injected (their "injecting" line), as fault records; recovered when the
    sidecar resynchronised the rank (its "resynchronising" line: the router's view cleared and rebuilt from a fresh
    subscription). ``clock_of`` turns a Unix time into the run's clock; lines the reader does not know are counted
    in ``tally``."""
    result: list[FaultRecord] = []
    for name in (*AGG_WORKERS, *PD_WORKERS):
        worker = topo.workers[name]
        resyncs = sorted(
            record.at
            for life in worker.sidecar.lives
            for record in records(life.process.log_path, tally, "sidecar")
            if _KV_RESYNC.match(record.text)
        )
        for life in worker.engine.managed.lives:
            for record in records(life.process.log_path, tally, "engine"):
                match = _KV_INJECTED.match(record.text)
                if match is None:
                    continue
                at = record.at
                kind = "kv_gap" if match.group(1) == "gap" else "kv_drop"
                planned = PlannedFault(clock_of(at), kind, name, 0.0, -1)
                rec = FaultRecord(planned, injected=clock_of(at), lifted=clock_of(at), note=f"batch #{match.group(2)}")
                after = next((t for t in resyncs if t >= at - 0.05), None)
                if after is not None and after - at < 30:
                    rec.recovered = clock_of(after)
                result.append(rec)
    return result


__all__ = [
    "EXITED",
    "FAULT_KINDS",
    "OBSERVED_KINDS",
    "ChaosState",
    "FaultRecord",
    "PlannedFault",
    "kv_faults",
    "monitor",
    "observed_kv_faults",
    "plan",
    "run_plan",
    "whole",
]
