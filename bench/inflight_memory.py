"""Memory per in-flight request of the sidecar's own code, without Dynamo: in-process, against ``openengine-mock``.

    python -m bench.inflight_memory                  # 1,000 requests: RSS and tracemalloc, ~1 min
    python -m bench.inflight_memory --requests 200   # quicker
    python -m bench.inflight_memory --top 25         # also the 25 largest tracemalloc sites per request

The path of one request is the worker's, minus the Dynamo binding: an asyncio task on the edge loop iterates the
Dynamo handler (``sidecar.dynamo._handler.make_handler``, with a stand-in for Dynamo's ``Context``), which runs
``RequestServer.handle`` as a trio task; that task opens the request's data path on the edge loop
(``sidecar.datapath``), which starts the ``Generate`` stream (``EngineClient.start_generate``, received by
``sidecar.engine._direct`` on grpclib's connection) and maps it into the outbox there.
The mock decodes slowly (``--decode-ms-per-token``, 100 ms by
default), so every request stays open once it has its first token.

Two measurements, each in a fresh child process (tracemalloc itself costs memory and time):

* **RSS**: (RSS with N requests in flight, each past its first token − RSS after a warm-up of ``--warmup``
  requests) / N, as ``bench.e2e`` computes it;
* **tracemalloc**: the Python heap's growth per request over the same interval, and its largest sites.

The figures are the sidecar's own part of the e2e memory goal; ``bench.e2e``'s memory test adds Dynamo's binding.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any, Final

import trio

MiB: Final = 2**20
_PAGE: Final = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size of this process."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE


class _Context:
    """Stands in for Dynamo's request ``Context``: an id, no trace headers, and a stop future."""

    def __init__(self, request_id: str, stop: asyncio.Future[None]) -> None:
        self._id = request_id
        self._stop = stop

    def id(self) -> str:
        return self._id

    def trace_headers(self) -> dict[str, str] | None:
        return None

    async def async_killed_or_stopped(self) -> None:
        await self._stop


def child(args: argparse.Namespace) -> dict[str, Any]:
    """Hold ``args.requests`` requests in flight; report RSS and (with ``--trace``) the Python heap per request."""
    from sidecar.convert import Capabilities
    from sidecar.dynamo._handler import make_handler
    from sidecar.edge import open_edge
    from sidecar.engine import EngineClientConfig, open_engine_client, parse_endpoint
    from sidecar.http2 import apply_tunings
    from sidecar.requests import RequestServer, ServingContext

    # As the worker does at start-up (--fat-streams: without the lean-streams tuning, for --lean-ab).
    apply_tunings(lean_streams=not args.fat_streams)

    async def main() -> dict[str, Any]:
        async with open_edge() as edge:
            config = EngineClientConfig(parse_endpoint(args.target), connections=args.connections)
            async with open_engine_client(edge, config) as client, trio.open_nursery() as nursery:
                info = await client.wait_connected(trio.current_time() + 30)
                model = info.supported_models[0]
                caps = Capabilities.from_discovery(info, await client.get_model_info(model))
                server = RequestServer()
                server.attach(ServingContext(client, caps, model, caps.max_context_length or 4096, 5.0, 600.0))
                generate, _ = make_handler(edge, nursery, server.handle, push=False)
                loop = edge.loop
                first_tokens = 0
                counter = 0

                def body() -> dict[str, Any]:
                    return {
                        "token_ids": list(range(5, 5 + args.prompt_tokens)),
                        "stop_conditions": {"max_tokens": args.max_tokens, "ignore_eos": True},
                        "sampling_options": {"temperature": 0.0},
                    }

                async def one(stop: asyncio.Future[None]) -> None:
                    nonlocal first_tokens, counter
                    counter += 1
                    seen = False
                    async for _chunk in generate(body(), _Context(f"mem-{counter}", stop)):
                        if not seen:
                            seen = True
                            first_tokens += 1

                async def launch(count: int) -> list[asyncio.Future[None]]:
                    stops = [loop.create_future() for _ in range(count)]
                    for stop in stops:
                        loop.create_task(one(stop))
                    return stops

                async def release(stops: list[asyncio.Future[None]]) -> None:
                    for stop in stops:
                        if not stop.done():
                            stop.set_result(None)

                held: list[asyncio.Future[None]] = []

                async def hold(count: int) -> float:
                    """Start ``count`` requests; return once each has its first token (seconds that took)."""
                    nonlocal first_tokens
                    first_tokens = 0
                    held[:] = await edge.run(launch, count)
                    started = time.monotonic()
                    with trio.fail_after(args.timeout):
                        while first_tokens < count:  # noqa: ASYNC110 (counted on the edge thread)
                            await trio.sleep(0.05)
                    arrived = time.monotonic() - started
                    await trio.sleep(args.settle)
                    return arrived

                async def drop() -> None:
                    """Stop the held requests (as a client going away) and wait until the server has none."""
                    await edge.run(release, held)
                    with trio.fail_after(args.timeout):
                        while server.in_flight:  # noqa: ASYNC110 (a plain count; polling is fine here)
                            await trio.sleep(0.05)
                    await trio.sleep(0.5)

                # A warm-up (as bench.e2e's): imports, pools and the connections exist before the baseline.
                await hold(args.warmup)
                await drop()
                gc.collect()
                if args.trace:
                    tracemalloc.start(args.frames)
                    before_snap = tracemalloc.take_snapshot()
                heap0 = tracemalloc.get_traced_memory()[0] if args.trace else 0
                rss0 = rss_bytes()
                arrived = await hold(args.requests)
                in_flight = server.in_flight
                gc.collect()
                rss1 = rss_bytes()
                heap1 = tracemalloc.get_traced_memory()[0] if args.trace else 0
                top: list[tuple[str, float]] = []
                if args.trace:
                    after_snap = tracemalloc.take_snapshot()
                    stats = after_snap.compare_to(before_snap, args.group)
                    for stat in stats[: args.top]:
                        frames = [
                            f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno}" for f in stat.traceback
                        ]
                        top.append((" < ".join(frames), stat.size_diff / args.requests))
                    tracemalloc.stop()
                await drop()
                nursery.cancel_scope.cancel()
        return {
            "requests": args.requests,
            "in_flight": in_flight,
            "all_first_tokens_s": arrived,
            "rss_per_request_kib": (rss1 - rss0) / args.requests / 1024,
            "rss_before_mib": rss0 / MiB,
            "rss_in_flight_mib": rss1 / MiB,
            "heap_per_request_kib": (heap1 - heap0) / args.requests / 1024 if args.trace else None,
            "top": top,
        }

    return trio.run(main)


def start_mock(work: Path, decode_ms: float, max_running: int) -> tuple[subprocess.Popen[bytes], str]:
    port_file = work / "port"
    argv = [
        sys.executable, "-m", "sidecar.testing.mock", "--profile", "trtllm", "--port", "0",
        "--port-file", str(port_file), "--speedup", "1", "--decode-ms-per-token", str(decode_ms),
        "--max-context-length", "4096",
        "--total-kv-blocks", "262144", "--max-running-requests", str(max_running), "--max-batched-tokens", "65536",
        "--log-level", "WARNING",
    ]  # fmt: skip
    log = (work / "mock.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 30
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"openengine-mock did not start:\n{(work / 'mock.log').read_text()[-4000:]}")
        time.sleep(0.02)
    return proc, port_file.read_text().strip()


def run_child(args: argparse.Namespace, target: str, trace: bool, fat: bool = False) -> dict[str, Any]:
    argv = [
        sys.executable, "-m", "bench.inflight_memory", "--child", "--target", target,
        "--requests", str(args.requests), "--connections", str(args.connections), "--top", str(args.top),
        "--frames", str(args.frames), "--group", args.group, "--warmup", str(args.warmup),
        "--max-tokens", str(args.max_tokens), "--timeout", str(args.timeout),
    ]  # fmt: skip
    if trace:
        argv.append("--trace")
    if fat:
        argv.append("--fat-streams")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=4 * args.timeout + 120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"child failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.inflight_memory", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests in flight at once [%(default)s]")
    parser.add_argument("--connections", type=int, default=8, help="Generate connections in the pool [%(default)s]")
    parser.add_argument("--decode-ms-per-token", type=float, default=100.0, help="the mock's pace [%(default)s]")
    parser.add_argument("--max-tokens", type=int, default=2000, help="tokens per request [%(default)s]")
    parser.add_argument("--top", type=int, default=0, help="print the N largest tracemalloc sites [%(default)s]")
    parser.add_argument("--frames", type=int, default=1, help="traceback depth of those sites [%(default)s]")
    parser.add_argument(
        "--group", choices=["lineno", "filename", "traceback"], default="traceback", help="how sites are grouped"
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="bound of each phase, s [%(default)s]")
    parser.add_argument("--no-trace", action="store_true", help="skip the tracemalloc run")
    parser.add_argument(
        "--lean-ab",
        action="store_true",
        help="also measure without the HTTP/2 layer's lean-streams tuning (grpclib's own per-stream containers)",
    )
    parser.add_argument("--warmup", type=int, default=50, help="requests held once before the baseline [%(default)s]")
    parser.add_argument("--prompt-tokens", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--settle", type=float, default=1.0, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fat-streams", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-mem-") as tmp:
        mock, target = start_mock(Path(tmp), args.decode_ms_per_token, max(1024, 2 * args.requests))
        try:
            rss = run_child(args, target, trace=False)
            print(
                f"RSS: {rss['in_flight']} requests in flight (all had a token after {rss['all_first_tokens_s']:.1f} s):"
                f" {rss['rss_before_mib']:.1f} -> {rss['rss_in_flight_mib']:.1f} MiB,"
                f" {rss['rss_per_request_kib']:.1f} KiB per request",
                flush=True,
            )
            if not args.no_trace:
                heap = run_child(args, target, trace=True)
                print(f"Python heap (tracemalloc): {heap['heap_per_request_kib']:.2f} KiB per request", flush=True)
                for site, size in heap["top"]:
                    print(f"  {size:8.0f} B/request  {site}")
            if args.lean_ab:
                fat = run_child(args, target, trace=False, fat=True)
                print(
                    f"RSS without the lean-streams tuning: {fat['rss_per_request_kib']:.1f} KiB per request"
                    f" (with it: {rss['rss_per_request_kib']:.1f})",
                    flush=True,
                )
                if not args.no_trace:
                    fat_heap = run_child(args, target, trace=True, fat=True)
                    print(
                        f"Python heap without the lean-streams tuning: {fat_heap['heap_per_request_kib']:.2f} KiB per"
                        f" request (with it: {heap['heap_per_request_kib']:.2f})",
                        flush=True,
                    )
        finally:
            mock.terminate()
            try:
                mock.wait(5)
            except subprocess.TimeoutExpired:
                mock.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
