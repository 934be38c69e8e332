"""Validation: each bad request gets its documented status with zero stream messages before it (wire §7.3, §7.5;
trtllm §6, §9)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from grpclib.const import Status

from openengine.v1 import generation_pb2, model_pb2

from ._context import Context
from ._model import FailCheck, Outcome, SkipCheck
from ._registry import check
from ._wire import Observation, RawMessage
from .rules import assemble, event_of, terminal_index

_STOP_LIMIT = 64


def refusal(obs: Observation, expected: Status, what: str) -> Outcome:
    """Judge a request that must be refused before acceptance: status ``expected``, no stream message at all."""
    if obs.messages:
        kinds = [event_of(m) for m in obs.messages]
        if "error" in kinds:
            code = obs.messages[kinds.index("error")].error.code
            raise FailCheck(
                f"{what}: accepted, then an EngineError ({code}) event; a refusal before acceptance is a status"
                f" with zero messages"
            )
        raise FailCheck(f"{what}: accepted ({len(obs.messages)} messages {kinds[:3]}…, {obs.describe_end()})")
    if obs.status is None:
        raise FailCheck(f"{what}: {obs.error}")
    if obs.status is Status.OK:
        raise FailCheck(f"{what}: status OK with zero messages (a stream must end with a terminal event)")
    if obs.status is not expected:
        raise FailCheck(f"{what}: {obs.describe_end()}, zero messages; expected {expected.name}")
    return Outcome.passed(f"{what} → {obs.describe_end()}, zero messages")


@check(
    "validation.empty_request_id",
    "an empty request_id is refused INVALID_ARGUMENT before acceptance",
    "wire §7.3; trtllm §6 (1), §9",
)
async def empty_request_id(ctx: Context) -> Outcome:
    ctx.require_requests()
    request = ctx.request("empty-id", request_id="")
    return refusal(await ctx.observe(request, request_id=""), Status.INVALID_ARGUMENT, "request_id ''")


@check(
    "validation.duplicate_request_id",
    "a request_id that is still active is refused ALREADY_EXISTS before acceptance",
    "wire §7.3; trtllm §6 (3), §9, §10",
)
async def duplicate_request_id(ctx: Context) -> Outcome:
    async with ctx.hold("dup-first") as hold:
        if not hold.streaming:
            raise SkipCheck(f"could not hold a request open to duplicate ({hold.obs.describe_end()})")
        duplicate = ctx.request("dup-second", max_tokens=4, request_id=hold.obs.request_id)
        obs = await ctx.observe(duplicate)
        first_still_open = not hold.obs.done.is_set()
    if obs.messages and not first_still_open:
        raise SkipCheck(f"the first request ended before the duplicate was answered ({hold.obs.describe_end()})")
    return refusal(obs, Status.ALREADY_EXISTS, f"second request with active id {obs.request_id!r}")


@check(
    "validation.no_input",
    "a request with neither prompt nor token_ids is refused INVALID_ARGUMENT",
    "wire §7.5; trtllm §6 (5), §9",
)
async def no_input(ctx: Context) -> Outcome:
    ctx.require_requests()
    request = ctx.request("no-input")
    request.ClearField("prompt")
    request.ClearField("token_ids")
    return refusal(await ctx.observe(request), Status.INVALID_ARGUMENT, "no prompt, no token_ids")


@check(
    "validation.both_inputs",
    "prompt and token_ids together (hand-encoded: a oneof keeps its last member) are refused or read as the last",
    "wire §7.5, §4 GenerateRequest oneof input; trtllm §6 (5)",
)
async def both_inputs(ctx: Context) -> Outcome:
    if ctx.advertised("supports_text_input") is False or ctx.advertised("supports_token_ids_input") is False:
        raise SkipCheck("needs both text and token-id input")
    base = await ctx.good_baseline()
    ids = assemble(base)[0][:3] or [1]
    request = ctx.request("both-inputs", max_tokens=2)
    tail = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids))
    raw = RawMessage(request.SerializeToString() + tail.SerializeToString())
    obs = await ctx.observe(raw, request_id=request.request_id)
    if not obs.messages:
        return refusal(obs, Status.INVALID_ARGUMENT, "prompt + token_ids on the wire")
    end = terminal_index(obs)
    if end is None or event_of(obs.messages[end]) == "error":
        raise FailCheck(f"prompt + token_ids: accepted but did not complete ({obs.describe_end()})")
    seen = obs.messages[end].usage.prompt_tokens
    which = "token_ids (the last member)" if seen == len(ids) else f"a prompt of {seen} tokens"
    return Outcome.variant(f"accepted as protobuf merges a oneof: the engine saw {which}; it cannot see both")


@check(
    "validation.num_sequences_zero",
    "num_sequences = 0 is refused INVALID_ARGUMENT",
    "wire §7.5; trtllm §6 sampling, §9",
)
async def num_sequences_zero(ctx: Context) -> Outcome:
    ctx.require_requests()
    request = ctx.request("n-zero", n=0)
    return refusal(await ctx.observe(request), Status.INVALID_ARGUMENT, "num_sequences 0")


@check(
    "validation.too_many_stops",
    f"more than {_STOP_LIMIT} stop conditions are refused INVALID_ARGUMENT",
    "trtllm §6 stopping, §9",
)
async def too_many_stops(ctx: Context) -> Outcome:
    ctx.require_requests()
    request = ctx.request("stops")
    for i in range(_STOP_LIMIT + 1):
        request.stopping.conditions.add(stop_text=f"<conformance-stop-{i}>")
    return refusal(await ctx.observe(request), Status.INVALID_ARGUMENT, f"{_STOP_LIMIT + 1} stop conditions")


@check(
    "validation.top_n_above_max",
    "output candidates top_n above the advertised max_top_n is refused INVALID_ARGUMENT",
    "wire §7.5; trtllm §6 response, §9",
)
async def top_n_above_max(ctx: Context) -> Outcome:
    ctx.require_requests()
    caps = ctx.minfo.generation.output_logprobs
    if not (caps.supported and caps.HasField("max_top_n")):
        raise SkipCheck("not advertised: output logprobs with a max_top_n")
    request = ctx.request("top-n")
    request.response.return_output_logprobs = True
    request.response.output_candidates.top_n = caps.max_top_n + 1
    obs = await ctx.observe(request)
    return refusal(obs, Status.INVALID_ARGUMENT, f"top_n {caps.max_top_n + 1} > max_top_n {caps.max_top_n}")


@dataclass(frozen=True, slots=True)
class _Probe:
    """One feature the engine reports unsupported, and how a request asks for it anyway."""

    name: str
    unsupported: Callable[[Context], bool]
    apply: Callable[[generation_pb2.GenerateRequest], None]
    metadata: dict[str, str] | None = None


def _mode_missing(ctx: Context, mode: int) -> bool:
    caps = ctx.minfo.generation.output_logprobs
    return bool(caps.supported) and mode not in caps.candidate_selection_modes


def _logprobs_off(ctx: Context, field: str) -> bool:
    caps: model_pb2.LogprobCapabilities = getattr(ctx.minfo.generation, field)
    return caps.HasField("supported") and not caps.supported


def _guide_missing(ctx: Context, mode: int) -> bool:
    guided = ctx.minfo.generation.guided_decoding
    return guided.HasField("supported") and mode not in guided.modes


def _set_guide(field: str, value: str) -> Callable[[generation_pb2.GenerateRequest], None]:
    def apply(request: generation_pb2.GenerateRequest) -> None:
        setattr(request.guided, field, value)

    return apply


def _logprobs(prompt: bool) -> Callable[[generation_pb2.GenerateRequest], None]:
    def apply(request: generation_pb2.GenerateRequest) -> None:
        if prompt:
            request.response.return_prompt_logprobs = True
            request.response.prompt_candidates.top_n = 1
        else:
            request.response.return_output_logprobs = True
            request.response.output_candidates.top_n = 1

    return apply


def _candidates(request: generation_pb2.GenerateRequest) -> generation_pb2.CandidateTokenSelection:
    request.response.return_output_logprobs = True
    return request.response.output_candidates


_PROBES: tuple[_Probe, ...] = (
    _Probe(
        "media",
        lambda ctx: ctx.advertised("supports_multimodal") is False,
        lambda r: r.media.add(modality=generation_pb2.MODALITY_IMAGE, url="https://example.invalid/conformance.png"),
    ),
    _Probe(
        "lora_name",
        lambda ctx: ctx.advertised("supports_lora") is False,
        lambda r: setattr(r, "lora_name", "oe-conformance-adapter"),
    ),
    _Probe(
        "kv.bypass_prefix_cache",
        lambda ctx: ctx.advertised("supports_prefix_cache_bypass") is False,
        lambda r: setattr(r.kv, "bypass_prefix_cache", True),
    ),
    _Probe(
        "kv.cache_salt",
        lambda ctx: ctx.advertised("supports_cache_salt") is False,
        lambda r: setattr(r.kv, "cache_salt", "oe-conformance"),
    ),
    _Probe(
        "include_stop_in_output",
        lambda ctx: ctx.advertised("supports_stop_in_output") is False,
        lambda r: setattr(r.stopping, "include_stop_in_output", True),
    ),
    _Probe(
        "openengine-priority",
        lambda ctx: ctx.advertised("supports_priority") is False,
        lambda r: None,
        {"openengine-priority": "1"},
    ),
    _Probe(
        "prompt logprobs",
        lambda ctx: _logprobs_off(ctx, "prompt_logprobs"),
        _logprobs(prompt=True),
    ),
    _Probe(
        "output logprobs",
        lambda ctx: _logprobs_off(ctx, "output_logprobs"),
        _logprobs(prompt=False),
    ),
    _Probe(
        "output candidates token_ids",
        lambda ctx: _mode_missing(ctx, model_pb2.CANDIDATE_TOKEN_SELECTION_MODE_TOKEN_IDS),
        lambda r: _candidates(r).token_ids.ids.append(1),
    ),
    _Probe(
        "output candidates all",
        lambda ctx: _mode_missing(ctx, model_pb2.CANDIDATE_TOKEN_SELECTION_MODE_ALL),
        lambda r: _candidates(r).all.SetInParent(),
    ),
    _Probe(
        "guided json_object",
        lambda ctx: _guide_missing(ctx, model_pb2.GUIDED_DECODING_MODE_JSON_OBJECT),
        lambda r: r.guided.json_object.SetInParent(),
    ),
    _Probe(
        "guided json_schema",
        lambda ctx: _guide_missing(ctx, model_pb2.GUIDED_DECODING_MODE_JSON_SCHEMA),
        _set_guide("json_schema", '{"type": "object"}'),
    ),
    _Probe(
        "guided regex",
        lambda ctx: _guide_missing(ctx, model_pb2.GUIDED_DECODING_MODE_REGEX),
        _set_guide("regex", "[a-z]+"),
    ),
    _Probe(
        "guided choice",
        lambda ctx: _guide_missing(ctx, model_pb2.GUIDED_DECODING_MODE_CHOICE),
        lambda r: r.guided.choice.choices.extend(["yes", "no"]),
    ),
    _Probe(
        "text prompt",
        lambda ctx: ctx.advertised("supports_text_input") is False,
        lambda r: setattr(r, "prompt", "conformance"),
    ),
)


@check(
    "validation.unadvertised_feature",
    "every feature ModelInfo reports unsupported is refused UNIMPLEMENTED before acceptance",
    "wire §7.1, §7.3; trtllm §6 (4), §9, §11 'Unsupported features'",
)
async def unadvertised_feature(ctx: Context) -> Outcome:
    ctx.require_requests()
    ctx.minfo  # noqa: B018 - skips when ModelInfo is missing
    probes = [p for p in _PROBES if p.unsupported(ctx)]
    if not probes:
        raise SkipCheck("ModelInfo reports no feature as unsupported")
    refused: list[str] = []
    for probe in probes:
        request = ctx.request("unadvertised", max_tokens=2)
        probe.apply(request)
        obs = await ctx.observe(request, metadata=probe.metadata)
        refusal(obs, Status.UNIMPLEMENTED, probe.name)
        refused.append(probe.name)
    return Outcome.passed(f"UNIMPLEMENTED, zero messages, for each of {refused}")
