"""GenerateResponse messages/s: our trio client vs a grpcio.aio + upb reference, against one ``openengine-mock``.

    python -m bench.client_throughput            # full run (~1.5 min)
    python -m bench.client_throughput --quick    # smoke run (~20 s)
    python -m bench.client_throughput --detokenize-ab --paced-ms 2.5 --streams 64   # the engine's side only

One mock process (``--speedup 0 --stream-interval 1``: one token per message, no model time; ``--paced-ms`` paces
it) serves every measurement. Each measurement runs in a fresh child process so that neither client inherits the
other's threads, caches or GC state, and so that its CPU time (``getrusage``, all threads) is its own. A child keeps
``S`` stream slots busy (each slot re-issues a 20k-token ``ignore_eos`` request whenever one ends; the mock has KV
room for all of them), lets them warm up, then counts the messages consumed during a fixed window. Clients run in
the order A B A B and the medians are reported.

With two or more CPUs the mock is pinned to the last CPU and the clients to CPU 0 (``--no-pin`` to disable), as in
the measurements that chose this client stack, so the client gets exactly one core. The mock is a Python server too:
its CPU share during the window is reported, and a ratio near 1.0 with the server at ~100 % means the server, not the
client, was the limit.

Clients:

* ``ours``       — ``open_edge`` + ``open_engine_client`` + ``generate`` (grpclib on the uvloop edge thread, batched
  bridge into trio), with the default pool of 8 connections;
* ``ours-1conn`` — the same with one connection (64-stream rows only), the like-for-like transport comparison;
* ``ours-nodetok`` — ``ours`` asking for ``extra.detokenize=false`` (``--detokenize-ab``: only these two, 64 streams):
  the mock's CPU per message with and without detokenizing, a proxy for what TensorRT-LLM saves;
* ``path``       — the worker's whole request path minus Dynamo's binding: per stream an asyncio task iterates the
  Dynamo handler (``sidecar.dynamo._handler.make_handler``, a stand-in ``Context``), which runs
  ``RequestServer.handle`` in trio, whose data path maps the engine stream into the outbox on the loop (64-stream
  rows only;
  ``--path-only`` measures nothing else); it counts engine messages consumed, like the others;
* ``path-h2repr`` — the same with hyperframe's own ``Frame.__repr__`` (``--repr-ab``): what the HTTP/2 layer's
  frame-repr tuning saves, toggled in one run (``ours`` and ``path`` apply every tuning, as the worker does);
* ``path-fat``   — the same with grpclib's own per-stream ``asyncio`` containers (``--lean-ab``): what the
  lean-streams tuning costs or saves in CPU;
* ``ours-direct``, ``path-direct`` — the same with ``EngineClientConfig(direct_receive=True)`` (``--direct-receive``);
* ``path@NAME``  — the same, imported from another checkout (``--tree NAME=DIR``): a before/after in one run;
  ``ours@NAME`` likewise for ``ours`` (unless ``--path-only``);
* ``reference``  — ``grpc.aio`` channel, ``unary_stream('/openengine.v1.Inference/Generate')`` with upb
  (de)serializers, consumed with ``async for`` (one channel, as grpcio users write it).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from openengine.v1 import generation_pb2

GENERATE_PATH: Final = "/openengine.v1.Inference/Generate"
MODEL: Final = "tiny-oe"
_64MiB: Final = 64 * 2**20
_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Result:
    """One measurement window of one child process."""

    client: str
    streams: int
    messages: int
    seconds: float
    client_cpu_s: float
    server_cpu_s: float
    requests_finished: int

    @property
    def rate(self) -> float:
        """Messages per second consumed during the window."""
        return self.messages / self.seconds if self.seconds > 0 else 0.0

    @property
    def client_us_per_msg(self) -> float:
        """Client CPU (all threads) per message, µs."""
        return 1e6 * self.client_cpu_s / self.messages if self.messages else float("nan")

    @property
    def server_us_per_msg(self) -> float:
        """Server CPU per message, µs (the engine's side)."""
        return 1e6 * self.server_cpu_s / self.messages if self.messages else float("nan")

    @property
    def server_share(self) -> float:
        """Server CPU time / wall time during the window (1.0 = one full core)."""
        return self.server_cpu_s / self.seconds if self.seconds > 0 else 0.0


def make_request(max_tokens: int, detokenize: bool = True) -> generation_pb2.GenerateRequest:
    """A 20k-token (by default) greedy request that ignores EOS, so it streams its full length; ``detokenize=False``
    asks the engine for token ids only (``extra.detokenize``, what the sidecar sends TensorRT-LLM)."""
    request = generation_pb2.GenerateRequest(request_id=str(uuid.uuid4()), model=MODEL)
    request.token_ids.ids.extend([1, 2, 3, 4, 5, 6, 7, 8])
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = max_tokens
    request.stopping.ignore_eos = True
    if not detokenize:
        request.extra.fields["detokenize"].bool_value = False
    return request


def process_cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (all threads), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    # After the ")" of comm: state is field 3, so utime (14) and stime (15) are at indices 11 and 12.
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def own_cpu_s() -> float:
    """CPU time of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------------------------------------- child: ours


def _tune(args: argparse.Namespace) -> None:
    """The HTTP/2 layer's tunings, as the worker applies them at start-up (minus the one an A/B leaves out). A tree
    from before the layer (``--tree``) has no such call: it patched at import."""
    try:
        from sidecar.http2 import apply_tunings
    except ImportError:
        return
    apply_tunings(frame_repr=not args.h2_repr, lean_streams=not args.fat_streams)


def child_ours(args: argparse.Namespace) -> Result:
    """Measure our trio client."""
    import trio

    from sidecar.edge import open_edge
    from sidecar.engine import EngineClientConfig, open_engine_client, parse_endpoint

    _tune(args)

    async def main() -> Result:
        async with open_edge() as edge:
            config = EngineClientConfig(
                parse_endpoint(args.target), connections=args.connections, direct_receive=args.direct
            )
            async with open_engine_client(edge, config) as client:
                await client.wait_connected(trio.current_time() + 15)
                count = 0
                finished = 0

                async def slot() -> None:
                    nonlocal count, finished
                    while True:
                        async with client.generate(make_request(args.max_tokens, not args.no_detokenize)) as batches:
                            async for batch in batches:
                                count += len(batch)
                        finished += 1

                async with trio.open_nursery() as nursery:
                    for _ in range(args.streams):
                        nursery.start_soon(slot)
                    await trio.sleep(args.warmup)
                    c0, f0, t0, cpu0, srv0 = count, finished, time.perf_counter(), own_cpu_s(), process_cpu_s(args.pid)
                    await trio.sleep(args.window)
                    c1, f1, t1, cpu1, srv1 = count, finished, time.perf_counter(), own_cpu_s(), process_cpu_s(args.pid)
                    nursery.cancel_scope.cancel(reason="measurement window over")
        name = "ours" if args.connections != 1 else "ours-1conn"
        if args.no_detokenize:
            name = "ours-nodetok"
        if args.direct:
            name = "ours-direct"
        return Result(name, args.streams, c1 - c0, t1 - t0, cpu1 - cpu0, srv1 - srv0, f1 - f0)

    return trio.run(main)


# ---------------------------------------------------------------------------------------------- child: path


def child_path(args: argparse.Namespace) -> Result:
    """Measure the request path: Dynamo handler -> trio request task -> engine client, all but Dynamo's binding."""
    import asyncio

    import trio

    from sidecar.convert import Capabilities
    from sidecar.dynamo._handler import make_handler
    from sidecar.edge import open_edge
    from sidecar.engine import EngineClientConfig, open_engine_client, parse_endpoint
    from sidecar.requests import RequestServer, ServingContext

    _tune(args)

    class Context:
        def __init__(self, request_id: str) -> None:
            self._id = request_id

        def id(self) -> str:
            return self._id

        def trace_headers(self) -> None:
            return None

        async def async_killed_or_stopped(self) -> None:
            await asyncio.Event().wait()

    async def main() -> Result:
        async with open_edge() as edge:
            config = EngineClientConfig(
                parse_endpoint(args.target), connections=args.connections, direct_receive=args.direct
            )
            async with open_engine_client(edge, config) as client:
                info = await client.wait_connected(trio.current_time() + 15)
                model = info.supported_models[0]
                caps = Capabilities.from_discovery(info, await client.get_model_info(model))
                server = RequestServer()
                server.attach(ServingContext(client, caps, model, caps.max_context_length or 0, 5.0, 60.0))
                count = 0
                finished = 0
                body = {
                    "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
                    "stop_conditions": {"max_tokens": args.max_tokens, "ignore_eos": True},
                    "sampling_options": {"temperature": 0.0},
                }

                async with trio.open_nursery() as nursery:
                    generate, _ = make_handler(edge, nursery, server.handle, push=False)

                    async def slot(index: int) -> None:
                        nonlocal count, finished
                        with contextlib.suppress(Exception):  # the end of the window cancels the trio side
                            for n in itertools.count():
                                request = generate(dict(body), Context(f"{index}-{n}"))
                                async for chunk in request:
                                    count += len(chunk["token_ids"])  # one token per engine message
                                finished += 1

                    async def start() -> None:
                        for index in range(args.streams):
                            edge.loop.create_task(slot(index))

                    await edge.run(start)
                    await trio.sleep(args.warmup)
                    c0, f0, t0, cpu0, srv0 = count, finished, time.perf_counter(), own_cpu_s(), process_cpu_s(args.pid)
                    await trio.sleep(args.window)
                    c1, f1, t1, cpu1, srv1 = count, finished, time.perf_counter(), own_cpu_s(), process_cpu_s(args.pid)
                    nursery.cancel_scope.cancel(reason="measurement window over")
        name = "path-h2repr" if args.h2_repr else "path-fat" if args.fat_streams else "path"
        if args.direct:
            name = "path-direct"
        return Result(name, args.streams, c1 - c0, t1 - t0, cpu1 - cpu0, srv1 - srv0, f1 - f0)

    return trio.run(main)


# ---------------------------------------------------------------------------------------------- child: reference


def child_reference(args: argparse.Namespace) -> Result:
    """Measure grpcio.aio + upb, the way a grpcio user would write the client."""
    import asyncio

    import grpc

    async def main() -> Result:
        options = [("grpc.max_receive_message_length", _64MiB), ("grpc.max_send_message_length", _64MiB)]
        async with grpc.aio.insecure_channel(args.target, options=options) as channel:
            await asyncio.wait_for(channel.channel_ready(), 15)
            generate = channel.unary_stream(
                GENERATE_PATH,
                request_serializer=generation_pb2.GenerateRequest.SerializeToString,
                response_deserializer=generation_pb2.GenerateResponse.FromString,
            )
            count = 0
            finished = 0

            async def slot() -> None:
                nonlocal count, finished
                while True:
                    async for _ in generate(make_request(args.max_tokens)):
                        count += 1
                    finished += 1

            tasks = [asyncio.create_task(slot()) for _ in range(args.streams)]
            await asyncio.sleep(args.warmup)
            c0, f0, t0, cpu0, srv0 = count, finished, time.perf_counter(), own_cpu_s(), process_cpu_s(args.pid)
            await asyncio.sleep(args.window)
            c1, f1, t1, cpu1, srv1 = count, finished, time.perf_counter(), own_cpu_s(), process_cpu_s(args.pid)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return Result("reference", args.streams, c1 - c0, t1 - t0, cpu1 - cpu0, srv1 - srv0, f1 - f0)

    return asyncio.run(main())


# ---------------------------------------------------------------------------------------------- parent


class Mock:
    """``openengine-mock --speedup 0`` (or paced, ``decode_ms`` per step) as a subprocess, killed on exit."""

    def __init__(
        self,
        cpu: int | None,
        max_tokens: int,
        decode_ms: float | None = None,
        interval: int = 1,
        *,
        step_clock: bool = False,
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-mock-")
        port_file = Path(self._tmp.name) / "port"
        timing = ["--speedup", "0"]
        if decode_ms is not None:
            timing = ["--speedup", "1", "--decode-ms-per-token", str(decode_ms)]
            if step_clock:
                timing += ["--step-clock", "engine"]
        argv = [
            sys.executable,
            "-m",
            "sidecar.testing.mock",
            "--profile",
            "trtllm",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            *timing,
            "--stream-interval",
            str(interval),
            "--max-context-length",
            str(max_tokens + 64),
            "--max-running-requests",
            "1024",
            # Room for every stream: at the mock's default 4,096 blocks, three 20k-token requests fill the KV cache
            # and the other slots wait in its queue.
            "--total-kv-blocks",
            str(1024 * (-(-(max_tokens + 64) // 16))),
            "--log-level",
            "WARNING",
        ]
        self.log = Path(self._tmp.name) / "mock.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if cpu is not None:
            os.sched_setaffinity(self.proc.pid, {cpu})
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                output = self.log.read_text(errors="replace")[-4000:]
                self.close()
                raise RuntimeError(f"openengine-mock did not start:\n{output}")
            time.sleep(0.02)
        self.target = port_file.read_text().strip()

    @property
    def pid(self) -> int:
        """The mock's process id (for its CPU time)."""
        return self.proc.pid

    def close(self) -> None:
        """Stop the mock (SIGTERM, then SIGKILL after 5 s) and remove its directory."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._tmp.cleanup()


def _named_tree(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not Path(path).is_dir():
        raise argparse.ArgumentTypeError(f"expected NAME=DIR with an existing DIR, got {text!r}")
    return name, Path(path)


def run_child(client: str, streams: int, target: str, pid: int, args: argparse.Namespace, cpu: int | None) -> Result:
    """One measurement in a fresh interpreter; its last stdout line is the JSON result."""
    connections = 1 if client == "ours-1conn" else args.connections
    argv = [
        sys.executable,
        "-m",
        "bench.client_throughput",
        "--child",
        "path" if client.startswith("path") else "ours" if client.startswith("ours") else "reference",
        "--target",
        target,
        "--pid",
        str(pid),
        "--streams",
        str(streams),
        "--connections",
        str(connections),
        "--warmup",
        str(args.warmup),
        "--window",
        str(args.window),
        "--max-tokens",
        str(args.max_tokens),
    ]
    if client == "path-h2repr":
        argv.append("--h2-repr")
    if client == "path-fat":
        argv.append("--fat-streams")
    if client == "ours-nodetok":
        argv.append("--no-detokenize")
    if client.endswith("-direct"):
        argv.append("--direct")
    # path@NAME / ours@NAME: the same child, imported from another checkout (--tree NAME=DIR), e.g. the commit before
    # a change.
    tree = dict(args.tree)[client.partition("@")[2]] if "@" in client else None
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    preexec = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    done = subprocess.run(
        argv,
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=args.warmup + args.window + 60,
        # Affinity only; the parent is single-threaded, so preexec_fn cannot deadlock on a lock held elsewhere.
        preexec_fn=preexec,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"child {client} x{streams} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    data = json.loads(done.stdout.strip().splitlines()[-1])
    data["client"] = client
    return Result(**data)


def main(argv: list[str] | None = None) -> int:
    """Parse flags; run as parent (orchestrate, print the table) or as a measuring child."""
    parser = argparse.ArgumentParser(prog="python -m bench.client_throughput", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: one round, short windows")
    parser.add_argument("--rounds", type=int, default=2, help="A B rounds per configuration [%(default)s]")
    parser.add_argument("--window", type=float, default=5.0, help="measured seconds per child [%(default)s]")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before the window [%(default)s]")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64], help="concurrent streams [1 64]")
    parser.add_argument("--connections", type=int, default=8, help="our pool size [%(default)s]")
    parser.add_argument("--max-tokens", type=int, default=20000, help="tokens per request [%(default)s]")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the mock and the clients to CPUs")
    parser.add_argument("--no-1conn", action="store_true", help="skip the one-connection variant of our client")
    parser.add_argument(
        "--paced-ms",
        type=float,
        help="pace the mock (--speedup 1, this many ms per decode step at batch 1): every client then sees the same "
        "message rate, and client µs/msg compares per-message costs at that rate (64 streams, 2.5 ms: ~12.8k msg/s)",
    )
    parser.add_argument(
        "--tree",
        type=_named_tree,
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also measure the request path as imported from DIR (a copy of another commit, e.g. `git archive HEAD "
        "| tar -x -C DIR`, with this bench file), interleaved, as client path@NAME (repeatable)",
    )
    parser.add_argument("--path-only", action="store_true", help="measure only the request path (64-stream rows)")
    parser.add_argument(
        "--direct-receive",
        action="store_true",
        help="also measure `ours` and `path` with EngineClientConfig(direct_receive=True) (sidecar/engine/_direct.py)",
    )
    parser.add_argument(
        "--detokenize-ab",
        action="store_true",
        help="only the engine's side: `ours` with and without extra.detokenize=false (64-stream rows), interleaved; "
        "the mock's CPU per message is the figure",
    )
    parser.add_argument(
        "--repr-ab", action="store_true", help="also the request path with hyperframe's own Frame.__repr__"
    )
    parser.add_argument(
        "--lean-ab", action="store_true", help="also the request path with grpclib's own per-stream containers"
    )
    # child mode (internal)
    parser.add_argument("--child", choices=["ours", "reference", "path"], help=argparse.SUPPRESS)
    parser.add_argument("--h2-repr", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fat-streams", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-detokenize", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--direct", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--pid", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child is not None:
        (args.streams,) = args.streams  # a child measures one stream count
        children = {"ours": child_ours, "reference": child_reference, "path": child_path}
        result = children[args.child](args)
        fields = {k: getattr(result, k) for k in Result.__dataclass_fields__}
        print(json.dumps(fields))
        return 0

    if args.quick:
        args.rounds, args.window, args.warmup = 1, 1.5, 0.5
    cpus = sorted(os.sched_getaffinity(0))
    pin = not args.no_pin and len(cpus) >= 2
    server_cpu, client_cpu = (cpus[-1], cpus[0]) if pin else (None, None)
    started = time.monotonic()
    mock = Mock(server_cpu, args.max_tokens, args.paced_ms)
    results: dict[tuple[str, int], list[Result]] = {}
    try:
        pinning = f"mock on CPU {server_cpu}, clients on CPU {client_cpu}" if pin else "no CPU pinning"
        print(
            f"openengine-mock at {mock.target} (pid {mock.pid}); {pinning}; "
            f"{args.rounds} round(s) x {args.window:g}s windows, {args.max_tokens} tokens/request",
            flush=True,
        )
        for streams in args.streams:
            clients = [] if args.path_only or args.detokenize_ab else ["ours", "reference"]
            if args.detokenize_ab:
                clients = ["ours", "ours-nodetok"] if streams > 1 else []
            elif streams > 1 and not args.no_1conn and not args.path_only:
                clients.append("ours-1conn")
            if not args.path_only and not args.detokenize_ab:
                clients.extend(f"ours@{name}" for name, _ in args.tree)
                if args.direct_receive:
                    clients.append("ours-direct")
            if streams > 1 and not args.detokenize_ab:
                clients.append("path")
                if args.repr_ab:
                    clients.append("path-h2repr")
                if args.lean_ab:
                    clients.append("path-fat")
                clients.extend(f"path@{name}" for name, _ in args.tree)
                if args.direct_receive:
                    clients.append("path-direct")
            for round_ in range(args.rounds):
                for client in clients:
                    result = run_child(client, streams, mock.target, mock.pid, args, client_cpu)
                    results.setdefault((client, streams), []).append(result)
                    print(
                        f"  round {round_ + 1}: {client:<12} x{streams:<3} {result.rate:9.0f} msg/s  "
                        f"client {result.client_us_per_msg:6.1f} µs/msg  server CPU {100 * result.server_share:4.0f} % "
                        f"({result.server_us_per_msg:.1f} µs/msg)",
                        flush=True,
                    )
    finally:
        mock.close()
    print_table(results, args.streams)
    print(f"total {time.monotonic() - started:.0f}s")
    return 0


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def print_table(results: dict[tuple[str, int], list[Result]], stream_counts: list[int]) -> None:
    """Medians per client and stream count, and the ratios ours / reference."""
    print()
    header = (
        f"{'client':<13}{'streams':>8}{'msg/s (median)':>16}{'client µs/msg':>15}{'server CPU':>12}"
        f"{'server µs/msg':>15}{'runs':>6}"
    )
    print(header)
    print("-" * len(header))
    rates: dict[tuple[str, int], float] = {}
    cpu: dict[tuple[str, int], float] = {}
    for streams in stream_counts:
        trees = dict.fromkeys(c for c, _ in results if "@" in c)
        order = ("ours", "ours-direct", "ours-nodetok", "ours-1conn", "path", "path-direct", "path-h2repr", "path-fat")
        for client in (*order, *trees, "reference"):
            runs = results.get((client, streams))
            if not runs:
                continue
            rate = _median([r.rate for r in runs])
            rates[(client, streams)] = rate
            us = cpu[(client, streams)] = _median([r.client_us_per_msg for r in runs])
            share = _median([r.server_share for r in runs])
            server_us = _median([r.server_us_per_msg for r in runs])
            print(
                f"{client:<13}{streams:>8}{rate:>16.0f}{us:>15.1f}{100 * share:>11.0f}%{server_us:>15.1f}{len(runs):>6}"
            )
    print()
    for streams in stream_counts:
        with_text, without = results.get(("ours", streams)), results.get(("ours-nodetok", streams))
        if with_text and without:
            a = _median([r.server_us_per_msg for r in with_text])
            b = _median([r.server_us_per_msg for r in without])
            print(
                f"engine (mock) CPU per message at {streams} stream(s): {a:.1f} µs detokenizing, {b:.1f} µs with "
                f"extra.detokenize=false ({b / a:.2f}x)"
            )
        for other, tuning in (("path-h2repr", "frame-repr"), ("path-fat", "lean-streams")):
            if (other, streams) in cpu and ("path", streams) in cpu:
                tuned, untuned = cpu[("path", streams)], cpu[(other, streams)]
                print(
                    f"request path at {streams} stream(s): {tuned:.1f} µs/msg with the {tuning} tuning, {untuned:.1f} "
                    f"without ({tuned / untuned:.2f}x)"
                )
        for client, count in cpu:
            kind = client.partition("@")[0]
            if count == streams and "@" in client and (kind, streams) in cpu:  # here against the other tree
                here, there = cpu[(kind, streams)], cpu[(client, streams)]
                what = "request path" if kind == "path" else "engine client alone"
                print(
                    f"{what} at {streams} stream(s): {here:.1f} µs/msg here, {there:.1f} in "
                    f"{client.partition('@')[2]} ({here / there:.2f}x)"
                )
        ref = rates.get(("reference", streams))
        if not ref:
            continue
        for client in ("ours", "ours-1conn"):
            if (client, streams) in rates:
                print(
                    f"ratio {client}/reference at {streams} stream(s): {rates[(client, streams)] / ref:.2f}x msg/s, "
                    f"{cpu[(client, streams)] / cpu[('reference', streams)]:.2f}x client CPU per message"
                )


if __name__ == "__main__":
    raise SystemExit(main())
