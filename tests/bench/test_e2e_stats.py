"""The benchmark's arithmetic: percentiles, the steady-state window, ITL as aiperf defines it, merging rounds."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench._e2e_common import RequestTiming, Stream, Table, latency_summary, percentile, seed_of, window_throughput
from bench.e2e import merge_runs


def test_percentile_interpolates_and_handles_empty() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_seeds_repeat_in_order() -> None:
    assert [seed_of(i, [7, 8, 9]) for i in range(5)] == [7, 8, 9, 7, 8]


def timing(start: float, first: float, last: float, end: float, tokens: int, chunks: int) -> RequestTiming:
    return RequestTiming(start, first, last, end, tokens, chunks)


def test_window_is_between_first_end_and_last_start() -> None:
    timings = [timing(0, 1, 4, 4, 4, 4), timing(0, 1, 6, 6, 6, 6), timing(4, 5, 8, 8, 4, 4)]
    events = [(t, 1) for t in (1, 2, 3, 4, 5, 6, 7, 8)] + [(3.5, 10)]
    rate, lo, hi = window_throughput(timings, events)
    # The window is [4, 4] + the guard: shorter than 0.2 s, so the whole run [0, 8] counts instead.
    assert (lo, hi) == (0, 8)
    assert rate == pytest.approx(18 / 8)
    timings = [timing(0, 1, 2, 2, 2, 2), timing(0, 1, 9, 9, 9, 9), timing(6, 7, 8, 8, 2, 2)]
    rate, lo, hi = window_throughput(timings, events)
    assert (lo, hi) == (2, 6)
    assert rate == pytest.approx((5 + 10) / 4)  # events at 2, 3, 3.5 (10 tokens), 4, 5, 6


def test_latency_summary_uses_aiperf_itl() -> None:
    timings = [timing(0, 0.010, 0.110, 0.12, 11, 11), timing(0, 0.020, 0.220, 0.23, 11, 2)]
    summary = latency_summary(timings)
    assert summary["ttft_p50_ms"] == pytest.approx(15)
    assert summary["itl_p50_ms"] == pytest.approx(15)  # 10 ms and 20 ms per token
    assert summary["tokens_per_chunk"] == pytest.approx(22 / 13)


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
