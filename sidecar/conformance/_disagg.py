"""Disaggregation, only when the engine reports a KV connector: context_only → PrefillReady → decode with the
``KvSessionRef`` (wire §7.4, §7.7; trtllm §8)."""

from __future__ import annotations

import asyncio

from openengine.v1 import kv_pb2, server_pb2

from ._context import Context
from ._model import FailCheck, Outcome, SkipCheck
from ._registry import check
from ._wire import Observation, generate
from .rules import assemble, event_of, terminal_index

_SESSION = "disagg.session"


def _require_connector(ctx: Context) -> None:
    info = ctx.info
    if not (info.HasField("kv_connector") and info.kv_connector.enabled):
        raise SkipCheck("not advertised: no enabled kv_connector in ServerInfo")


@check(
    "disagg.prefill_ready",
    "a context_only request ends with PrefillReady (terminal, with usage, no finished) carrying a KvSessionRef",
    "wire §7.4 (PrefillReady terminal), §7.7; trtllm §8 'Context (prefill) leg'",
)
async def prefill_ready(ctx: Context) -> Outcome:
    _require_connector(ctx)
    if ctx.role == server_pb2.ENGINE_ROLE_DECODE:
        raise SkipCheck("engine role DECODE: qualify its prefill engine with --decode-engine pointing here")
    request = ctx.request("prefill", max_tokens=1, ignore_eos=None)
    request.extra.update({"request_type": "context_only"})
    obs = await ctx.observe(request)
    if not obs.accepted:
        raise FailCheck(f"context_only request refused: {obs.describe_end()}")
    end = terminal_index(obs)
    kinds = [event_of(m) for m in obs.messages]
    if end is None:
        raise FailCheck(f"no terminal event: {kinds}, {obs.describe_end()}")
    final = obs.messages[end]
    if event_of(final) == "finished":
        raise SkipCheck(f"the first token ended the request ({final.finished.reason}): no handoff to judge")
    if event_of(final) != "prefill_ready":
        raise FailCheck(f"the context leg ended with {event_of(final)}: {kinds}")
    if "finished" in kinds[:end]:
        raise FailCheck(f"finished before PrefillReady: {kinds}")
    if not final.HasField("usage"):
        raise FailCheck("PrefillReady carries no usage")
    session = final.prefill_ready.kv_session
    if not final.prefill_ready.HasField("kv_session") or not session.session_id:
        raise FailCheck("PrefillReady without a kv_session.session_id")
    if not (len(session.endpoints) or session.HasField("attributes_struct")):
        raise FailCheck("the KvSessionRef names neither endpoints nor attributes: decode cannot reach the KV")
    ctx.memo[_SESSION] = obs
    return Outcome.passed(
        f"{kinds}: session {session.session_id!r} via {session.transfer_backend or '(no backend)'},"
        f" {len(session.endpoints)} endpoint(s), attributes {sorted(session.attributes_struct.fields)}"
    )


def _first_gen_tokens(session: kv_pb2.KvSessionRef) -> list[int]:
    value = session.attributes_struct.fields.get("first_gen_tokens")
    if value is None or value.WhichOneof("kind") != "list_value":
        return []
    return [int(v.number_value) for v in value.list_value.values if v.WhichOneof("kind") == "number_value"]


@check(
    "disagg.decode",
    "the decode leg, sent the KvSessionRef verbatim with the full prompt, generates (replaying the first token)"
    " and the prefill engine then holds no KV session",
    "wire §7.7 'Decode'; trtllm §8 'Generation (decode) leg', 'Cleanup'",
)
async def decode(ctx: Context) -> Outcome:
    _require_connector(ctx)
    prefill = ctx.memo.get(_SESSION)
    if not isinstance(prefill, Observation) or prefill.request is None:
        raise SkipCheck("no PrefillReady to decode from (see disagg.prefill_ready)")
    target = ctx.config.decode_target
    if target is None:
        if ctx.role == server_pb2.ENGINE_ROLE_PREFILL:
            raise SkipCheck("engine role PREFILL: needs --decode-engine")
        target = ctx.config.target
    session = prefill.messages[terminal_index(prefill) or 0].prefill_ready.kv_session
    request = ctx.request("decode", max_tokens=6, request_id=prefill.request_id)
    request.ClearField("extra")  # a kv.session makes it a decode leg (trtllm §8); no phase hint
    request.ClearField("prompt")
    request.ClearField("token_ids")
    if prefill.request.HasField("prompt"):
        request.prompt = prefill.request.prompt
    else:
        request.token_ids.CopyFrom(prefill.request.token_ids)
    request.kv.session.CopyFrom(session)
    channel = target.channel()
    try:
        obs = await generate(channel, request, bound=ctx.config.rpc_timeout)
    finally:
        channel.close()
    if not obs.accepted:
        raise FailCheck(f"decode leg refused: {obs.describe_end()}")
    end = terminal_index(obs)
    if end is None or event_of(obs.messages[end]) != "finished":
        raise FailCheck(f"decode leg did not finish: {[event_of(m) for m in obs.messages]}, {obs.describe_end()}")
    tokens, _ = assemble(obs)
    prefill_tokens = assemble(prefill)[0] or _first_gen_tokens(session)
    notes = [f"{len(tokens)} tokens, finished"]
    if prefill_tokens:
        if tokens[: len(prefill_tokens)] != prefill_tokens:
            raise FailCheck(f"decode output {tokens} does not start with the prefill's first token {prefill_tokens}")
        notes.append("first token replayed")
    load = await ctx.unary(ctx.control.GetLoad, server_pb2.GetLoadRequest())
    if load.ok and load.get().HasField("active_kv_sessions"):
        sessions = await _wait_sessions_released(ctx)
        if sessions:
            raise FailCheck(f"the prefill engine still holds {sessions} KV session(s) after the decode leg")
        notes.append("prefill engine holds 0 KV sessions")
    return Outcome.passed("; ".join(notes))


async def _wait_sessions_released(ctx: Context) -> int:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ctx.config.settle
    while True:
        load = await ctx.unary(ctx.control.GetLoad, server_pb2.GetLoadRequest())
        sessions = int(load.get().active_kv_sessions) if load.ok else 0
        if sessions == 0 or loop.time() > deadline:
            return sessions
        await asyncio.sleep(0.05)
