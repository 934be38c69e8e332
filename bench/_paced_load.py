"""The load client of ``bench.paced``: streaming completions through the real frontend, every SSE event timed.

    python -m bench._paced_load '{"url": ..., "model": ..., "concurrency": 64, "requests": 192, "max_tokens": 200}'

Closed loop: ``concurrency`` slots each send the next request when theirs ends, until ``requests`` were sent (a new
connection per request: the frontend stalls reused HTTP/1.1 connections now and then, docs/performance.md). Each
request is ``/v1/completions`` with ``stream``, ``ignore_eos``, ``max_tokens`` and usage. Per request: the arrival time
of every SSE event carrying text (what a user sees), and the tokens its usage reports. Prints one JSON line: tokens,
events, the gaps between a request's consecutive text events (p50/p90/p99 over all of them), requests complete and
failed, and the wall time of the run.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from typing import Any

import httpx
import uvloop

PROMPT = "The river runs past the mill and the old bridge"


async def one(http: httpx.AsyncClient, cfg: dict[str, Any]) -> tuple[list[float], int, bool]:
    """Event times, completion tokens, and whether the answer was complete."""
    body = {
        "model": cfg["model"],
        "prompt": PROMPT,
        "max_tokens": cfg["max_tokens"],
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0,
    }
    times: list[float] = []
    tokens = 0
    finish = None
    async with http.stream("POST", f"{cfg['url']}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return times, 0, False
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("error"):
                return times, tokens, False
            for choice in event.get("choices") or ():
                if choice.get("text"):
                    times.append(time.perf_counter())
                finish = choice.get("finish_reason") or finish
            usage = event.get("usage")
            if usage:
                tokens = int(usage.get("completion_tokens") or 0)
    return times, tokens, finish == "length" and tokens == cfg["max_tokens"]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(cfg: dict[str, Any]) -> dict[str, Any]:
    limits = httpx.Limits(max_keepalive_connections=0, max_connections=cfg["concurrency"] + 8)
    gaps: list[float] = []
    worst: list[float] = []
    totals = {"tokens": 0, "events": 0, "complete": 0, "failed": 0}
    sent = 0
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=cfg.get("timeout_s", 120), limits=limits) as http:

        async def slot() -> None:
            nonlocal sent
            while sent < cfg["requests"]:
                sent += 1
                try:
                    times, tokens, complete = await one(http, cfg)
                except httpx.HTTPError:
                    totals["failed"] += 1
                    continue
                totals["failed" if not complete else "complete"] += 1
                totals["tokens"] += tokens
                totals["events"] += len(times)
                request_gaps = [b - a for a, b in itertools.pairwise(times)]
                gaps.extend(request_gaps)
                if request_gaps:
                    worst.append(max(request_gaps))

        await asyncio.gather(*(slot() for _ in range(cfg["concurrency"])))
    return {
        **totals,
        "seconds": time.perf_counter() - started,
        "gap_p50_ms": 1e3 * _percentile(gaps, 0.5),
        "gap_p90_ms": 1e3 * _percentile(gaps, 0.9),
        "gap_p99_ms": 1e3 * _percentile(gaps, 0.99),
        "worst_gap_p50_ms": 1e3 * _percentile(worst, 0.5),
    }


def main() -> int:
    cfg = json.loads(sys.argv[1])
    print(json.dumps(uvloop.run(run(cfg))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
