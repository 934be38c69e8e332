"""The stream as a user feels it, side by side: the sidecar (B) against an in-process worker (A) at equal chunking.

    python -m bench.paced             # ~6 min on 2 cores: paced rows, saturated rows, the goals of issue 30
    python -m bench.paced --quick     # smoke run (~2 min)

One real Dynamo frontend, pinned as ``bench.e2e --pin`` does (the engine on the last CPU, everything else on the
others). **A** is ``bench._paced_worker``: a plain Dynamo worker that sleeps the mock's own decode steps (the same
batch slowdown) and yields one chunk per engine message, as an in-process backend does. **B** is
``openengine-sidecar`` in front of ``openengine-mock --profile trtllm`` paced the same way. Per row the two run
A B A B from fresh load clients (``bench._paced_load``, its CPU apart), medians reported:

* paced rows: the engine at 10 and 20 ms per token (``--speedup 1 --decode-ms-per-token``), one token per message,
  concurrency 16 and 64 -- the gaps between SSE events carrying text (p50, p99), tokens per event, and CPU per token
  of worker A and of the sidecar;
* saturated rows: the engine flat out (``--speedup 0``), five tokens per message against A yielding five per chunk
  (A5), concurrency 16 and 64 -- throughput B/A5; and one token per message at 64 -- the sidecar's CPU per engine
  message.

It ends with one line per goal of issue 30, ``goal <name>: <measured> (target <target>) met|MISSED``, each the worst
over the rows it covers. (``bench.e2e`` reports the same goals on its own, larger run.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import trio

from sidecar.testing.mock.lm import MODEL_DIR
from tests.helpers.processes import DynamoEnv, dynamo_env, start_frontend, start_process, wait_for_model

MODEL_A: Final = "paced-a"
MODEL_B: Final = "paced-b"
MODEL_R: Final = "paced-r"
_TICKS: Final = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    decode_ms: float  # 0: the engine flat out
    interval: int  # tokens per engine message (and per A chunk)
    concurrency: int


@dataclass(slots=True)
class Measured:
    tokens: int
    events: int
    seconds: float
    cpu_s: float
    gap_p50_ms: float
    gap_p99_ms: float
    failed: int

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_event(self) -> float:
        return self.tokens / self.events if self.events else float("nan")

    @property
    def us_per_token(self) -> float:
        return 1e6 * self.cpu_s / self.tokens if self.tokens else float("nan")


def cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (all threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def pin(pid: int, cpus: set[int]) -> None:
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task), cpus)


class Bench:
    def __init__(
        self, denv: DynamoEnv, url: str, work: Path, engine: set[int] | None, rest: set[int] | None, ref: Path | None
    ) -> None:
        self.denv, self.url, self.work, self.engine, self.rest, self.ref = denv, url, work, engine, rest, ref

    def _pin(self, pid: int, cpus: set[int] | None) -> None:
        if cpus is not None:
            pin(pid, cpus)

    async def start(self, stack: AsyncExitStack, decode_ms: float, interval: int) -> dict[str, int]:
        """Path A's worker, path B's mock + sidecar (and path R's, from ``--sidecar-tree``) for one engine setting;
        their pids by model name."""
        pids = {MODEL_B: await self._sidecar(stack, decode_ms, interval, MODEL_B, None)}
        if self.ref is not None:
            pids[MODEL_R] = await self._sidecar(stack, decode_ms, interval, MODEL_R, self.ref)
        worker = await stack.enter_async_context(
            start_process(
                [sys.executable, "-m", "bench._paced_worker", "--model-path", str(MODEL_DIR), "--served-model-name",
                 MODEL_A, "--decode-ms", str(decode_ms), "--interval", str(interval)],
                self.denv.worker_env(), log_path=self.denv.log_path("worker-a"), ready=r"^READY",
            )
        )  # fmt: skip
        pids[MODEL_A] = worker.pid
        for model, pid in pids.items():
            await wait_for_model(self.url, model, timeout=60)
            self._pin(pid, self.rest)
        print("pids:", " ".join(f"{model}={pid}" for model, pid in pids.items()), flush=True)
        return pids

    async def _sidecar(
        self, stack: AsyncExitStack, decode_ms: float, interval: int, model: str, tree: Path | None
    ) -> int:
        timing = ["--speedup", "0"] if decode_ms == 0 else ["--speedup", "1", "--decode-ms-per-token", str(decode_ms)]
        port_file = self.work / f"mock-{time.monotonic_ns()}.port"
        argv = [
            sys.executable, "-m", "sidecar.testing.mock", "--profile", "trtllm", "--port", "0",
            "--port-file", str(port_file), *timing, "--stream-interval", str(interval),
            "--max-context-length", "4096", "--total-kv-blocks", "262144", "--max-running-requests", "1024",
            "--max-batched-tokens", "8192", "--log-level", "WARNING", "--served-model-name", f"{model}-engine",
        ]  # fmt: skip

        async def ready(_: Any) -> bool:
            return port_file.exists()

        mock = await stack.enter_async_context(
            start_process(argv, self.denv.env, log_path=self.denv.log_path("mock"), ready=ready)
        )
        self._pin(mock.pid, self.engine)
        env = self.denv.worker_env()
        if tree is not None:
            env["PYTHONPATH"] = str(tree)
        component = ["--component", "reference"] if tree is not None else []
        sidecar = await stack.enter_async_context(
            start_process(
                [sys.executable, "-m", "sidecar", "--grpc-endpoint", port_file.read_text().strip(), "--model-path",
                 str(MODEL_DIR), "--served-model-name", model, "--log-level", "warning", *component],
                env, log_path=self.denv.log_path(f"sidecar-{model}"), stop_grace=10, cwd=tree,
            )
        )  # fmt: skip
        return sidecar.pid

    async def load(self, model: str, pid: int, concurrency: int, requests: int, max_tokens: int) -> Measured:
        cfg = {
            "url": self.url,
            "model": model,
            "concurrency": concurrency,
            "requests": requests,
            "max_tokens": max_tokens,
        }
        rest = self.rest
        preexec: Callable[[], None] | None = None if rest is None else (lambda: os.sched_setaffinity(0, rest))
        before = cpu_s(pid)
        with trio.fail_after(600):
            done = await trio.run_process(
                [sys.executable, "-m", "bench._paced_load", json.dumps(cfg)],
                capture_stdout=True, capture_stderr=True, check=False, preexec_fn=preexec,
            )  # fmt: skip
        used = cpu_s(pid) - before
        if done.returncode != 0:
            raise RuntimeError(f"load client failed:\n{done.stderr.decode(errors='replace')[-3000:]}")
        r = json.loads(done.stdout.decode().strip().splitlines()[-1])
        return Measured(r["tokens"], r["events"], r["seconds"], used, r["gap_p50_ms"], r["gap_p99_ms"], r["failed"])


def _median(runs: list[Measured], key: Callable[[Measured], float]) -> float:
    return statistics.median(key(r) for r in runs)


async def run(args: argparse.Namespace) -> list[tuple[Row, list[Measured], list[Measured]]]:
    cpus = sorted(os.sched_getaffinity(0))
    engine = {cpus[-1]} if len(cpus) > 1 else None
    rest = set(cpus[:-1]) if len(cpus) > 1 else None
    concurrencies = [16] if args.quick else [16, 64]
    if args.concurrency:
        concurrencies = [args.concurrency]
    settings: list[tuple[float, int, list[Row]]] = []
    for ms in (10.0, 20.0):
        settings.append((ms, 1, [Row(f"paced {ms:g} ms", ms, 1, c) for c in concurrencies]))
    settings.append((0.0, 5, [Row("saturated 5 tok/msg", 0.0, 5, c) for c in concurrencies]))
    settings.append((0.0, 1, [Row("saturated 1 tok/msg", 0.0, 1, max(concurrencies))]))
    if args.rows:
        keys = {"paced10": (10.0, 1), "paced20": (20.0, 1), "sat5": (0.0, 5), "sat1": (0.0, 1)}
        wanted = {keys[key] for key in args.rows.split(",")}
        settings = [setting for setting in settings if (setting[0], setting[1]) in wanted]
    results: list[tuple[Row, list[Measured], list[Measured]]] = []
    with dynamo_env() as denv, tempfile.TemporaryDirectory(prefix="bench-paced-") as tmp:
        async with start_frontend(denv) as frontend:
            if rest is not None:
                pin(frontend.process.pid, rest)
            bench = Bench(denv, frontend.url, Path(tmp), engine, rest, args.sidecar_tree)
            models = [MODEL_A, MODEL_B] + ([MODEL_R] if args.sidecar_tree is not None else [])
            for decode_ms, interval, rows in settings:
                async with AsyncExitStack() as stack:
                    pids = await bench.start(stack, decode_ms, interval)
                    for row in rows:
                        requests = (args.requests_per_slot if decode_ms else 3) * row.concurrency
                        runs: dict[str, list[Measured]] = {model: [] for model in models}
                        for model in models:  # warm-up
                            await bench.load(model, pids[model], row.concurrency, row.concurrency, args.max_tokens)
                        for _ in range(args.rounds):
                            for model in models:
                                measured = await bench.load(
                                    model, pids[model], row.concurrency, requests, args.max_tokens
                                )
                                runs[model].append(measured)
                        results.append((row, runs[MODEL_A], runs[MODEL_B]))
                        print(line(row, runs[MODEL_A], runs[MODEL_B]), flush=True)
                        if MODEL_R in runs:
                            print("  reference (R) in place of B:", line(row, runs[MODEL_A], runs[MODEL_R]), flush=True)
    return results


def line(row: Row, a: list[Measured], b: list[Measured]) -> str:
    def m(runs: list[Measured], key: Callable[[Measured], float]) -> float:
        return _median(runs, key)

    return (
        f"{row.name}, c={row.concurrency}: tok/s A {m(a, lambda r: r.rate):,.0f} B {m(b, lambda r: r.rate):,.0f}; "
        f"gap p50 A {m(a, lambda r: r.gap_p50_ms):.1f} B {m(b, lambda r: r.gap_p50_ms):.1f} ms, "
        f"p99 A {m(a, lambda r: r.gap_p99_ms):.1f} B {m(b, lambda r: r.gap_p99_ms):.1f} ms; "
        f"tok/event A {m(a, lambda r: r.tokens_per_event):.2f} B {m(b, lambda r: r.tokens_per_event):.2f}; "
        f"CPU µs/token A {m(a, lambda r: r.us_per_token):.1f} B {m(b, lambda r: r.us_per_token):.1f}; "
        f"failed A {sum(r.failed for r in a)} B {sum(r.failed for r in b)}"
    )


def goals(results: list[tuple[Row, list[Measured], list[Measured]]]) -> list[str]:
    def worst(rows: list[tuple[Row, list[Measured], list[Measured]]], f: Callable[..., float], high: bool) -> float:
        values = [f(a, b) for _, a, b in rows]
        return max(values) if high else min(values)

    paced = [r for r in results if r[0].decode_ms > 0]
    sat5 = [r for r in results if r[0].decode_ms == 0 and r[0].interval == 5]
    sat1 = [r for r in results if r[0].decode_ms == 0 and r[0].interval == 1]
    out: list[tuple[str, float, str, float, bool]] = []
    if paced:
        p50 = worst(paced, lambda a, b: _median(b, lambda r: r.gap_p50_ms) / _median(a, lambda r: r.gap_p50_ms), True)
        p99 = worst(paced, lambda a, b: _median(b, lambda r: r.gap_p99_ms) / _median(a, lambda r: r.gap_p99_ms), True)
        tpe = worst(paced, lambda a, b: _median(b, lambda r: r.tokens_per_event), True)
        c64 = [r for r in paced if r[0].decode_ms == 10 and r[0].concurrency == 64] or paced
        cpu = worst(c64, lambda a, b: _median(b, lambda r: r.us_per_token) / _median(a, lambda r: r.us_per_token), True)
        out += [
            ("paced_gap_p50_ratio", p50, "<=", 1.10, p50 <= 1.10),
            ("paced_gap_p99_ratio", p99, "<=", 1.20, p99 <= 1.20),
            ("paced_tokens_per_event", tpe, "<=", 1.2, tpe <= 1.2),
            ("paced_cpu_per_token_ratio", cpu, "<=", 1.5, cpu <= 1.5),
        ]
    if sat5:
        ratio = worst(sat5, lambda a, b: _median(b, lambda r: r.rate) / _median(a, lambda r: r.rate), False)
        out.append(("saturated_equal_chunk_ratio", ratio, ">=", 0.9, ratio >= 0.9))
    if sat1:
        us = worst(sat1, lambda a, b: _median(b, lambda r: r.us_per_token), True)
        out.append(("saturated_us_per_message", us, "<=", 25.0, us <= 25.0))
    return [
        f"goal {name}: {value:.3f} (target {op} {target:g}) {'met' if ok else 'MISSED'}"
        for name, value, op, target, ok in out
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.paced", description=__doc__.split("\n")[0] if __doc__ else ""
    )
    parser.add_argument("--quick", action="store_true", help="concurrency 16 only, one round, shorter answers")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--requests-per-slot", type=int, default=2, help="paced rows: requests per concurrency slot")
    parser.add_argument(
        "--sidecar-tree", type=Path, default=None, help="also run the sidecar of another checkout (path R), same rounds"
    )
    parser.add_argument(
        "--rows", default="", help="only these settings: paced10, paced20, sat5, sat1 (comma-separated)"
    )
    parser.add_argument("--concurrency", type=int, default=0, help="only this concurrency")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.max_tokens, args.requests_per_slot = 1, 60, 1
    results = trio.run(run, args)
    print()
    for text in goals(results):
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
