"""The load client of ``bench.e2e``: streaming chat completions through the real frontend with the OpenAI client.

Run by the bench as a child process (its CPU is its own): ``python -m bench._e2e_load CONFIG.json``; prints one JSON
line with the result. Closed loop: ``concurrency`` slots each send the next request as soon as theirs ends, until
``requests`` were sent; every request is bounded by ``timeout_s`` and the whole run by ``deadline_s``.

Each request is ``stream=True`` with ``stream_options.include_usage``, ``max_tokens``, ``temperature``, ``seed`` and
``ignore_eos: true`` (extra body), read with the OpenAI client's raw streaming response (``iter_lines``: the SDK's
per-event pydantic models would make the client the bottleneck on two cores). Every response is checked: HTTP 200,
no error event, ``[DONE]``, ``finish_reason`` ``length``, ``usage.completion_tokens`` = ``max_tokens``, and the text
equal to the engine's tokens decoded — so no request is lost, cut or mis-ordered. Each text-carrying SSE event is
stamped on arrival (``time.monotonic()``): tokens per event and the gaps between events (``gap_summary``) come from
those stamps.

``hold_s`` > 0 is the memory mode: open every request at once, wait until each has received a token, hold them for
``hold_s`` seconds (the bench reads the sidecar's RSS meanwhile), then close them all (the sidecar aborts them).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import uvloop
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from bench._e2e_common import (
    PROMPT,
    TEMPERATURE,
    RequestTiming,
    Table,
    gap_summary,
    jsonable,
    latency_summary,
    own_cpu_s,
    seed_of,
    window_throughput,
)


@dataclass(frozen=True, slots=True)
class LoadConfig:
    url: str
    model: str
    concurrency: int
    requests: int
    max_tokens: int
    seeds: list[int]
    table: str
    timeout_s: float
    deadline_s: float
    hold_s: float = 0.0
    annotations: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Outcome:
    timing: RequestTiming | None = None
    error: str | None = None
    events: list[tuple[float, int]] = field(default_factory=list)


async def one_request(client: AsyncOpenAI, cfg: LoadConfig, table: Table, number: int, hold: Holder | None) -> Outcome:
    seed = seed_of(number, cfg.seeds)
    expected = table.streams[seed]
    offsets = expected.offsets
    start = time.monotonic()
    first = last = math.nan
    text: list[str] = []
    chars = 0
    delivered = 0
    count_events = 0
    events: list[tuple[float, int]] = []
    finish: str | None = None
    usage: dict[str, Any] | None = None
    done = False
    async with client.chat.completions.with_streaming_response.create(
        model=cfg.model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=cfg.max_tokens,
        temperature=TEMPERATURE,
        seed=seed,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, **({"nvext": {"annotations": cfg.annotations}} if cfg.annotations else {})},
    ) as response:
        if response.status_code != 200:
            return Outcome(error=f"HTTP {response.status_code}: {(await response.read())[:200]!r}")
        async for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                return Outcome(error=f"error event: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    now = time.monotonic()
                    if chars == 0:
                        first = now
                        if hold is not None:
                            hold.arrived()
                    last = now
                    chars += len(content)
                    text.append(content)
                    count_events += 1
                    # Tokens delivered so far, from the engine's text offsets (the frontend detokenizes).
                    count = bisect.bisect_right(offsets, chars)
                    events.append((now, count - delivered))
                    delivered = count
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
            if hold is not None and hold.released.is_set():
                break
    end = time.monotonic()
    if hold is not None:
        return Outcome(RequestTiming(start, first, last, end, delivered, count_events), None, events)
    got = "".join(text)
    completion = (usage or {}).get("completion_tokens")
    if not done:
        return Outcome(error="stream ended without [DONE]")
    if finish != "length":
        return Outcome(error=f"finish_reason {finish!r}")
    if completion != cfg.max_tokens:
        return Outcome(error=f"usage.completion_tokens {completion} != {cfg.max_tokens}")
    want = expected.text[: offsets[cfg.max_tokens - 1]]
    if got != want:
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        return Outcome(
            error=f"text differs from the engine's at char {at}: {got[at : at + 30]!r} vs {want[at : at + 30]!r}"
        )
    return Outcome(RequestTiming(start, first, last, end, cfg.max_tokens, count_events), None, events)


class Holder:
    """Memory mode: counts requests that received a token; ``released`` tells them to close."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.count = 0
        self.all_arrived = asyncio.Event()
        self.released = asyncio.Event()

    def arrived(self) -> None:
        self.count += 1
        if self.count >= self.total:
            self.all_arrived.set()


async def run(cfg: LoadConfig) -> dict[str, Any]:
    table = Table.load(Path(cfg.table))
    if table.max_tokens < cfg.max_tokens and cfg.hold_s <= 0:
        raise SystemExit(f"table has {table.max_tokens} tokens per stream, {cfg.max_tokens} asked")
    # A connection per request: on a reused connection the frontend's stream stalls ~40 ms now and then (a
    # Nagle/delayed-ACK pattern; curl, with a connection per call, never shows it). See docs/performance.md.
    limits = httpx2.Limits(max_connections=cfg.concurrency + 8, max_keepalive_connections=0)
    transport = httpx2.AsyncHTTPTransport(limits=limits, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    timeout = httpx2.Timeout(cfg.timeout_s, connect=10.0)
    client = AsyncOpenAI(
        api_key="bench",
        base_url=f"{cfg.url}/v1",
        max_retries=0,
        timeout=timeout,
        http_client=DefaultAsyncHttpxClient(transport=transport, timeout=timeout),
    )
    outcomes: list[Outcome] = []
    next_number = 0
    hold = Holder(cfg.requests) if cfg.hold_s > 0 else None

    async def slot() -> None:
        nonlocal next_number
        while next_number < cfg.requests:
            number = next_number
            next_number += 1
            try:
                async with asyncio.timeout(cfg.timeout_s):
                    outcomes.append(await one_request(client, cfg, table, number, hold))
            except Exception as exc:  # every failure is counted, none ends the run
                outcomes.append(Outcome(error=f"{type(exc).__name__}: {exc}"))
                if hold is not None:
                    hold.arrived()

    cpu0 = own_cpu_s()
    started = time.monotonic()
    held: dict[str, float] = {}
    async with client:
        tasks = [asyncio.ensure_future(slot()) for _ in range(cfg.concurrency)]
        try:
            async with asyncio.timeout(cfg.deadline_s):
                if hold is not None:
                    await hold.all_arrived.wait()
                    held["all_arrived"] = time.monotonic()
                    print(json.dumps({"held": held["all_arrived"]}), file=sys.stderr, flush=True)
                    await asyncio.sleep(cfg.hold_s)
                    held["released"] = time.monotonic()
                    hold.released.set()
                await asyncio.gather(*tasks)
        except TimeoutError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = time.monotonic() - started
    cpu = own_cpu_s() - cpu0
    timings = [o.timing for o in outcomes if o.timing is not None]
    events = [e for o in outcomes for e in o.events]
    errors = [o.error for o in outcomes if o.error is not None]
    rate, lo, hi = window_throughput(timings, events)
    result: dict[str, Any] = {
        "requests": cfg.requests,
        "completed": len(timings),
        "failed": len(errors),
        "lost": cfg.requests - len(outcomes),
        "errors": errors[:5],
        "tokens": sum(t.tokens for t in timings),
        "elapsed_s": elapsed,
        "tokens_per_s": rate,
        "window_s": hi - lo,
        "client_cpu_s": cpu,
        "t_start": started,
        **latency_summary(timings),
        **gap_summary([[when for when, _ in o.events] for o in outcomes if o.timing is not None]),
    }
    if hold is not None:
        result.update(held)
        starts = sorted(t.first for t in timings if not math.isnan(t.first))
        result["peak_in_flight"] = _peak_overlap(timings)
        result["first_tokens"] = len(starts)
    return result


def _peak_overlap(timings: list[RequestTiming]) -> int:
    """Most requests streaming at once (from first token to end)."""
    edges = sorted([(t.first, 1) for t in timings if not math.isnan(t.first)] + [(t.end, -1) for t in timings])
    peak = current = 0
    for _, step in edges:
        current += step
        peak = max(peak, current)
    return peak


def main() -> int:
    cfg = LoadConfig(**json.loads(Path(sys.argv[1]).read_text()))
    result = uvloop.run(run(cfg))
    print(json.dumps(jsonable(asdict(cfg) | result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
