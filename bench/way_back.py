"""How soon a worker serves again after its engine restarts: ours and Dynamo's own sidecar, side by side in one run.

    python -m bench.way_back                       # away 1, 3 and 7 s, both sidecars, 3 rounds each (~3 min)
    python -m bench.way_back --away 7 --rounds 1 --sidecar ours

Each sidecar gets a fresh loopback stack (the real frontend, ``openengine-mock --profile trtllm``, the sidecar). Per
round: 8 streams of 60 tokens run, the engine is SIGKILLed, stays away for ``--away`` seconds, and starts again on the
same port. From then on this program connects to the engine's port every 2 ms (the moment the engine *accepts
connections*) and polls the frontend every ``--poll-ms`` (default 50 ms, as issue 38 measured): ``GET /v1/models``
listing the model and a one-token completion answered 200. The figure is the time from the first accepted connection
to the first such answer: what a client sees, discovery and routing included.

Our worker also logs its own figure (``engine back: serving again … after it accepted a connection``, with the
phases); the report shows it beside the client's. Nothing here is a pass/fail bound: ``tests/faults/
test_way_back.py`` holds the bound; this program prints the figures.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Final

import httpx
import trio

from tests.helpers.processes import DynamoEnv, Frontend, dynamo_env, free_port, start_frontend
from tests.helpers.stack import MODEL, Engine, Worker, start_dynamo_sidecar, start_engine, start_sidecar, wait_routable
from tests.helpers.way_back import OWN_FIGURE, first_accept, serving_after

STREAMS: Final = 8
TOKENS: Final = 60
#: The mock as the issue ran it: TensorRT-LLM's wire, 20 ms a token (8 × 60 tokens last 1.2 s).
ENGINE_ARGS: Final = ("--profile", "trtllm", "--decode-ms-per-token", "20")


@dataclass
class Round:
    away_s: float
    seconds: float | None  # accepted connection -> the frontend serves; None: not within the bound
    own_ms: float | None = None  # the worker's own figure (ours only)
    stream_errors: int = 0


@dataclass
class Run:
    sidecar: str
    rounds: list[Round] = field(default_factory=list)


async def one_stream(http: httpx.AsyncClient, url: str, i: int, errors: list[int]) -> None:
    body = {"model": MODEL, "prompt": f"Story {i}.", "max_tokens": TOKENS, "stream": True, "ignore_eos": True}
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            text = (await response.aread()).decode(errors="replace")
        if response.status_code != 200 or '"error"' in text:
            errors.append(i)
    except httpx.HTTPError:
        errors.append(i)


@asynccontextmanager
async def sidecar(kind: str, denv: DynamoEnv, address: str) -> AsyncIterator[Worker]:
    if kind == "ours":
        async with start_sidecar(denv, address, ready=None) as worker:
            yield worker
    else:
        async with start_dynamo_sidecar(denv, address) as worker:
            yield worker


async def measure(kind: str, aways: list[float], rounds: int, poll_s: float, bound_s: float) -> Run:
    run = Run(kind)
    with dynamo_env() as denv:
        async with start_frontend(denv) as frontend:
            port = free_port()
            address = f"127.0.0.1:{port}"
            async with (
                start_engine(denv, *ENGINE_ARGS, port=port, name="engine") as engine,
                sidecar(kind, denv, address) as worker,
                httpx.AsyncClient(timeout=10) as http,
            ):
                await kill_under_streams(http, frontend.url, engine, [])
                for away in [a for a in aways for _ in range(rounds)]:
                    run.rounds.append(await one_round(denv, frontend, worker, http, port, away, poll_s, bound_s))
                    print(f"{kind}: away {away:g} s -> {_seconds(run.rounds[-1].seconds)}", file=sys.stderr)
    return run


async def kill_under_streams(http: httpx.AsyncClient, url: str, engine: Engine, errors: list[int]) -> None:
    """8 streams of 60 tokens, and the engine SIGKILLed under them (the outage of the next round begins)."""
    await wait_routable(url, workers=1, timeout=60)
    async with trio.open_nursery() as streams:
        for i in range(STREAMS):
            streams.start_soon(partial(one_stream, http, url, i, errors))
        await trio.sleep(0.3)  # ~15 tokens into each stream (20 ms a token): the kill lands mid-stream
        engine.process.signal(signal.SIGKILL)


async def one_round(
    denv: DynamoEnv,
    frontend: Frontend,
    worker: Worker,
    http: httpx.AsyncClient,
    port: int,
    away: float,
    poll_s: float,
    bound_s: float,
) -> Round:
    """One outage: the engine was just killed; it comes back after ``away`` s, and is killed again mid-stream."""
    killed_at = trio.current_time()
    errors: list[int] = []
    mark = len(worker.process.log())
    await trio.sleep_until(killed_at + away)  # the outage itself: the engine stays away this long
    async with trio.open_nursery() as nursery:
        listened: list[float] = []
        heard = trio.Event()

        async def probe() -> None:
            listened.append(await first_accept(port))
            heard.set()

        nursery.start_soon(probe)
        async with start_engine(denv, *ENGINE_ARGS, port=port, name="engine-again") as engine:
            with trio.move_on_after(bound_s + 5):
                await heard.wait()
            seconds = None
            if listened:
                seconds = await serving_after(http, frontend.url, listened[0], poll_s=poll_s, bound_s=bound_s)
            await trio.sleep(0.1)  # not a synchronisation: the worker's own line follows its serving at once
            own = OWN_FIGURE.findall(worker.process.log()[mark:])
            # Streams against the engine that is back, then it is killed: the next round's outage begins.
            await kill_under_streams(http, frontend.url, engine, errors)
        nursery.cancel_scope.cancel()
    return Round(away, seconds, float(own[-1]) if own else None, len(errors))


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f} s"


def report(runs: list[Run]) -> str:
    lines = [
        "| sidecar | away | rounds | accepted → frontend serves (min / median / max) | worker's own figure (median) |",
        "|---|---:|---:|---|---|",
    ]
    for run in runs:
        for away in sorted({r.away_s for r in run.rounds}):
            rs = [r for r in run.rounds if r.away_s == away]
            got = [r.seconds for r in rs if r.seconds is not None]
            figure = "never" if not got else f"{min(got):.3f} / {statistics.median(got):.3f} / {max(got):.3f} s"
            if len(got) < len(rs):
                figure += f" ({len(rs) - len(got)} not within the bound)"
            own = [r.own_ms for r in rs if r.own_ms is not None]
            own_text = f"{statistics.median(own):.0f} ms" if own else "—"
            lines.append(f"| {run.sidecar} | {away:g} s | {len(rs)} | {figure} | {own_text} |")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> None:
    runs = []
    for kind in args.sidecar:
        with trio.fail_after(60 + len(args.away) * args.rounds * (max(args.away) + 30)):
            runs.append(await measure(kind, args.away, args.rounds, args.poll_ms / 1000, args.bound))
    print(report(runs))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.way_back", description=__doc__.split("\n")[0])
    parser.add_argument("--away", type=float, nargs="+", default=[1.0, 3.0, 7.0], help="outage lengths, seconds")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per outage length")
    parser.add_argument("--sidecar", nargs="+", choices=["ours", "dynamo"], default=["ours", "dynamo"])
    parser.add_argument("--poll-ms", type=float, default=50.0, help="frontend poll interval")
    parser.add_argument("--bound", type=float, default=30.0, help="give up on a round after this many seconds")
    trio.run(main_async, parser.parse_args(argv))


if __name__ == "__main__":
    main()
