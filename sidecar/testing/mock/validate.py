"""``GenerateRequest`` + metadata → :class:`RequestPlan`, or a :class:`Rejection` (a status before acceptance).

The checks run in TensorRT-LLM's order (``docs/mock.md``, *Generate: validation*): id, model, duplicate id, unsupported
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
    "check_request_id_length",
    "validate_request",
]

MAX_STOP_CONDITIONS = 64
#: prompt tokens × candidates above this → terminal ``EngineError(INVALID_ARGUMENT)`` (after acceptance, as TRT).
PROMPT_LOGPROB_LIMIT = 1_000_000
_INT32 = (-(2**31), 2**31 - 1)
_DECIMAL = re.compile(r"[+-]?[0-9]+")
_REQUEST_TYPES = ("context_and_generation", "context_only")
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
    #: ``openengine-target-dp-rank`` (None: not sent).
    target_dp_rank: int | None = None
    #: ``extra.conversation_id`` when it is a string (None: not sent).
    conversation_id: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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


def _metadata_checks(metadata: MultiDict[str | bytes] | None, config: MockConfig, n: int) -> tuple[int, int | None]:
    """gRPC metadata rules (wire §7.6 as TRT applies them); returns the priority (0 = default) and the DP rank
    targeted (None: not sent)."""
    if metadata is None:
        return 0, None
    keys = {k.lower() for k in metadata}
    for key in sorted(keys):
        if key.startswith("openengine-") and len(metadata.getall(key)) > 1:
            raise _invalid(f"metadata key {key!r} must not be repeated")
    if config.engine.refuses_unknown_metadata:
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
    rank: int | None = None
    if raw_rank is not None:
        if not config.engine.targets_dp_rank:
            raise _unimplemented("metadata openengine-target-dp-rank is not supported")
        text = raw_rank.decode() if isinstance(raw_rank, bytes) else raw_rank
        size = config.data_parallel_size
        if not _DECIMAL.fullmatch(text.strip()) or not 0 <= int(text) < size:
            raise _invalid(f"metadata openengine-target-dp-rank must be in [0, {size}), got {text!r}")
        if n > 1:
            raise _invalid("metadata openengine-target-dp-rank cannot be combined with num_sequences > 1")
        rank = int(text)
    return priority, rank


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


@dataclasses.dataclass(frozen=True, slots=True)
class _Features:
    """Step 4: the optional features a request asks for."""

    media: tuple[MediaInput, ...]
    lora_name: str | None
    bypass_prefix_cache: bool


@dataclasses.dataclass(frozen=True, slots=True)
class _Sampling:
    """Step 6: ``SamplingParams`` with TensorRT-LLM's defaults resolved."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    n: int

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class _Stopping:
    """Step 6: ``StoppingOptions`` (``max_tokens`` is resolved against the window at step 10)."""

    stop_texts: tuple[str, ...]
    stop_ids: frozenset[int]
    include_stop: bool
    min_tokens: int | None
    ignore_eos: bool


@dataclasses.dataclass(frozen=True, slots=True)
class _Response:
    """Step 6: ``ResponseOptions``."""

    output_logprobs: bool
    output_top_n: int
    prompt_logprobs: bool
    prompt_top_n: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Extra:
    """Step 6: the ``extra`` keys the engine reads."""

    context_only: bool
    detokenize: bool
    conversation_id: str | None


def _fault_spec(
    request: generation_pb2.GenerateRequest, extra: dict[str, JsonValue], config: MockConfig, lm: LanguageModel
) -> MockFaults:
    """Step 0: ``extra.mock`` (or a prompt directive), first, so a test can force any pre-acceptance status."""
    spec = extra.get("mock")
    if spec is None and config.faults_from_prompt:
        text = request.prompt if request.WhichOneof("input") == "prompt" else lm.decode(request.token_ids.ids)
        spec = prompt_fault_spec(text)
    if spec is None:
        faults = MockFaults()
    else:
        try:
            faults = parse_faults(spec)
        except FaultError as exc:
            raise _invalid(str(exc)) from None
        if faults.reject_status is not None:
            raise _reject(faults.reject_status, faults.reject_message or "rejected by extra.mock.reject_status")
    if config.fault_violation is not None and faults.violation is None:
        faults = dataclasses.replace(faults, violation=cast("Violation", config.fault_violation))
    return faults


def check_request_id_length(request_id: str, config: MockConfig) -> None:
    """With several frontends, an id the coordinator cannot carry is ``INVALID_ARGUMENT`` (``Generate``, ``Abort``)."""
    limit = config.engine.frontend_request_id_limit
    if limit is not None and config.frontends > 1 and len(request_id.encode()) > limit:
        raise _invalid(f"request_id must not exceed {limit} UTF-8 bytes with multiple frontends")


def _identity(request: generation_pb2.GenerateRequest, config: MockConfig, is_live: Callable[[str], bool]) -> None:
    """Steps 1–3: request id, model, duplicate id."""
    if not request.request_id:
        raise _invalid("request_id must not be empty")
    check_request_id_length(request.request_id, config)
    if not request.model:
        raise _invalid("model must not be empty")
    if request.model not in config.model_names and not config.engine.serves_unknown_models:
        raise _reject(
            Status.NOT_FOUND, f"model {request.model!r} is not served here (serving {config.served_model_name!r})"
        )
    if is_live(request.request_id):
        raise _reject(Status.ALREADY_EXISTS, f"request_id {request.request_id!r} is already active")


def _features(request: generation_pb2.GenerateRequest, config: MockConfig, loras: Collection[str]) -> _Features:
    """Step 4: media, LoRA and prefix-cache bypass, each only where advertised."""
    caps = config.capabilities
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
    return _Features(media, lora_name, bypass)


def _input(
    request: generation_pb2.GenerateRequest, config: MockConfig, lm: LanguageModel, media: tuple[MediaInput, ...]
) -> list[int]:
    """Step 5: exactly one input; token ids in the vocabulary (a prompt is tokenized at step 10, like TRT)."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise _invalid("exactly one of prompt or token_ids is required")
    prompt_ids: list[int] = []
    if kind == "prompt":
        if not request.prompt:
            raise _invalid("prompt must not be empty")
        if not config.capabilities.text_input:
            raise _unimplemented("text prompts are not supported (supports_text_input=false); send token_ids")
    else:
        prompt_ids = list(request.token_ids.ids)
        if not prompt_ids:
            raise _invalid("token_ids must not be empty")
        bad = next((t for t in prompt_ids if t >= lm.vocab_size), None)
        if bad is not None:
            raise _invalid(f"token id {bad} is out of range (vocab_size={lm.vocab_size})")
    if media:
        _placeholder_checks(request.prompt if kind == "prompt" else lm.decode(prompt_ids), media)
    return prompt_ids


def _sampling(sampling: generation_pb2.SamplingParams, config: MockConfig, deferred: list[str]) -> _Sampling:
    """Step 6: sampling. What TensorRT-LLM's request mapping passes and its executor refuses goes to ``deferred``."""
    passes_through = config.engine.invalid_sampling == "engine_error"
    temperature = _finite("temperature", sampling.temperature) if sampling.HasField("temperature") else 1.0
    if temperature < 0:
        raise _invalid(f"temperature must be >= 0, got {temperature}")
    top_p = _finite("top_p", sampling.top_p) if sampling.HasField("top_p") else 1.0
    if passes_through:
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
        if not passes_through:
            raise _invalid(f"min_p must be in [0, 1], got {min_p}")
        deferred.append(f"min_p={min_p} is rejected by the sampler")
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        if sampling.HasField(name):
            _finite(name, getattr(sampling, name))
    if sampling.HasField("repetition_penalty") and sampling.repetition_penalty <= 0:
        if not passes_through:
            raise _invalid("repetition_penalty must be > 0")
        deferred.append(f"repetition_penalty={sampling.repetition_penalty} is rejected by the sampler")
    n = sampling.num_sequences if sampling.HasField("num_sequences") else 1
    if n == 0:
        raise _invalid("num_sequences must be > 0")
    if config.max_num_sequences is not None and n > config.max_num_sequences:
        raise _invalid(f"num_sequences={n} exceeds max_num_sequences={config.max_num_sequences}")
    # TensorRT-LLM's SamplingParams: temperature 0, top_k 1 and top_p 0 are each greedy.
    greedy = temperature == 0.0 or (config.engine.greedy_by_top_k_or_top_p and (top_k == 1 or top_p == 0.0))
    if n > 1 and greedy:
        raise _invalid("greedy sampling (temperature=0, top_k=1 or top_p=0) does not support num_sequences > 1")
    seed = sampling.seed if sampling.HasField("seed") else None
    return _Sampling(temperature, top_p, top_k, min_p, seed, n)


def _stopping(stopping: generation_pb2.StoppingOptions, config: MockConfig, deferred: list[str]) -> _Stopping:
    """Step 6: stop conditions, ``max_tokens`` 0, ``include_stop_in_output``, ``ignore_eos``."""
    engine = config.engine
    if len(stopping.conditions) > MAX_STOP_CONDITIONS:
        raise _invalid(f"at most {MAX_STOP_CONDITIONS} stop conditions are allowed, got {len(stopping.conditions)}")
    stop_texts: list[str] = []
    stop_ids: set[int] = set()
    for i, cond in enumerate(stopping.conditions):
        which = cond.WhichOneof("condition")
        if which == "stop_text" and (cond.stop_text or not engine.refuses_empty_stop_text):
            if cond.stop_text:  # TensorRT-LLM keeps an empty one: its empty tokenization never matches
                stop_texts.append(cond.stop_text)
        elif which == "stop_token_id":
            stop_ids.add(cond.stop_token_id)
        else:
            raise _invalid(f"stopping.conditions[{i}] is empty")
    if stopping.HasField("max_tokens") and stopping.max_tokens == 0:
        if engine.invalid_sampling == "refused":
            raise _invalid("max_tokens must be > 0")
        deferred.append("max_tokens=0 is rejected by the executor")
    include_stop = stopping.include_stop_in_output if stopping.HasField("include_stop_in_output") else False
    if include_stop and not config.capabilities.stop_in_output:
        raise _unimplemented("include_stop_in_output is not supported (supports_stop_in_output=false)")
    ignore_eos = stopping.ignore_eos if stopping.HasField("ignore_eos") else False
    if engine.ignore_eos_drops_stop_words and ignore_eos:
        # TensorRT-LLM's SamplingParams: ignore_eos drops every stop word, not only the end id.
        stop_texts, stop_ids = [], set()
    min_tokens = stopping.min_tokens if stopping.HasField("min_tokens") else None
    return _Stopping(tuple(stop_texts), frozenset(stop_ids), include_stop, min_tokens, ignore_eos)


def _response_options(response: generation_pb2.ResponseOptions, config: MockConfig) -> _Response:
    """Step 6: prompt and output logprobs (top-N only)."""
    caps = config.capabilities
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
    return _Response(output_logprobs, output_top_n, prompt_logprobs, prompt_top_n)


def _guide(request: generation_pb2.GenerateRequest, config: MockConfig) -> Guide | None:
    """Step 6: guided decoding — one guide the profile lists and ``guided.py`` can construct."""
    if not request.HasField("guided"):
        return None
    guided = request.guided
    if guided.backend:
        raise _unimplemented(f"guided.backend {guided.backend!r}: per-request backends are not supported")
    guide = guided.WhichOneof("guide")
    if guide is None:
        return None
    if not config.capabilities.guided:
        raise _unimplemented("guided decoding is not supported")
    if guide not in config.engine.guided_modes:
        raise _unimplemented(f"guided decoding mode {guide!r} is not supported by {config.engine.guided_backend}")
    if guide == "choice":
        if not any(guided.choice.choices):
            raise _invalid("guided.choice needs at least one non-empty choice")
        spec = json.dumps(list(guided.choice.choices))
    elif guide == "json_object":
        spec = ""
    else:
        spec = str(getattr(guided, guide))
    try:
        return compile_guide(guide, spec)
    except UnsupportedGuide as exc:
        raise _unimplemented(f"guided.{guide}: {exc.message}") from None


def _extra_options(extra: dict[str, JsonValue], config: MockConfig, has_session: bool) -> _Extra:
    """Step 6: ``extra.request_type``, ``extra.detokenize``, ``extra.conversation_id``.

    An engine whose ``kv.session`` decides the leg never reads ``request_type`` when a session is there; one that does
    not check the other keys' types (TensorRT-LLM's merged server never reads them) treats a wrong type as unset.
    """
    engine = config.engine
    request_type = extra.get("request_type", "context_and_generation")
    if has_session and engine.session_overrides_request_type:
        request_type = "context_and_generation"
    if not isinstance(request_type, str) or request_type not in _REQUEST_TYPES:
        raise _invalid(f"extra.request_type must be one of {', '.join(_REQUEST_TYPES)}, got {request_type!r}")
    detokenize = extra.get("detokenize", True)
    if not isinstance(detokenize, bool):
        if engine.checks_extra_types:
            raise _invalid(f"extra.detokenize must be a boolean, got {detokenize!r}")
        detokenize = True
    conversation = extra.get("conversation_id")
    if engine.checks_extra_types and "conversation_id" in extra and not isinstance(conversation, str):
        raise _invalid("extra.conversation_id must be a string")
    return _Extra(
        context_only=request_type == "context_only",
        detokenize=detokenize,
        conversation_id=conversation if isinstance(conversation, str) else None,
    )


def _cache_salt(request: generation_pb2.GenerateRequest, config: MockConfig) -> str | None:
    """Step 8: ``kv.cache_salt`` where advertised."""
    cache_salt = request.kv.cache_salt if request.HasField("kv") and request.kv.HasField("cache_salt") else None
    if cache_salt is not None and not config.capabilities.cache_salt:
        raise _unimplemented("kv.cache_salt is not supported (supports_cache_salt=false)")
    return cache_salt or None


def _disaggregation(
    request: generation_pb2.GenerateRequest, config: MockConfig, lm: LanguageModel, context_only: bool, n: int
) -> DecodeSession | None:
    """Step 9: the leg against the engine's role, and the replayed session of a decode leg."""
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
    if not has_session:
        return None
    session = _decode_session(request)
    bad = next((t for t in session.replay_tokens if t >= lm.vocab_size), None)
    if bad is not None:
        raise _invalid(f"kv.session: first_gen_tokens id {bad} is out of range")
    return session


@dataclasses.dataclass(frozen=True, slots=True)
class _Budget:
    """Step 10: the prompt as the engine sees it and what it may generate."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    min_tokens: int


def _engine_limits(
    request: generation_pb2.GenerateRequest,
    config: MockConfig,
    lm: LanguageModel,
    prompt_ids: list[int],
    *,
    n: int,
    context_only: bool,
    min_tokens: int | None,
) -> _Budget:
    """Step 10: what ``generate_async`` would refuse — an empty tokenization, the window, the KV pool."""
    if request.WhichOneof("input") == "prompt":
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
    stopping = request.stopping
    if stopping.HasField("max_tokens") and config.engine.clamps_max_tokens:
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
    bs = config.kv_block_size
    full = prompt_len // bs
    blocks = full + n * (-(-(prompt_len + max_tokens) // bs) - full)
    if blocks > config.total_kv_blocks:
        raise _invalid(f"request needs {blocks} KV blocks; the pool holds {config.total_kv_blocks}")
    return _Budget(tuple(prompt_ids), max_tokens, min(min_tokens, max_tokens) if min_tokens is not None else 0)


def validate_request(
    request: generation_pb2.GenerateRequest,
    metadata: MultiDict[str | bytes] | None,
    *,
    config: MockConfig,
    lm: LanguageModel,
    is_live: Callable[[str], bool],
    loras: Collection[str],
) -> RequestPlan:
    """Check ``request`` and resolve its defaults; raises :class:`Rejection` on the first failed rule.

    The steps run in TensorRT-LLM's order (module docstring); each helper checks one part of the request.
    """
    extra = _extra(request)
    faults = _fault_spec(request, extra, config, lm)  # 0
    _identity(request, config, is_live)  # 1–3
    features = _features(request, config, loras)  # 4
    prompt_ids = _input(request, config, lm, features.media)  # 5
    # 6. TensorRT-LLM's request mapping passes some out-of-range values through, and its executor then fails the
    # submitted request (the first such reason is kept; pre-acceptance checks below still win).
    deferred: list[str] = []
    sampling = _sampling(request.sampling, config, deferred)
    stops = _stopping(request.stopping, config, deferred)
    response = _response_options(request.response, config)
    guide = _guide(request, config)
    bad = next((t for t in faults.tokens or () if t >= lm.vocab_size), None)
    if bad is not None:
        raise _invalid(f"extra.mock.tokens: token id {bad} is out of range (vocab_size={lm.vocab_size})")
    has_session = request.HasField("kv") and request.kv.HasField("session")
    options = _extra_options(extra, config, has_session)
    priority, target_dp_rank = _metadata_checks(metadata, config, sampling.n)  # 7
    cache_salt = _cache_salt(request, config)  # 8
    session = _disaggregation(request, config, lm, options.context_only, sampling.n)  # 9
    budget = _engine_limits(  # 10
        request, config, lm, prompt_ids, n=sampling.n, context_only=options.context_only, min_tokens=stops.min_tokens
    )
    token_stops = config.engine.stop_words == "tokens"
    stop_sequences = (
        tuple((text, ids) for text in stops.stop_texts if (ids := tuple(lm.encode(text)))) if token_stops else ()
    )
    # Token ids that may still turn out to be a stop word are held back (none with include_stop_in_output: nothing
    # would be cut), by the longest stop word's tokenization - 1, as TensorRT-LLM's formatter does.
    holdback = 0 if stops.include_stop else max((len(lm.encode(s)) for s in stops.stop_texts), default=1) - 1
    without_transceiver = options.context_only and config.no_cache_transceiver
    if without_transceiver and config.engine.context_only_without_transceiver == "engine_error":
        deferred.append("context-only request without a KV cache transceiver (cache_transceiver_config)")
    return RequestPlan(
        request_id=request.request_id,
        model=request.model,
        prompt_ids=budget.prompt_ids,
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        seed=sampling.seed,
        max_tokens=budget.max_tokens,
        min_tokens=budget.min_tokens,
        ignore_eos=stops.ignore_eos,
        include_stop=stops.include_stop,
        stop_texts=stops.stop_texts,
        stop_ids=stops.stop_ids,
        token_holdback=max(holdback, 0),
        output_logprobs=response.output_logprobs,
        output_top_n=response.output_top_n,
        prompt_logprobs=response.prompt_logprobs,
        prompt_top_n=response.prompt_top_n,
        context_only=options.context_only,
        session=session,
        detokenize=options.detokenize,
        lora_name=features.lora_name,
        cache_salt=cache_salt,
        bypass_prefix_cache=features.bypass_prefix_cache,
        priority=priority,
        script=faults.tokens,
        script_ends_with_eos=False,
        faults=faults,
        media=features.media,
        text_prompt=request.WhichOneof("input") == "prompt",
        guide=guide,
        stop_sequences=stop_sequences,
        text_stops=not token_stops,
        trim_stops=token_stops and not stops.include_stop,
        deferred_error=deferred[0] if deferred else None,
        split_finish_ms=faults.split_finish_ms if faults.split_finish_ms is not None else config.split_finish_ms,
        target_dp_rank=target_dp_rank,
        conversation_id=options.conversation_id,
    )
