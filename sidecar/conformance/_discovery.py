"""Discovery: ``ServerInfo`` and ``ModelInfo`` present and self-consistent (wire §7.1, §7.2, §7.11; trtllm §2, §5)."""

from __future__ import annotations

import re

from openengine.v1 import model_pb2, server_pb2
from sidecar.contract import CLIENT_REVISION, PINNED_SCHEMA_RELEASE

from ._context import Context
from ._model import FailCheck, Outcome, SkipCheck
from ._registry import check

_HEX = re.compile(r"^[0-9a-f]+$")
_WILDCARD_HOSTS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})


@check(
    "discovery.server_info",
    "GetServerInfo answers with an engine name and at least one supported model",
    "wire §2, §7.1; trtllm §5",
)
async def server_info(ctx: Context) -> Outcome:
    if not ctx.server_info.ok:
        raise FailCheck(f"GetServerInfo: {ctx.server_info.describe()}")
    info = ctx.server_info.get()
    if not info.engine_name:
        raise FailCheck("engine_name is empty")
    if not info.supported_models:
        raise FailCheck("supported_models is empty: no model name to send")
    if ctx.config.model and ctx.config.model not in info.supported_models:
        raise FailCheck(f"--model {ctx.config.model!r} is not among supported_models {list(info.supported_models)}")
    version = f" {info.engine_version}" if info.engine_version else ""
    return Outcome.passed(
        f"{info.engine_name}{version}, instance {info.instance_id or '(none)'}, models {list(info.supported_models)}"
    )


@check(
    "discovery.schema_revision",
    "schema_revision is at least 1 and minimum_client_revision admits a revision-1 client",
    "wire §7.1, §4 ServerInfo; trtllm §0",
)
async def schema_revision(ctx: Context) -> Outcome:
    info = ctx.info
    revision, minimum = info.schema_revision, info.minimum_client_revision
    text = f"schema_revision {revision}, minimum_client_revision {minimum}"
    if revision < 1:
        raise FailCheck(f"{text}: revision 0 is invalid")
    if minimum > revision:
        raise FailCheck(f"{text}: the minimum client revision exceeds the server's own")
    if minimum > CLIENT_REVISION:
        raise FailCheck(f"{text}: refuses revision-{CLIENT_REVISION} clients (v0.1.0)")
    if revision > CLIENT_REVISION:
        return Outcome.passed(f"{text} (newer, additive revision: v0.1.0 clients admitted)")
    return Outcome.passed(text)


@check(
    "discovery.schema_release",
    "schema_release names OpenEngine v0.1.0 by an immutable id (full, 12-hex prefix or empty are known forms)",
    "wire §7.1, header table; trtllm §2",
)
async def schema_release(ctx: Context) -> Outcome:
    release = ctx.info.schema_release
    if release == PINNED_SCHEMA_RELEASE:
        return Outcome.passed(f"{release!r}: the full v0.1.0 Buf commit (newer TensorRT-LLM form)")
    if not release:
        return Outcome.variant("empty: TensorRT-LLM when its bindings metadata is missing; clients cannot check it")
    lowered = release.lower()
    if _HEX.match(lowered) and len(lowered) >= 12 and PINNED_SCHEMA_RELEASE.startswith(lowered):
        return Outcome.variant(f"{release!r}: a {len(release)}-hex prefix of the v0.1.0 commit (TensorRT-LLM baseline)")
    if not _HEX.match(lowered):
        raise FailCheck(f"{release!r} is not an immutable release id (a moving name says nothing about the wire)")
    raise FailCheck(f"{release!r} is not v0.1.0 ({PINNED_SCHEMA_RELEASE})")


@check(
    "discovery.role",
    "engine_role is a v0.1.0 value; UNSPECIFIED means the phase is chosen per request",
    "wire §7.2; trtllm §0, §8",
)
async def role(ctx: Context) -> Outcome:
    value = ctx.info.engine_role
    if value not in server_pb2.EngineRole.values():
        raise FailCheck(f"engine_role {value} is not a v0.1.0 EngineRole value")
    name = server_pb2.EngineRole.Name(value)
    if value == server_pb2.ENGINE_ROLE_UNSPECIFIED:
        return Outcome.variant(f"{name}: phase per request (TensorRT-LLM: extra.request_type, kv.session)")
    return Outcome.passed(name)


@check(
    "discovery.capacity",
    "DeploymentCapacity and ParallelismInfo, when reported, hold positive sizes that fit the context window",
    "wire §7.1, §7.11 DeploymentCapacity; trtllm §5",
)
async def capacity(ctx: Context) -> Outcome:
    info = ctx.info
    notes: list[str] = []
    if info.HasField("capacity"):
        cap = info.capacity
        for name in ("kv_block_size", "total_kv_blocks", "max_running_requests", "max_batched_tokens"):
            if cap.HasField(name):
                value = getattr(cap, name)
                if value < 1:
                    raise FailCheck(f"capacity.{name} = {value}: a deployment cannot run with that")
                notes.append(f"{name}={value}")
        window = ctx.window
        if cap.HasField("kv_block_size") and cap.HasField("total_kv_blocks") and window is not None:
            pool = cap.kv_block_size * cap.total_kv_blocks
            if pool < window:
                raise FailCheck(f"KV pool {pool} tokens ({notes}) cannot hold one max_context_length {window} request")
    else:
        notes.append("capacity not reported")
    if info.HasField("parallelism"):
        par = info.parallelism
        for name in (
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_size",
            "decode_context_parallel_size",
        ):
            if par.HasField(name) and getattr(par, name) < 1:
                raise FailCheck(f"parallelism.{name} = {getattr(par, name)}; sizes are at least 1")
        if (
            par.HasField("data_parallel_rank")
            and par.HasField("data_parallel_size")
            and par.data_parallel_rank >= par.data_parallel_size
        ):
            raise FailCheck(
                f"data_parallel_rank {par.data_parallel_rank} ≥ data_parallel_size {par.data_parallel_size}"
            )
    return Outcome.passed(", ".join(notes))


@check(
    "discovery.model_info",
    "GetModelInfo answers for a supported model, names it, and accepts text or token ids",
    "wire §7.1; trtllm §5 ModelInfo",
)
async def model_info(ctx: Context) -> Outcome:
    if not ctx.model_info.ok:
        raise FailCheck(f"GetModelInfo({ctx.model!r}): {ctx.model_info.describe()}")
    info = ctx.model_info.get()
    names = {info.served_model_name, info.model_id, *info.served_model_aliases} - {""}
    if not names:
        raise FailCheck("ModelInfo names no model (served_model_name and model_id empty)")
    if ctx.server_info.ok and not names & set(ctx.server_info.get().supported_models):
        raise FailCheck(f"ModelInfo names {sorted(names)}, none of them in supported_models")
    text, ids = ctx.advertised("supports_text_input"), ctx.advertised("supports_token_ids_input")
    if text is False and ids is False:
        raise FailCheck("neither text nor token-id input is supported: no request can be sent")
    return Outcome.passed(f"{info.served_model_name!r}: text input {text}, token-id input {ids}")


@check(
    "discovery.unknown_model",
    "GetModelInfo for a model that is not served answers NOT_FOUND (TensorRT-LLM answers for its one model)",
    "wire §7.1; trtllm §5",
)
async def unknown_model(ctx: Context) -> Outcome:
    name = ctx.new_id("no-such-model")
    answer = await ctx.unary(ctx.control.GetModelInfo, model_pb2.GetModelInfoRequest(model=name))
    if answer.ok:
        return Outcome.variant(f"answered for {answer.get().served_model_name!r}: any name is accepted (TensorRT-LLM)")
    if answer.status is not None and answer.status.name == "NOT_FOUND":
        return Outcome.passed(f"NOT_FOUND ({answer.details})")
    raise FailCheck(f"{answer.describe()}; expected NOT_FOUND")


@check(
    "discovery.limits",
    "max_context_length and max_output_tokens: absent = not reported, present = positive and within the window",
    "wire §7.1, §7.11 ModelInfo; trtllm §5, §12 item 3",
)
async def limits(ctx: Context) -> Outcome:
    info = ctx.minfo
    notes: list[str] = []
    variant = False
    window = info.max_context_length if info.HasField("max_context_length") else None
    if window is None:
        variant = True
        notes.append("max_context_length unset (TensorRT-LLM without --max_seq_len)")
    elif window < 1:
        raise FailCheck("max_context_length = 0")
    else:
        notes.append(f"max_context_length {window}")
    if not info.HasField("max_output_tokens"):
        variant = True
        notes.append("max_output_tokens unset (newer TensorRT-LLM: the budget is the window minus the prompt)")
    else:
        limit = info.max_output_tokens
        if limit < 1:
            raise FailCheck(f"max_output_tokens = {limit}: nothing could be generated")
        if window is not None and limit > window:
            raise FailCheck(f"max_output_tokens {limit} > max_context_length {window}")
        if limit == window:
            variant = True
            notes.append(f"max_output_tokens {limit} = the window (TensorRT-LLM baseline)")
        else:
            notes.append(f"max_output_tokens {limit}")
    return (Outcome.variant if variant else Outcome.passed)("; ".join(notes))


def _check_logprob_caps(name: str, caps: model_pb2.LogprobCapabilities) -> str:
    modes = [m for m in caps.candidate_selection_modes if m in model_pb2.CandidateTokenSelectionMode.values()]
    if not caps.HasField("supported"):
        return f"{name}: not reported"
    if not caps.supported:
        if modes or caps.HasField("max_top_n"):
            raise FailCheck(f"{name}: supported=false but modes {modes} / max_top_n listed")
        return f"{name}: unsupported"
    if not modes:
        raise FailCheck(f"{name}: supported=true with no candidate selection mode listed")
    if model_pb2.CANDIDATE_TOKEN_SELECTION_MODE_TOP_N in modes and not (
        caps.HasField("max_top_n") and caps.max_top_n >= 1
    ):
        raise FailCheck(f"{name}: TOP_N listed without a positive max_top_n")
    names = [
        model_pb2.CandidateTokenSelectionMode.Name(m).removeprefix("CANDIDATE_TOKEN_SELECTION_MODE_") for m in modes
    ]
    return f"{name}: {names} max_top_n {caps.max_top_n}"


@check(
    "discovery.capabilities",
    "capability flags agree with the modes listed (supported ⇔ modes; TOP_N ⇒ max_top_n; max_num_sequences ≥ 1)",
    "wire §7.1, §4 GenerationCapabilities; trtllm §5",
)
async def capabilities(ctx: Context) -> Outcome:
    info = ctx.minfo
    if not info.HasField("generation"):
        return Outcome.passed("generation capabilities not reported")
    gen = info.generation
    notes = [
        _check_logprob_caps("prompt_logprobs", gen.prompt_logprobs),
        _check_logprob_caps("output_logprobs", gen.output_logprobs),
    ]
    guided = gen.guided_decoding
    modes = [m for m in guided.modes if m in model_pb2.GuidedDecodingMode.values()]
    if guided.HasField("supported"):
        if guided.supported and not modes:
            raise FailCheck("guided_decoding: supported=true with no mode listed")
        if not guided.supported and modes:
            raise FailCheck(f"guided_decoding: supported=false but modes {modes} listed")
        names = [model_pb2.GuidedDecodingMode.Name(m).removeprefix("GUIDED_DECODING_MODE_") for m in modes]
        notes.append(f"guided: {names if guided.supported else 'unsupported'}")
    if gen.HasField("max_num_sequences"):
        if gen.max_num_sequences < 1:
            raise FailCheck(f"max_num_sequences = {gen.max_num_sequences}")
        notes.append(f"max_num_sequences {gen.max_num_sequences}")
    return Outcome.passed("; ".join(notes))


@check(
    "discovery.kv_connector",
    "a reported KV connector names its transfer backend and routable endpoints",
    "wire §4 KvConnectorInfo, §7.7; trtllm §5",
)
async def kv_connector(ctx: Context) -> Outcome:
    info = ctx.info
    if not info.HasField("kv_connector"):
        raise SkipCheck("not advertised: no kv_connector in ServerInfo")
    kvc = info.kv_connector
    if not kvc.enabled:
        return Outcome.passed("kv_connector reported disabled")
    if not kvc.transfer_backend:
        raise FailCheck("kv_connector enabled without a transfer_backend")
    for endpoint in kvc.local_endpoints:
        if endpoint.host in _WILDCARD_HOSTS or not 0 < endpoint.port < 65536:
            raise FailCheck(f"local endpoint {endpoint.host}:{endpoint.port} is not routable")
    flags = [
        name
        for name in ("supports_remote_prefill", "supports_decode_pull", "supports_abort_cleanup")
        if getattr(kvc, name)
    ]
    return Outcome.passed(f"backend {kvc.transfer_backend!r}, {len(kvc.local_endpoints)} endpoint(s), {flags}")
