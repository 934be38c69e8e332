"""LoRA controls, only when ``ModelInfo.supports_lora`` (wire §7.9; trtllm §11)."""

from __future__ import annotations

from grpclib.const import Status

from openengine.v1 import lora_pb2

from ._context import Context
from ._model import FailCheck, Outcome, SkipCheck
from ._registry import check
from .rules import terminal_index


def _require_lora(ctx: Context) -> None:
    if not ctx.advertised("supports_lora"):
        raise SkipCheck("not advertised: supports_lora is not true")


@check(
    "lora.controls",
    "ListLoras answers; unloading an unknown adapter is NOT_FOUND; lora_id 0 is refused INVALID_ARGUMENT",
    "wire §7.9",
)
async def controls(ctx: Context) -> Outcome:
    _require_lora(ctx)
    listed = await ctx.unary(ctx.control.ListLoras, lora_pb2.ListLorasRequest())
    if not listed.ok:
        raise FailCheck(f"ListLoras: {listed.describe()}")
    unknown = await ctx.unary(ctx.control.UnloadLora, lora_pb2.UnloadLoraRequest(lora_name=ctx.new_id("no-lora")))
    if unknown.status is not Status.NOT_FOUND:
        raise FailCheck(f"UnloadLora of an unknown adapter: {unknown.describe()}; expected NOT_FOUND")
    bad = lora_pb2.LoraAdapter(lora_id=0, lora_name=ctx.new_id("lora"), source_path="/nonexistent")
    refused = await ctx.unary(ctx.control.LoadLora, lora_pb2.LoadLoraRequest(adapter=bad))
    if refused.status is not Status.INVALID_ARGUMENT:
        raise FailCheck(f"LoadLora with lora_id 0: {refused.describe()}; expected INVALID_ARGUMENT")
    return Outcome.passed(f"{len(listed.get().adapters)} adapter(s) listed; NOT_FOUND; INVALID_ARGUMENT")


@check(
    "lora.lifecycle",
    "load (again: already_loaded; conflicting: ALREADY_EXISTS), list, generate with it, unload, then refused",
    "wire §7.5 (lora_name), §7.9",
)
async def lifecycle(ctx: Context) -> Outcome:
    _require_lora(ctx)
    if ctx.config.lora_dir is None:
        raise SkipCheck("needs --lora-dir (an adapter directory the engine can read)")
    listed = await ctx.unary(ctx.control.ListLoras, lora_pb2.ListLorasRequest())
    if not listed.ok:
        raise FailCheck(f"ListLoras: {listed.describe()}")
    lora_id = max([a.lora_id for a in listed.get().adapters] + [1000]) + 1
    name = f"oe-conformance-{ctx.nonce}"
    adapter = lora_pb2.LoraAdapter(lora_id=lora_id, lora_name=name, source_path=ctx.config.lora_dir)
    loaded = await ctx.unary(ctx.control.LoadLora, lora_pb2.LoadLoraRequest(adapter=adapter))
    if not loaded.ok:
        raise FailCheck(f"LoadLora({name!r}, {ctx.config.lora_dir!r}): {loaded.describe()}")
    try:
        if loaded.get().already_loaded:
            raise FailCheck("a fresh adapter was reported already_loaded")
        again = await ctx.unary(ctx.control.LoadLora, lora_pb2.LoadLoraRequest(adapter=adapter))
        if not (again.ok and again.get().already_loaded):
            raise FailCheck(f"loading the same adapter again: {again.describe()}; expected already_loaded")
        other = lora_pb2.LoraAdapter(lora_id=lora_id + 1, lora_name=name, source_path=ctx.config.lora_dir)
        conflict = await ctx.unary(ctx.control.LoadLora, lora_pb2.LoadLoraRequest(adapter=other))
        if conflict.status is not Status.ALREADY_EXISTS:
            raise FailCheck(f"the same name with another id: {conflict.describe()}; expected ALREADY_EXISTS")
        listed = await ctx.unary(ctx.control.ListLoras, lora_pb2.ListLorasRequest())
        if not listed.ok or name not in [a.lora_name for a in listed.get().adapters]:
            raise FailCheck(f"ListLoras after loading does not list {name!r}: {listed.describe()}")
        if ctx.serves_generation:
            request = ctx.request("lora", max_tokens=4)
            request.lora_name = name
            obs = await ctx.observe(request)
            if not obs.accepted or terminal_index(obs) is None:
                raise FailCheck(f"Generate with lora_name {name!r}: {obs.describe_end()}")
    finally:
        unloaded = await ctx.unary(ctx.control.UnloadLora, lora_pb2.UnloadLoraRequest(lora_name=name))
    if not unloaded.ok:
        raise FailCheck(f"UnloadLora({name!r}): {unloaded.describe()}")
    if not ctx.serves_generation:
        return Outcome.passed(
            f"loaded, idempotent, conflict refused, listed, unloaded (role {ctx.role_name}: no generation)"
        )
    request = ctx.request("lora-gone", max_tokens=2)
    request.lora_name = name
    gone = await ctx.observe(request)
    if gone.accepted or gone.status in (None, Status.OK):
        raise FailCheck(f"Generate with the unloaded adapter {name!r}: {gone.describe_end()}")
    return Outcome.passed(f"loaded, idempotent, conflict refused, listed, served, unloaded; then {gone.describe_end()}")
