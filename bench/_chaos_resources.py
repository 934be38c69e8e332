"""Resources of the long-lived processes of ``bench.chaos``: sampled through the run, and whether any grew.

**Samples.** Every ``interval`` seconds of the load (30 s in an hour's run), and once when the topology is idle
before the load and once idle after it, each long-lived process — sidecars, frontends, engines, etcd, NATS — is read
from ``/proc/<pid>``: its resident memory (``VmRSS``), its open file descriptors (the entries of ``fd/``) and its
threads (``Threads``); a sidecar's ``/metrics`` adds its live trio and asyncio tasks
(``openengine_sidecar_trio_tasks``, ``openengine_sidecar_asyncio_tasks``). A restarted process starts a new *life*.

**Slope.** A figure's trend is fitted within each life, after a warm-up (allocators, caches, the router's view fill
up under load first): one least-squares slope shared by all lives, each with its own level (restarts reset memory,
so a line through all lives would mistake a restart for a shrink). Lives with fewer than three samples after their
warm-up carry no slope. A process the schedule never restarts (a *witness*: one sidecar, one engine, one frontend,
etcd, NATS) gives the longest life, the one that decides.

**Verdict.** A figure *grew* when the trend's rise over the longest measured life exceeds what the figure wanders
anyway: three times the residual standard deviation of the samples around the trend (connections, requests in
flight and garbage collection at the moment of sampling), and at least a floor (:data:`FLOORS`) below which growth
is one connection or request more and nothing an operator would act on. Task counts must also come back: idle
after the load, a process's trio and asyncio tasks are at most the floor above what they were idle before it (the
same life). ``resources: flat`` when nothing grew.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Final

import httpx

FIGURES: Final = ("rss_mb", "fds", "threads", "trio_tasks", "asyncio_tasks")
UNITS: Final = {"rss_mb": "MB", "fds": "fds", "threads": "threads", "trio_tasks": "tasks", "asyncio_tasks": "tasks"}
#: The least rise over a life that counts as growth, per figure: a fixed amount, or a share of the level.
FLOORS: Final = {"rss_mb": (4.0, 0.03), "fds": (4.0, 0.0), "threads": (2.0, 0.0), "trio_tasks": (4.0, 0.0),
                 "asyncio_tasks": (4.0, 0.0)}  # fmt: skip
#: Times the residual standard deviation a rise must exceed.
NOISE_FACTOR: Final = 3.0
#: A trend over a shorter life is shown, never judged: minutes of samples cannot tell growth from warming up.
MIN_SPAN_S: Final = 240.0
#: The chaos program itself: sampled and shown, never judged (it keeps every request's verdict by design).
HARNESS: Final = "bench.chaos (this program)"
#: Task figures compared idle before and idle after the load.
IDLE_FIGURES: Final = ("trio_tasks", "asyncio_tasks")
_TASK_GAUGE: Final = re.compile(r"^openengine_sidecar_(trio|asyncio)_tasks(?:\{[^}]*\})? (\S+)$", re.M)
_PAGE: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading of one process; ``t`` on the run's clock, ``phase`` "load", "idle-start" or "idle-end"."""

    t: float
    life: int
    phase: str
    values: tuple[float | None, ...]  # in the order of FIGURES

    def value(self, figure: str) -> float | None:
        return self.values[FIGURES.index(figure)]


@dataclass
class Watched:
    """A long-lived process to sample: ``current()`` gives its life number, pid and the life's start on the run's
    clock (None while it is down); ``metrics_url`` is a sidecar's ``/metrics``."""

    name: str
    kind: str
    current: Callable[[], tuple[int, int, float] | None]
    metrics_url: str | None = None
    samples: list[Sample] = field(default_factory=list)
    life_starts: dict[int, float] = field(default_factory=dict)


def read_proc(pid: int) -> tuple[float, int, int] | None:
    """``(RSS in MB, open fds, threads)`` of ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            rss_pages = int(statm.read().split()[1])
        with open(f"/proc/{pid}/status") as status:
            threads = next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError, StopIteration, IndexError):
        return None
    return rss_pages * _PAGE / 2**20, fds, threads


def task_gauges(page: str) -> tuple[float | None, float | None]:
    """``(trio, asyncio)`` task counts from a sidecar's metrics page (None when absent)."""
    found: dict[str, float] = {}
    for match in _TASK_GAUGE.finditer(page):
        found[match.group(1)] = found.get(match.group(1), 0.0) + float(match.group(2))
    return found.get("trio"), found.get("asyncio")


async def sample(watched: Sequence[Watched], t: float, phase: str, http: httpx.AsyncClient) -> None:
    """One reading of every process that is up (bounded: each scrape by the client's timeout)."""
    for process in watched:
        now = process.current()
        if now is None:
            continue
        life, pid, started = now
        proc = read_proc(pid)
        if proc is None:
            continue
        process.life_starts.setdefault(life, started)
        trio_tasks = asyncio_tasks = None
        if process.metrics_url is not None:
            with contextlib.suppress(httpx.HTTPError):
                trio_tasks, asyncio_tasks = task_gauges((await http.get(process.metrics_url)).text)
        process.samples.append(Sample(t, life, phase, (*proc, trio_tasks, asyncio_tasks)))


# ------------------------------------------------------------------------------------------------------ analysis


@dataclass(frozen=True)
class Trend:
    """One figure of one process over the load."""

    level: float | None  # median after warm-up
    slope_h: float | None  # per hour, within lives (and within the parts of a life around its one step)
    noise: float | None  # residual standard deviation around the trend
    span_s: float  # the longest life's measured span
    lives: int  # lives that carried a slope
    rise: float | None  # slope over the longest span
    threshold: float | None
    grew: bool
    #: One-off level shifts, at most one per life: ``(life, t, size)``.
    steps: tuple[tuple[int, float, float], ...] = ()


#: A jump between two samples is a level shift when it exceeds the figure's floor and this many times the median
#: jump of its life.
STEP_FACTOR: Final = 8.0


def _split(points: list[tuple[float, float]], floor: float) -> tuple[list[list[tuple[float, float]]], float | None]:
    """A life's points as one segment, or two around its largest jump when that jump is a level shift (a runtime
    that allocates a buffer once and keeps it; every Dynamo process, sidecar or frontend, does so once, by ~53 MB).
    A second shift stays in a segment, where the slope sees it: growth in steps is growth."""
    if len(points) < 6:
        return [points], None
    jumps = [b[1] - a[1] for a, b in itertools.pairwise(points)]
    at = max(range(len(jumps)), key=lambda k: abs(jumps[k]))
    typical = statistics.median(abs(j) for k, j in enumerate(jumps) if k != at)
    if abs(jumps[at]) <= max(floor, STEP_FACTOR * typical):
        return [points], None
    return [points[: at + 1], points[at + 1 :]], jumps[at]


def fit(samples: Sequence[Sample], figure: str, life_starts: dict[int, float], warmup_s: float) -> Trend:
    """The within-life trend of ``figure`` over the load's samples after each life's warm-up."""
    lives: dict[int, list[tuple[float, float]]] = {}
    for s in samples:
        value = s.value(figure)
        if s.phase != "load" or value is None:
            continue
        if s.t < max(life_starts.get(s.life, 0.0), 0.0) + warmup_s:
            continue
        lives.setdefault(s.life, []).append((s.t, value))
    lives = {life: points for life, points in lives.items() if len(points) >= 3}
    if not lives:
        return Trend(None, None, None, 0.0, 0, None, None, False)
    values = sorted(v for points in lives.values() for _, v in points)
    level = values[len(values) // 2]
    fixed, share = FLOORS[figure]
    floor = max(fixed, share * level)
    groups: list[list[tuple[float, float]]] = []
    steps: list[tuple[int, float, float]] = []
    for life, points in lives.items():
        parts, step = _split(points, floor)
        groups += [part for part in parts if len(part) >= 2]
        if step is not None:
            steps.append((life, parts[1][0][0], step))
    sxx = sxy = residual = 0.0
    for points in groups:
        mt = sum(t for t, _ in points) / len(points)
        mv = sum(v for _, v in points) / len(points)
        sxx += sum((t - mt) ** 2 for t, _ in points)
        sxy += sum((t - mt) * (v - mv) for t, v in points)
    slope = sxy / sxx if sxx > 0 else 0.0
    for points in groups:
        mt = sum(t for t, _ in points) / len(points)
        mv = sum(v for _, v in points) / len(points)
        residual += sum((v - mv - slope * (t - mt)) ** 2 for t, v in points)
    freedom = sum(len(points) for points in groups) - len(groups) - 1
    noise = math.sqrt(residual / freedom) if freedom > 0 else 0.0
    span = max(points[-1][0] - points[0][0] for points in lives.values())
    rise = slope * span
    threshold = max(floor, NOISE_FACTOR * noise)
    grew = rise > threshold and span >= MIN_SPAN_S
    return Trend(level, slope * 3600, noise, span, len(lives), rise, threshold, grew, tuple(steps))


@dataclass(frozen=True)
class Idle:
    """A task figure idle before and idle after the load (the same life), and whether it came back."""

    before: float
    after: float
    grew: bool


def idle(process: Watched, figure: str) -> Idle | None:
    before = [s for s in process.samples if s.phase == "idle-start" and s.value(figure) is not None]
    after = [s for s in process.samples if s.phase == "idle-end" and s.value(figure) is not None]
    if not before or not after or before[-1].life != after[-1].life:
        return None
    b, a = before[-1].value(figure), after[-1].value(figure)
    assert a is not None
    assert b is not None
    return Idle(b, a, a - b > FLOORS[figure][0])


@dataclass
class Resources:
    """Every watched process's samples and trends, the verdict line and the table."""

    processes: list[Watched]
    interval_s: float
    warmup_s: float
    trends: dict[str, dict[str, Trend]] = field(default_factory=dict)
    idles: dict[str, dict[str, Idle]] = field(default_factory=dict)

    def analyse(self) -> None:
        for process in self.processes:
            self.trends[process.name] = {
                figure: fit(process.samples, figure, process.life_starts, self.warmup_s) for figure in FIGURES
            }
            found = {figure: idle(process, figure) for figure in IDLE_FIGURES}
            self.idles[process.name] = {k: v for k, v in found.items() if v is not None}

    def grown(self) -> list[str]:
        """What grew, one phrase each (empty: flat)."""
        out = []
        for name, trends in self.trends.items():
            if name == HARNESS:
                continue
            for figure, trend in trends.items():
                if trend.grew:
                    assert trend.slope_h is not None
                    assert trend.rise is not None
                    assert trend.threshold is not None
                    out.append(
                        f"{name} {figure} {trend.slope_h:+.1f} {UNITS[figure]}/h (rise {trend.rise:.1f} over "
                        f"{trend.span_s / 60:.0f} min > {trend.threshold:.1f})"
                    )
            for figure, seen in self.idles.get(name, {}).items():
                if seen.grew:
                    out.append(f"{name} {figure} idle {seen.before:.0f} before the load, {seen.after:.0f} after")
        return out

    def unmeasured(self) -> list[str]:
        """Processes with no life long enough to judge a trend (``MIN_SPAN_S`` after its warm-up)."""
        return [n for n, trends in self.trends.items() if n != HARNESS and trends["rss_mb"].span_s < MIN_SPAN_S]

    @property
    def flat(self) -> bool:
        return not self.grown()

    def verdict(self) -> str:
        grown = self.grown()
        judged = len([n for n in self.trends if n != HARNESS])
        measured = judged - len(self.unmeasured())
        if grown:
            return "resources: GREW — " + "; ".join(grown)
        line = f"resources: flat ({measured} of {judged} processes measured"
        if not measured:
            line = f"resources: not judged (no life lasted {MIN_SPAN_S / 60:.0f} minutes after its warm-up"
        elif self.unmeasured():
            line += f"; no life long enough to judge: {', '.join(self.unmeasured())}"
        return line + ")"

    def table(self) -> list[str]:
        lines = [
            f"Resources: sampled every {self.interval_s:.0f} s; slopes per hour within each life after a "
            f"{self.warmup_s / 60:.0f}-minute warm-up (level ± noise, slope; ↑ grew). Idle tasks: before → after "
            "the load.",
            "",
            "| process | lives | longest span | RSS MB | open fds | threads | trio tasks | asyncio tasks "
            "| idle tasks |",
            "|---|---:|---:|---|---|---|---|---|---|",
        ]
        for process in self.processes:
            trends = self.trends[process.name]
            rss = trends["rss_mb"]
            cells = [_cell(trends[f], f) for f in FIGURES]
            idles = self.idles.get(process.name, {})
            idle_cell = " / ".join(f"{idles[f].before:.0f} → {idles[f].after:.0f}" for f in IDLE_FIGURES if f in idles)
            lines.append(
                f"| {process.name} | {len(process.life_starts)} | {rss.span_s / 60:.0f} min | "
                + " | ".join(cells)
                + f" | {idle_cell or '—'} |"
            )
        return [*lines, *self._shifts()]

    def _shifts(self) -> list[str]:
        """The level shifts the fit set aside (one per life), summed up per figure."""
        out = []
        for figure in FIGURES:
            sizes: list[float] = []
            where: dict[str, int] = {}
            for name, trends in self.trends.items():
                for _, _, size in trends[figure].steps:
                    sizes.append(size)
                    where[name] = where.get(name, 0) + 1
            if sizes:
                names = ", ".join(f"{name} ×{n}" if n > 1 else name for name, n in where.items())
                out.append(
                    f"- {figure}: {len(sizes)} shift(s) of {min(sizes):+.0f} to {max(sizes):+.0f} {UNITS[figure]} "
                    f"({names})"
                )
        if not out:
            return []
        return ["", "Level shifts set aside (at most one per life; a second one stays in the fit and counts):", *out]

    def to_json(self) -> dict[str, object]:
        return {
            "interval_s": self.interval_s,
            "warmup_s": self.warmup_s,
            "verdict": self.verdict(),
            "trends": {name: {f: asdict(t) for f, t in trends.items()} for name, trends in self.trends.items()},
            "samples": {p.name: [(s.t, s.life, s.phase, s.values) for s in p.samples] for p in self.processes},
        }


def _cell(trend: Trend, figure: str) -> str:
    if trend.level is None:
        return "—"
    digits = 1 if figure == "rss_mb" else 0
    text = f"{trend.level:.{digits}f}"
    if trend.slope_h is None or trend.noise is None:
        return text
    text += f" ± {trend.noise:.1f}, {trend.slope_h:+.1f}/h"
    return text + (" ↑" if trend.grew else "")


def schedule(load_s: float) -> tuple[float, float]:
    """``(interval, warm-up)`` in seconds for a load of ``load_s``: about 40 samples a run, every 5 to 30 s; a
    warm-up of a sixth of the load, 1 to 10 minutes."""
    return min(30.0, max(5.0, load_s / 40)), min(600.0, max(60.0, load_s / 6))


__all__ = [
    "FIGURES",
    "FLOORS",
    "HARNESS",
    "IDLE_FIGURES",
    "MIN_SPAN_S",
    "Idle",
    "Resources",
    "Sample",
    "Trend",
    "Watched",
    "fit",
    "read_proc",
    "sample",
    "schedule",
    "task_gauges",
]
