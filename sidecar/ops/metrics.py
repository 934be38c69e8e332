"""Prometheus metrics of the sidecar, in one registry of their own (:data:`REGISTRY`).

The registry is exported through the worker's Dynamo system port (``DYN_SYSTEM_PORT``): ``sidecar.dynamo`` hands
:func:`exposition` to Dynamo's ``Endpoint.metrics`` callbacks, so one ``curl :<system port>/metrics`` shows our
``openengine_sidecar_*`` families next to Dynamo's ``dynamo_component_*``. A registry of our own (not
prometheus-client's default one) keeps Python's ``process_*``/``python_*`` collectors out of Dynamo's page.

Dynamo's conventions: every exported sample carries Dynamo's ``dynamo_namespace``/``dynamo_component``/
``dynamo_endpoint`` labels (:func:`set_dynamo_labels`; Dynamo injects them into its own series, not into a callback's
text), and the engine's KV usage is also exported under the names Dynamo 1.6.1's own backends use
(``dynamo_component_total_blocks``, ``dynamo_component_gpu_cache_usage_percent``; ``LLMBackendMetrics`` in
``dynamo.common.utils.prometheus``), derived at scrape time from ``openengine_sidecar_engine_kv_blocks``.

Label values come from fixed sets (outcomes, violation names, RPC names, gRPC status names, state names), so
cardinality stays bounded; request ids never become labels. Nothing here is updated per token: a request records its
token counts and latencies once, when it ends (:class:`RequestStats`).

Thread safety: metrics are updated on the trio thread and read by Dynamo's scrape on a runtime thread;
prometheus-client's metric objects lock internally, and :class:`_StateCollector` only reads per-state integers.
:class:`_TaskCollector` walks trio's task tree from the scraping thread through copies trio makes under the GIL
(``Task.child_nurseries`` is a ``list``, ``Nursery.child_tasks`` a ``frozenset``, each copied in one C call).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from sidecar.errors import EngineFailure, EngineGone, EngineRpcError, ProtocolViolation, WorkerDraining
from statemachines import KINDS, REQUEST, WORKER

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence

__all__ = [
    "ABORTS",
    "ABORT_LATENCY",
    "DYNAMO_CACHE_USAGE",
    "DYNAMO_LABELS",
    "DYNAMO_TOTAL_BLOCKS",
    "ENGINE_KV_BLOCKS",
    "ENGINE_RPC_LATENCY",
    "HEALTH_TRANSITIONS",
    "INPUT_TOKENS",
    "INTER_TOKEN_LATENCY",
    "KV_EVENT_LAG",
    "KV_EVENT_RESYNCS",
    "OUTPUT_TOKENS",
    "PREFIX",
    "PROTOCOL_VIOLATIONS",
    "RECONNECTS",
    "REGISTRATION_RESTORES",
    "REGISTRATION_RESTORE_FAILURES",
    "REGISTRY",
    "REQUESTS_ENDED",
    "REQUESTS_RECEIVED",
    "TIME_TO_FIRST_TOKEN",
    "WORKER_STATE",
    "FamilyDoc",
    "RequestStats",
    "catalogue",
    "collect_families",
    "dynamo_labels",
    "exposition",
    "mark_worker_state",
    "observe_rpc",
    "rpc_code",
    "set_dynamo_labels",
    "typed_families",
    "watch_tasks",
]

PREFIX: Final = "openengine_sidecar"

# `*_created` samples (one per labelled child) double the page for nothing an operator reads; this process is ours.
disable_created_metrics()  # type: ignore[no-untyped-call]

REGISTRY: Final = CollectorRegistry(auto_describe=True)
"""Every metric of the sidecar; nothing else (no process or GC collectors: Dynamo's page is not ours)."""

# Latencies from a millisecond (a local engine's Abort) to minutes (a long queue before the first token).
_LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Inter-token latency: a decode step is milliseconds to a few hundred milliseconds.
_ITL_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)

REQUESTS_RECEIVED: Final = Counter(
    f"{PREFIX}_requests_received", "Generation requests handed to the worker by Dynamo", registry=REGISTRY
)
REQUESTS_ENDED: Final = Counter(
    f"{PREFIX}_requests_ended",
    "Generation requests by terminal outcome (finished, rejected, cancelled, failed)",
    ["outcome"],
    registry=REGISTRY,
)
PROTOCOL_VIOLATIONS: Final = Counter(
    f"{PREFIX}_protocol_violations",
    "Engine responses that broke the OpenEngine stream contract",
    ["violation"],
    registry=REGISTRY,
)
ABORTS: Final = Counter(
    f"{PREFIX}_aborts",
    "Control.Abort calls sent for requests that ended early, by result (sent, failed, timeout)",
    ["result"],
    registry=REGISTRY,
)
ABORT_LATENCY: Final = Histogram(
    f"{PREFIX}_abort_latency_seconds",
    "Time to complete Control.Abort",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
    registry=REGISTRY,
)
WORKER_STATE: Final = Gauge(
    f"{PREFIX}_worker_state",
    "1 for the worker's current lifecycle state, 0 for the others",
    ["state"],
    registry=REGISTRY,
)
TIME_TO_FIRST_TOKEN: Final = Histogram(
    f"{PREFIX}_time_to_first_token_seconds",
    "From opening the Generate stream to the first chunk with tokens (engine queueing + prefill + transport)",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
INTER_TOKEN_LATENCY: Final = Histogram(
    f"{PREFIX}_inter_token_latency_seconds",
    "Mean time between output tokens after the first, one observation per request with at least two tokens",
    buckets=_ITL_BUCKETS,
    registry=REGISTRY,
)
INPUT_TOKENS: Final = Counter(
    f"{PREFIX}_input_tokens", "Prompt tokens of requests sent to the engine", registry=REGISTRY
)
OUTPUT_TOKENS: Final = Counter(
    f"{PREFIX}_output_tokens", "Tokens generated by the engine and passed on to Dynamo", registry=REGISTRY
)
ENGINE_RPC_LATENCY: Final = Histogram(
    f"{PREFIX}_engine_rpc_duration_seconds",
    "Duration of OpenEngine RPCs by RPC name and final gRPC status (Generate: the whole stream)",
    ["rpc", "code"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
RECONNECTS: Final = Counter(
    f"{PREFIX}_engine_reconnects",
    "Engine connection losses and recoveries: stage=lost when the worker starts reconnecting, stage=recovered when "
    "it serves again",
    ["stage"],
    registry=REGISTRY,
)
HEALTH_TRANSITIONS: Final = Counter(
    f"{PREFIX}_health_transitions",
    "Worker health changes driven by the engine's Control.Health: change=degraded or recovered",
    ["change"],
    registry=REGISTRY,
)
REGISTRATION_RESTORES: Final = Counter(
    f"{PREFIX}_registration_restores",
    "Discovery entries (instances, model cards, KV event and load channels, event sources) the worker found lost "
    "and published again",
    registry=REGISTRY,
)
REGISTRATION_RESTORE_FAILURES: Final = Counter(
    f"{PREFIX}_registration_restore_failures",
    "Attempts to publish a lost discovery entry again that failed (each entry, each check)",
    registry=REGISTRY,
)
LORA_ADAPTERS: Final = Gauge(
    f"{PREFIX}_lora_adapters",
    "LoRA adapters this worker serves (engine holds them and Dynamo lists their cards, or being reloaded)",
    registry=REGISTRY,
)
LORA_OPERATIONS: Final = Counter(
    f"{PREFIX}_lora_operations",
    "load_lora / unload_lora calls by outcome: ok, already_loaded, or the error code of the answer",
    ["operation", "outcome"],
    registry=REGISTRY,
)
KV_EVENT_LAG: Final = Histogram(
    f"{PREFIX}_kv_event_lag_seconds",
    "Delay between the engine stamping a KV cache event and the worker publishing it to Dynamo",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
KV_EVENT_RESYNCS: Final = Counter(
    f"{PREFIX}_kv_event_resyncs",
    "KV event stream resynchronisations (gap in sequence numbers, stream restart), by reason",
    ["reason"],
    registry=REGISTRY,
)


class _StateCollector(Collector):
    """Models per lifecycle state, read from the machines' own counts at scrape time (no per-transition cost)."""

    def collect(self) -> Iterator[Metric]:
        active = GaugeMetricFamily(
            f"{PREFIX}_requests_in_state",
            "Requests currently in each non-terminal request state (statemachines/request.py)",
            labels=["state"],
        )
        # Terminal states are left to ``requests_ended_total{outcome}``: a second family with the same counts is noise.
        for state, count in REQUEST.counts().items():
            if state not in REQUEST.terminal:
                active.add_metric([state], count)
        abandoned = CounterMetricFamily(
            f"{PREFIX}_lifecycles_abandoned",
            "Lifecycle models dropped before a terminal state, by machine (a bug if it moves)",
            labels=["machine"],
        )
        for kind in KINDS:
            abandoned.add_metric([kind.name], kind.abandoned)
        yield active
        yield abandoned

    def describe(self) -> Iterable[Metric]:
        return []


REGISTRY.register(_StateCollector())


class _TaskCollector(Collector):
    """Live tasks of the worker's trio run and of its asyncio edge loop, counted when scraped (a walk of trio's task
    tree and one copy of asyncio's task set: microseconds for the few hundred tasks of a busy worker, nothing per
    request). A count that keeps growing while the load does not is a leak; ``bench.chaos`` samples both."""

    def __init__(self) -> None:
        self.trio_root: trio.lowlevel.Task | None = None
        self.asyncio_tasks: Callable[[], int] | None = None

    def collect(self) -> Iterator[Metric]:
        trio_tasks = GaugeMetricFamily(
            f"{PREFIX}_trio_tasks", "Live trio tasks of the worker (request tasks, watchers, the bridge's consumers)"
        )
        asyncio_tasks = GaugeMetricFamily(
            f"{PREFIX}_asyncio_tasks", "Live asyncio tasks on the edge loop (Dynamo's handlers, grpclib's streams)"
        )
        if self.trio_root is not None:
            trio_tasks.add_metric([], _count_trio_tasks(self.trio_root))
        if self.asyncio_tasks is not None:
            asyncio_tasks.add_metric([], self.asyncio_tasks())
        yield trio_tasks
        yield asyncio_tasks

    def describe(self) -> Iterable[Metric]:
        return []


def _count_trio_tasks(root: trio.lowlevel.Task) -> int:
    count, pending = 0, [root]
    while pending:
        task = pending.pop()
        count += 1
        for nursery in task.child_nurseries:
            pending.extend(nursery.child_tasks)
    return count


_TASKS: Final = _TaskCollector()
REGISTRY.register(_TASKS)


def watch_tasks(trio_root: trio.lowlevel.Task | None, asyncio_tasks: Callable[[], int]) -> None:
    """Count, at every scrape, the tasks below ``trio_root`` and ``asyncio_tasks()`` (the edge loop's live tasks;
    callable from any thread)."""
    _TASKS.trio_root = trio_root
    _TASKS.asyncio_tasks = asyncio_tasks


for _outcome in sorted(REQUEST.terminal):
    REQUESTS_ENDED.labels(outcome=_outcome)
for _state in WORKER.states:
    WORKER_STATE.labels(state=_state).set(0)
for _stage in ("lost", "recovered"):
    RECONNECTS.labels(stage=_stage)
for _change in ("degraded", "recovered"):
    HEALTH_TRANSITIONS.labels(change=_change)


def mark_worker_state(state: str) -> None:
    """Set the worker-state gauge to ``state`` (the machine's initial state is never a transition's ``dest``)."""
    for other in WORKER.states:
        WORKER_STATE.labels(state=other).set(1 if other == state else 0)


def observe_rpc(rpc: str, code: str, seconds: float) -> None:
    """Record one engine RPC: ``rpc`` an OpenEngine RPC name, ``code`` a gRPC status name (``OK``, ``UNAVAILABLE``)."""
    ENGINE_RPC_LATENCY.labels(rpc=rpc, code=code).observe(seconds)


def rpc_code(error: BaseException | None) -> str:
    """The gRPC status name a Generate stream ended with, for the RPC-latency label (a fixed, small set)."""
    if error is None:
        return "OK"
    if isinstance(error, EngineRpcError):
        return error.code.name
    if isinstance(error, EngineFailure | ProtocolViolation):
        return "OK"  # the RPC itself completed; the engine reported (or broke) something in-band
    if isinstance(error, trio.Cancelled | GeneratorExit | WorkerDraining | EngineGone):
        return "CANCELLED"
    return "UNKNOWN"


class RequestStats:
    """Token counts and latencies of one request, recorded into the histograms once, at its end.

    ``time.monotonic`` rather than ``trio.current_time``: this module is not trio code, and the figures are wall
    latencies either way.
    """

    __slots__ = ("_first", "_last", "_start", "output_tokens")

    def __init__(self, prompt_tokens: int) -> None:
        INPUT_TOKENS.inc(prompt_tokens)
        self._start = time.monotonic()
        self._first = 0.0
        self._last = 0.0
        self.output_tokens = 0

    def chunks(self, chunks: Sequence[dict[str, Any]]) -> None:
        """Count the tokens of chunks about to be handed to Dynamo; the first token stamps the TTFT."""
        tokens = 0
        for chunk in chunks:
            ids = chunk.get("token_ids")
            if ids:
                tokens += len(ids)
        if not tokens:
            return
        now = time.monotonic()
        if not self.output_tokens:
            self._first = now
            TIME_TO_FIRST_TOKEN.observe(now - self._start)
        self._last = now
        self.output_tokens += tokens

    def end(self, *, code: str) -> None:
        """The request ended; ``code`` is the Generate stream's gRPC status name."""
        OUTPUT_TOKENS.inc(self.output_tokens)
        if self.output_tokens > 1 and self._last > self._first:
            INTER_TOKEN_LATENCY.observe((self._last - self._first) / (self.output_tokens - 1))
        observe_rpc("Generate", code, time.monotonic() - self._start)


#: Dynamo's label names for the series of one endpoint (``dynamo.prometheus_names.labels``).
DYNAMO_LABELS: Final = ("dynamo_namespace", "dynamo_component", "dynamo_endpoint")
#: Dynamo 1.6.1's names for a worker's KV usage (``prometheus_names.kvstats`` under the ``dynamo_component`` prefix).
DYNAMO_TOTAL_BLOCKS: Final = "dynamo_component_total_blocks"
DYNAMO_CACHE_USAGE: Final = "dynamo_component_gpu_cache_usage_percent"
#: Our family the Dynamo-named KV usage is derived from (registered by ``sidecar.kv``, ``kind`` = used | total).
ENGINE_KV_BLOCKS: Final = f"{PREFIX}_engine_kv_blocks"

_labels: dict[str, str] = {"dynamo_namespace": "dynamo", "dynamo_component": "backend", "dynamo_endpoint": "generate"}
_model: str = ""


def set_dynamo_labels(namespace: str, component: str, endpoint: str, model: str | None = None) -> None:
    """The Dynamo identity every exported sample carries (and, for the KV usage families, the served model).

    Called before anything is exported (the component may change once, when discovery finds a prefill engine).
    """
    global _labels, _model
    _labels = {"dynamo_namespace": namespace, "dynamo_component": component, "dynamo_endpoint": endpoint}
    if model is not None:
        _model = model


def dynamo_labels() -> dict[str, str]:
    """The labels :func:`set_dynamo_labels` set (a copy)."""
    return dict(_labels)


def _with_labels(metric: Metric, extra: dict[str, str]) -> Metric:
    out = Metric(metric.name, metric.documentation, metric.type, metric.unit)
    # A label the family already has wins (Dynamo's injection rule: it never overwrites a label).
    out.samples = [s._replace(labels={**extra, **s.labels}) for s in metric.samples]
    return out


def _dynamo_kv_families(families: list[Metric]) -> list[Metric]:
    """``openengine_sidecar_engine_kv_blocks{rank, kind}`` under Dynamo's worker names, per ``dp_rank``."""
    used: dict[str, float] = {}
    total: dict[str, float] = {}
    for family in families:
        if family.name != ENGINE_KV_BLOCKS:
            continue
        for s in family.samples:
            (used if s.labels.get("kind") == "used" else total)[s.labels["rank"]] = float(s.value)
    blocks = GaugeMetricFamily(
        DYNAMO_TOTAL_BLOCKS, "Total number of KV cache blocks available on the worker.", labels=["model", "dp_rank"]
    )
    usage = GaugeMetricFamily(
        DYNAMO_CACHE_USAGE, "GPU cache usage as a percentage (0.0-1.0).", labels=["model", "dp_rank"]
    )
    for rank in sorted(total, key=int):
        blocks.add_metric([_model, rank], total[rank])
        if rank in used and total[rank] > 0:
            usage.add_metric([_model, rank], used[rank] / total[rank])
    return [blocks, usage] if blocks.samples else []


def collect_families() -> list[Metric]:
    """Everything this process exports: the registry plus the Dynamo-named KV usage, each sample with Dynamo's
    labels."""
    families = list(REGISTRY.collect())
    families += _dynamo_kv_families(families)
    extra = dict(_labels)
    return [_with_labels(family, extra) for family in families]


class _Exported:
    """What :func:`generate_latest` scrapes: :func:`collect_families` (it only needs ``collect``)."""

    def collect(self) -> list[Metric]:
        return collect_families()


def exposition() -> str:
    """Everything exported, in Prometheus text format (what Dynamo appends to the system port's ``/metrics``)."""
    return generate_latest(_Exported()).decode("utf-8")


_Sample = tuple[str, list[tuple[str, str]], float, float | None]


def typed_families() -> list[tuple[str, str, str, str, list[_Sample]]]:
    """The same as Dynamo's typed-callback structure (its OTLP export): ``(name, help, type, unit, samples)``."""
    return [
        (
            metric.name,
            metric.documentation,
            metric.type,
            metric.unit,
            [
                (s.name, list(s.labels.items()), float(s.value), None if s.timestamp is None else float(s.timestamp))
                for s in metric.samples
            ],
        )
        for metric in collect_families()
    ]


class FamilyDoc(NamedTuple):
    """One exported family as the operator guide lists it."""

    name: str  # as exposed (counters with ``_total``)
    type: str
    labels: tuple[str, ...]  # without Dynamo's three, which every family carries
    help: str


def catalogue() -> list[FamilyDoc]:
    """Every family this process can export, sorted by name, with its label names -- also those of labelled
    families that have no sample yet (read from the metric objects, which know their label names)."""
    docs: dict[str, FamilyDoc] = {}
    for collector in list(REGISTRY._collector_to_names):
        if isinstance(collector, MetricWrapperBase):
            kind = str(collector._type)
            name = collector._name + ("_total" if kind == "counter" else "")
            labels = tuple(collector._labelnames)
            docs[name] = FamilyDoc(name, kind, labels, collector._documentation)
            continue
        for family in collector.collect():
            names = {key for s in family.samples for key in s.labels}
            name = family.name + ("_total" if family.type == "counter" else "")
            docs[name] = FamilyDoc(name, family.type, tuple(sorted(names)), family.documentation)
    for dynamo_name in (DYNAMO_TOTAL_BLOCKS, DYNAMO_CACHE_USAGE):
        help_text = (
            "Total number of KV cache blocks available on the worker (Dynamo's name; from GetLoad)"
            if dynamo_name == DYNAMO_TOTAL_BLOCKS
            else "GPU cache usage as a percentage (0.0-1.0) (Dynamo's name; used / total from GetLoad)"
        )
        docs[dynamo_name] = FamilyDoc(dynamo_name, "gauge", ("model", "dp_rank"), help_text)
    return sorted(docs.values())
