"""Path A of ``bench.e2e``: a plain in-process Dynamo Python worker that yields the engine's tokens itself.

The shape of Dynamo's in-process backends: one asyncio (uvloop) thread, ``serve_endpoint`` with an async generator
that yields **one chunk per token** (``{"token_ids": [t], "index": 0}``, the last with ``finish_reason`` and
``completion_usage``). It is registered with the same ``register_model`` call and the same card fields as the sidecar
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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvloop
from dynamo.runtime import DistributedRuntime

from bench._e2e_common import Table
from sidecar.dynamo import Registration
from sidecar.dynamo._bindings import register

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


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


def _pace_s(request: dict[str, Any]) -> float:
    for annotation in request.get("annotations") or ():
        key, _, value = str(annotation).partition(":")
        if key == "pace_ms":
            return float(value) / 1000
    return 0.0


def make_generate(tokens: Tokens) -> Any:
    async def generate(request: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        prompt = len(request.get("token_ids") or ())
        ids = tokens.lookup(request) if request.get("sampling_options") else None
        if not ids:  # health canary, or a request the table does not cover
            usage = {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}
            yield {"token_ids": [], "index": 0, "finish_reason": "stop", "completion_usage": usage}
            return
        pace = _pace_s(request)
        loop = asyncio.get_running_loop()
        due = loop.time()
        last = len(ids) - 1
        for i, token in enumerate(ids):
            if pace:  # an engine's decode step (bench.e2e's paced run); absolute deadlines, so no drift
                due += pace
                await asyncio.sleep(due - loop.time())
            if i < last:
                yield {"token_ids": [token], "index": 0}
            else:
                usage = {"prompt_tokens": prompt, "completion_tokens": len(ids), "total_tokens": prompt + len(ids)}
                yield {"token_ids": [token], "index": 0, "finish_reason": "length", "completion_usage": usage}

    return generate


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
