"""Client CPU per GenerateResponse over TCP loopback vs a Unix-domain socket, side by side in one run.

    python -m bench.transport            # ~1 min
    python -m bench.transport --quick    # smoke run (~15 s)

One grpcio (grpc-core) server process listens on ``127.0.0.1:0`` and on ``unix:<tmp>/engine.sock`` at once and
streams pre-encoded 63-byte ``GenerateResponse`` messages flat out (``stopping.max_tokens`` of them per request): the
cheapest server there is, so the client is the bottleneck. Each measurement is a fresh child
of ``bench.client_throughput`` (``ours``: ``open_edge`` + ``open_engine_client`` + ``generate``, the default pool of 8
connections) pointed at one of the two addresses; CPU is the child's ``getrusage`` over the window, per message
received. Transports alternate TCP, UDS, TCP, UDS... and medians are reported. With two or more CPUs the server is
pinned to the last CPU and the clients to CPU 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

from bench.client_throughput import Result, run_child
from openengine.v1 import generation_pb2, server_pb2
from sidecar.engine import PINNED_SCHEMA_RELEASE

GENERATE: Final = "/openengine.v1.Inference/Generate"
SERVER_INFO: Final = "/openengine.v1.Control/GetServerInfo"


def _payloads() -> tuple[bytes, bytes, bytes]:
    token = generation_pb2.GenerateResponse(request_id="0" * 36)
    token.token.output_index = 0
    token.token.text = " hello"
    token.token.tokens.add(token_id=1, token=" hello")
    done = generation_pb2.GenerateResponse(request_id="0" * 36)
    done.finished.output_index = 0
    done.finished.reason = generation_pb2.FINISH_REASON_LENGTH
    info = server_pb2.ServerInfo(
        engine_name="bench", schema_revision=1, minimum_client_revision=1, schema_release=PINNED_SCHEMA_RELEASE
    )
    return token.SerializeToString(), done.SerializeToString(), info.SerializeToString()


def serve(ready_file: Path, socket_path: Path) -> int:
    """The server child: grpc.aio on TCP loopback and a Unix socket; writes both targets to ``ready_file``."""
    import asyncio

    import grpc

    token, done, info = _payloads()

    async def generate(request: bytes, context: object) -> object:
        count = generation_pb2.GenerateRequest.FromString(request).stopping.max_tokens
        for _ in range(count):
            yield token
        yield done

    async def server_info(request: bytes, context: object) -> bytes:
        return info

    handlers = {
        GENERATE: grpc.unary_stream_rpc_method_handler(generate),
        SERVER_INFO: grpc.unary_unary_rpc_method_handler(server_info),
    }

    class Handlers(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpcio ships no type hints
        def service(self, details: grpc.HandlerCallDetails) -> object:
            return handlers.get(details.method)

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
        server.add_generic_rpc_handlers([Handlers()])
        port = server.add_insecure_port("127.0.0.1:0")
        server.add_insecure_port(f"unix:{socket_path}")
        await server.start()
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(f"127.0.0.1:{port}\nunix://{socket_path}\n")
        os.replace(tmp, ready_file)
        await server.wait_for_termination()

    asyncio.run(main())
    return 0


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transport", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: one round, short windows")
    parser.add_argument("--rounds", type=int, default=3, help="TCP/UDS rounds per stream count [%(default)s]")
    parser.add_argument("--window", type=float, default=4.0, help="measured seconds per child [%(default)s]")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before the window [%(default)s]")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64], help="concurrent streams [1 64]")
    parser.add_argument("--connections", type=int, default=8, help="our pool size [%(default)s]")
    parser.add_argument("--max-tokens", type=int, default=20000, help="messages per request [%(default)s]")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the server and the clients to CPUs")
    parser.add_argument("--serve", nargs=2, metavar=("READY_FILE", "SOCKET"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return serve(Path(args.serve[0]), Path(args.serve[1]))
    if args.quick:
        args.rounds, args.window, args.warmup = 1, 1.5, 0.5
    # What bench.client_throughput's run_child reads.
    args.tree = []
    cpus = sorted(os.sched_getaffinity(0))
    pin = not args.no_pin and len(cpus) >= 2
    server_cpu, client_cpu = (cpus[-1], cpus[0]) if pin else (None, None)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-transport-") as tmp:
        ready = Path(tmp) / "ready"
        argv_server = [sys.executable, "-m", "bench.transport", "--serve", str(ready), str(Path(tmp) / "engine.sock")]
        server = subprocess.Popen(argv_server, start_new_session=True)
        results: dict[tuple[str, int], list[Result]] = {}
        try:
            if server_cpu is not None:
                os.sched_setaffinity(server.pid, {server_cpu})
            deadline = time.monotonic() + 30
            while not ready.exists():
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the grpcio server did not start")
                time.sleep(0.02)
            tcp, uds = ready.read_text().split()
            pinning = f"server on CPU {server_cpu}, clients on CPU {client_cpu}" if pin else "no CPU pinning"
            print(f"grpcio server (pid {server.pid}) at {tcp} and {uds}; {pinning}", flush=True)
            for streams in args.streams:
                for round_ in range(args.rounds):
                    for name, target in (("tcp", tcp), ("uds", uds)):
                        result = run_child("ours", streams, target, server.pid, args, client_cpu)
                        results.setdefault((name, streams), []).append(result)
                        print(
                            f"  round {round_ + 1}: {name} x{streams:<3} {result.rate:9.0f} msg/s  client "
                            f"{result.client_us_per_msg:6.1f} µs/msg  server CPU {100 * result.server_share:4.0f} %",
                            flush=True,
                        )
        finally:
            server.terminate()
            try:
                server.wait(5)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(5)
    print()
    header = f"{'streams':>8}{'TCP µs/msg':>12}{'UDS µs/msg':>12}{'UDS/TCP':>9}{'TCP msg/s':>11}{'UDS msg/s':>11}"
    print(header)
    print("-" * len(header))
    for streams in args.streams:
        tcp_runs, uds_runs = results.get(("tcp", streams), []), results.get(("uds", streams), [])
        tcp_us = _median([r.client_us_per_msg for r in tcp_runs])
        uds_us = _median([r.client_us_per_msg for r in uds_runs])
        tcp_rate = _median([r.rate for r in tcp_runs])
        uds_rate = _median([r.rate for r in uds_runs])
        print(f"{streams:>8}{tcp_us:>12.1f}{uds_us:>12.1f}{uds_us / tcp_us:>8.2f}x{tcp_rate:>11.0f}{uds_rate:>11.0f}")
    print(f"total {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
