"""The sidecar's Prometheus metrics: names, bounded labels, what a request records, the machine-count collector."""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.errors import (
    EngineFailure,
    EngineGone,
    EngineRpcError,
    GrpcCode,
    ProtocolViolation,
    RequestRejected,
    Violation,
    WorkerDraining,
)
from sidecar.ops import metrics
from statemachines import REQUEST, RequestLifecycle

# Every family the issue asks for, by its exposed name (counters get `_total` from prometheus-client).
EXPECTED = {
    "openengine_sidecar_requests_received": "counter",
    "openengine_sidecar_requests_ended": "counter",
    "openengine_sidecar_time_to_first_token_seconds": "histogram",
    "openengine_sidecar_inter_token_latency_seconds": "histogram",
    "openengine_sidecar_input_tokens": "counter",
    "openengine_sidecar_output_tokens": "counter",
    "openengine_sidecar_aborts": "counter",
    "openengine_sidecar_abort_latency_seconds": "histogram",
    "openengine_sidecar_protocol_violations": "counter",
    "openengine_sidecar_engine_rpc_duration_seconds": "histogram",
    "openengine_sidecar_worker_state": "gauge",
    "openengine_sidecar_requests_in_state": "gauge",
    "openengine_sidecar_lifecycles_abandoned": "counter",
    "openengine_sidecar_engine_reconnects": "counter",
    "openengine_sidecar_health_transitions": "counter",
    "openengine_sidecar_registration_restores": "counter",
    "openengine_sidecar_kv_event_lag_seconds": "histogram",
    "openengine_sidecar_kv_event_resyncs": "counter",
    "openengine_sidecar_trio_tasks": "gauge",
    "openengine_sidecar_asyncio_tasks": "gauge",
}

# Label names allowed anywhere, and the only values each may take (None: the set is fixed by code, checked below).
BOUNDED_LABELS = {
    "outcome",
    "state",
    "violation",
    "result",
    "rpc",
    "code",
    "stage",
    "change",
    "reason",
    "machine",
    "le",
    # Dynamo's identity labels, on every sample (their values are the worker's configuration).
    "dynamo_namespace",
    "dynamo_component",
    "dynamo_endpoint",
}


def families() -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(metrics.exposition())}


def sample(name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(metrics.exposition()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def test_every_family_is_exported_with_prometheus_conventions() -> None:
    found = families()
    for name, kind in EXPECTED.items():
        assert found.get(name) == kind, name
    text = metrics.exposition()
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{")[0].split(" ")[0]
        assert name.startswith(("openengine_sidecar_", metrics.DYNAMO_TOTAL_BLOCKS, metrics.DYNAMO_CACHE_USAGE)), line
        assert not name.endswith("_created"), line  # disabled: noise on Dynamo's page
    for family in text_string_to_metric_families(text):
        if family.name not in EXPECTED:
            continue  # families other packages register in the same registry (sidecar.kv) are theirs to check
        if family.type == "counter":
            assert all(s.name.endswith("_total") for s in family.samples), family.name
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name
    # No process or GC collectors: Dynamo's system port page is not ours to fill with them.
    assert "process_" not in text
    assert "python_gc" not in text


def test_labels_are_bounded_and_never_request_ids() -> None:
    RequestLifecycle("label-check").fire("reject")
    for family in text_string_to_metric_families(metrics.exposition()):
        for s in family.samples:
            if family.name in EXPECTED:
                assert set(s.labels) <= BOUNDED_LABELS, (family.name, s.labels)
            assert "label-check" not in s.labels.values()


def test_request_states_come_from_the_machine_counts() -> None:
    before = sample("openengine_sidecar_requests_in_state", state="submitted")
    request = RequestLifecycle("collector")
    request.fire("submit")
    assert sample("openengine_sidecar_requests_in_state", state="submitted") == before + 1
    request.fire("finish")
    assert sample("openengine_sidecar_requests_in_state", state="submitted") == before


def test_terminal_outcomes_are_exported_once() -> None:
    """Terminal request states are counted by requests_ended_total{outcome} alone: no second family repeats them."""
    found = families()
    assert "openengine_sidecar_requests_terminal" not in found
    in_state = {
        s.labels["state"]
        for f in text_string_to_metric_families(metrics.exposition())
        if f.name == "openengine_sidecar_requests_in_state"
        for s in f.samples
    }
    assert in_state == set(REQUEST.states) - set(REQUEST.terminal)
    ended = {
        s.labels["outcome"]
        for f in text_string_to_metric_families(metrics.exposition())
        if f.name == "openengine_sidecar_requests_ended"
        for s in f.samples
    }
    assert ended == set(REQUEST.terminal)


def test_every_sample_carries_dynamos_labels() -> None:
    saved = metrics.dynamo_labels()
    metrics.set_dynamo_labels("ns-a", "prefill", "generate")
    try:
        for family in text_string_to_metric_families(metrics.exposition()):
            for s in family.samples:
                assert s.labels["dynamo_namespace"] == "ns-a", s
                assert s.labels["dynamo_component"] == "prefill", s
                assert s.labels["dynamo_endpoint"] == "generate", s
        for name, _, _, _, typed in metrics.typed_families():
            for _, labels, _, _ in typed:
                assert ("dynamo_namespace", "ns-a") in labels, name
    finally:
        metrics.set_dynamo_labels(*saved.values())


def test_kv_usage_is_exported_under_dynamos_worker_names() -> None:
    from sidecar.kv._metrics import RANK_KV_BLOCKS

    labels = metrics.dynamo_labels()
    metrics.set_dynamo_labels(labels["dynamo_namespace"], labels["dynamo_component"], labels["dynamo_endpoint"], "tiny")
    RANK_KV_BLOCKS.labels(rank="3", kind="used").set(25)
    RANK_KV_BLOCKS.labels(rank="3", kind="total").set(100)
    assert sample(metrics.DYNAMO_TOTAL_BLOCKS, dp_rank="3", model="tiny") == 100
    assert sample(metrics.DYNAMO_CACHE_USAGE, dp_rank="3", model="tiny") == 0.25
    kinds = families()
    assert kinds[metrics.DYNAMO_TOTAL_BLOCKS] == kinds[metrics.DYNAMO_CACHE_USAGE] == "gauge"


def test_a_request_records_tokens_ttft_itl_and_its_generate_rpc_once() -> None:
    ttft = sample("openengine_sidecar_time_to_first_token_seconds_count")
    itl = sample("openengine_sidecar_inter_token_latency_seconds_count")
    tokens_in = sample("openengine_sidecar_input_tokens_total")
    tokens_out = sample("openengine_sidecar_output_tokens_total")
    rpcs = sample("openengine_sidecar_engine_rpc_duration_seconds_count", rpc="Generate", code="OK")

    stats = metrics.RequestStats(prompt_tokens=7)
    stats.chunks([{"token_ids": []}])  # no tokens: no first token yet
    assert sample("openengine_sidecar_time_to_first_token_seconds_count") == ttft
    stats.chunks([{"token_ids": [1, 2]}, {"token_ids": [3]}])
    stats.chunks([{"token_ids": [4], "finish_reason": "stop"}])
    stats.end(code="OK")

    assert sample("openengine_sidecar_time_to_first_token_seconds_count") == ttft + 1
    assert sample("openengine_sidecar_inter_token_latency_seconds_count") == itl + 1
    assert sample("openengine_sidecar_input_tokens_total") == tokens_in + 7
    assert sample("openengine_sidecar_output_tokens_total") == tokens_out + 4
    assert sample("openengine_sidecar_engine_rpc_duration_seconds_count", rpc="Generate", code="OK") == rpcs + 1


def test_a_single_token_request_has_no_inter_token_latency() -> None:
    itl = sample("openengine_sidecar_inter_token_latency_seconds_count")
    stats = metrics.RequestStats(prompt_tokens=1)
    stats.chunks([{"token_ids": [9]}])
    stats.end(code="OK")
    assert sample("openengine_sidecar_inter_token_latency_seconds_count") == itl


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (None, "OK"),
        (EngineRpcError("Generate", GrpcCode.UNAVAILABLE, "gone"), "UNAVAILABLE"),
        (EngineRpcError("Generate", GrpcCode.RESOURCE_EXHAUSTED, ""), "RESOURCE_EXHAUSTED"),
        (EngineFailure(3, "bad", retryable=False), "OK"),
        (ProtocolViolation(Violation.MISSING_USAGE, "x"), "OK"),
        (GeneratorExit(), "CANCELLED"),
        (WorkerDraining("drain deadline"), "CANCELLED"),
        (EngineGone("lost"), "CANCELLED"),
        (RequestRejected("x", "y"), "UNKNOWN"),
        (RuntimeError("bug"), "UNKNOWN"),
    ],
)
def test_generate_status_label(error: BaseException | None, code: str) -> None:
    assert metrics.rpc_code(error) == code
    assert re.fullmatch(r"[A-Z_]+", code)


def test_worker_state_gauge_has_exactly_one_state_set() -> None:
    metrics.mark_worker_state("serving")
    values = {
        s.labels["state"]: s.value
        for f in text_string_to_metric_families(metrics.exposition())
        if f.name == "openengine_sidecar_worker_state"
        for s in f.samples
    }
    assert values["serving"] == 1
    assert sum(values.values()) == 1
    metrics.mark_worker_state("starting")


def test_typed_families_mirror_the_exposition() -> None:
    typed = metrics.typed_families()
    names = {name for name, *_ in typed}
    assert set(EXPECTED) <= names
    for name, help_text, kind, unit, samples in typed:
        assert help_text
        assert kind in ("counter", "gauge", "histogram")
        assert unit == ""
        for sample_name, labels, value, timestamp in samples:
            assert sample_name.startswith(name)
            assert all(isinstance(k, str) and isinstance(v, str) for k, v in labels)
            assert isinstance(value, float)
            assert timestamp is None


def _gauge(text: str, name: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return float(s.value)
    return None


async def test_the_task_gauges_count_both_loops_when_scraped_from_another_thread() -> None:
    """``openengine_sidecar_trio_tasks`` / ``_asyncio_tasks`` follow tasks as they start and end, read by a scrape on
    another thread (Dynamo's), as the chaos soak reads them to prove the worker leaks no task."""
    import asyncio
    from functools import partial

    import trio

    from sidecar.edge import loop_tasks, open_edge

    async def parked() -> None:
        await asyncio.sleep(3600)

    async def start_parked(count: int) -> list[asyncio.Task[None]]:
        return [asyncio.create_task(parked()) for _ in range(count)]

    async def cancel_all(tasks: list[asyncio.Task[None]]) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def scrape() -> tuple[float | None, float | None]:
        text = await trio.to_thread.run_sync(metrics.exposition)
        return _gauge(text, "openengine_sidecar_trio_tasks"), _gauge(text, "openengine_sidecar_asyncio_tasks")

    saved = (metrics._TASKS.trio_root, metrics._TASKS.asyncio_tasks)
    try:
        async with open_edge() as edge:
            metrics.watch_tasks(trio.lowlevel.current_root_task(), partial(loop_tasks, edge.loop))
            trio_before, asyncio_before = await scrape()
            assert trio_before is not None
            assert trio_before >= 1
            assert asyncio_before is not None
            async with trio.open_nursery() as nursery:
                for _ in range(5):
                    nursery.start_soon(trio.sleep_forever)
                await trio.testing.wait_all_tasks_blocked()
                tasks = await edge.run(start_parked, 3)
                trio_during, asyncio_during = await scrape()
                assert trio_during == trio_before + 5
                assert asyncio_during == asyncio_before + 3
                await edge.run(cancel_all, tasks)
                nursery.cancel_scope.cancel()
            assert await scrape() == (trio_before, asyncio_before)
    finally:
        metrics._TASKS.trio_root, metrics._TASKS.asyncio_tasks = saved
