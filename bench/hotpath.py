"""Micro-benchmarks of the per-message costs that docs/performance.md names, each as A/B in one process.

    python -m bench.hotpath            # ~30 s
    python -m bench.hotpath --quick    # ~5 s

* **h2 receive**: ``H2Connection.receive_data`` of one DATA frame carrying a ``GenerateResponse``, with hyperframe's
  own ``Frame.__repr__`` and with the HTTP/2 layer's cheap one (``sidecar.http2.apply_tunings``).
* **wakeups, edge loop → trio**: bursts of 64 callables posted from the edge thread to trio (one decode step of 64
  streams), each by its own ``TrioToken.run_sync_soon`` (as before) or through ``Link.to_trio`` (one wakeup per
  burst); process CPU (all threads) per callable, and wakeups per burst.
* **wakeups, trio → edge loop**: the same with ``loop.call_soon_threadsafe`` each (what ``Link.to_loop`` does)
  against the same queue-and-drain scheme aimed at the loop (which uvloop makes a loss: it coalesces wakeups itself).

Figures are the best of ``--rounds`` (A and B alternate within each round). They are CPU costs in isolation; what
they add up to on the request path is ``python -m bench.datapath``.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import h2.connection
import hyperframe.frame
import trio

from openengine.v1 import generation_pb2
from sidecar.testing.h2pair import connected_pair

BURST: Final = 64
# Between two bursts (a decode step), long enough for the other side to drain and go idle (libuv timers: 1 ms).
_PAUSE_S: Final = 0.002


def cpu_s() -> float:
    """CPU time of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ------------------------------------------------------------------------------------------------ h2 receive


def _frames(count: int) -> tuple[h2.connection.H2Connection, list[bytes]]:
    client, server, stream_id = connected_pair(open_window=True)
    response = generation_pb2.GenerateResponse(request_id="0b6a4c0e-6d1f-4bde-9c43-5f7c54a3e8d2")
    response.token.output_index = 0
    response.token.tokens.add(token_id=1234, token=" the")
    body = response.SerializeToString()
    payload = b"\x00" + struct.pack(">I", len(body)) + body
    frames = []
    for _ in range(count):
        server.send_data(stream_id, payload)
        frames.append(server.data_to_send())
    return client, frames


def h2_receive_us(count: int, frame_repr: Callable[[Any], str]) -> float:
    client, frames = _frames(count)
    previous = hyperframe.frame.Frame.__repr__
    hyperframe.frame.Frame.__repr__ = frame_repr  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        for data in frames:
            client.receive_data(data)
        return 1e6 * (time.perf_counter() - start) / count
    finally:
        hyperframe.frame.Frame.__repr__ = previous  # type: ignore[method-assign]


# ------------------------------------------------------------------------------------------------ wakeups


class _Counting:
    def __init__(self, target: Any, method: str) -> None:
        self.target = target
        self.method = method
        self.posts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)


class CountingToken(_Counting):
    def run_sync_soon(self, fn: Callable[..., object], *args: object) -> None:
        self.posts += 1
        self.target.run_sync_soon(fn, *args)


class CountingLoop(_Counting):
    def call_soon_threadsafe(self, fn: Callable[..., object], *args: object) -> Any:
        self.posts += 1
        return self.target.call_soon_threadsafe(fn, *args)


async def to_trio_us(edge: Any, bursts: int, batched: bool) -> tuple[float, float]:
    """CPU µs per callable posted from the edge thread into trio, and wakeups per burst."""
    from sidecar.edge._link import Link, to_trio

    token = CountingToken(trio.lowlevel.current_trio_token(), "run_sync_soon")
    link = Link(edge.loop, token)  # type: ignore[arg-type]
    done = trio.Event()
    seen = 0

    def took() -> None:
        nonlocal seen
        seen += 1
        if seen == bursts * BURST:
            done.set()

    async def post_bursts() -> None:
        for _ in range(bursts):
            for _ in range(BURST):
                if batched:
                    link.to_trio(took)
                else:
                    to_trio(token, took)  # type: ignore[arg-type]
            await asyncio.sleep(_PAUSE_S)  # the next decode step: trio goes idle in between

    start = cpu_s()
    await edge.run(post_bursts)
    await done.wait()
    return 1e6 * (cpu_s() - start) / (bursts * BURST), token.posts / bursts


class _QueuedPoster:
    """What ``Link.to_trio`` does, aimed at the loop instead: the variant ``Link.to_loop`` does not use."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.jobs: deque[tuple[Callable[..., object], tuple[object, ...]]] = deque()
        self.posted = False

    def post(self, fn: Callable[..., object], *args: object) -> None:
        self.jobs.append((fn, args))
        if not self.posted:
            self.posted = True
            self.loop.call_soon_threadsafe(self.drain)

    def drain(self) -> None:
        self.posted = False
        jobs = self.jobs
        for _ in range(len(jobs)):
            fn, args = jobs.popleft()
            fn(*args)


async def to_loop_us(edge: Any, bursts: int, batched: bool) -> tuple[float, float]:
    """CPU µs per callable posted from trio onto the edge loop, and wakeups per burst."""
    loop = CountingLoop(edge.loop, "call_soon_threadsafe")
    queued = _QueuedPoster(loop)
    seen = 0
    lock = threading.Lock()

    def took() -> None:
        nonlocal seen
        with lock:
            seen += 1

    start = cpu_s()
    for _ in range(bursts):
        for _ in range(BURST):
            if batched:
                queued.post(took)
            else:
                loop.call_soon_threadsafe(took)  # what Link.to_loop does
        await trio.sleep(_PAUSE_S)  # the edge loop goes idle in between
    while seen < bursts * BURST:  # noqa: ASYNC110 (`seen` is written by the edge thread)
        await trio.sleep(0.001)
    return 1e6 * (cpu_s() - start) / (bursts * BURST), loop.posts / bursts


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hotpath", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations and rounds")
    parser.add_argument("--rounds", type=int, default=5, help="A/B rounds; the best of each is reported [%(default)s]")
    args = parser.parse_args(argv)
    rounds, scale = (2, 0.2) if args.quick else (args.rounds, 1.0)
    frames, bursts = int(20000 * scale), int(200 * scale)

    from sidecar.edge import open_edge
    from sidecar.http2 import HYPERFRAME_REPR, cheap_frame_repr

    h2_a = min(h2_receive_us(frames, HYPERFRAME_REPR) for _ in range(rounds))
    h2_b = min(h2_receive_us(frames, cheap_frame_repr) for _ in range(rounds))
    print(f"h2 receive of one DATA frame:            {h2_a:6.2f} µs with hyperframe's repr, {h2_b:6.2f} µs tuned "
          f"({h2_b / h2_a - 1:+.0%})")  # fmt: skip

    async def bridge() -> None:
        async with open_edge(name="bench-hotpath") as edge:
            results: dict[str, list[tuple[float, float]]] = {}
            for _ in range(rounds):
                for name, measure in (
                    ("to_trio per item", to_trio_us(edge, bursts, batched=False)),
                    ("to_trio batched", to_trio_us(edge, bursts, batched=True)),
                    ("to_loop per item", to_loop_us(edge, bursts, batched=False)),
                    ("to_loop batched", to_loop_us(edge, bursts, batched=True)),
                ):
                    results.setdefault(name, []).append(await measure)
            for direction, what in (("to_trio", "run_sync_soon"), ("to_loop", "call_soon_threadsafe")):
                (a_us, a_posts), (b_us, b_posts) = (
                    min(results[f"{direction} {k}"], key=lambda r: r[0]) for k in ("per item", "batched")
                )
                print(f"{direction:<7} {BURST}-item bursts, CPU per item:  {a_us:6.2f} µs with a {what} each "
                      f"({a_posts:.0f} per burst), {b_us:6.2f} µs batched ({b_posts:.1f} per burst) "
                      f"({b_us / a_us - 1:+.0%})")  # fmt: skip

    trio.run(bridge)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
