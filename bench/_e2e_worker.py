"""Path A of ``bench.e2e``: a plain in-process Dynamo Python worker that yields the engine's tokens itself.

The shape of Dynamo's in-process backends: one asyncio (uvloop) thread, ``serve_endpoint`` with an async generator
that yields **one chunk per engine message** (``{"token_ids": [...], "index": 0}``, the last with ``finish_reason``
and ``completion_usage``): with the mock sending 5 tokens per message, 5-token chunks ("A5"), as an in-process backend
passes on what its engine hands it. With a paced engine it sleeps the mock's decode steps (:class:`Shape`). It is
registered with the same ``register_model`` call and the same card fields as the sidecar
(``sidecar.dynamo._bindings.register``), under its own served name and component.

It does no model work: the tokens come from the table that ``bench.e2e`` built by asking ``openengine-mock`` (path C),
keyed by (prompt token ids, seed). A request the table does not cover is written to ``--record`` (that is how the
bench learns the prompt's token ids) and answered with an empty ``stop``.

    python -m bench._e2e_worker --model-path DIR --served-model-name bench-a --table T.json --record R.json ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvloop
from dynamo.runtime import DistributedRuntime

from bench._e2e_common import Table
from sidecar.dynamo import Registration
from sidecar.dynamo._bindings import register

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable


class Tokens:
    """The table, (re)read when a request misses it (the bench writes it after the worker started)."""

    def __init__(self, table: Path, record: Path) -> None:
        self._path = table
        self._record = record
        self._streams: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def _reload(self) -> None:
        if self._path.exists():
            table = Table.load(self._path)
            prompt = tuple(table.prompt_ids)
            self._streams = {(prompt, seed): stream.ids for seed, stream in table.streams.items()}

    def lookup(self, request: dict[str, Any]) -> list[int] | None:
        seed = (request.get("sampling_options") or {}).get("seed")
        key = (tuple(request.get("token_ids") or ()), int(seed) if seed is not None else -1)
        max_tokens = (request.get("stop_conditions") or {}).get("max_tokens")
        ids = self._streams.get(key)
        if ids is None:
            self._reload()
            ids = self._streams.get(key)
        if ids is None or max_tokens is None or max_tokens > len(ids):
            tmp = self._record.with_suffix(".tmp")
            tmp.write_text(json.dumps(request))
            tmp.replace(self._record)
            return None
        return ids[:max_tokens]


@dataclass(frozen=True, slots=True)
class Shape:
    """How the engine behind path B paces and cuts its output, as the bench tells this worker per request
    (``nvext.annotations``, ``key:value``) so that it yields the same stream in the same rhythm:

    * ``tokens_per_message:N`` -- one chunk per N tokens (the mock's ``--stream-interval``), the last chunk with what
      is left, as an in-process backend passes on what its engine hands it;
    * ``pace_ms:X`` -- X ms of decode per token (``--decode-ms-per-token``, ``--speedup 1``); 0 = as fast as it goes;
    * ``batch_slowdown:S`` -- a step lasts ``pace_ms × (1 + (B − 1) / S)`` with ``B`` the requests decoding at once
      in this worker, as the mock computes its steps (absent: every step lasts ``pace_ms``);
    * ``prefill_tokens_per_s:R`` -- the prompt takes ``len(prompt) / R`` before the first step, as the mock's prefill;
    * ``step_clock:engine`` -- one step for every request of this worker (:class:`StepClock`), as the mock's
      ``--step-clock engine``; absent (or ``per-request``): each request sleeps its own steps.
    """

    tokens_per_message: int = 1
    pace_s: float = 0.0
    batch_slowdown: float = 0.0
    prefill_tokens_per_s: float = 0.0
    engine_clock: bool = False

    @classmethod
    def of(cls, request: dict[str, Any]) -> Shape:
        values: dict[str, str] = {}
        for annotation in request.get("annotations") or ():
            key, _, value = str(annotation).partition(":")
            values[key] = value
        return cls(
            tokens_per_message=max(1, int(values.get("tokens_per_message", 1))),
            pace_s=float(values.get("pace_ms", 0)) / 1000,
            batch_slowdown=float(values.get("batch_slowdown", 0)),
            prefill_tokens_per_s=float(values.get("prefill_tokens_per_s", 0)),
            engine_clock=values.get("step_clock", "per-request") == "engine",
        )

    def step_s(self, decoding: int) -> float:
        if self.batch_slowdown <= 0:
            return self.pace_s
        return self.pace_s * (1.0 + (max(decoding, 1) - 1) / self.batch_slowdown)


class StepClock:
    """The mock's ``--step-clock engine`` in this worker: one step for all its decoding requests. One timer per step;
    the requests waiting for it wait on one ``asyncio.Event``, set at the step, so they all wake in one pass of the
    loop. A step lasts ``step_s()`` at the batch of its start, on absolute deadlines (a late step starts from now); the
    clock stops when ``busy()`` says nothing decodes, and restarts one step ahead with the next request that waits."""

    def __init__(self, step_s: Callable[[], float], busy: Callable[[], bool]) -> None:
        self._step_s = step_s
        self._busy = busy
        self._event: asyncio.Event | None = None
        self._due = 0.0
        self.steps = 0

    async def next_step(self) -> None:
        event = self._event
        if event is None:
            loop = asyncio.get_running_loop()
            event = self._event = asyncio.Event()
            self._due = loop.time() + self._step_s()
            loop.call_at(self._due, self._step)
        await event.wait()

    def _step(self) -> None:
        assert self._event is not None
        event, self._event = self._event, None
        self.steps += 1
        event.set()
        if self._busy():
            loop = asyncio.get_running_loop()
            self._event = asyncio.Event()
            self._due = max(self._due + self._step_s(), loop.time())
            loop.call_at(self._due, self._step)


def make_generate(tokens: Tokens) -> Any:
    decoding = 0  # requests of this worker in their decode steps (the mock's batch size, for paced steps)
    clocks: dict[tuple[float, float], StepClock] = {}  # one engine-wide clock per step model

    async def generate(request: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        nonlocal decoding
        prompt = len(request.get("token_ids") or ())
        ids = tokens.lookup(request) if request.get("sampling_options") else None
        if not ids:  # health canary, or a request the table does not cover
            usage = {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}
            yield {"token_ids": [], "index": 0, "finish_reason": "stop", "completion_usage": usage}
            return
        shape = Shape.of(request)
        every = shape.tokens_per_message
        last = len(ids)
        if not shape.pace_s:
            for at in range(0, last, every):
                chunk = ids[at : at + every]
                if at + every < last:
                    yield {"token_ids": chunk, "index": 0}
                else:
                    yield _final(chunk, prompt, last)
            return
        # An engine's decode steps (bench.e2e's paced rows), as the mock runs them: absolute deadlines, a step late
        # starts from now rather than catching up.
        loop = asyncio.get_running_loop()
        if shape.prefill_tokens_per_s > 0:
            await asyncio.sleep(prompt / shape.prefill_tokens_per_s)
        clock: StepClock | None = None
        if shape.engine_clock:
            key = (shape.pace_s, shape.batch_slowdown)
            clock = clocks.get(key)
            if clock is None:
                clock = clocks[key] = StepClock(lambda: shape.step_s(decoding), lambda: decoding > 0)
        decoding += 1
        counted = True
        try:
            due = loop.time()
            pending: list[int] = []
            for i, token in enumerate(ids):
                if clock is not None:
                    await clock.next_step()
                else:
                    now = loop.time()
                    due = max(due + shape.step_s(decoding), now)
                    await asyncio.sleep(due - now)
                pending.append(token)
                if i + 1 == last:
                    decoding -= 1  # out of the batch before its final chunk goes, as the mock ends the output first
                    counted = False
                    yield _final(pending, prompt, last)
                elif len(pending) >= every:
                    yield {"token_ids": pending, "index": 0}
                    pending = []
        finally:
            if counted:  # cancelled mid-stream
                decoding -= 1

    return generate


def _final(chunk: list[int], prompt: int, total: int) -> dict[str, Any]:
    usage = {"prompt_tokens": prompt, "completion_tokens": total, "total_tokens": prompt + total}
    return {"token_ids": chunk, "index": 0, "finish_reason": "length", "completion_usage": usage}


async def main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    endpoint = runtime.endpoint(f"{args.namespace}.{args.component}.generate")
    registration = Registration(
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        model_input="tokens",
        endpoint_types=("chat", "completions"),
        worker_type="aggregated",
        context_length=args.context_length,
        kv_block_size=args.kv_block_size,
        total_kv_blocks=args.total_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        runtime_data={"openengine_engine": "openengine-mock"},
    )
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, runtime.shutdown)
    generate = make_generate(Tokens(Path(args.table), Path(args.record)))
    serving = asyncio.ensure_future(
        endpoint.serve_endpoint(generate, graceful_shutdown=True, health_check_payload={"token_ids": [1]})
    )
    await register(endpoint, registration)
    print("READY", flush=True)
    await serving


def cli() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench._e2e_worker", description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--namespace", default="dynamo")
    parser.add_argument("--component", default="baseline")
    parser.add_argument("--table", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--context-length", type=int, required=True)
    parser.add_argument("--kv-block-size", type=int, required=True)
    parser.add_argument("--total-kv-blocks", type=int, required=True)
    parser.add_argument("--max-num-seqs", type=int, required=True)
    parser.add_argument("--max-num-batched-tokens", type=int, required=True)
    uvloop.run(main(parser.parse_args()))


if __name__ == "__main__":
    cli()
