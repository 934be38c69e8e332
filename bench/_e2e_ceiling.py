"""Path C of ``bench.e2e``: our OpenEngine client (``open_edge`` + ``open_engine_client`` + ``generate``) reading
``openengine-mock`` directly, no Dynamo. Also how the bench learns what the engine produces for each seed.

Run by the bench as a child process: ``python -m bench._e2e_ceiling CONFIG.json``; prints one JSON line.

* ``mode: "table"`` — one request per seed, one at a time; the result holds every seed's token ids.
* ``mode: "load"`` — closed loop like the HTTP load client, each stream's token ids checked against the table and
  its end checked to be ``finished(LENGTH)`` with usage.
"""

from __future__ import annotations

import json
import math
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import trio

from bench._e2e_common import (
    ENGINE_MODEL,
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
from openengine.v1 import generation_pb2
from sidecar.edge import open_edge
from sidecar.engine import EngineClient, EngineClientConfig, open_engine_client, parse_endpoint


@dataclass(frozen=True, slots=True)
class CeilingConfig:
    target: str
    mode: str  # "table" or "load"
    prompt_ids: list[int]
    max_tokens: int
    seeds: list[int]
    concurrency: int = 1
    requests: int = 0
    table: str = ""
    timeout_s: float = 60.0
    deadline_s: float = 120.0


def make_request(prompt_ids: list[int], seed: int, max_tokens: int) -> generation_pb2.GenerateRequest:
    """What the sidecar sends for the bench's chat request (token ids in, seeded sampling, EOS ignored)."""
    request = generation_pb2.GenerateRequest(request_id=str(uuid.uuid4()), model=ENGINE_MODEL)
    request.token_ids.ids.extend(prompt_ids)
    request.sampling.temperature = TEMPERATURE
    request.sampling.seed = seed
    request.stopping.max_tokens = max_tokens
    request.stopping.ignore_eos = True
    return request


async def stream_once(
    client: EngineClient, cfg: CeilingConfig, seed: int
) -> tuple[list[int], RequestTiming, list[tuple[float, int]], str | None]:
    """One Generate stream: its token ids, timing, (time, tokens) per batch, and what was wrong with it."""
    ids: list[int] = []
    events: list[tuple[float, int]] = []
    start = time.monotonic()
    first = last = math.nan
    count_events = 0
    finish: int | None = None
    usage = False
    async with client.generate(make_request(cfg.prompt_ids, seed, cfg.max_tokens)) as batches:
        async for batch in batches:
            before = len(ids)
            for response in batch:
                kind = response.WhichOneof("event")
                if kind == "token":
                    ids.extend(info.token_id for info in response.token.tokens)
                elif kind == "finished":
                    finish = response.finished.reason
                    usage = response.HasField("usage")
            if len(ids) > before:
                now = time.monotonic()
                if before == 0:
                    first = now
                last = now
                count_events += 1
                events.append((now, len(ids) - before))
    timing = RequestTiming(start, first, last, time.monotonic(), len(ids), count_events)
    problem = None
    if finish != generation_pb2.FINISH_REASON_LENGTH or not usage:
        problem = f"ended with finish reason {finish} (usage: {usage})"
    elif len(ids) != cfg.max_tokens:
        problem = f"{len(ids)} tokens, {cfg.max_tokens} asked"
    return ids, timing, events, problem


async def run(cfg: CeilingConfig) -> dict[str, Any]:
    config = EngineClientConfig(parse_endpoint(cfg.target))
    async with open_edge() as edge, open_engine_client(edge, config) as client:
        await client.wait_connected(trio.current_time() + 30)
        if cfg.mode == "table":
            streams: dict[str, list[int]] = {}
            for seed in cfg.seeds:
                with trio.fail_after(cfg.timeout_s):
                    ids, _, _, problem = await stream_once(client, cfg, seed)
                if problem is not None:
                    raise SystemExit(f"seed {seed}: {problem}")
                streams[str(seed)] = ids
            return {"streams": streams}
        return await _load(client, cfg)


async def _load(client: EngineClient, cfg: CeilingConfig) -> dict[str, Any]:
    table = Table.load(Path(cfg.table))
    timings: list[RequestTiming] = []
    events: list[tuple[float, int]] = []
    per_request: list[list[float]] = []
    errors: list[str] = []
    next_number = 0

    async def slot() -> None:
        nonlocal next_number
        while next_number < cfg.requests:
            number = next_number
            next_number += 1
            seed = seed_of(number, cfg.seeds)
            try:
                with trio.fail_after(cfg.timeout_s):
                    ids, timing, got, problem = await stream_once(client, cfg, seed)
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            if problem is None and ids != table.streams[seed].ids[: cfg.max_tokens]:
                problem = "token ids differ from the table"
            if problem is not None:
                errors.append(problem)
                continue
            timings.append(timing)
            events.extend(got)
            per_request.append([when for when, _ in got])

    cpu0 = own_cpu_s()
    started = time.monotonic()
    with trio.move_on_after(cfg.deadline_s):
        async with trio.open_nursery() as nursery:
            for _ in range(cfg.concurrency):
                nursery.start_soon(slot)
    elapsed = time.monotonic() - started
    rate, lo, hi = window_throughput(timings, events)
    return {
        "requests": cfg.requests,
        "completed": len(timings),
        "failed": len(errors),
        "lost": cfg.requests - len(timings) - len(errors),
        "errors": errors[:5],
        "tokens": sum(t.tokens for t in timings),
        "elapsed_s": elapsed,
        "tokens_per_s": rate,
        "window_s": hi - lo,
        "client_cpu_s": own_cpu_s() - cpu0,
        "t_start": started,
        **latency_summary(timings),
        **gap_summary(per_request),
    }


def main() -> int:
    cfg = CeilingConfig(**json.loads(Path(sys.argv[1]).read_text()))
    result = trio.run(run, cfg)
    print(json.dumps(jsonable(asdict(cfg) | result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
