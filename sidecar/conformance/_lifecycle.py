"""Abort, cancellation, Health and GetLoad (wire §7.8, §7.10, §4 LoadInfo; trtllm §10)."""

from __future__ import annotations

import asyncio
import time

from grpclib.const import Status

from openengine.v1 import generation_pb2, lifecycle_pb2, server_pb2

from ._context import Context
from ._model import FailCheck, Outcome, SkipCheck
from ._registry import check
from .rules import event_of, terminal_index

#: How far GetLoad's timestamp may stray from the kit's clock (a snapshot up to 30 s old is TensorRT-LLM's bound).
_LOAD_AGE_S = 30.0


def _idle_note(running: int | None, waited: float, settle: float) -> str:
    if running is None:
        return "GetLoad reports no running_requests"
    if running:
        raise FailCheck(f"GetLoad still counts {running} running request(s) {settle:g} s later")
    return f"GetLoad running_requests 0 after {waited:.2f} s"


@check(
    "abort.mid_stream",
    "Abort(request_id) mid-stream answers ABORTED; the stream ends finished(CANCELLED) + usage, OK; GetLoad → 0",
    "wire §7.8; trtllm §10 Abort, §7 'Termination'",
)
async def abort_mid_stream(ctx: Context) -> Outcome:
    settle = ctx.config.settle
    async with ctx.hold("abort") as hold:
        if not hold.streaming:
            raise SkipCheck(f"could not hold a request open to abort ({hold.obs.describe_end()})")
        loop = asyncio.get_running_loop()
        sent = loop.time()
        answer = await ctx.unary(ctx.control.Abort, lifecycle_pb2.AbortRequest(request_id=hold.obs.request_id))
        if not answer.ok:
            raise FailCheck(f"Abort({hold.obs.request_id!r}): {answer.describe()}")
        status = answer.get().status
        if status == lifecycle_pb2.ABORT_STATUS_ALREADY_FINISHED and hold.obs.done.is_set():
            raise SkipCheck("the request finished before the abort arrived; nothing to judge")
        if status != lifecycle_pb2.ABORT_STATUS_ABORTED:
            raise FailCheck(f"Abort of a streaming request answered {lifecycle_pb2.AbortStatus.Name(status)}")
        if not await hold.wait_done(settle):
            raise FailCheck(f"the stream did not end within {settle:g} s of ABORTED")
        ended = loop.time() - sent
    obs = hold.obs
    end = terminal_index(obs)
    if end is None:
        raise FailCheck(f"after ABORTED the stream ended without a terminal event ({obs.describe_end()})")
    final = obs.messages[end]
    if event_of(final) != "finished" or final.finished.reason != generation_pb2.FINISH_REASON_CANCELLED:
        raise FailCheck(f"after ABORTED the terminal event is {event_of(final)} {final.finished.reason}, not CANCELLED")
    if not final.HasField("usage"):
        raise FailCheck("finished(CANCELLED) after the abort carries no usage")
    if obs.status is not Status.OK:
        raise FailCheck(f"after finished(CANCELLED) the call ended {obs.describe_end()}, not OK")
    running, waited = await ctx.wait_idle()
    note = _idle_note(running, waited, settle)
    return Outcome.passed(f"ABORTED; finished(CANCELLED) + usage, OK, {ended:.2f} s after the Abort; {note}")


@check(
    "abort.unknown_id",
    "Abort of an unknown request_id: NOT_FOUND (TensorRT-LLM: ALREADY_FINISHED, idempotent success)",
    "wire §7.8; trtllm §10 Abort",
)
async def abort_unknown(ctx: Context) -> Outcome:
    request_id = ctx.new_id("never-sent")
    answer = await ctx.unary(ctx.control.Abort, lifecycle_pb2.AbortRequest(request_id=request_id))
    if answer.ok:
        status = answer.get().status
        if status == lifecycle_pb2.ABORT_STATUS_ALREADY_FINISHED:
            return Outcome.variant("ALREADY_FINISHED (TensorRT-LLM's idempotent answer)")
        raise FailCheck(f"answered {lifecycle_pb2.AbortStatus.Name(status)} for an id never sent")
    if answer.status is Status.NOT_FOUND:
        return Outcome.passed(f"NOT_FOUND ({answer.details})")
    raise FailCheck(f"{answer.describe()}; expected NOT_FOUND or ALREADY_FINISHED")


@check(
    "abort.no_target",
    "Abort without a target is refused INVALID_ARGUMENT",
    "wire §7.8; trtllm §9 Control RPCs",
)
async def abort_no_target(ctx: Context) -> Outcome:
    answer = await ctx.unary(ctx.control.Abort, lifecycle_pb2.AbortRequest())
    if answer.status is Status.INVALID_ARGUMENT:
        return Outcome.passed(f"INVALID_ARGUMENT ({answer.details})")
    raise FailCheck(f"{answer.describe()}; expected INVALID_ARGUMENT")


@check(
    "abort.rpc_cancel",
    "cancelling the Generate RPC aborts the request: GetLoad returns to 0 and its request_id is free again",
    "trtllm §10 'Client cancellation / disconnect'",
)
async def rpc_cancel(ctx: Context) -> Outcome:
    settle = ctx.config.settle
    async with ctx.hold("cancel") as hold:
        if not hold.streaming:
            raise SkipCheck(f"could not hold a request open to cancel ({hold.obs.describe_end()})")
        hold.task.cancel()
        await hold.wait_done(settle)
    running, waited = await ctx.wait_idle()
    note = _idle_note(running, waited, settle)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settle
    while True:
        again = await ctx.observe(ctx.request("cancel-reuse", max_tokens=2, request_id=hold.obs.request_id))
        if again.accepted or again.status is not Status.ALREADY_EXISTS or loop.time() > deadline:
            break
        await asyncio.sleep(0.05)
    if not again.accepted:
        raise FailCheck(f"re-using the cancelled request's id: {again.describe_end()}")
    return Outcome.passed(f"RPC cancelled; {note}; the id is accepted again")


def _state_name(state: int) -> str:
    if state in lifecycle_pb2.HealthState.values():
        return str(lifecycle_pb2.HealthState.Name(state)).removeprefix("HEALTH_STATE_")
    return f"unknown({state})"


def _judge_health(response: lifecycle_pb2.HealthResponse) -> str:
    checks = [(c.name, c.state) for c in response.checks]
    if response.state == lifecycle_pb2.HEALTH_STATE_UNSPECIFIED:
        raise FailCheck(f"overall state UNSPECIFIED, checks {checks}")
    if any(not name for name, _ in checks):
        raise FailCheck("a health check without a name")
    not_ready = [name for name, state in checks if state != lifecycle_pb2.HEALTH_STATE_READY]
    shown = ", ".join(f"{name} {_state_name(state)}" for name, state in checks)
    if not_ready and response.state == lifecycle_pb2.HEALTH_STATE_READY:
        raise FailCheck(f"READY overall while checks {not_ready} are not ({shown})")
    if response.state != lifecycle_pb2.HEALTH_STATE_READY:
        raise FailCheck(f"the engine is {_state_name(response.state)} ({shown}); qualify a ready engine")
    return shown


@check(
    "control.health",
    "Health answers a v0.1.0 state consistent with its named checks; a qualifying engine is READY",
    "wire §7.10, §3 HealthState; trtllm §10 Health",
)
async def health(ctx: Context) -> Outcome:
    answer = await ctx.unary(ctx.control.Health, lifecycle_pb2.HealthRequest())
    if not answer.ok:
        raise FailCheck(f"Health: {answer.describe()}")
    return Outcome.passed(f"READY in {answer.seconds:.2f} s ({_judge_health(answer.get())})")


@check(
    "control.health_probe",
    "Health with include_inference_probe reports the probe as an extra check",
    "wire §7.10; trtllm §10 Health",
)
async def health_probe(ctx: Context) -> Outcome:
    bound = max(ctx.config.rpc_timeout, 35.0)  # TensorRT-LLM bounds its probe to 30 s
    answer = await ctx.unary(ctx.control.Health, lifecycle_pb2.HealthRequest(include_inference_probe=True), bound=bound)
    if not answer.ok:
        raise FailCheck(f"Health(include_inference_probe): {answer.describe()}")
    response = answer.get()
    shown = _judge_health(response)
    names = [c.name for c in response.checks]
    if len(names) < 2 or not any("probe" in name for name in names):
        raise FailCheck(f"no inference-probe check among {names}")
    running, waited = await ctx.wait_idle()
    return Outcome.passed(
        f"READY in {answer.seconds:.2f} s ({shown}); {_idle_note(running, waited, ctx.config.settle)}"
    )


@check(
    "control.load",
    "GetLoad: this instance, a timestamp, counts that fit together (used ≤ total blocks, ranks by rank)",
    "wire §4 LoadInfo, §7.1; trtllm §10 GetLoad",
)
async def load(ctx: Context) -> Outcome:
    answer = await ctx.unary(ctx.control.GetLoad, server_pb2.GetLoadRequest(include_per_rank=True))
    if not answer.ok:
        raise FailCheck(f"GetLoad: {answer.describe()}")
    info = answer.get()
    instance = ctx.server_info.response.instance_id if ctx.server_info.response is not None else ""
    if info.instance_id and instance and info.instance_id != instance:
        raise FailCheck(f"GetLoad instance_id {info.instance_id!r} ≠ ServerInfo's {instance!r}")
    if not info.HasField("timestamp_unix_nanos"):
        raise FailCheck("no timestamp_unix_nanos: a client cannot tell how old the figures are")
    if (
        info.HasField("used_kv_blocks")
        and info.HasField("total_kv_blocks")
        and info.used_kv_blocks > info.total_kv_blocks
    ):
        raise FailCheck(f"used_kv_blocks {info.used_kv_blocks} > total_kv_blocks {info.total_kv_blocks}")
    ranks = [r.data_parallel_rank for r in info.ranks]
    if len(set(ranks)) != len(ranks):
        raise FailCheck(f"per-rank entries repeat a rank: {ranks}")
    fields = [f.name for f, _ in info.ListFields() if f.name not in ("instance_id", "timestamp_unix_nanos")]
    return Outcome.passed(f"fields {fields}, {len(ranks)} rank entr{'y' if len(ranks) == 1 else 'ies'}")


@check(
    "control.load_fresh",
    "GetLoad is current: its timestamp is recent and advances, and it counts a request while it streams",
    "wire §4 LoadInfo; trtllm §10 GetLoad",
)
async def load_fresh(ctx: Context) -> Outcome:
    first = await ctx.unary(ctx.control.GetLoad, server_pb2.GetLoadRequest())
    if not first.ok:
        raise FailCheck(f"GetLoad: {first.describe()}")
    stamp = first.get().timestamp_unix_nanos
    if not first.get().HasField("timestamp_unix_nanos"):
        raise SkipCheck("no timestamp_unix_nanos (see control.load)")
    age = time.time() - stamp / 1e9
    if abs(age) > _LOAD_AGE_S:
        raise FailCheck(f"timestamp is {age:+.1f} s off the kit's clock (more than {_LOAD_AGE_S:g} s)")
    await asyncio.sleep(0.05)
    second = await ctx.unary(ctx.control.GetLoad, server_pb2.GetLoadRequest())
    if not second.ok:
        raise FailCheck(f"GetLoad: {second.describe()}")
    if second.get().timestamp_unix_nanos < stamp:
        raise FailCheck("the timestamp went backwards between two calls")
    if not first.get().HasField("running_requests"):
        return Outcome.passed(f"timestamp {age:+.2f} s off; running_requests not reported")
    if not ctx.serves_generation:
        return Outcome.passed(f"timestamp {age:+.2f} s off and advancing (role {ctx.role_name}: no stream to count)")
    async with ctx.hold("load") as hold:
        if not hold.streaming:
            raise SkipCheck(f"could not hold a request open ({hold.obs.describe_end()})")
        running = await ctx.running_requests()
        still_open = hold.streaming
    if running is None:
        raise FailCheck("GetLoad stopped reporting running_requests")
    if running < 1 and still_open:
        raise FailCheck("running_requests 0 while a request was streaming")
    return Outcome.passed(f"timestamp {age:+.2f} s off and advancing; running_requests {running} while streaming")
