"""Chaos soak with an exactness checker: many faults at once, every response checked against its reference.

    python -m bench.chaos --minutes 3 --seed 1                        # file discovery, loopback
    python -m bench.chaos --minutes 2 --seed 1 --control-plane etcd   # etcd + NATS (namespaces when root)
    python -m bench.chaos --minutes 3 --seed 1 --write-docs           # also update docs/faults.md
    python -m bench.chaos --minutes 60 --control-plane etcd --write-docs   # the hour (the etcd figures of the docs)
    python -m bench.chaos --minutes 10 --sidecar dynamo --write-comparison # Dynamo's own sidecar, docs/comparison.md
    python -m bench.chaos --minutes 10 --topology common --write-comparison   # ours on the same topology, beside it

Topology (``bench._chaos_topology``): 2 Dynamo frontends (``--migration-limit 3``, KV router) × 3 aggregated
workers, each an ``openengine-sidecar`` driving its own ``openengine-mock --profile full`` (KV events, LoRA), plus a
1P1D pair serving a model of its own; on file discovery, or etcd + NATS. A fault-free reference stack (its own
frontend, sidecar and mock) answers every request template first: the mock's output is a function of the context
and the absolute position, so a migrated request must continue exactly where its first attempt stopped.

Load (``bench._chaos_load``): a bounded closed loop of clients through both frontends. Faults
(``bench._chaos_faults``): a seeded schedule, several overlapping. Checker (``bench._chaos_check``): every response
complete and exactly equal to its reference, or a clean error with no ``finish_reason``; never a truncated 200.
Afterwards every engine holds no request and no KV session, every worker serves, on etcd each live worker holds
one set of discovery entries and no dead instance any, and the sidecars' counters reconcile with what the clients
saw. Resources (``bench._chaos_resources``): every long-lived process sampled through the run, slopes within lives,
a verdict. The report (``bench._chaos_report``) is printed and ends with two verdict lines, ``violations: …`` and
``resources: …``; ``--report PATH`` writes it as JSON, ``--write-docs`` into ``docs/faults.md``. A violation prints
the seed and the request's full transcript. Exit status 0 only with no violation, every post-condition met and
resources flat; 2 for bad flags.

``--sidecar dynamo`` runs Dynamo's own TensorRT-LLM sidecar (``python -m dynamo.trtllm.sidecar``) in every worker
on the ``common`` topology (``bench._chaos_topology``: what both sidecars serve; ``--topology common`` runs ours on
it), with the same load, faults, checker and post-conditions where they can see it from the outside. What cannot
apply to Dynamo's sidecar is said in the report: the reconciliation of the sidecars' own counters (it logs no
request ends and exports no outcome counters), the idle task counts (it has no task gauges); in their place every
live run's Dynamo in-flight gauge must be 0 after the load (both sidecars, on the common topology).
``--write-comparison`` puts the report into ``docs/comparison.md``, beside the other sidecar's.

Bounded: every loop by count and time, every request by ``REQUEST_TIMEOUT_S``, every process stopped at the end
(also on Ctrl-C or an error), nothing outside loopback or the project's network namespaces.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import httpx
import trio

from bench._chaos_check import (
    Answer,
    End,
    LifeCounts,
    Reconciliation,
    Verdict,
    frontend_abandoned,
    frontend_lost,
    frontend_migrations,
    judge,
    log_ends,
    log_instances,
    metric_counts,
    migrated_usage,
    parse,
    reconcile,
    reference_problems,
    request_ids,
)
from bench._chaos_discovery import LEASE_S, MARGIN_S, etcd_entries, fill_raft_log, sets, settled
from bench._chaos_faults import (
    ChaosState,
    kv_faults,
    monitor,
    observed_kv_faults,
    plan,
    run_plan,
    whole,
)
from bench._chaos_load import Behaviour, Template, Transcript, catalogue, send
from bench._chaos_logs import Tally
from bench._chaos_net import netem_unavailable
from bench._chaos_report import Report, comparison_markers, write_block, write_docs
from bench._chaos_resources import HARNESS, Resources, Watched, sample, schedule
from bench._chaos_topology import (
    AGG_WORKERS,
    LORA,
    Managed,
    SidecarKind,
    Topology,
    TopologyKind,
    build,
    make_adapter,
    worker_instance,
)
from tests.cluster.network import Host, Network, netns_unavailable, open_network, partition_unavailable
from tests.cluster.topology import CATCH_UP_ENTRIES, SNAPSHOT_COUNT, Cluster, missing_binaries
from tests.helpers.processes import DynamoEnv, Process, base_env, free_low_port, start_frontend
from tests.helpers.stack import (
    MODEL,
    dynamo_sidecar_missing,
    engine_load,
    mock_stats,
    start_dynamo_sidecar,
    start_engine,
    start_sidecar,
)

ROOT: Final = Path(__file__).resolve().parent.parent
DOCS: Final = ROOT / "docs" / "faults.md"
COMPARISON: Final = ROOT / "docs" / "comparison.md"
#: What Dynamo's sidecar serves nothing of: the templates of the common topology leave them out.
_COMMON_LEAVES_OUT: Final = "LoRA and n > 1"
CLIENTS: Final = 8
#: Bound on the requests one client sends (the deadline ends the loop first in any sane run).
MAX_REQUESTS_PER_CLIENT: Final = 5000
#: After a clean error a client waits this long (seconds) before its next request, as real clients back off: a
#: frontend that answers 404 at once for a while must not turn the closed loop into a storm.
ERROR_BACKOFF_S: Final = (0.1, 0.5)
#: Share of the load that carries an error directive while an error window is open.
DIRECTIVE_SHARE: Final = 0.5
BEHAVIOURS: Final[tuple[tuple[Behaviour, float], ...]] = (("normal", 0.7), ("slow", 0.15), ("disconnect", 0.15))
STARTUP_TIMEOUT_S: Final = 240.0
HEAL_TIMEOUT_S: Final = 90.0
QUIESCE_TIMEOUT_S: Final = 40.0
#: Hosts of the etcd variant in network namespaces (last address octet).
ETCD_HOSTS: Final = {
    "cp": 1,
    "fe1": 11,
    "fe2": 12,
    "w1": 21,
    "w2": 22,
    "w3": 23,
    "pd": 30,
    "e1": 41,
    "e2": 42,
    "e3": 43,
}


@dataclass(frozen=True)
class Args:
    minutes: float
    seed: int
    control_plane: Literal["file", "etcd"]
    network: Literal["auto", "netem", "proxy"]
    report: Path | None
    write_docs: bool
    log_dir: Path | None
    sidecar: SidecarKind = "ours"
    topology: TopologyKind = "full"
    write_comparison: bool = False


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, no usage banner
        print(f"bench.chaos: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: Sequence[str]) -> Args:
    parser = _Parser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="load duration in minutes (0.5–120)")
    parser.add_argument("--seed", type=int, default=1, help="seeds the faults, the templates and the load")
    parser.add_argument("--control-plane", choices=("file", "etcd"), default="file")
    parser.add_argument(
        "--network",
        choices=("auto", "netem", "proxy"),
        default="auto",
        help="sidecar↔engine faults through tc netem in network namespaces, or a TCP proxy (auto: netem if it works)",
    )
    parser.add_argument("--report", type=Path, help="write the report as JSON to this file")
    parser.add_argument("--write-docs", action="store_true", help="update the chaos section of docs/faults.md")
    parser.add_argument(
        "--log-dir",
        type=Path,
        help="keep every process log here (default: a temporary directory, kept and named only if the run fails)",
    )
    parser.add_argument(
        "--sidecar",
        choices=("ours", "dynamo"),
        default="ours",
        help="the workers' sidecar: ours, or Dynamo's own TensorRT-LLM sidecar (python -m dynamo.trtllm.sidecar)",
    )
    parser.add_argument(
        "--topology",
        choices=("full", "common"),
        help="full: the soak's own (LoRA, KV events, the KV router; ours only); common: what both sidecars serve "
        "(TensorRT-LLM's engines, round-robin; the default with --sidecar dynamo)",
    )
    parser.add_argument(
        "--write-comparison", action="store_true", help="write the report into docs/comparison.md (its sidecar's block)"
    )
    ns = parser.parse_args(argv)
    if not 0.5 <= ns.minutes <= 120:
        parser.error(f"--minutes {ns.minutes:g}: must be between 0.5 and 120")
    if ns.report is not None and not ns.report.parent.is_dir():
        parser.error(f"--report {ns.report}: directory {ns.report.parent} does not exist")
    topology: TopologyKind = ns.topology or ("common" if ns.sidecar == "dynamo" else "full")
    if ns.sidecar == "dynamo" and topology == "full":
        parser.error("--sidecar dynamo --topology full: Dynamo's sidecar serves no LoRA and no KV events; use common")
    if ns.write_docs and topology != "full":
        parser.error("--write-docs: docs/faults.md holds ours on the full topology; use --write-comparison")
    return Args(
        ns.minutes, ns.seed, ns.control_plane, ns.network, ns.report, ns.write_docs, ns.log_dir, ns.sidecar, topology,
        ns.write_comparison,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------- network


def choose_network(args: Args) -> tuple[Literal["proxy", "netem"], str]:
    """netem when asked for or when ``auto`` finds it working (and namespaces); else the proxy. The reason says why."""
    if args.network == "proxy":
        return "proxy", "asked for"
    reason = netem_unavailable() or netns_unavailable()
    if reason is None:
        return "netem", "tc netem in network namespaces"
    if args.network == "netem":
        raise ChaosUnavailable(f"--network netem: {reason}")
    return "proxy", f"netem unavailable: {reason}"


@contextmanager
def open_hosts(control_plane: str, mode: str) -> Iterator[Network]:
    """Namespaces for the etcd variant (as ``tests/cluster``) and for netem's engines; loopback otherwise."""
    names = dict(ETCD_HOSTS) if control_plane == "etcd" else {}
    if mode == "netem":
        names.update({"e1": 41, "e2": 42, "e3": 43})
    if not names or (control_plane == "etcd" and mode == "proxy" and netns_unavailable() is not None):
        all_names = names or {"e1": 0}
        yield Network("loopback", {n: Host(n, "127.0.0.1") for n in all_names}, reason="loopback")
        return
    with open_network(tuple(names), addresses=names) as network:
        yield network


# ---------------------------------------------------------------------------------------------------- reference


async def references(
    templates: list[Template], root: Path, sidecar: SidecarKind = "ours", kind: TopologyKind = "full"
) -> dict[str, Answer]:
    """Every template's answer from a fault-free stack of its own (a frontend, a sidecar of the run's kind, a mock
    without prompt directives, the LoRA adapter loaded on the full topology), asked twice: both answers must agree and
    be complete."""
    ref_root = root / "reference"
    ref_root.mkdir()
    denv = DynamoEnv(ref_root, base_env(ref_root))
    answers: dict[str, Answer] = {}
    async with AsyncExitStack() as stack:
        frontend = await stack.enter_async_context(start_frontend(denv, ready_timeout=120))
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=60))
        if kind == "full":
            engine_flags = ("--profile", "full", "--kv-events", "grpc", "--capability", "lora=true", "--speedup", "0")
            engine = await stack.enter_async_context(start_engine(denv, *engine_flags, name="ref-engine"))
            lora_root = make_adapter(ref_root / "loras")
            worker = await stack.enter_async_context(
                start_sidecar(denv, engine.address, "--lora-root", str(lora_root), name="ref-sidecar")
            )
            body = {"lora_name": LORA, "source_path": str(lora_root / LORA)}
            loaded = (await http.post(f"{worker.system_url}/engine/load_lora", json=body)).json()
            if loaded.get("status") != "ok":
                raise RuntimeError(f"reference stack: loading {LORA} failed: {loaded}")
            await _wait_serves(http, frontend.url, [MODEL, LORA], own=set())
        else:
            engine = await stack.enter_async_context(
                start_engine(denv, "--profile", "trtllm", "--speedup", "0", name="ref-engine")
            )
            start = start_dynamo_sidecar if sidecar == "dynamo" else start_sidecar
            await stack.enter_async_context(start(denv, engine.address, name="ref-sidecar"))
            await _wait_serves(http, frontend.url, [MODEL], own=set())
        for template in templates:
            first = await _reference_answer(http, frontend.url, template)
            second = await _reference_answer(http, frontend.url, template)
            problems = reference_problems(template, first)
            if problems or first.to_json()["choices"] != second.to_json()["choices"]:
                raise RuntimeError(f"reference for {template.name} is unusable: {problems or 'not reproducible'}")
            if [c.logprobs for c in first.choices.values()] != [c.logprobs for c in second.choices.values()]:
                raise RuntimeError(f"reference for {template.name}: logprobs not reproducible")
            answers[template.name] = first
    return answers


def templates_for(seed: int, kind: TopologyKind) -> list[Template]:
    """The run's templates: the seed's whole catalogue on the full topology; on the common one, those both sidecars
    serve (no LoRA adapter, one choice: Dynamo's TensorRT-LLM sidecar refuses ``n > 1``)."""
    templates = catalogue(seed)
    if kind == "full":
        return templates
    return [t for t in templates if t.model_kind != "lora" and t.n == 1]


async def _reference_answer(http: httpx.AsyncClient, url: str, template: Template) -> Answer:
    transcript = Transcript(0, 0, template, "ref", "normal", 0.0, template.body_for(reference=True))
    await send(http, url, transcript, time.monotonic, random.Random(0))
    if transcript.status != 200:
        raise RuntimeError(f"reference for {template.name}: HTTP {transcript.status} {transcript.lines[-1:]}")
    return parse(transcript)


async def _wait_serves(http: httpx.AsyncClient, url: str, models: list[str], own: set[str]) -> None:
    """Until one small request per model succeeds through ``url`` (bounded by the caller); their ids go to ``own``."""
    for model in models:
        while True:
            try:
                response = await http.post(
                    f"{url}/v1/completions", json={"model": model, "prompt": "warm up", "max_tokens": 2}
                )
                if response.status_code == 200:
                    own.add(str(response.json().get("id", "")).removeprefix("cmpl-"))
                    break
            except (httpx.HTTPError, ValueError):
                pass
            await trio.sleep(0.2)


# ---------------------------------------------------------------------------------------------------- the run


#: What a judged request keeps of its lines and request (shared, never written to).
_NO_LINES: Final[list[tuple[float, str]]] = []
_NO_REQUEST: Final[dict[str, Any]] = {}


@dataclass
class Load:
    """The templates with their references, and every request judged as it ended. Only a violation keeps its whole
    transcript and answer (printed at the end); the others keep what the reconciliation needs (ids, usage), so a
    run of hours stays small."""

    templates: list[Template]
    references: dict[str, Answer]
    results: list[tuple[Transcript, Verdict, Answer | None]]
    #: When faults stopped each frontend (shared with the injector): a stream broken by it is a clean error.
    frontend_stops: dict[str, list[float]] = field(default_factory=dict)

    def record(self, transcript: Transcript) -> None:
        reference = self.references[transcript.template.name]
        verdict = judge(transcript, reference)
        verdict = frontend_lost(verdict, transcript, reference, self.frontend_stops.get(transcript.frontend, ()))
        seen = parse(transcript) if transcript.status == 200 else None
        if verdict.outcome != "violation":
            # The template rebuilds the request and the lines were judged: an hour's run keeps the ids (for the
            # reconciliation) and the times (for the fault attribution) of its ~50 000 requests, ~1 KB each.
            transcript.lines = _NO_LINES
            transcript.request = _NO_REQUEST
            transcript.behaviour_detail = ""
            seen = None if seen is None else Answer(ids=seen.ids)
        self.results.append((transcript, verdict, seen))


async def client_loop(
    state: ChaosState, load: Load, number: int, seed: int, deadline: float, http: httpx.AsyncClient, counter: list[int]
) -> None:
    rng = random.Random(f"client-{seed}-{number}")
    ordinary = [t for t in load.templates if t.directive is None]
    directed: dict[str, list[Template]] = {}
    for template in load.templates:
        if template.directive is not None:
            directed.setdefault(template.directive, []).append(template)
    frontends = sorted(state.topo.frontends)
    for _ in range(MAX_REQUESTS_PER_CLIENT):
        if state.clock() >= deadline:
            return
        open_kinds = sorted(k for k, n in state.windows.items() if n > 0)
        if open_kinds and rng.random() < DIRECTIVE_SHARE:
            template = rng.choice(directed[rng.choice(open_kinds)])
        else:
            template = rng.choice(ordinary)
        behaviour: Behaviour = rng.choices([b for b, _ in BEHAVIOURS], [w for _, w in BEHAVIOURS])[0]
        if behaviour == "slow" and not template.stream:
            behaviour = "normal"
        choices = [f for f in frontends if f not in state.draining] or frontends
        name = rng.choice(choices)
        counter[0] += 1
        transcript = Transcript(
            counter[0], number, template, name, behaviour, state.clock(), template.body_for(reference=False)
        )
        state.inflight[name] = state.inflight.get(name, 0) + 1
        try:
            await send(http, state.topo.frontends[name].url, transcript, state.clock, rng)
        finally:
            state.inflight[name] -= 1
        load.record(transcript)
        if transcript.status != 200 and not transcript.disconnected:
            await trio.sleep(rng.uniform(*ERROR_BACKOFF_S))


async def engines_quiet(topo: Topology, bound_s: float) -> list[tuple[str, bool, str]]:
    """Every engine: no running or queued request, no live request, no KV session (waited for, bounded)."""
    results = []
    for name, worker in topo.workers.items():
        detail = "not asked"
        quiet = False
        with trio.move_on_after(bound_s):
            while True:
                try:
                    load = await engine_load(worker.engine.address)
                    stats = await mock_stats(worker.engine.address)
                except Exception as exc:
                    detail = f"{type(exc).__name__}: {exc}"
                    await trio.sleep(0.5)
                    continue
                detail = (
                    f"running {load.running_requests or 0}, queued {load.queued_requests or 0}, live "
                    f"{stats.get('live_requests', 0)}, KV sessions {stats.get('active_kv_sessions', 0)}"
                )
                quiet = not (
                    load.running_requests
                    or load.queued_requests
                    or stats.get("live_requests")
                    or stats.get("active_kv_sessions")
                )
                if quiet:
                    break
                await trio.sleep(0.5)
        results.append((f"engine of {name} idle", quiet, detail))
    return results


class ChaosUnavailable(Exception):
    """The machine lacks what the requested variant needs (one line for the operator)."""


async def soak(args: Args) -> Report:
    """The whole run: topology, references, load and faults, healing, checks; every process stopped at the end."""
    started = time.monotonic()
    load_s = args.minutes * 60
    mode, note = choose_network(args)
    if args.control_plane == "etcd" and missing_binaries():
        raise ChaosUnavailable(f"--control-plane etcd needs {' and '.join(missing_binaries())}")
    if args.sidecar == "dynamo" and (missing := dynamo_sidecar_missing()) is not None:
        raise ChaosUnavailable(missing)
    templates = templates_for(args.seed, args.topology)
    faults = plan(args.seed, load_s, args.control_plane)
    print(
        f"bench.chaos: seed {args.seed}, {len(templates)} templates, {len(faults)} planned faults, {mode} ({note}); "
        f"{args.sidecar} sidecar, {args.topology} topology"
    )
    root = Path(tempfile.mkdtemp(prefix="oe-chaos-"))
    report: Report | None = None
    try:
        with open_hosts(args.control_plane, mode) as network:
            report = await _run(args, root, network, mode, note, templates, faults, load_s, started)
            return report
    finally:
        keep = args.log_dir
        if keep is None and (report is None or not report.ok):
            # A failed run is rare and not reproducible at will (a 10-minute run once lost a sidecar's exit to
            # this): its logs are what explains it.
            keep = Path(tempfile.mkdtemp(prefix="oe-chaos-logs-"))
        if keep is not None and (root / "logs").is_dir():
            shutil.copytree(root / "logs", keep, dirs_exist_ok=True)
            print(f"bench.chaos: logs in {keep}")
        shutil.rmtree(root, ignore_errors=True)


async def run(args: Args) -> int:
    try:
        report = await soak(args)
    except ChaosUnavailable as exc:
        print(f"bench.chaos: error: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    if args.report is not None:
        args.report.write_text(json.dumps(report.to_json(), indent=1, default=str))
    command = f"python -m bench.chaos --minutes {args.minutes:g} --seed {args.seed}"
    if args.control_plane != "file":
        command += f" --control-plane {args.control_plane}"
    if args.write_docs:
        write_docs(DOCS, args.control_plane, report.docs_section(command))
        print(f"bench.chaos: wrote the chaos section of {DOCS.relative_to(ROOT)}")
    if args.write_comparison:
        if args.sidecar != "ours":
            command += f" --sidecar {args.sidecar}"
        elif args.topology != "full":
            command += f" --topology {args.topology}"
        markers = comparison_markers(args.sidecar, args.topology, args.control_plane)
        write_block(COMPARISON, markers, report.docs_section(command, markers))
        print(f"bench.chaos: wrote the {args.sidecar} sidecar's chaos block of {COMPARISON.relative_to(ROOT)}")
    return 0 if report.ok else 1


async def _run(
    args: Args,
    root: Path,
    network: Network,
    mode: Literal["proxy", "netem"],
    note: str,
    templates: list[Template],
    faults: list[Any],
    load_s: float,
    started: float,
) -> Report:
    topo = build(root, args.control_plane, network, mode, sidecar=args.sidecar, kind=args.topology)
    if args.topology == "full":  # TensorRT-LLM's engines of the common topology publish no KV events
        for name in AGG_WORKERS:
            topo.workers[name].engine.kv_faults = {life: kv_faults(args.seed, name, life) for life in range(1, 200)}
    own_ids: set[str] = set()
    async with AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        # Unwinding runs these last-first: the sidecars and engines stop (drain) while the proxies still carry their
        # traffic, then the control plane, then the background tasks (proxies) are cancelled.
        stack.callback(nursery.cancel_scope.cancel)
        refs = await _start(args, root, topo, stack, nursery, templates, own_ids)
        expected_sets = await _discovery_sets(topo)
        print(f"bench.chaos: topology up and references ready after {time.monotonic() - started:.0f} s")

        t0 = trio.current_time()
        wall0, mono0 = time.time(), time.monotonic()
        state = ChaosState(topo, lambda: trio.current_time() - t0)
        state.partition_unavailable = partition_unavailable(network)
        interval_s, warmup_s = schedule(load_s)
        resources = Resources(watched(topo, mono0), interval_s, warmup_s)
        load = Load(templates, refs, [], state.frontend_stops)
        counter = [0]
        monitor_scope = trio.CancelScope()
        sampler_scope = trio.CancelScope()

        async def run_monitor(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with monitor_scope:
                await monitor(state, task_status=task_status)

        async def run_sampler(http: httpx.AsyncClient) -> None:
            with sampler_scope:
                while True:
                    await sample(resources.processes, state.clock(), "load", http)
                    await trio.sleep(interval_s)

        await nursery.start(run_monitor)
        async with httpx.AsyncClient(timeout=5) as probe:
            await sample(resources.processes, state.clock(), "idle-start", probe)
            nursery.start_soon(run_sampler, probe)
            async with (
                httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=30) as http,
                trio.open_nursery() as run_nursery,
            ):
                run_nursery.start_soon(run_plan, state, faults, args.seed)
                for number in range(CLIENTS):
                    run_nursery.start_soon(client_loop, state, load, number, args.seed, load_s, http, counter)
            sampler_scope.cancel()
            print(f"bench.chaos: load done ({len(load.results)} requests) at {state.clock():.0f} s; healing")

            postconditions = await _heal(state)
            monitor_scope.cancel()  # nothing restarts from here on
            if topo.kind == "common":
                postconditions.append(await _nothing_in_flight(topo))
            if topo.cluster is not None:
                postconditions.append(await _discovery_settled(topo, expected_sets))
            await sample(resources.processes, state.clock(), "idle-end", probe)
        resources.analyse()
        tally = Tally()
        lives = await _final_counts(topo, tally)
        attempts: dict[str, list[End]] = {}
        for life_counts in lives:
            if life_counts.worker != "pd-prefill":
                for end in life_counts.ends:
                    attempts.setdefault(end.request_id, []).append(end)
        verdicts = _excuse_migrations(topo, load, attempts, tally)
        frontend_logs = [life.process.log_path for f in topo.frontends.values() for life in f.managed.lives]
        extra: dict[str, Any] = {"etcd_warm_up": topo.etcd_warm_up, "sidecar": args.sidecar, "topology": topo.kind}
        if args.sidecar == "dynamo":
            reconciliation = _not_reconciled(lives, verdicts)
            extra["reconciliation_note"] = NOT_RECONCILED
        else:
            # A second read of the frontends' logs (the first, for migrations): unknown lines are counted there.
            reconciliation = reconcile(lives, verdicts, own_ids, frontend_abandoned(frontend_logs, Tally()))
        if topo.kind == "common":
            # Counted the same way for both sidecars: from the frontends' own migration records.
            complete_ids = {
                rid for _, v, seen in verdicts if v.outcome == "complete" and seen for rid in request_ids(seen)
            }
            moved = frontend_migrations(frontend_logs, complete_ids, Tally())
            migrated = sum(
                1
                for _, v, seen in verdicts
                if v.outcome == "complete" and seen is not None and request_ids(seen) & set(moved)
            )
            extra["migrations_from"] = "frontend"
        else:
            migrated = sum(
                1
                for _, verdict, seen in verdicts
                if verdict.kind == "migrated_prompt_tokens"
                or (
                    verdict.outcome == "complete"
                    and seen is not None
                    and sum(len(attempts.get(rid, [])) for rid in request_ids(seen)) > 1
                )
            )
        extra["complete_after_migration"] = migrated
        kv_records = observed_kv_faults(topo, lambda unix: unix - wall0, tally)
        report = Report(
            seed=args.seed,
            minutes=args.minutes,
            control_plane=args.control_plane,
            network=mode,
            network_note=f"{note}; hosts: {'network namespaces' if network.isolated else 'loopback'}",
            verdicts=verdicts,
            faults=[*state.records, *kv_records],
            reconciliation=reconciliation,
            postconditions=postconditions,
            anomalies=state.anomalies,
            lora_reloads=topo.lora_reloads,
            elapsed_s=time.monotonic() - started,
            extra=extra,
            resources=resources,
            unknown_lines=tally,
        )
        for transcript, verdict, _ in report.violations()[:20]:
            print(report.transcript_text(transcript, verdict, refs[transcript.template.name]))
        if len(report.violations()) > 20:
            print(f"… and {len(report.violations()) - 20} more violation(s) (all in --report)")
        report.extra["violation_transcripts"] = [
            {"verdict": asdict(v), "transcript": t.to_json()} for t, v, _ in report.violations()
        ]
        report.elapsed_s = time.monotonic() - started
        return report
    raise AssertionError("unreachable")


async def _start(
    args: Args,
    root: Path,
    topo: Topology,
    stack: AsyncExitStack,
    nursery: trio.Nursery,
    templates: list[Template],
    own_ids: set[str],
) -> dict[str, Answer]:
    """The control plane (etcd), the proxies, the topology and the references (at once), the LoRA adapter on every
    aggregated worker, and every model served through every frontend; returns the references. What is started is
    stopped by ``stack``; this program's own warm-up requests' ids go to ``own_ids``."""
    if args.control_plane == "etcd":
        cluster = Cluster(
            topo.network, root, topo.env, etcd_port=free_low_port(), nats_port=free_low_port(), stack=stack
        )
        topo.cluster = cluster
        stack.push_async_callback(_stop_control_plane, cluster)
        await cluster.start_etcd()
        entries = CATCH_UP_ENTRIES + SNAPSHOT_COUNT + 500
        topo.etcd_warm_up = (entries, await fill_raft_log(cluster.etcd_url, entries))
        await cluster.start_nats()
        for frontend in topo.frontends.values():
            frontend.managed.env = topo.host_env(frontend.host)
        for worker in topo.workers.values():
            worker.sidecar.env = topo.host_env(worker.host, DYN_SYSTEM_PORT=str(worker.system_port))
    stack.push_async_callback(topo.stop_all)
    for proxy in topo.proxies:
        await nursery.start(proxy.run)
    refs: dict[str, Answer] = {}

    async def reference_task() -> None:
        refs.update(await references(templates, root, args.sidecar, args.topology))

    with trio.fail_after(STARTUP_TIMEOUT_S):
        async with trio.open_nursery() as startup:
            startup.start_soon(reference_task)
            startup.start_soon(topo.start_all)
        async with httpx.AsyncClient(timeout=30) as http:
            for name in AGG_WORKERS if topo.lora_root is not None else ():
                answer = await topo.load_lora(topo.workers[name])
                if answer.get("status") != "ok":
                    raise RuntimeError(f"loading {LORA} on {name}: {answer}")
            for frontend in topo.frontends.values():
                await _wait_serves(http, frontend.url, sorted(topo.models), own_ids)
    return refs


async def _heal(state: ChaosState) -> list[tuple[str, bool, str]]:
    """The faults have stopped: the topology must be whole within ``HEAL_TIMEOUT_S``, then every engine quiet."""
    healed = False
    states: dict[str, str] = {}
    async with httpx.AsyncClient(timeout=10) as http:
        with trio.move_on_after(HEAL_TIMEOUT_S):
            while True:
                healed, states = await whole(state, http)
                if healed:
                    break
                await trio.sleep(0.5)
    postconditions = [("every worker serving and listed by both frontends", healed, str(states))]
    return postconditions + await engines_quiet(state.topo, QUIESCE_TIMEOUT_S)


def _excuse_migrations(
    topo: Topology, load: Load, attempts: dict[str, list[End]], tally: Tally
) -> list[tuple[Transcript, Verdict, Answer | None]]:
    """Every request's verdict, in order; a ``usage_mismatch`` judged again with the frontend's record of the
    migration (``migrated_usage``), and when it stays a violation, with what the frontend and the sidecars said."""
    mismatched = {
        rid for _, v, seen in load.results if seen and v.kind == "usage_mismatch" for rid in request_ids(seen)
    }
    frontend_logs = [life.process.log_path for f in topo.frontends.values() for life in f.managed.lives]
    moved = frontend_migrations(frontend_logs, mismatched, tally)
    verdicts: list[tuple[Transcript, Verdict, Answer | None]] = []
    for transcript, verdict, seen in sorted(load.results, key=lambda r: r[0].number):
        if seen is not None and verdict.kind == "usage_mismatch":
            ids = request_ids(seen)
            by_frontend = max((moved[rid] for rid in ids if rid in moved), default=None)
            verdict = migrated_usage(verdict, seen, load.references[transcript.template.name], by_frontend)
            if verdict.outcome == "violation":
                tried = [a for rid in ids for a in attempts.get(rid, [])]
                shown = "; ".join(f"{a.outcome} ({a.reason}) {a.tokens_in} in / {a.tokens_out} out" for a in tried)
                detail = (
                    f"{verdict.detail}; the frontend's migrations moved {by_frontend} tokens; the sidecars' "
                    f"attempts: {shown or 'none'}"
                )
                verdict = Verdict("violation", verdict.kind, detail)
        verdicts.append((transcript, verdict, seen))
    return verdicts


def watched(topo: Topology, mono0: float) -> list[Watched]:
    """The long-lived processes whose resources are sampled, and this program itself (not judged)."""

    def of(managed: Managed) -> Callable[[], tuple[int, int, float] | None]:
        def current() -> tuple[int, int, float] | None:
            life = managed.life
            if life is None or life.end != "running" or life.process.returncode is not None:
                return None
            return life.number, life.process.pid, life.started - mono0

        return current

    def fixed(process: Process | None, pid: int | None = None) -> Callable[[], tuple[int, int, float] | None]:
        def current() -> tuple[int, int, float] | None:
            if pid is not None:
                return 1, pid, -1.0
            if process is None or process.returncode is not None:
                return None
            return 1, process.pid, -1.0

        return current

    # Dynamo's sidecar has no task gauges: its processes are sampled from /proc alone.
    metrics = topo.sidecar_kind == "ours"
    out = [Watched(f"sidecar {name}", "sidecar", of(w.sidecar), f"{w.system_url}/metrics" if metrics else None)
           for name, w in topo.workers.items()]  # fmt: skip
    out += [Watched(f"engine {name}", "engine", of(w.engine.managed)) for name, w in topo.workers.items()]
    out += [Watched(f"frontend {name}", "frontend", of(f.managed)) for name, f in topo.frontends.items()]
    if topo.cluster is not None:
        out += [Watched("etcd", "etcd", fixed(topo.cluster.etcd)), Watched("nats", "nats", fixed(topo.cluster.nats))]
    out.append(Watched(HARNESS, "harness", fixed(None, os.getpid())))
    return out


async def _discovery_sets(topo: Topology) -> dict[str, Counter[str]]:
    """Each worker's discovery entries in etcd, as shapes, once the topology is up (empty on file discovery)."""
    if topo.cluster is None:
        return {}
    async with httpx.AsyncClient(timeout=5) as http:
        entries = sets(await etcd_entries(http, topo.cluster.etcd_url))
        instances = {name: await worker_instance(http, worker) for name, worker in topo.workers.items()}
    return {name: entries.get(instance, Counter()) for name, instance in instances.items() if instance is not None}


async def _discovery_settled(topo: Topology, expected: dict[str, Counter[str]]) -> tuple[str, bool, str]:
    """One set of entries per live worker in etcd, none of a dead instance (waited for: a SIGKILLed run's entries
    stay until its lease expires)."""
    assert topo.cluster is not None
    async with httpx.AsyncClient(timeout=5) as http:
        live = {name: await worker_instance(http, worker) for name, worker in topo.workers.items()}
    known = {name: instance for name, instance in live.items() if instance is not None}
    ok, detail = await settled(topo.cluster.etcd_url, known, expected, LEASE_S + MARGIN_S)
    if len(known) < len(live):
        ok, detail = False, f"no instance id from {sorted(set(live) - set(known))}; {detail}"
    return "etcd holds one set of discovery entries per live worker, none of a dead instance", ok, detail


async def _final_counts(topo: Topology, tally: Tally) -> list[LifeCounts]:
    """Every sidecar run's request-end lines, and the metrics of the runs still alive (scraped now, all quiet)."""
    lives: list[LifeCounts] = []
    async with httpx.AsyncClient(timeout=5) as http:
        for name, worker in topo.workers.items():
            for life in worker.sidecar.lives:
                metrics = None
                if life.end == "running" and life.process.returncode is None:
                    try:
                        metrics = metric_counts((await http.get(f"{worker.system_url}/metrics")).text)
                    except httpx.HTTPError:
                        metrics = None
                ends = log_ends(life.process.log_path, tally)
                # A second read of the same log: its unknown lines are counted once, above.
                instances = log_instances(life.process.log_path, Tally())
                counts = Counter(end.outcome for end in ends)
                handoff = name == "pd-prefill"  # its "finished (length)" hands the request to the decode worker
                finished = [
                    e.request_id for e in ends if e.outcome == "finished" and not (handoff and e.reason == "length")
                ]
                killed = life.ended_unix if life.end == "sigkill" else None
                lives.append(
                    LifeCounts(name, life.number, life.end, metrics, counts, finished, ends, killed, instances)
                )
    return lives


#: Why the sidecars' counters are not reconciled with what the clients saw when the workers run Dynamo's sidecar.
NOT_RECONCILED: Final = (
    "not reconciled: Dynamo's sidecar logs no request end and exports no counter by outcome, so which run finished "
    "which request cannot be known from outside it; in their place every live run's Dynamo in-flight gauge must be "
    "0 after the load (a post-condition above, for both sidecars on this topology)"
)


def _not_reconciled(
    lives: list[LifeCounts], verdicts: Sequence[tuple[Transcript, Verdict, Answer | None]]
) -> Reconciliation:
    """The reconciliation's figures that the clients alone give (complete answers per model kind), no problem."""
    complete: Counter[str] = Counter(t.template.model_kind for t, v, _ in verdicts if v.outcome == "complete")
    explained = {"own": 0, "client_left": 0, "complete": sum(complete.values()), "rerouted": 0}
    return Reconciliation(lives, [], complete, Counter(), explained)


#: Dynamo's runtime gauge of the requests a worker's endpoint is handling (ours and Dynamo's sidecar both carry it).
_INFLIGHT = re.compile(r"^dynamo_component_inflight_requests(?:\{[^}]*\})? (\S+)$", re.M)


async def _nothing_in_flight(topo: Topology) -> tuple[str, bool, str]:
    """After the load, every live sidecar run's Dynamo in-flight gauge is 0 (waited for, bounded): no request is
    stuck in a worker whatever the engine says."""
    detail: dict[str, str] = {}
    with trio.move_on_after(QUIESCE_TIMEOUT_S):
        async with httpx.AsyncClient(timeout=5) as http:
            while True:
                for name, worker in topo.workers.items():
                    try:
                        page = (await http.get(f"{worker.system_url}/metrics")).text
                    except httpx.HTTPError as exc:
                        detail[name] = type(exc).__name__
                        continue
                    values = [float(v) for v in _INFLIGHT.findall(page)]
                    detail[name] = f"{sum(values):g}" if values else "no gauge"
                if all(v == "0" for v in detail.values()):
                    break
                await trio.sleep(0.5)
    ok = all(v == "0" for v in detail.values())
    return "every live sidecar run's Dynamo in-flight gauge is 0", ok, str(detail)


async def _stop_control_plane(cluster: Cluster) -> None:
    with trio.CancelScope(shield=True):
        if cluster.etcd is not None:
            await cluster.stop_etcd(signal.SIGTERM)
        if cluster.nats is not None:
            await cluster.stop_nats(signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    code = 130
    try:
        code = trio.run(run, args)
    except* KeyboardInterrupt:  # trio may deliver it inside an exception group (from a nursery)
        print("bench.chaos: interrupted; every process was stopped", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["Args", "ChaosUnavailable", "main", "parse_args", "soak"]
