"""The graceful stop, destructive and only with ``--include-stop``: open streams finish, new ones are refused
(trtllm §3 'Stop grace': GOAWAY, streams keep running up to the grace, then are cut)."""

from __future__ import annotations

import asyncio
import sys
from contextlib import suppress

from grpclib.const import Status

from ._context import Context
from ._model import FailCheck, Outcome, SkipCheck
from ._registry import check
from ._wire import Observation, generate
from .rules import assemble, event_of, terminal_index

#: Open streams are sized to last about this long (well inside TensorRT-LLM's 5 s grace).
_STREAM_SECONDS = 1.5
_STREAMS = 2
_PROBE_INTERVAL_S = 0.1


async def _run_stop_command(command: tuple[str, ...]) -> None:
    try:
        process = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL
        )
    except OSError as exc:
        raise FailCheck(f"--stop-command {command[0]!r} could not start: {exc}") from None
    try:
        code = await asyncio.wait_for(process.wait(), 10.0)
    except TimeoutError:
        process.kill()
        raise FailCheck("--stop-command did not exit within 10 s") from None
    if code != 0:
        raise FailCheck(f"--stop-command exited {code}")


async def _refused(ctx: Context) -> str | None:
    """Try one new request on a new connection: the reason it was refused, or ``None`` if it was served."""
    channel = ctx.config.target.channel()
    try:
        obs = await generate(channel, ctx.request("after-stop", max_tokens=1), bound=ctx.config.rpc_timeout)
    finally:
        channel.close()
    if obs.accepted:
        return None
    return obs.describe_end()


@check(
    "stop.graceful",
    "on a graceful stop, open streams run to their terminal event (GOAWAY with grace) and new requests are refused",
    "trtllm §3 'Stop grace', §12 item 15",
    destructive=True,
)
async def graceful(ctx: Context) -> Outcome:
    if not ctx.config.include_stop:
        raise SkipCheck("destructive: needs --include-stop")
    base = await ctx.good_baseline()
    per_token = base.seconds / max(len(assemble(base)[0]), 1)
    tokens = max(16, min(ctx.hold_tokens, int(_STREAM_SECONDS / max(per_token, 1e-4))))
    channel = ctx.config.target.channel(tolerate_goaway=True)
    loop = asyncio.get_running_loop()
    wait = ctx.config.stop_wait
    streams = [Observation(request_id=ctx.new_id(f"stop-{i}"), n=1) for i in range(_STREAMS)]
    tasks = []
    for obs in streams:
        obs.request = ctx.request("stop", max_tokens=tokens, request_id=obs.request_id)
        tasks.append(asyncio.create_task(generate(channel, obs.request, bound=wait, observation=obs)))
    try:
        for obs in streams:
            with suppress(TimeoutError):
                await asyncio.wait_for(obs.first_message.wait(), ctx.config.settle)
        if not all(obs.accepted for obs in streams):
            raise FailCheck(f"the streams to stop under did not start: {[o.describe_end() for o in streams]}")
        started = loop.time()
        if ctx.config.stop_command:
            await _run_stop_command(ctx.config.stop_command)
        else:
            print(
                f"openengine-conformance: stop the engine now (SIGTERM); waiting up to {wait:g} s",
                file=sys.stderr,
                flush=True,
            )
        refused: str | None = None
        while loop.time() - started < wait:
            if channel.goaways:
                break
            refused = await _refused(ctx)
            if refused is not None:
                break
            if all(obs.done.is_set() for obs in streams):
                raise SkipCheck(f"the streams ({tokens} tokens) ended before the stop took effect")
            await asyncio.sleep(_PROBE_INTERVAL_S)
        else:
            raise FailCheck(f"no sign of a stop within {wait:g} s (no GOAWAY, new requests still served)")
        stopped = loop.time() - started
        if refused is None:
            refused = await _refused(ctx)
            if refused is None:
                raise FailCheck("a new request on a new connection was served after GOAWAY")
        await asyncio.wait(tasks, timeout=wait)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        channel.close()
    for obs in streams:
        end = terminal_index(obs)
        if end is None or event_of(obs.messages[end]) != "finished" or obs.status is not Status.OK:
            raise FailCheck(
                f"{obs.request_id!r} was cut: {len(obs.messages)} messages, {obs.describe_end()},"
                f" {obs.seconds:.2f} s after it started"
            )
    # GoAway.at is time.monotonic(), the clock asyncio's loop.time() reads.
    goaway = f"GOAWAY at +{channel.goaways[0].at - started:.2f} s" if channel.goaways else "no GOAWAY seen"
    return Outcome.passed(
        f"stop seen after {stopped:.2f} s ({goaway}); {_STREAMS} open streams of {tokens} tokens finished, OK;"
        f" a new request: {refused}"
    )
