"""A tiny Dynamo worker for end-to-end tests: ``open_edge`` + ``open_dynamo`` + ``register`` + ``serve`` with a trio
echo handler that yields the prompt tokens back in batches.

Run as ``python tests/dynamo/echo_worker.py --model-path DIR [--tag a] [...]`` with the Dynamo environment of
``tests.helpers.processes.DynamoEnv``. Lines it prints (the tests wait for them)::

    READY <instance id hex> runtime=<s> serve=<s> register=<s>
    REQ <tag> <request id> annotations=<...>
    CANCELLED <tag> <request id> <time.monotonic()>     the trio handler task saw trio.Cancelled
    DONE <tag> <request id>
    OK <command> <result>                                answer to a stdin command
    SHUTDOWN_BEGIN / SHUTDOWN_DONE / EXIT

Per-request behaviour comes from ``nvext.annotations`` (``"key:value"`` strings):

    delay:<s>          sleep before each batch (default 0)
    batch:<n>          tokens per batch (default 2)
    fail:<Kind>        raise a SidecarError of that DynamoErrorKind value (or RequestRejected, RuntimeError, ...)
    fail_at:<n>        raise after n tokens were sent (default 0: before the first token)
    fail_tag:<tag>     raise only on the worker started with --tag <tag>

Commands on stdin, one per line: withdraw, restore, unregister, register, republish, present, health <0|1>, abort
(leave the serving nursery without calling ``shutdown``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

import trio

from sidecar.dynamo import ChunkSink, DynamoSettings, DynamoWorker, Registration, RequestContext, open_dynamo
from sidecar.edge import open_edge
from sidecar.errors import DynamoErrorKind, EngineGone, RequestRejected, SidecarError, WorkerDraining

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from sidecar.edge import Edge


def say(*parts: object) -> None:
    # One write per line: print(*parts) writes each part separately, and the runtime's Rust log lines (same stdout)
    # can land in between, splitting a line the test waits for.
    sys.stdout.write(" ".join(map(str, parts)) + "\n")
    sys.stdout.flush()


def make_error(name: str, tag: str) -> BaseException:
    message = f"worker {tag} says {name}"
    if name == "RequestRejected":
        return RequestRejected("messages", "rejected on purpose")
    if name == "EngineGone":
        return EngineGone(message)
    if name == "WorkerDraining":
        return WorkerDraining(message)
    if name in {k.value for k in DynamoErrorKind}:
        error = SidecarError(message)
        error.kind = DynamoErrorKind(name)
        return error
    builtin = {"RuntimeError": RuntimeError, "TimeoutError": TimeoutError, "ConnectionError": ConnectionError}
    return builtin.get(name, RuntimeError)(message)


def parse_annotations(ctx: RequestContext) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in ctx.annotations:
        key, _, value = item.partition(":")
        out[key] = value
    return out


class Echo:
    def __init__(self, tag: str, edge: Edge) -> None:
        self.tag = tag
        self.edge = edge

    async def handle(self, request: dict[str, Any], ctx: RequestContext, outbox: ChunkSink) -> None:
        """The adapter's handler: each batch of :meth:`batches` goes to the outbox on the edge loop; a stop from
        Dynamo cancels it; an exception reaches the adapter, which fails the outbox with it."""
        edge = self.edge
        with trio.CancelScope() as scope:

            def stop() -> None:
                edge.to_trio(scope.cancel)

            def watch() -> None:
                outbox.on_stop = stop
                if outbox.stopped:
                    stop()

            edge.to_loop(watch)
            async for batch in self.batches(request, ctx):
                edge.to_loop(outbox.deliver, batch)
            edge.to_loop(outbox.end)

    async def batches(self, request: dict[str, Any], ctx: RequestContext) -> AsyncIterator[list[dict[str, Any]]]:
        opts = parse_annotations(ctx)
        say("REQ", self.tag, ctx.request_id, f"annotations={list(ctx.annotations)}", f"trace={ctx.trace_headers}")
        prompt: list[int] = list(request.get("token_ids") or [1])
        stop = request.get("stop_conditions") or {}
        max_tokens = int(stop.get("max_tokens") or 16)
        delay = float(opts.get("delay", "0"))
        batch = max(1, int(opts.get("batch", "2")))
        fail = opts.get("fail")
        if fail and opts.get("fail_tag", self.tag) != self.tag:
            fail = None
        fail_at = int(opts.get("fail_at", "0"))
        sent = 0
        try:
            while sent < max_tokens:
                if fail and sent >= fail_at:
                    raise make_error(fail, self.tag)
                if delay:
                    # Not a synchronisation: the echo engine's pace (the request's delay annotation).
                    await trio.sleep(delay)
                n = min(batch, max_tokens - sent)
                if fail:
                    n = min(n, max(1, fail_at - sent))
                chunks: list[dict[str, Any]] = [{"token_ids": [prompt[(sent + i) % len(prompt)]]} for i in range(n)]
                sent += n
                if sent >= max_tokens:
                    chunks[-1]["finish_reason"] = "length"
                    chunks[-1]["completion_usage"] = {
                        "prompt_tokens": len(prompt),
                        "completion_tokens": sent,
                        "total_tokens": len(prompt) + sent,
                    }
                yield chunks
            say("DONE", self.tag, ctx.request_id)
        except trio.Cancelled:
            say("CANCELLED", self.tag, ctx.request_id, f"{time.monotonic():.6f}")
            raise


async def commands(worker: DynamoWorker, reg: Registration, nursery: trio.Nursery) -> None:
    stdin = trio.lowlevel.FdStream(0)
    buffer = b""
    while True:
        data = await stdin.receive_some()
        if not data:
            return
        buffer += data
        while b"\n" in buffer:
            raw, buffer = buffer.split(b"\n", 1)
            command = raw.decode().strip()
            if not command:
                continue
            t0 = time.monotonic()
            result: object = None
            try:
                if command == "withdraw":
                    await worker.withdraw()
                elif command == "restore":
                    await worker.restore()
                elif command == "unregister":
                    await worker.unregister()
                elif command == "register":
                    await worker.register(reg)
                elif command == "republish":
                    await worker.republish()
                elif command == "present":
                    result = await worker.registration_present()
                elif command == "abort":
                    # Leave without worker.shutdown(): open_dynamo's exit must clean up on its own.
                    nursery.cancel_scope.cancel(reason="abort command")
                elif command.startswith("health "):
                    worker.set_health(command.split()[1] == "1")
                else:
                    result = "unknown"
            except Exception as exc:
                result = f"error:{exc!r}"
            say("OK", command.replace(" ", "_"), result, f"{time.monotonic() - t0:.4f}")


async def main(args: argparse.Namespace) -> None:
    settings = DynamoSettings(namespace=args.namespace, component=args.component, endpoint=args.endpoint)
    reg = Registration(
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        context_length=2048,
        kv_block_size=16,
        total_kv_blocks=1000,
        max_num_seqs=64,
        runtime_data={"openengine_engine": "echo", "tag": args.tag},
    )
    t0 = time.monotonic()
    async with open_edge() as edge, open_dynamo(edge, settings) as worker:
        echo = Echo(args.tag, edge)
        t_runtime = time.monotonic() - t0
        async with trio.open_nursery() as nursery:
            t1 = time.monotonic()
            payload = None if args.no_health_payload else {"token_ids": [1], "stop_conditions": {"max_tokens": 1}}
            await worker.serve(nursery, echo.handle, health_check_payload=payload)
            t_serve = time.monotonic() - t1
            t2 = time.monotonic()
            await worker.register(reg)
            t_register = time.monotonic() - t2
            worker.set_health(True)
            say(
                "READY",
                f"{worker.instance_id:x}",
                f"runtime={t_runtime:.4f}",
                f"serve={t_serve:.4f}",
                f"register={t_register:.4f}",
            )
            if args.stdin:
                nursery.start_soon(commands, worker, reg, nursery)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break
            say("SHUTDOWN_BEGIN")
            with trio.move_on_after(args.drain_timeout):
                await worker.shutdown()
            say("SHUTDOWN_DONE")
            nursery.cancel_scope.cancel(reason="worker exit")
    say("EXIT")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--served-model-name", default="tiny")
    parser.add_argument("--namespace", default="dynamo")
    parser.add_argument("--component", default="backend")
    parser.add_argument("--endpoint", default="generate")
    parser.add_argument("--tag", default="a")
    parser.add_argument("--drain-timeout", type=float, default=20.0)
    parser.add_argument("--stdin", action="store_true", help="read commands from stdin")
    parser.add_argument("--no-health-payload", action="store_true", help="serve without health_check_payload")
    trio.run(main, parser.parse_args())
