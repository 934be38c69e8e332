"""Shared by ``bench.e2e`` and its child processes: the workload, the expected-token table, /proc readings, stats."""

from __future__ import annotations

import itertools
import json
import math
import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

#: Served model names: A = the in-process baseline worker, B = openengine-sidecar.
MODEL_A: Final = "bench-a"
MODEL_B: Final = "bench-b"
#: The mock's own served model name (what path C and the sidecar send in ``GenerateRequest.model``).
ENGINE_MODEL: Final = "tiny-oe"
PROMPT: Final = "Tell me about the river."
#: Sampling for every request: the mock's seeded output is a function of seed, context and position, so a seed fixes a
#: stream.
TEMPERATURE: Final = 1.0

_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")
_PAGE: Final = os.sysconf("SC_PAGE_SIZE")


def seed_of(request_number: int, seeds: list[int]) -> int:
    """Request ``i`` of every run uses this seed: the same sequence of token streams on every path."""
    return seeds[request_number % len(seeds)]


@dataclass(frozen=True, slots=True)
class Stream:
    """What the engine produces for one seed: token ids, their text, and the text length after each token."""

    ids: list[int]
    text: str
    offsets: list[int]  # offsets[k] = len(decode(ids[: k + 1]))


@dataclass(frozen=True, slots=True)
class Table:
    """The expected output of every seed, for a fixed prompt (as token ids) and ``max_tokens``."""

    prompt_ids: list[int]
    max_tokens: int
    streams: dict[int, Stream]

    def dump(self, path: Path) -> None:
        data = {
            "prompt_ids": self.prompt_ids,
            "max_tokens": self.max_tokens,
            "streams": {
                str(seed): {"ids": s.ids, "text": s.text, "offsets": s.offsets} for seed, s in self.streams.items()
            },
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Table:
        data = json.loads(path.read_text())
        streams = {int(seed): Stream(s["ids"], s["text"], s["offsets"]) for seed, s in data["streams"].items()}
        return cls(list(data["prompt_ids"]), int(data["max_tokens"]), streams)


def process_cpu_s(pid: int) -> float:
    """utime + stime of process ``pid``, all threads (NaN once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    # After the ")" of comm, field 3 (state) is index 0: utime (14) and stime (15) are indices 11 and 12.
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


@dataclass(frozen=True, slots=True)
class CpuReading:
    """A process's CPU time now: utime + stime (10 ms ticks, threads that ended included) and each live thread's run
    time in nanoseconds (``/proc/<pid>/task/<tid>/schedstat``, the scheduler's own account)."""

    ticks_s: float
    threads_ns: dict[int, int]


def read_cpu(pid: int) -> CpuReading:
    threads: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            threads[int(tid)] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return CpuReading(process_cpu_s(pid), threads)


def cpu_between(before: CpuReading, after: CpuReading) -> float:
    """CPU seconds the process used between two readings: the threads' nanoseconds, exact where a few ticks would
    not be (a short run of a cheap process is a handful of 10 ms ticks); the ticks where a thread ended in between
    (its nanoseconds left with it, the process's ticks kept them)."""
    ticks = after.ticks_s - before.ticks_s
    exact = sum(ns - before.threads_ns.get(tid, 0) for tid, ns in after.threads_ns.items()) / 1e9
    if not math.isfinite(ticks) or ticks > exact + 2 / _CLOCK_TICKS:
        return ticks
    return exact


def process_rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (0 once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
    except OSError:
        return 0


def own_cpu_s() -> float:
    """CPU time of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0–100), linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """One request as a client saw it (``time.monotonic()`` seconds, comparable across processes)."""

    start: float
    first: float  # first token (NaN if none)
    last: float  # last token
    end: float  # stream closed
    tokens: int
    events: int  # events carrying tokens (SSE events with text for A/B, engine batches for C)


def window_throughput(timings: list[RequestTiming], events: list[tuple[float, int]]) -> tuple[float, float, float]:
    """Steady-state output tokens/s: tokens delivered between the first request's end (every slot is busy by then)
    and the last request's start (no slot idles before then). Where that window is under a quarter of the run (few
    requests per slot: they start and end in waves) the whole run counts instead, first start to last end. Returns
    (tokens/s, window start, window end)."""
    if not timings:
        return math.nan, math.nan, math.nan
    lo = min(t.end for t in timings)
    hi = max(t.start for t in timings)
    first, final = min(t.start for t in timings), max(t.end for t in timings)
    if hi - lo < (final - first) / 4:
        lo, hi = first, final
    tokens = sum(n for when, n in events if lo <= when <= hi)
    return (tokens / (hi - lo) if hi > lo else math.nan), lo, hi


def latency_summary(timings: list[RequestTiming]) -> dict[str, float]:
    """TTFT and ITL percentiles (ms), and tokens per event. ITL per request is (last − first) / (tokens − 1), as
    aiperf computes it: an average per request, blind to how the tokens were spread over the events."""
    ttft = [1e3 * (t.first - t.start) for t in timings if not math.isnan(t.first)]
    itl = [1e3 * (t.last - t.first) / (t.tokens - 1) for t in timings if t.tokens > 1 and not math.isnan(t.first)]
    tokens = sum(t.tokens for t in timings)
    events = sum(t.events for t in timings)
    return {
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "tokens_per_event": tokens / events if events else math.nan,
    }


def gap_summary(requests: list[list[float]]) -> dict[str, float]:
    """What a user feels between pieces of text: the gaps (ms) between consecutive events of each request.

    ``requests`` holds, per request, the client's clock readings of its events that carried text, in order. The
    gaps of all requests are pooled for p50/p90/p99; each request's largest gap is its *worst gap*, summarized by
    its p50 and p99 over the requests that had at least two events. NaN where there is nothing to measure."""
    gaps: list[float] = []
    worst: list[float] = []
    for times in requests:
        mine = [1e3 * (later - earlier) for earlier, later in itertools.pairwise(times)]
        if mine:
            gaps.extend(mine)
            worst.append(max(mine))
    return {
        "gap_p50_ms": percentile(gaps, 50),
        "gap_p90_ms": percentile(gaps, 90),
        "gap_p99_ms": percentile(gaps, 99),
        "worst_gap_p50_ms": percentile(worst, 50),
        "worst_gap_p99_ms": percentile(worst, 99),
        "gaps": float(len(gaps)),
    }


def jsonable(value: Any) -> Any:
    """NaN/inf → None, recursively (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value
