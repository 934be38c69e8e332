"""The request path side by side: CPU per engine message, gaps between chunks, tokens per chunk, per candidate.

    python -m bench.datapath                          # paced 10 ms/token, 64 streams, this tree's two receive paths
    python -m bench.datapath --tree main=DIR          # ... and today's path of another checkout (git archive main)
    python -m bench.datapath --saturated --interval 1 # the mock flat out, one token per engine message
    python -m bench.datapath --quick                  # smoke run (~30 s)

What is measured is the worker's request path minus Dynamo's own binding: Dynamo's handler (``make_handler``, a
stand-in ``Context``) → the trio request task → the engine client → one ``openengine-mock`` (``--profile trtllm``,
pinned to the last CPU; the client to CPU 0). Dynamo's reader is emulated as Dynamo drives it: one reader thread
calls each request's ``__anext__`` (as Dynamo's tokio threads do, holding the GIL) and is handed the result through
a done-callback posted onto the edge loop, so every chunk crosses between two Python threads as it does in
production. Each candidate runs in a fresh child process (its CPU time is its own, all threads, ``getrusage``) that
keeps ``--streams`` requests of ``--max-tokens`` tokens in flight (closed loop), warms up, then measures a window.
Candidates run interleaved (A B C A B C ...), medians reported.

Candidates:

* ``push`` -- this tree in push mode (what Dynamo 1.6.1 drives for a handler naming ``response_sender``): chunks go
  to a stand-in ``ResponseSender`` (it counts them and stamps their arrival) from the loop or the egress threads,
  ``Generate`` received from the HTTP/2 events; Dynamo's encode and channel are not part of it;
* ``loop-direct`` -- this tree in pull mode, ``Generate`` received from the HTTP/2 events
  (``EngineClientConfig.direct_receive``);
* ``loop-grpclib`` -- this tree in pull mode, received through grpclib's streams;
* ``NAME``, ``NAME-direct`` -- another checkout's path (``--tree NAME=DIR``) with its default and its direct receive
  (the same child code: ``make_handler(edge, nursery, server.handle)`` is the same call in both trees).

Figures per candidate: engine messages per second, **client CPU µs per engine message**, chunks (SSE events in
production) per second, **tokens per chunk**, and the **gap between consecutive chunks** of a request as the reader
saw them (p50 / p90 / p99 over every gap in the window; with a paced engine the engine's own interval is the floor).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

_HERE: Final = Path(__file__).resolve()
_ROOT: Final = _HERE.parent.parent


@dataclass(frozen=True, slots=True)
class Result:
    """One measurement window of one child process."""

    candidate: str
    messages: int
    tokens: int
    chunks: int
    seconds: float
    cpu_s: float
    mock_cpu_s: float
    gap_p50_ms: float
    gap_p90_ms: float
    gap_p99_ms: float
    finished: int

    @property
    def us_per_message(self) -> float:
        return 1e6 * self.cpu_s / self.messages if self.messages else float("nan")

    @property
    def tokens_per_chunk(self) -> float:
        return self.tokens / self.chunks if self.chunks else float("nan")


# ------------------------------------------------------------------------------------------------ child


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _cpu_s(pid: int | None = None) -> float:
    if pid is None:
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


class _Context:
    """What the handler uses of Dynamo's context."""

    def __init__(self, request_id: str, loop: Any) -> None:
        self._id = request_id
        self._loop = loop

    def id(self) -> str:
        return self._id

    def trace_headers(self) -> None:
        return None

    def async_killed_or_stopped(self) -> Any:
        return self._loop.create_future()  # never stopped; cancelled by the handler at the end


class _Sender:
    """A stand-in ``ResponseSender``: counts what arrives (any thread), and tells the reader when the stream closes."""

    __slots__ = ("_reader", "_slot")

    def __init__(self, reader: _PushReader, slot: int) -> None:
        self._reader, self._slot = reader, slot

    def send(self, chunk: dict[str, Any]) -> None:
        self._reader.chunk(self._slot, chunk)

    def close(self) -> None:
        pass


class _PushReader:
    """Dynamo's side in push mode: each request's iterator is advanced once; its chunks arrive at its sender; when
    the iteration ends, the slot's next request starts (on the loop, as Dynamo's dispatch does)."""

    def __init__(self, loop: Any, generate: Any, args: argparse.Namespace) -> None:
        import threading

        self.loop, self.generate, self.streams = loop, generate, args.streams
        self.body = {
            "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
            "stop_conditions": {"max_tokens": args.max_tokens, "ignore_eos": True},
            "sampling_options": {"temperature": 0.0},
        }
        self.stop = threading.Event()
        self.last: dict[int, float] = {}
        self.iterators: dict[int, Any] = {}  # held as Dynamo holds them: dropping one stops its request
        self.serial = 0
        self.tokens = self.chunks = self.finished = 0
        self.gaps: list[float] | None = None

    def chunk(self, slot: int, chunk: dict[str, Any]) -> None:
        ids = chunk.get("token_ids") or ()
        if ids:
            now = time.perf_counter()
            self.tokens += len(ids)
            self.chunks += 1
            if self.gaps is not None and slot in self.last:
                self.gaps.append(now - self.last[slot])
            self.last[slot] = now

    def _start(self, slot: int) -> None:
        if self.stop.is_set():
            return
        self.serial += 1
        self.last.pop(slot, None)
        iterator = self.generate(
            dict(self.body), _Context(f"{slot}-{self.serial}", self.loop), response_sender=_Sender(self, slot)
        )
        self.iterators[slot] = iterator
        future = iterator.__anext__()
        future.add_done_callback(lambda f, s=slot: self._ended(s, f))

    def _ended(self, slot: int, future: Any) -> None:
        error = future.exception()
        if not isinstance(error, StopAsyncIteration):
            print(f"request failed: {error!r}", file=sys.stderr)
        self.finished += 1
        self._start(slot)

    def run(self) -> None:
        for slot in range(self.streams):
            self.loop.call_soon_threadsafe(self._start, slot)


class _Reader:
    """Dynamo's side: one thread drives every request's iterator, one ``__anext__`` at a time per request, and is
    handed each result through a done-callback posted onto the loop (as Dynamo's binding does)."""

    def __init__(self, loop: Any, generate: Any, args: argparse.Namespace) -> None:
        import queue
        import threading

        self.loop, self.generate, self.streams = loop, generate, args.streams
        self.body = {
            "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
            "stop_conditions": {"max_tokens": args.max_tokens, "ignore_eos": True},
            "sampling_options": {"temperature": 0.0},
        }
        self.done: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.slots: dict[int, Any] = {}
        self.last: dict[int, float] = {}
        self.serial = 0
        self.tokens = self.chunks = self.finished = 0
        self.gaps: list[float] | None = None  # recorded while the window is open

    def _start(self, slot: int) -> None:
        self.serial += 1
        self.slots[slot] = self.generate(dict(self.body), _Context(f"{slot}-{self.serial}", self.loop))
        self.last.pop(slot, None)
        self._ask(slot)

    def _ask(self, slot: int) -> None:
        future = self.slots[slot].__anext__()
        self.loop.call_soon_threadsafe(future.add_done_callback, lambda f, s=slot: self.done.put((s, f)))

    def run(self) -> None:
        import queue

        for slot in range(self.streams):
            self._start(slot)
        while not self.stop.is_set():
            try:
                slot, future = self.done.get(timeout=0.2)
            except queue.Empty:
                continue
            error = future.exception()
            if error is not None:
                if not isinstance(error, StopAsyncIteration):
                    print(f"request failed: {error!r}", file=sys.stderr)
                self.finished += 1
                self._start(slot)
                continue
            ids = future.result().get("token_ids") or ()
            if ids:
                now = time.perf_counter()
                self.tokens += len(ids)
                self.chunks += 1
                if self.gaps is not None and slot in self.last:
                    self.gaps.append(now - self.last[slot])
                self.last[slot] = now
            self._ask(slot)


def child(args: argparse.Namespace) -> Result:
    """Run the request path in this process against the mock at ``args.target``; one measurement window."""
    import threading

    import trio

    from sidecar.convert import Capabilities
    from sidecar.dynamo._handler import make_handler
    from sidecar.edge import open_edge
    from sidecar.engine import EngineClientConfig, open_engine_client, parse_endpoint
    from sidecar.requests import RequestServer, ServingContext

    async def main() -> Result:
        async with open_edge() as edge:
            config = EngineClientConfig(parse_endpoint(args.target), direct_receive=args.direct)
            async with open_engine_client(edge, config) as client:
                info = await client.wait_connected(trio.current_time() + 15)
                model = info.supported_models[0]
                caps = Capabilities.from_discovery(info, await client.get_model_info(model))
                server = RequestServer()
                server.attach(ServingContext(client, caps, model, caps.max_context_length or 0, 5.0, 60.0))
                async with trio.open_nursery() as nursery:
                    made = make_handler(edge, nursery, server.handle)
                    # Another checkout's make_handler may return the function alone (before push egress).
                    generate = made[0] if isinstance(made, tuple) else made
                    reader: _Reader | _PushReader
                    reader = (_PushReader if args.push else _Reader)(edge.loop, generate, args)
                    thread = threading.Thread(target=reader.run, daemon=True)
                    thread.start()
                    await trio.sleep(args.warmup)
                    gaps: list[float] = []
                    reader.gaps = gaps
                    t0, cpu0, mock0 = time.perf_counter(), _cpu_s(), _cpu_s(args.pid)
                    tok0, ch0, fin0 = reader.tokens, reader.chunks, reader.finished
                    await trio.sleep(args.window)
                    t1, cpu1, mock1 = time.perf_counter(), _cpu_s(), _cpu_s(args.pid)
                    tok1, ch1, fin1 = reader.tokens, reader.chunks, reader.finished
                    reader.gaps = None
                    reader.stop.set()
                    nursery.cancel_scope.cancel(reason="measurement window over")
                await trio.to_thread.run_sync(thread.join, 5)
        tokens = tok1 - tok0
        return Result(
            candidate=args.name,
            messages=tokens // args.interval,
            tokens=tokens,
            chunks=ch1 - ch0,
            seconds=t1 - t0,
            cpu_s=cpu1 - cpu0,
            mock_cpu_s=mock1 - mock0,
            gap_p50_ms=1e3 * _percentile(gaps, 0.5),
            gap_p90_ms=1e3 * _percentile(gaps, 0.9),
            gap_p99_ms=1e3 * _percentile(gaps, 0.99),
            finished=fin1 - fin0,
        )

    return trio.run(main)


# ------------------------------------------------------------------------------------------------ parent


def run_child(candidate: str, tree: Path | None, mock: Any, args: argparse.Namespace, cpu: int | None) -> Result:
    """One candidate's measurement in a fresh interpreter (from ``tree``, if given); its last line is the result."""
    argv = [
        sys.executable, str(_HERE), "--child", "--name", candidate, "--target", mock.target,
        "--pid", str(mock.pid),
        "--streams", str(args.streams), "--max-tokens", str(args.max_tokens), "--interval", str(args.interval),
        "--warmup", str(args.warmup), "--window", str(args.window),
    ]  # fmt: skip
    if candidate.endswith("-direct") or candidate.startswith("push"):
        argv.append("--direct")
    if candidate.startswith("push"):
        argv.append("--push")
    root = tree if tree is not None else _ROOT
    env = {**os.environ, "PYTHONPATH": str(root)}
    preexec = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    done = subprocess.run(
        argv, cwd=root, env=env, capture_output=True, text=True, timeout=args.warmup + args.window + 90,
        preexec_fn=preexec, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"child {candidate} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return Result(**json.loads(done.stdout.strip().splitlines()[-1]))


def _median(results: list[Result], attr: str) -> float:
    values = [getattr(r, attr) for r in results]
    return statistics.median(values) if values else float("nan")


def report(results: dict[str, list[Result]], args: argparse.Namespace) -> str:
    load = "saturated (--speedup 0)" if args.saturated else f"paced {args.paced_ms:g} ms/token"
    lines = [
        f"request path, {args.streams} streams, {args.max_tokens} tokens each, {args.interval} token(s) per engine "
        f"message, engine {load}; medians of {args.rounds} round(s), {args.window:g} s windows",
        "",
        "| candidate | msg/s | µs CPU per engine msg | tokens per chunk | gap p50 ms | gap p90 ms | gap p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in results.items():
        rate = statistics.median(r.messages / r.seconds for r in runs)
        gaps = " | ".join(f"{_median(runs, f'gap_{q}_ms'):.2f}" for q in ("p50", "p90", "p99"))
        lines.append(
            f"| {name} | {rate:,.0f} | {_median(runs, 'us_per_message'):.1f} | {_median(runs, 'tokens_per_chunk'):.2f} "
            f"| {gaps} |"
        )
    return "\n".join(lines)


def _tree(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not Path(path).is_dir():
        raise argparse.ArgumentTypeError(f"expected NAME=DIR with an existing DIR, got {text!r}")
    return name, Path(path).resolve()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="smoke run: short windows, one round")
    p.add_argument("--tree", type=_tree, action="append", default=[], help="NAME=DIR: also measure that checkout")
    p.add_argument("--only", default="", help="comma-separated candidates to run (default: all)")
    p.add_argument("--saturated", action="store_true", help="the mock flat out (--speedup 0) instead of paced")
    p.add_argument("--paced-ms", type=float, default=10.0, help="the mock's decode time per token (default 10)")
    p.add_argument("--interval", type=int, default=1, help="tokens per engine message (the mock's stream interval)")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--window", type=float, default=8.0)
    p.add_argument("--no-pin", action="store_true", help="do not pin the mock and the clients to separate CPUs")
    # child
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--name", default="", help=argparse.SUPPRESS)
    p.add_argument("--target", default="", help=argparse.SUPPRESS)
    p.add_argument("--pid", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--direct", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--push", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--step-clock", action="store_true", help="the mock's engine-wide step clock (paced rows)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup, args.window = 1, 1.5, 3.0
    return args


def main(argv: list[str] | None = None) -> int:
    from bench.client_throughput import Mock  # the parent only: a child may run another checkout's bench

    args = parse(argv)
    if args.child:
        print(json.dumps(asdict(child(args))))
        return 0
    cpus = sorted(os.sched_getaffinity(0))
    pin = not args.no_pin and len(cpus) >= 2
    candidates: list[tuple[str, Path | None]] = [("push", None), ("loop-direct", None), ("loop-grpclib", None)]
    for name, path in args.tree:
        candidates += [(name, path), (f"{name}-direct", path), (f"push-{name}", path)]
    if args.only:
        wanted = set(args.only.split(","))
        candidates = [c for c in candidates if c[0] in wanted]
    results: dict[str, list[Result]] = {name: [] for name, _ in candidates}
    mock = Mock(
        cpus[-1] if pin else None,
        args.max_tokens,
        None if args.saturated else args.paced_ms,
        args.interval,
        step_clock=args.step_clock,
    )
    try:
        for round_ in range(args.rounds):
            for name, tree in candidates:
                result = run_child(name, tree, mock, args, cpus[0] if pin else None)
                results[name].append(result)
                print(
                    f"round {round_ + 1} {name}: {result.us_per_message:.1f} µs/msg, "
                    f"{result.tokens_per_chunk:.2f} tok/chunk, gap p50 {result.gap_p50_ms:.2f} ms "
                    f"p99 {result.gap_p99_ms:.2f} ms, mock {100 * result.mock_cpu_s / result.seconds:.0f} % CPU",
                    flush=True,
                )
    finally:
        mock.close()
    print()
    print(report(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
