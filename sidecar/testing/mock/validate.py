"""``GenerateRequest`` + metadata → :class:`RequestPlan`, or a :class:`Rejection` (a status before acceptance).

The checks run in TensorRT-LLM's order: id, model, duplicate id, unsupported
features, input, sampling/stopping/response/guided/``extra``, metadata, cache salt, disaggregation, then the
"engine" checks (prompt length, window, KV capacity). The first failing check wins. Validation is synchronous, so the
duplicate-id check and the registration that follows it are atomic on the event loop.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
import re
import urllib.parse
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, cast

from grpclib.const import Status

from .faults import FaultError, MockFaults, parse_faults, prompt_fault_spec
from .guided import Guide, UnsupportedGuide, compile_guide
from .structs import JsonValue, struct_to_dict

if TYPE_CHECKING:
    from multidict import MultiDict

    from openengine.v1 import generation_pb2

    from .config import MockConfig
    from .faults import Violation
    from .lmapi import LanguageModel

__all__ = [
    "MAX_STOP_CONDITIONS",
    "PLACEHOLDERS",
    "PROMPT_LOGPROB_LIMIT",
    "DecodeSession",
    "MediaInput",
    "Rejection",
    "ReplayLogprob",
    "RequestPlan",
    "guided_modes",
    "validate_request",
]

MAX_STOP_CONDITIONS = 64
#: prompt tokens × candidates above this → terminal ``EngineError(INVALID_ARGUMENT)`` (after acceptance, as TRT).
PROMPT_LOGPROB_LIMIT = 1_000_000
_INT32 = (-(2**31), 2**31 - 1)
_DECIMAL = re.compile(r"[+-]?[0-9]+")
_REQUEST_TYPES = ("context_and_generation", "context_only")
#: The guides TensorRT-LLM's xgrammar backend builds (``capabilities.py``), in its order; never ``choice``.
XGRAMMAR_MODES = ("json_schema", "regex", "ebnf_grammar", "structural_tag", "json_object")
#: The ``full`` engine's guides (with ``--capability guided=true``).
FULL_GUIDED_MODES = ("json_object", "choice")
#: ``Modality`` numbers (generation.proto) → names; UNSPECIFIED (0) and unknown numbers are refused.
_MODALITIES = {1: "image", 2: "video", 3: "audio"}
#: The mock model's media placeholders: prompt text ``<image>`` stands where ``media[i]`` (an image) goes.
PLACEHOLDERS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}
_PLACEHOLDER = re.compile(r"<(image|video|audio)>")
# data:<type>/<subtype>[;param=value]*;base64,<payload> (wire §7.11: the engine decodes base64 data URIs).
_DATA_URI = re.compile(r"data:([A-Za-z0-9!#$&^_.+-]+)/[A-Za-z0-9!#$&^_.+-]+(?:;[^;,]+)*?;base64,(.*)", re.S | re.I)


class Rejection(Exception):
    """A request refused before acceptance: a non-OK status and zero stream messages."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


#: One position of ``first_gen_log_probs``: a float, or ``(token_id, logprob, rank)`` triples.
ReplayLogprob = float | tuple[tuple[int, float, int], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeSession:
    """The parts of a replayed ``KvSessionRef`` the decode leg uses."""

    session_id: str
    replay_tokens: tuple[int, ...]
    #: ``first_gen_log_probs`` per replayed position: the token's logprob, or ``(token_id, logprob, rank)`` triples.
    replay_logprobs: tuple[ReplayLogprob, ...] = ()
    #: Where the context engine's KV transfer endpoint is (None: only ``opaque_state``, nothing to pull from).
    host: str | None = None
    port: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class MediaInput:
    """What the engine took from one ``MediaItem`` (the mock fetches and decodes nothing)."""

    modality: str
    #: Which ``source`` member was set: ``url``, ``data_uri`` or ``raw_bytes``.
    source: str
    uuid: str


@dataclasses.dataclass(frozen=True, slots=True)
class RequestPlan:
    """A validated request with every default resolved."""

    request_id: str
    model: str
    prompt_ids: tuple[int, ...]
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    include_stop: bool
    stop_texts: tuple[str, ...]
    stop_ids: frozenset[int]
    token_holdback: int
    output_logprobs: bool
    output_top_n: int
    prompt_logprobs: bool
    prompt_top_n: int
    context_only: bool
    session: DecodeSession | None
    detokenize: bool
    lora_name: str | None
    cache_salt: str | None
    bypass_prefix_cache: bool
    priority: int
    script: tuple[int, ...] | None
    script_ends_with_eos: bool
    faults: MockFaults
    media: tuple[MediaInput, ...] = ()
    #: The request came as text (``prompt``), not token ids.
    text_prompt: bool = False
    #: The guided-decoding guide, checked; each output is one of its texts, then EOS (``guided.py``).
    guide: Guide | None = None
    #: ``(stop string, its token ids)``: TensorRT-LLM matches stop words as token sequences, not on text.
    stop_sequences: tuple[tuple[str, tuple[int, ...]], ...] = ()
    #: Stop strings are matched on the detokenized text (the ``full`` engine) rather than as token sequences.
    text_stops: bool = True
    #: A matched stop word's / stop token's ids are dropped from the output and not counted (TensorRT-LLM without
    #: ``include_stop_in_output``).
    trim_stops: bool = False
    #: Accepted, but the engine fails it right after submission: one terminal ``EngineError(INTERNAL)`` with usage
    #: (TensorRT-LLM's executor refusing what its request mapping let through).
    deferred_error: str | None = None
    #: Milliseconds between an output's last token message and its ``finished``.
    split_finish_ms: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def guided_modes(config: MockConfig) -> tuple[str, ...]:
    """The guides advertised (``ModelInfo.generation.guided_decoding.modes``) and accepted when guided is enabled."""
    return XGRAMMAR_MODES if config.trt else FULL_GUIDED_MODES


def _reject(status: Status, message: str) -> Rejection:
    return Rejection(status, message)


def _invalid(message: str) -> Rejection:
    return Rejection(Status.INVALID_ARGUMENT, message)


def _unimplemented(message: str) -> Rejection:
    return Rejection(Status.UNIMPLEMENTED, message)


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise _invalid(f"{name} must be finite, got {value}")
    return value


def _candidates(name: str, response: generation_pb2.ResponseOptions, field: str, max_top_n: int) -> int:
    """The ``top_n`` of one candidate selection (0 when unset); token_ids/all are UNIMPLEMENTED as in TRT."""
    if not response.HasField(field):
        return 0
    selection: generation_pb2.CandidateTokenSelection = getattr(response, field)
    kind = selection.WhichOneof("selection")
    if kind in ("token_ids", "all"):
        raise _unimplemented(f"{name}: candidate selection {kind!r} is not supported (top_n only)")
    top_n = selection.top_n if kind == "top_n" else 0
    if top_n > max_top_n:
        raise _invalid(f"{name}.top_n={top_n} exceeds max_top_n={max_top_n}")
    return top_n


def _media(request: generation_pb2.GenerateRequest) -> tuple[MediaInput, ...]:
    """Check every ``MediaItem`` as an engine must before fetching: a modality, one well-formed source."""
    seen: list[MediaInput] = []
    for i, item in enumerate(request.media):
        modality = _MODALITIES.get(item.modality)
        if modality is None:
            raise _invalid(f"media[{i}].modality must be image, video or audio, got {item.modality}")
        source = item.WhichOneof("source")
        if source is None:
            raise _invalid(f"media[{i}] needs exactly one source (url, data_uri or raw_bytes)")
        if source == "url" and not item.url:
            raise _invalid(f"media[{i}].url must not be empty")
        if source == "raw_bytes" and not item.raw_bytes:
            raise _invalid(f"media[{i}].raw_bytes must not be empty")
        if source == "data_uri":
            match = _DATA_URI.fullmatch(item.data_uri)
            if match is None:
                raise _invalid(f"media[{i}].data_uri must be data:<type>/<subtype>;base64,<payload>")
            try:
                base64.b64decode(match.group(2), validate=True)
            except (binascii.Error, ValueError):
                raise _invalid(f"media[{i}].data_uri: the payload is not valid base64") from None
            kind = match.group(1).lower()
            if kind in _MODALITIES.values() and kind != modality:
                raise _invalid(f"media[{i}] is {modality} but its data_uri holds {kind} data")
        seen.append(MediaInput(modality=modality, source=source, uuid=item.uuid))
    return tuple(seen)


def _placeholder_checks(text: str, media: tuple[MediaInput, ...]) -> None:
    """Item *i* fills the *i*-th placeholder (wire §7.5); checked only when the prompt has placeholders at all."""
    found = _PLACEHOLDER.findall(text)
    if not found:
        return  # a template that renders no placeholders: nothing to align against
    wanted = [item.modality for item in media]
    if len(found) != len(wanted):
        raise _invalid(f"the prompt has {len(found)} media placeholders for {len(wanted)} media items")
    for i, (placeholder, modality) in enumerate(zip(found, wanted, strict=True)):
        if placeholder != modality:
            raise _invalid(f"media[{i}] is {modality} but placeholder {i} is {PLACEHOLDERS[placeholder]}")


#: ``openengine-*`` metadata keys TensorRT-LLM's newer servers know; any other one is ``UNIMPLEMENTED`` there.
_NEWER_METADATA_KEYS = frozenset({"openengine-priority", "openengine-target-dp-rank"})
#: Attention-DP ranks of the mock (one engine, rank 0).
_DP_SIZE = 1


def _metadata_checks(metadata: MultiDict[str | bytes] | None, config: MockConfig, n: int) -> int:
    """gRPC metadata rules (wire §7.6 as TRT applies them); returns the priority (0 = default)."""
    if metadata is None:
        return 0
    keys = {k.lower() for k in metadata}
    for key in sorted(keys):
        if key.startswith("openengine-") and len(metadata.getall(key)) > 1:
            raise _invalid(f"metadata key {key!r} must not be repeated")
    if config.newer:
        unknown = sorted(k for k in keys if k.startswith("openengine-") and k not in _NEWER_METADATA_KEYS)
        if unknown:
            raise _unimplemented(f"metadata {', '.join(unknown)} is not supported")
    routing = metadata.get("openengine-routing-key")
    if routing is not None and not routing:
        raise _invalid("metadata openengine-routing-key must not be empty")
    priority = 0
    raw_priority = metadata.get("openengine-priority")
    if raw_priority is not None:
        if not config.capabilities.priority:
            raise _unimplemented("metadata openengine-priority is not supported (supports_priority=false)")
        text = raw_priority.decode() if isinstance(raw_priority, bytes) else raw_priority
        if not _DECIMAL.fullmatch(text.strip()) or not _INT32[0] <= int(text) <= _INT32[1]:
            raise _invalid(f"metadata openengine-priority must be a base-10 int32, got {text!r}")
        priority = int(text)
    raw_rank = metadata.get("openengine-target-dp-rank")
    if raw_rank is not None:
        if not config.newer:
            raise _unimplemented("metadata openengine-target-dp-rank is not supported")
        text = raw_rank.decode() if isinstance(raw_rank, bytes) else raw_rank
        if not _DECIMAL.fullmatch(text.strip()) or not 0 <= int(text) < _DP_SIZE:
            raise _invalid(f"metadata openengine-target-dp-rank must be in [0, {_DP_SIZE}), got {text!r}")
        if n > 1:
            raise _invalid("metadata openengine-target-dp-rank cannot be combined with num_sequences > 1")
    return priority


def _extra(request: generation_pb2.GenerateRequest) -> dict[str, JsonValue]:
    return struct_to_dict(request.extra) if request.HasField("extra") else {}


def _decode_session(request: generation_pb2.GenerateRequest) -> DecodeSession:
    """Validate a replayed ``KvSessionRef`` like TRT's decode leg (§8) and pull out the replay tokens."""
    session = request.kv.session
    attrs = struct_to_dict(session.attributes_struct) if session.HasField("attributes_struct") else {}
    has_endpoint = False
    host: str | None = None
    port: int | None = None
    ctx_endpoint = attrs.get("ctx_info_endpoint")
    if ctx_endpoint is not None:
        parsed = urllib.parse.urlsplit(ctx_endpoint) if isinstance(ctx_endpoint, str) else None
        try:
            port = parsed.port if parsed is not None else None
        except ValueError:
            port = None
        if parsed is None or not parsed.hostname or not port:
            raise _invalid(f"kv.session: unusable ctx_info_endpoint {ctx_endpoint!r}")
        host = parsed.hostname
        has_endpoint = True
    elif session.endpoints:
        endpoint = session.endpoints[0]
        if not endpoint.host or not endpoint.port:
            raise _invalid("kv.session: endpoint without host or port")
        host, port = endpoint.host, endpoint.port
        has_endpoint = True
    opaque = attrs.get("opaque_state")
    if opaque is not None:
        if not isinstance(opaque, str):
            raise _invalid("kv.session: opaque_state must be a base64 string")
        try:
            base64.b64decode(opaque, validate=True)
        except (binascii.Error, ValueError):
            raise _invalid("kv.session: opaque_state is not valid base64") from None
    if not has_endpoint and opaque is None:
        raise _invalid("kv.session: neither ctx_info_endpoint/endpoints nor opaque_state")
    session_id = session.session_id
    if session_id:
        if not session_id.isdecimal():
            raise _invalid(f"kv.session: session_id must be an integer, got {session_id!r}")
    elif "disagg_request_id" not in attrs:
        raise _invalid("kv.session: neither session_id nor disagg_request_id")
    else:
        session_id = str(attrs["disagg_request_id"])
    replay: list[int] = []
    first = attrs.get("first_gen_tokens")
    if first is not None:
        if not isinstance(first, list) or not all(isinstance(t, float) and t.is_integer() and t >= 0 for t in first):
            raise _invalid("kv.session: first_gen_tokens must be a list of token ids")
        replay = [int(t) for t in first if isinstance(t, float)]
    replay_logprobs = _replay_logprobs(attrs.get("first_gen_log_probs"))
    return DecodeSession(
        session_id=session_id,
        replay_tokens=tuple(replay),
        replay_logprobs=replay_logprobs,
        host=host,
        port=port,
    )


def _replay_logprobs(raw: JsonValue) -> tuple[ReplayLogprob, ...]:
    """``first_gen_log_probs`` (TensorRT-LLM: per position a float or ``[token_id, logprob, rank]`` triples)."""
    if raw is None:
        return ()
    bad = _invalid("kv.session: first_gen_log_probs must hold a number or [token_id, logprob, rank] lists per token")
    if not isinstance(raw, list):
        raise bad
    positions: list[ReplayLogprob] = []
    for entry in raw:
        if isinstance(entry, float):
            positions.append(entry)
            continue
        if not isinstance(entry, list):
            raise bad
        triples: list[tuple[int, float, int]] = []
        for item in entry:
            if not (isinstance(item, list) and len(item) == 3 and all(isinstance(v, float) for v in item)):
                raise bad
            token_id, logprob, rank = (cast(float, v) for v in item)
            if not token_id.is_integer() or not rank.is_integer() or token_id < 0:
                raise bad
            triples.append((int(token_id), logprob, int(rank)))
        positions.append(tuple(triples))
    return tuple(positions)


def validate_request(
    request: generation_pb2.GenerateRequest,
    metadata: MultiDict[str | bytes] | None,
    *,
    config: MockConfig,
    lm: LanguageModel,
    is_live: Callable[[str], bool],
    loras: Collection[str],
) -> RequestPlan:
    """Check ``request`` and resolve its defaults; raises :class:`Rejection` on the first failed rule."""
    caps = config.capabilities
    extra = _extra(request)

    # 0. Mock faults first, so a test can force any pre-acceptance status.
    faults = MockFaults()
    spec = extra.get("mock")
    if spec is None and config.faults_from_prompt:
        text = request.prompt if request.WhichOneof("input") == "prompt" else lm.decode(request.token_ids.ids)
        spec = prompt_fault_spec(text)
    if spec is not None:
        try:
            faults = parse_faults(spec)
        except FaultError as exc:
            raise _invalid(str(exc)) from None
        if faults.reject_status is not None:
            raise _reject(faults.reject_status, faults.reject_message or "rejected by extra.mock.reject_status")

    # 1–3. Identity.
    if not request.request_id:
        raise _invalid("request_id must not be empty")
    if not request.model:
        raise _invalid("model must not be empty")
    if request.model not in config.model_names and not config.trt:  # TensorRT-LLM serves any name
        raise _reject(
            Status.NOT_FOUND, f"model {request.model!r} is not served here (serving {config.served_model_name!r})"
        )
    if is_live(request.request_id):
        raise _reject(Status.ALREADY_EXISTS, f"request_id {request.request_id!r} is already active")

    # 4. Features this engine may not support.
    media: tuple[MediaInput, ...] = ()
    if request.media:
        if not caps.multimodal:
            raise _unimplemented("media inputs are not supported (supports_multimodal=false)")
        media = _media(request)
    lora_name = request.lora_name or None
    if lora_name is not None:
        if not caps.lora:
            raise _unimplemented("lora_name is not supported (supports_lora=false)")
        if lora_name not in loras:
            raise _reject(Status.NOT_FOUND, f"LoRA adapter {lora_name!r} is not loaded")
    bypass = request.kv.bypass_prefix_cache if request.HasField("kv") else False
    if bypass and not caps.prefix_cache_bypass:
        raise _unimplemented("kv.bypass_prefix_cache is not supported (supports_prefix_cache_bypass=false)")

    # 5. Input.
    kind = request.WhichOneof("input")
    if kind is None:
        raise _invalid("exactly one of prompt or token_ids is required")
    prompt_ids: list[int]
    if kind == "prompt":
        if not request.prompt:
            raise _invalid("prompt must not be empty")
        if not caps.text_input:
            raise _unimplemented("text prompts are not supported (supports_text_input=false); send token_ids")
        prompt_ids = []  # tokenized at step 10, like TRT's generate_async
    else:
        prompt_ids = list(request.token_ids.ids)
        if not prompt_ids:
            raise _invalid("token_ids must not be empty")
        bad = next((t for t in prompt_ids if t >= lm.vocab_size), None)
        if bad is not None:
            raise _invalid(f"token id {bad} is out of range (vocab_size={lm.vocab_size})")
    if media:
        _placeholder_checks(request.prompt if kind == "prompt" else lm.decode(prompt_ids), media)

    # 6. Sampling, stopping, response options, guided decoding, extra.
    # TensorRT-LLM's request mapping passes some out-of-range values through, and its executor then fails the
    # submitted request (the first such reason is kept; pre-acceptance checks below still win).
    deferred: list[str] = []
    trt = config.trt
    sampling = request.sampling
    temperature = _finite("temperature", sampling.temperature) if sampling.HasField("temperature") else 1.0
    if temperature < 0:
        raise _invalid(f"temperature must be >= 0, got {temperature}")
    top_p = _finite("top_p", sampling.top_p) if sampling.HasField("top_p") else 1.0
    if trt:
        if not 0.0 <= top_p <= 1.0:
            raise _invalid(f"top_p must be in [0, 1], got {top_p}")
        if top_p == 0.0:
            deferred.append("top_p=0 is rejected by the sampler")
    elif not 0.0 < top_p <= 1.0:
        raise _invalid(f"top_p must be in (0, 1], got {top_p}")
    top_k = sampling.top_k if sampling.HasField("top_k") else 0
    if top_k < 0:
        raise _invalid(f"top_k must be >= 0, got {top_k}")
    min_p = _finite("min_p", sampling.min_p) if sampling.HasField("min_p") else 0.0
    if not 0.0 <= min_p <= 1.0:
        if not trt:
            raise _invalid(f"min_p must be in [0, 1], got {min_p}")
        deferred.append(f"min_p={min_p} is rejected by the sampler")
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        if sampling.HasField(name):
            _finite(name, getattr(sampling, name))
    if sampling.HasField("repetition_penalty") and sampling.repetition_penalty <= 0:
        if not trt:
            raise _invalid("repetition_penalty must be > 0")
        deferred.append(f"repetition_penalty={sampling.repetition_penalty} is rejected by the sampler")
    n = sampling.num_sequences if sampling.HasField("num_sequences") else 1
    if n == 0:
        raise _invalid("num_sequences must be > 0")
    if config.max_num_sequences is not None and n > config.max_num_sequences:
        raise _invalid(f"num_sequences={n} exceeds max_num_sequences={config.max_num_sequences}")
    # TensorRT-LLM's SamplingParams: temperature 0, top_k 1 and top_p 0 are each greedy.
    greedy = temperature == 0.0 or (trt and (top_k == 1 or top_p == 0.0))
    if n > 1 and greedy:
        raise _invalid("greedy sampling (temperature=0, top_k=1 or top_p=0) does not support num_sequences > 1")
    seed = sampling.seed if sampling.HasField("seed") else None

    stopping = request.stopping
    if len(stopping.conditions) > MAX_STOP_CONDITIONS:
        raise _invalid(f"at most {MAX_STOP_CONDITIONS} stop conditions are allowed, got {len(stopping.conditions)}")
    stop_texts: list[str] = []
    stop_ids: set[int] = set()
    for i, cond in enumerate(stopping.conditions):
        which = cond.WhichOneof("condition")
        if which == "stop_text" and cond.stop_text:
            stop_texts.append(cond.stop_text)
        elif which == "stop_token_id":
            stop_ids.add(cond.stop_token_id)
        else:
            raise _invalid(f"stopping.conditions[{i}] is empty")
    if stopping.HasField("max_tokens") and stopping.max_tokens == 0:
        if not trt:
            raise _invalid("max_tokens must be > 0")
        deferred.append("max_tokens=0 is rejected by the executor")
    include_stop = stopping.include_stop_in_output if stopping.HasField("include_stop_in_output") else False
    if include_stop and not caps.stop_in_output:
        raise _unimplemented("include_stop_in_output is not supported (supports_stop_in_output=false)")
    if trt and stopping.HasField("ignore_eos") and stopping.ignore_eos:
        # TensorRT-LLM's SamplingParams: ignore_eos drops every stop word, not only the end id.
        stop_texts, stop_ids = [], set()

    response = request.response
    output_logprobs = response.return_output_logprobs if response.HasField("return_output_logprobs") else False
    prompt_logprobs = response.return_prompt_logprobs if response.HasField("return_prompt_logprobs") else False
    if output_logprobs and not caps.output_logprobs:
        raise _unimplemented("output logprobs are not supported")
    if prompt_logprobs and not caps.prompt_logprobs:
        raise _unimplemented("prompt logprobs are not supported")
    output_top_n = _candidates("output_candidates", response, "output_candidates", config.max_top_n)
    prompt_top_n = _candidates("prompt_candidates", response, "prompt_candidates", config.max_top_n)
    if response.HasField("prompt_logprob_start") and response.prompt_logprob_start != 0:
        raise _unimplemented("prompt_logprob_start != 0 is not supported")

    script: tuple[int, ...] | None = None
    script_ends_with_eos = False
    compiled_guide: Guide | None = None
    if request.HasField("guided"):
        guided = request.guided
        if guided.backend:
            raise _unimplemented(f"guided.backend {guided.backend!r}: per-request backends are not supported")
        guide = guided.WhichOneof("guide")
        if guide is not None:
            if not caps.guided:
                raise _unimplemented("guided decoding is not supported")
            if guide not in guided_modes(config):
                backend = "the xgrammar backend" if config.trt else "openengine-mock"
                raise _unimplemented(f"guided decoding mode {guide!r} is not supported by {backend}")
            if guide == "choice":
                if not any(guided.choice.choices):
                    raise _invalid("guided.choice needs at least one non-empty choice")
                guide_spec = json.dumps(list(guided.choice.choices))
            elif guide == "json_object":
                guide_spec = ""
            else:
                guide_spec = str(getattr(guided, guide))
            try:
                compiled_guide = compile_guide(guide, guide_spec)
            except UnsupportedGuide as exc:
                raise _unimplemented(f"guided.{guide}: {exc.message}") from None
    if faults.tokens is not None:
        bad = next((t for t in faults.tokens if t >= lm.vocab_size), None)
        if bad is not None:
            raise _invalid(f"extra.mock.tokens: token id {bad} is out of range (vocab_size={lm.vocab_size})")
        script = faults.tokens
        script_ends_with_eos = False

    request_type = extra.get("request_type", "context_and_generation")
    if not isinstance(request_type, str) or request_type not in _REQUEST_TYPES:
        raise _invalid(f"extra.request_type must be one of {', '.join(_REQUEST_TYPES)}, got {request_type!r}")
    detokenize = extra.get("detokenize", True)
    if not isinstance(detokenize, bool):
        raise _invalid(f"extra.detokenize must be a boolean, got {detokenize!r}")
    if "conversation_id" in extra and not isinstance(extra["conversation_id"], str):
        raise _invalid("extra.conversation_id must be a string")
    context_only = request_type == "context_only"

    # 7. Metadata.
    priority = _metadata_checks(metadata, config, n)

    # 8. Cache salt.
    cache_salt = request.kv.cache_salt if request.HasField("kv") and request.kv.HasField("cache_salt") else None
    if cache_salt is not None and not caps.cache_salt:
        raise _unimplemented("kv.cache_salt is not supported (supports_cache_salt=false)")

    # 9. Disaggregation: roles and the replayed session.
    has_session = request.HasField("kv") and request.kv.HasField("session")
    if config.role == "prefill" and (has_session or not context_only):
        raise _reject(
            Status.FAILED_PRECONDITION,
            "this engine serves the prefill role: send extra.request_type=context_only without kv.session",
        )
    if config.role == "decode" and (context_only or not has_session):
        raise _reject(Status.FAILED_PRECONDITION, "this engine serves the decode role: requests need kv.session")
    if has_session and context_only:
        raise _invalid("extra.request_type=context_only cannot be combined with kv.session")
    if context_only and n > 1:
        raise _invalid("extra.request_type=context_only supports num_sequences=1 only")
    session = _decode_session(request) if has_session else None
    if session is not None:
        bad = next((t for t in session.replay_tokens if t >= lm.vocab_size), None)
        if bad is not None:
            raise _invalid(f"kv.session: first_gen_tokens id {bad} is out of range")

    # 10. What generate_async would refuse.
    if kind == "prompt":
        prompt_ids = lm.encode(request.prompt)
        if not prompt_ids:
            raise _invalid("prompt tokenizes to zero tokens")
    window = config.max_context_length
    prompt_len = len(prompt_ids)
    if prompt_len >= window:
        raise _invalid(f"prompt length {prompt_len} leaves no room to generate (max_context_length={window})")
    budget = window - prompt_len
    if config.max_output_tokens is not None:
        budget = min(budget, config.max_output_tokens)
    if stopping.HasField("max_tokens") and trt:
        # TensorRT-LLM serves an over-long max_tokens up to the window instead of refusing it.
        max_tokens = min(stopping.max_tokens, budget) or 1
    elif stopping.HasField("max_tokens"):
        max_tokens = stopping.max_tokens
        if prompt_len + max_tokens > window:
            raise _invalid(f"prompt length {prompt_len} + max_tokens {max_tokens} exceeds max_context_length={window}")
        if config.max_output_tokens is not None and max_tokens > config.max_output_tokens:
            raise _invalid(f"max_tokens {max_tokens} exceeds max_output_tokens={config.max_output_tokens}")
    else:
        max_tokens = budget
    if context_only:
        max_tokens = 1
    min_tokens = min(stopping.min_tokens, max_tokens) if stopping.HasField("min_tokens") else 0
    ignore_eos = stopping.ignore_eos if stopping.HasField("ignore_eos") else False
    bs = config.kv_block_size
    full = prompt_len // bs
    blocks = full + n * (-(-(prompt_len + max_tokens) // bs) - full)
    if blocks > config.total_kv_blocks:
        raise _invalid(f"request needs {blocks} KV blocks; the pool holds {config.total_kv_blocks}")
    stop_sequences = tuple((text, ids) for text in stop_texts if (ids := tuple(lm.encode(text)))) if trt else ()
    holdback = max((len(lm.encode(s)) for s in stop_texts), default=1) - 1
    if context_only and config.no_cache_transceiver and trt:
        deferred.append("context-only request without a KV cache transceiver (cache_transceiver_config)")
    if config.fault_violation is not None and faults.violation is None:
        faults = dataclasses.replace(faults, violation=cast("Violation", config.fault_violation))
    split_finish_ms = faults.split_finish_ms if faults.split_finish_ms is not None else config.split_finish_ms

    return RequestPlan(
        request_id=request.request_id,
        model=request.model,
        prompt_ids=tuple(prompt_ids),
        n=n,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        include_stop=include_stop,
        stop_texts=tuple(stop_texts),
        stop_ids=frozenset(stop_ids),
        token_holdback=max(holdback, 0),
        output_logprobs=output_logprobs,
        output_top_n=output_top_n,
        prompt_logprobs=prompt_logprobs,
        prompt_top_n=prompt_top_n,
        context_only=context_only,
        session=session,
        detokenize=detokenize,
        lora_name=lora_name,
        cache_salt=cache_salt or None,
        bypass_prefix_cache=bypass,
        priority=priority,
        script=script,
        script_ends_with_eos=script_ends_with_eos,
        faults=faults,
        media=media,
        text_prompt=kind == "prompt",
        guide=compiled_guide,
        stop_sequences=stop_sequences,
        text_stops=not trt,
        trim_stops=trt and not include_stop,
        deferred_error=deferred[0] if deferred else None,
        split_finish_ms=split_finish_ms,
    )
