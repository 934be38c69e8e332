"""Path A of ``bench.paced``: an in-process Dynamo worker paced like ``openengine-mock``, N tokens per chunk.

    python -m bench._paced_worker --served-model-name NAME --model-path DIR --decode-ms 10 --interval 1

Per request: the mock's decode loop without the engine -- a step of ``decode_ms × (1 + (in flight - 1) / 64)`` (the
mock's batch slowdown, ``sidecar/testing/mock/engine.py``), absolute deadlines (no drift), and one chunk every
``interval`` tokens (the engine's ``stream_interval``: one chunk per engine message, as an in-process backend yields
them). ``--decode-ms 0``: no steps, as fast as the worker goes (the saturated rows). Token ids cycle through a fixed
range of the tiny model's vocabulary; the last chunk carries ``length`` and usage.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import TYPE_CHECKING, Any, Final

import uvloop
from dynamo.runtime import DistributedRuntime

from sidecar.dynamo import Registration
from sidecar.dynamo._bindings import register

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

# The mock's batch slowdown (its decode step grows by 1/64 of the step per extra sequence decoding).
_BATCH_SLOWDOWN: Final = 64.0
_FIRST_ID: Final = 300
_IDS: Final = 200


def make_generate(decode_ms: float, interval: int) -> Any:
    in_flight = 0

    async def generate(request: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        nonlocal in_flight
        prompt = len(request.get("token_ids") or ())
        stop = request.get("stop_conditions") or {}
        max_tokens = int(stop.get("max_tokens") or 16)
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        in_flight += 1
        try:
            sent = 0
            while sent < max_tokens:
                n = min(interval, max_tokens - sent)
                for _ in range(n):
                    if decode_ms > 0:
                        step = decode_ms / 1000.0 * (1.0 + (in_flight - 1) / _BATCH_SLOWDOWN)
                        now = loop.time()
                        next_at = max(next_at + step, now)
                        await asyncio.sleep(next_at - now)
                ids = [_FIRST_ID + (sent + i) % _IDS for i in range(n)]
                sent += n
                chunk: dict[str, Any] = {"token_ids": ids, "index": 0}
                if sent >= max_tokens:
                    chunk["finish_reason"] = "length"
                    chunk["completion_usage"] = {
                        "prompt_tokens": prompt,
                        "completion_tokens": sent,
                        "total_tokens": prompt + sent,
                    }
                yield chunk
        finally:
            in_flight -= 1

    return generate


async def main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    endpoint = runtime.endpoint(f"dynamo.{args.component}.generate")
    registration = Registration(
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        context_length=4096,
        kv_block_size=16,
        total_kv_blocks=262144,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        runtime_data={"openengine_engine": "bench-paced"},
    )
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, runtime.shutdown)
    generate = make_generate(args.decode_ms, args.interval)
    serving = asyncio.ensure_future(
        endpoint.serve_endpoint(generate, graceful_shutdown=True, health_check_payload={"token_ids": [1]})
    )
    await register(endpoint, registration)
    print("READY", flush=True)
    await serving


def cli() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench._paced_worker")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--component", default="paced")
    parser.add_argument("--decode-ms", type=float, default=10.0)
    parser.add_argument("--interval", type=int, default=1)
    uvloop.run(main(parser.parse_args()))


if __name__ == "__main__":
    cli()
