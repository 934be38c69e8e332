"""The benchmark's arithmetic: percentiles, the steady-state window, ITL as aiperf defines it, the gaps between
events and tokens per event, merging rounds, the goal lines, and worker A's copy of the mock's step model."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import e2e
from bench._e2e_common import (
    CpuReading,
    RequestTiming,
    Stream,
    Table,
    cpu_between,
    gap_summary,
    latency_summary,
    percentile,
    read_cpu,
    seed_of,
    window_throughput,
)
from bench._e2e_worker import Shape, make_generate
from bench.e2e import GOALS, Goal, merge_runs, worker_a_annotations
from sidecar.testing.mock.config import MockConfig
from sidecar.testing.mock.engine import Engine


def test_percentile_interpolates_and_handles_empty() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_seeds_repeat_in_order() -> None:
    assert [seed_of(i, [7, 8, 9]) for i in range(5)] == [7, 8, 9, 7, 8]


def timing(start: float, first: float, last: float, end: float, tokens: int, events: int) -> RequestTiming:
    return RequestTiming(start, first, last, end, tokens, events)


def test_window_is_between_first_end_and_last_start() -> None:
    timings = [timing(0, 1, 4, 4, 4, 4), timing(0, 1, 6, 6, 6, 6), timing(4, 5, 8, 8, 4, 4)]
    events = [(t, 1) for t in (1, 2, 3, 4, 5, 6, 7, 8)] + [(3.5, 10)]
    rate, lo, hi = window_throughput(timings, events)
    # The window is [4, 4]: under a quarter of the run, so the whole run [0, 8] counts instead.
    assert (lo, hi) == (0, 8)
    assert rate == pytest.approx(18 / 8)
    timings = [timing(0, 1, 2, 2, 2, 2), timing(0, 1, 9, 9, 9, 9), timing(6, 7, 8, 8, 2, 2)]
    rate, lo, hi = window_throughput(timings, events)
    assert (lo, hi) == (2, 6)
    assert rate == pytest.approx((5 + 10) / 4)  # events at 2, 3, 3.5 (10 tokens), 4, 5, 6
    # Two waves of requests: the window between them (1.9 to 2.1 of a 4 s run) would measure the hand-over alone.
    timings = [timing(0, 0.1, 2, 2, 2, 2), timing(0, 0.1, 1.9, 1.9, 2, 2), timing(2.1, 2.2, 4, 4, 2, 2)]
    rate, lo, hi = window_throughput(timings, [(0.5, 3), (1.5, 1), (3.0, 2)])
    assert (lo, hi) == (0, 4)
    assert rate == pytest.approx(6 / 4)


def test_latency_summary_uses_aiperf_itl() -> None:
    timings = [timing(0, 0.010, 0.110, 0.12, 11, 11), timing(0, 0.020, 0.220, 0.23, 11, 2)]
    summary = latency_summary(timings)
    assert summary["ttft_p50_ms"] == pytest.approx(15)
    assert summary["itl_p50_ms"] == pytest.approx(15)  # 10 ms and 20 ms per token
    assert summary["tokens_per_event"] == pytest.approx(22 / 13)


def test_table_round_trip(tmp_path: Path) -> None:
    table = Table([1, 2], 3, {5: Stream([10, 11, 12], "abc", [1, 2, 3])})
    path = tmp_path / "t.json"
    table.dump(path)
    assert Table.load(path) == table


def test_rounds_merge_to_medians_and_sums() -> None:
    runs = [
        {"path": "B", "requests": 10, "completed": 10, "failed": 0, "lost": 0, "tokens": 100, "errors": [],
         "tokens_per_s": 100.0, "itl_p50_ms": 1.0, "cpu_s_per_1k_tokens": {"sidecar": 0.1}},
        {"path": "B", "requests": 10, "completed": 9, "failed": 1, "lost": 0, "tokens": 90, "errors": ["x"],
         "tokens_per_s": 300.0, "itl_p50_ms": 3.0, "cpu_s_per_1k_tokens": {"sidecar": 0.3}},
    ]  # fmt: skip
    merged = merge_runs(runs)
    assert merged["requests"] == 20
    assert merged["completed"] == 19
    assert merged["failed"] == 1
    assert merged["errors"] == ["x"]
    assert merged["tokens_per_s"] == 200.0
    assert merged["itl_p50_ms"] == 2.0
    assert merged["cpu_s_per_1k_tokens"] == {"sidecar": pytest.approx(0.2)}
    assert merged["tokens_per_s_rounds"] == [100.0, 300.0]


def test_gaps_are_pooled_and_worst_is_per_request() -> None:
    # Request 1: events 10 ms apart, then a 50 ms stall; request 2: one 30 ms gap; request 3: a single event (no gap).
    summary = gap_summary([[0.0, 0.010, 0.020, 0.070], [1.0, 1.030], [2.0]])
    # Pooled gaps (ms): 10, 10, 50, 30.
    assert summary["gaps"] == 4
    assert summary["gap_p50_ms"] == pytest.approx(20)
    assert summary["gap_p90_ms"] == pytest.approx(44)
    assert summary["gap_p99_ms"] == pytest.approx(49.4)
    # Worst per request: 50 and 30 (the single-event request has none).
    assert summary["worst_gap_p50_ms"] == pytest.approx(40)
    assert summary["worst_gap_p99_ms"] == pytest.approx(49.8)


def test_gaps_see_what_itl_averages_away() -> None:
    """Ten tokens every 10 ms one by one, or three at a time every 30 ms: the same ITL, three times the gap."""
    steady = [[0.01 * k for k in range(10)]]
    bursty = [[0.0, 0.03, 0.06, 0.09]]  # the tenth token's text arrives with the last event
    assert gap_summary(steady)["gap_p50_ms"] == pytest.approx(10)
    assert gap_summary(bursty)["gap_p50_ms"] == pytest.approx(30)
    itl = latency_summary([timing(0, 0, 0.09, 0.1, 10, 10), timing(0, 0, 0.09, 0.1, 10, 4)])
    assert itl["itl_p50_ms"] == pytest.approx(10)
    assert itl["tokens_per_event"] == pytest.approx(20 / 14)


def test_gaps_of_nothing_are_nan() -> None:
    summary = gap_summary([[], [5.0]])
    assert summary["gaps"] == 0
    assert all(math.isnan(summary[key]) for key in ("gap_p50_ms", "gap_p99_ms", "worst_gap_p50_ms"))


GOAL_LINE = re.compile(r"^goal ([a-z0-9_]+): (not measured|-?\d+\.\d+) \(target (≤|≥) (\d+\.\d+)\) (met|MISSED)$")


def test_goal_lines_parse_and_judge() -> None:
    below = Goal("x_ratio", "≤", 1.1, 2, "")
    assert below.line(1.0999) == "goal x_ratio: 1.10 (target ≤ 1.10) met"
    assert below.line(1.2) == "goal x_ratio: 1.20 (target ≤ 1.10) MISSED"
    assert below.line(math.nan) == "goal x_ratio: not measured (target ≤ 1.10) MISSED"
    above = Goal("y", "≥", 0.9, 2, "")
    assert above.line(0.95).endswith(" met")
    assert above.line(0.85).endswith(" MISSED")
    for goal in GOALS:
        assert GOAL_LINE.match(goal.line(1.0)), goal.line(1.0)
    assert [g.name for g in GOALS] == [
        "paced_gap_p50_ratio", "paced_gap_p99_ratio", "paced_tokens_per_event", "paced_cpu_per_token_ratio",
        "saturated_equal_chunk_ratio", "saturated_us_per_message", "memory_kib_per_request",
        "paced_cpu_vs_dynamo", "saturated_cpu_vs_dynamo", "ttft_vs_dynamo", "frontend_cpu_vs_dynamo",
        "paced_gap_p99_vs_dynamo", "memory_vs_dynamo",
    ]  # fmt: skip


def test_worker_a_cuts_and_paces_as_the_mock_does() -> None:
    """Worker A reads its shape from the annotations the bench sends, and its steps are the mock's."""
    shape = Shape.of({"annotations": worker_a_annotations(5, 10.0)})
    assert shape.tokens_per_message == 5
    assert shape.prefill_tokens_per_s == MockConfig().prefill_tokens_per_s
    engine = Engine(
        MockConfig(speedup=1.0, decode_ms_per_token=10.0), SimpleNamespace(eos_token_ids=())
    )  # no model needed
    for batch in (1, 16, 64):
        engine._decoding_sequences = batch  # the mock's own step model, at this batch size
        assert shape.step_s(batch) == pytest.approx(engine._step_time())
    assert Shape.of({"annotations": worker_a_annotations(1, 0.0)}) == Shape()
    assert Shape.of({"annotations": ["pace_ms:1000"]}).step_s(500) == 1.0


def test_a_later_run_shows_its_goals_beside_the_baseline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    baseline = tmp_path / "baseline.json"
    goals = [{"name": goal.name, "value": 2.0} for goal in GOALS]
    baseline.write_text(json.dumps({"date": "then", "commit": "aaa", "sidecar_commit": "c096775",
                                    "summary": {"goals": goals}}))  # fmt: skip
    monkeypatch.setattr(e2e, "BASELINE", baseline)
    monkeypatch.setattr(e2e, "ROOT", tmp_path)
    now = {"goals": [{"name": goal.name, "value": 1.0} for goal in GOALS]}
    lines = e2e.against_baseline(now, {"date": "now", "commit": "bbb"})
    assert "`c096775`" in lines[0]
    row = next(line for line in lines if "`paced_gap_p50_ratio`" in line)
    assert row == "| `paced_gap_p50_ratio` | 2.00 | 1.00 | ≤ 1.1 |"
    assert len([line for line in lines if line.startswith("| `")]) == len(GOALS)
    # The baseline run itself is not compared with itself.
    assert e2e.against_baseline(now, {"date": "then", "commit": "aaa"}) == []


def _point(path: str, row: e2e.Row, **figures: float) -> dict[str, object]:
    cpu = {key[4:]: value for key, value in figures.items() if key.startswith("cpu_")}
    point: dict[str, object] = {
        "path": path, "interval": row.interval, "pace_ms": row.pace_ms, "concurrency": row.concurrency,
        "clock": row.clock, "one_token": row.one_token, "requests": 1, "completed": 1, "cpu_us_per_token": cpu,
    }  # fmt: skip
    point.update({key: value for key, value in figures.items() if not key.startswith("cpu_")})
    return point


def test_goals_against_dynamo_are_the_worst_row_of_each_and_not_measured_without_path_d() -> None:
    plan = e2e.Plan(**{**dataclasses.asdict(e2e.QUICK), "cpu_ratio_row": (10.0, 16), "per_request_ms": [10.0]})
    engine, per_request = e2e.paced_rows(plan)
    (sat5,) = [row for row in e2e.saturated_rows(plan) if row.interval == 5]
    points = []
    # Paced: ours costs 2x Dynamo's on the engine clock, 3x on per-request timers; TTFT p99 worst on the engine clock.
    for row, ours, ttft99 in ((engine, 200.0, 132.0), (per_request, 300.0, 100.0)):
        common = {"tokens_per_event": 1.0, "gap_p50_ms": 12.0, "ttft_p50_ms": 50.0}
        points += [
            _point("A", row, cpu_worker_a=100.0, cpu_frontend=60.0, gap_p99_ms=14.0, ttft_p99_ms=100.0, **common),
            _point("B", row, cpu_sidecar=ours, cpu_frontend=63.0, gap_p99_ms=15.4, ttft_p99_ms=ttft99, **common),
            _point("D", row, cpu_sidecar_d=100.0, cpu_frontend=60.0, gap_p99_ms=14.0, ttft_p99_ms=100.0, **common),
        ]
    points += [_point("B", sat5, cpu_sidecar=12.0), _point("D", sat5, cpu_sidecar_d=8.0)]
    memory = {"per_request_kib": 30.0, "failed": 0, "dynamo": {"per_request_kib": 60.0}}
    goals = {g["name"]: g for g in e2e.summarize(plan, {"points": points, "memory": memory})["goals"]}
    assert goals["paced_cpu_vs_dynamo"]["value"] == pytest.approx(3.0)  # the worse of the two step shapes
    assert goals["paced_cpu_per_token_ratio"]["value"] == pytest.approx(3.0)  # c=16, 10 ms: both shapes count
    assert goals["saturated_cpu_vs_dynamo"]["value"] == pytest.approx(1.5)
    assert goals["saturated_cpu_vs_dynamo"]["met"]
    assert goals["ttft_vs_dynamo"]["value"] == pytest.approx(1.32)  # p99 of the engine-clock row
    assert goals["frontend_cpu_vs_dynamo"]["value"] == pytest.approx(1.05)
    assert goals["paced_gap_p99_vs_dynamo"]["value"] == pytest.approx(1.10)
    assert goals["memory_vs_dynamo"]["value"] == pytest.approx(0.5)
    # Without path D every goal against it is "not measured", and not met.
    without = e2e.summarize(plan, {"points": [p for p in points if p["path"] != "D"],
                                   "memory": {**memory, "dynamo": None}})  # fmt: skip
    for goal in without["goals"]:
        if goal["name"].endswith("_vs_dynamo"):
            assert "not measured" in goal["line"], goal
            assert not goal["met"], goal


def test_worker_a_on_the_engine_clock_hands_every_request_its_token_in_the_same_loop_pass() -> None:
    """Worker A's ``step_clock:engine``: requests whose prefills end at different times (prompts of 1, 100 and 200
    tokens at 20,000 tokens/s: 0.05, 5 and 10 ms into a 20 ms step) get their tokens in common passes of the event
    loop (counted by a callback that reschedules itself every pass). On per-request timers (``step_clock`` ignored)
    this fails: their timers fire in passes of their own, except where a pause of the whole process puts some
    together."""

    async def passes_of_chunks() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        passes = 0

        def count() -> None:
            nonlocal passes
            passes += 1
            handle[0] = loop.call_soon(count)

        handle = [loop.call_soon(count)]
        generate = make_generate(SimpleNamespace(lookup=lambda request: list(range(6))))  # type: ignore[arg-type]
        annotations = worker_a_annotations(1, 20.0, "engine")

        async def one(prompt: int) -> list[int]:
            request = {"token_ids": [7] * prompt, "sampling_options": {"seed": 1},
                       "stop_conditions": {"max_tokens": 6}, "annotations": annotations}  # fmt: skip
            return [passes async for _ in generate(request, None)]

        try:
            return list(await asyncio.gather(one(1), one(100), one(200)))
        finally:
            handle[0].cancel()

    engine = asyncio.run(passes_of_chunks())
    assert all(len(chunks) == 6 for chunks in engine)
    # Once the last request joined (its first chunk), every request's chunk of a step came in one pass.
    joined = max(chunks[0] for chunks in engine)
    steps = [sorted(p for p in chunks if p >= joined) for chunks in engine]
    shortest = min(len(s) for s in steps)
    assert shortest >= 3, engine
    assert all(s[:shortest] == steps[0][:shortest] for s in steps), engine


def test_engine_clock_annotations_reach_worker_a() -> None:
    assert Shape.of({"annotations": worker_a_annotations(1, 10.0, "engine")}).engine_clock
    assert not Shape.of({"annotations": worker_a_annotations(1, 10.0, "per-request")}).engine_clock
    assert not Shape.of({"annotations": worker_a_annotations(1, 10.0)}).engine_clock


def test_cpu_between_counts_the_threads_nanoseconds_and_falls_back_to_ticks_when_a_thread_ended() -> None:
    before = CpuReading(ticks_s=1.00, threads_ns={1: 500_000_000, 2: 200_000_000})
    # Both threads ran on and a third started: 3 ms + 4 ms + 1 ms, where the ticks saw nothing (one tick is 10 ms).
    after = CpuReading(ticks_s=1.00, threads_ns={1: 503_000_000, 2: 204_000_000, 3: 1_000_000})
    assert cpu_between(before, after) == pytest.approx(0.008)
    # Thread 2 ended after 300 ms more: its nanoseconds left with it, the process's ticks kept them.
    ended = CpuReading(ticks_s=1.31, threads_ns={1: 510_000_000})
    assert cpu_between(before, ended) == pytest.approx(0.31)
    # A process gone: NaN, as the ticks are.
    assert math.isnan(cpu_between(before, CpuReading(ticks_s=math.nan, threads_ns={})))


def test_read_cpu_sees_this_process_work() -> None:
    before = read_cpu(os.getpid())
    deadline = time.process_time() + 0.02
    while time.process_time() < deadline:
        pass
    spent = cpu_between(before, read_cpu(os.getpid()))
    assert 0.015 <= spent <= 1.0, spent
