"""Dynamo ``PreprocessedRequest`` dict → OpenEngine ``GenerateRequest`` (upb) + gRPC metadata.

One function for every worker role (``aggregated``, ``prefill``, ``decode``; see "Disaggregation" below). Every
field of the request dict is in exactly one of three states, listed in :data:`FIELD_POLICY`:

* **mapped** — validated and carried to the engine;
* **refused** — not representable (yet) or not advertised by the engine: when present with a
  non-default value the request is rejected with :class:`~sidecar.errors.RequestRejected` naming
  the field, before any RPC (HTTP 400);
* **ignored** — the frontend already applied it, or it only matters to Dynamo's router.

The input is whatever the Dynamo binding hands us, so it is checked, not trusted: any malformed
value becomes ``RequestRejected``, never another exception (the tests fuzz this).

Rules shared with Dynamo's Rust sidecars (ai-dynamo/dynamo ``lib/sidecar/``) and TensorRT-LLM's OpenEngine server:

* ``stopping.max_tokens`` is always sent. When the request has none it is derived as
  ``context_length − prompt_len`` (TensorRT-LLM mishandles an omitted value, TRT-LLM #16549),
  capped by the model's ``max_output_tokens``. An explicit value above ``max_output_tokens`` is
  refused (as Dynamo's engine-neutral sidecar does); one above the remaining window is clamped to
  it — generation would end there with ``length`` anyway. A prompt that fills the window is refused.
* ``sampling.temperature`` is sent whenever given (TensorRT-LLM defaults to 1.0: greedy must be asked).
* Stop strings and stop token ids (``stop_token_ids`` ∪ ``stop_token_ids_hidden``) are deduplicated
  and sorted; at most 64 conditions together, as TensorRT-LLM enforces.

Capability-gated features (``docs/request-features.md``), each mapped only when the engine advertises it and
refused otherwise: guided decoding (one guide, advertised mode), prompt logprobs (aggregated requests; returned on
the final chunk), ``routing.priority`` → ``openengine-priority``, DP rank → ``openengine-target-dp-rank`` (never on
a decode leg: its ``kv.session`` decides), the cache salt → ``kv.cache_salt``, prefix-cache bypass →
``kv.bypass_prefix_cache``, ``routing.lora_name`` → ``lora_name``, ``multi_modal_data`` → ``media`` in message order
(:mod:`.media`; with an engine that takes text, ``extra_args.formatted_prompt`` becomes the input). The
``openengine-extra:{json}`` annotation fills ``GenerateRequest.extra`` (non-portable); for TensorRT-LLM
``agent_context.session_id`` (the client's ``X-Dynamo-Session-ID``) becomes ``extra.conversation_id`` on every leg. A
DP rank is dropped (not refused) with ``n > 1``, which TensorRT-LLM refuses to target; a request id above 1024 UTF-8
bytes is refused (TensorRT-LLM's multi-frontend server would answer INVALID_ARGUMENT).

Disaggregation (context-first, as TensorRT-LLM schedules it):

* **prefill** leg: ``max_tokens = 1``; ``min_tokens`` kept (clamped to 1, which has the same effect: EOS cannot end
  the one-token context phase, so the handoff happens); ``extra.request_type = "context_only"`` (TensorRT-LLM picks
  the phase per request from it; engines that know their role ignore it); one output only.
* **decode** leg: ``prefill_result.disaggregated_params`` is decoded and validated (:mod:`.handoff`) and replayed as
  ``kv.session``, with the full prompt; ``prefill_result.prompt_tokens_details.cached_tokens`` becomes the cached
  token count of the final usage (the decode engine would report the transferred prompt as a ~100 % cache hit). A
  decode request without ``prefill_result`` runs the whole request here (Dynamo's conditional disaggregation bypass).
* ``prefill_result`` on an aggregated or prefill worker is refused: it must be routed to a decode worker.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias

from openengine.v1 import generation_pb2
from openengine_bp.openengine.v1 import EngineRole, GuidedDecodingMode
from sidecar.errors import RequestRejected

from .handoff import handoff_to_session
from .media import map_media
from .response import ResponseMapper
from .structjson import StructValueError, json_to_pb_struct

if TYPE_CHECKING:
    from .capabilities import Capabilities

__all__ = [
    "FIELD_POLICY",
    "HEALTH_CANARY_PAYLOAD",
    "MAX_METADATA_BYTES",
    "MAX_STOP_CONDITIONS",
    "GenerateCall",
    "Role",
    "build_generate_request",
    "role_of_engine",
]

#: The worker's role, which decides the leg a request is (``sidecar.startup`` resolves it at start-up).
Role: TypeAlias = Literal["aggregated", "prefill", "decode"]

#: ``GenerateRequest.extra.request_type`` of a prefill leg (TensorRT-LLM's context-only phase).
CONTEXT_ONLY: Final = "context_only"

_ROLE_OF_ENGINE: Final[dict[EngineRole, Role]] = {
    EngineRole.AGGREGATED: "aggregated",
    EngineRole.PREFILL: "prefill",
    EngineRole.DECODE: "decode",
}


def role_of_engine(engine_role: EngineRole) -> Role:
    """The role an engine reports (``ServerInfo.engine_role``); UNSPECIFIED (TensorRT-LLM) reads as aggregated."""
    return _ROLE_OF_ENGINE.get(engine_role, "aggregated")


UINT32_MAX: Final = 2**32 - 1
UINT64_MAX: Final = 2**64 - 1
INT32_MAX: Final = 2**31 - 1

#: TensorRT-LLM refuses more stop conditions than this with INVALID_ARGUMENT.
MAX_STOP_CONDITIONS: Final = 64

#: Bound on the metadata copied from annotations (HTTP/2 header lists are small; stay far below).
MAX_METADATA_BYTES: Final = 8192

#: Dynamo's health canary for this worker (the payload Dynamo's engine-neutral sidecar registers):
#: one prompt token, one greedy output token, EOS ignored so the answer length is fixed. Treat it as
#: read-only; it maps to a valid request with any engine whose context window exceeds one token.
HEALTH_CANARY_PAYLOAD: Final[dict[str, Any]] = {
    "token_ids": [1],
    "stop_conditions": {"max_tokens": 1, "ignore_eos": True},
    "sampling_options": {"temperature": 0.0},
}

_MAPPED: Final = "mapped"
_REFUSED: Final = "refused"
_IGNORED: Final = "ignored"

#: Every PreprocessedRequest field this module knows → (policy, why). Unknown keys are ignored.
FIELD_POLICY: Final[Mapping[str, tuple[str, str]]] = MappingProxyType(
    {
        "token_ids": (_MAPPED, "GenerateRequest.token_ids; empty refused; uint32 each"),
        "model": (_IGNORED, "the worker serves one model; GenerateRequest.model comes from configuration"),
        "mdc_sum": (_IGNORED, "model-card checksum, frontend bookkeeping"),
        "eos_token_ids": (_IGNORED, "the engine knows its EOS tokens; the frontend applies EOS itself"),
        "annotations": (
            _MAPPED,
            "'key:value' entries with a plain metadata key → gRPC metadata; 'openengine-extra:{json object}' → "
            "GenerateRequest.extra (non-portable engine knobs); others ignored",
        ),
        "stop_conditions.max_tokens": (_MAPPED, "stopping.max_tokens, always sent (derived when absent)"),
        "stop_conditions.min_tokens": (_MAPPED, "stopping.min_tokens; must not exceed max_tokens"),
        "stop_conditions.stop": (_MAPPED, "stopping.conditions stop_text; deduplicated, sorted, empty strings dropped"),
        "stop_conditions.stop_token_ids": (_MAPPED, "stopping.conditions stop_token_id; deduplicated, sorted"),
        "stop_conditions.stop_token_ids_hidden": (_MAPPED, "merged into the stop token ids"),
        "stop_conditions.stop_token_ids_visible": (
            _REFUSED,
            "one include_stop_in_output flag cannot keep some stop tokens and hide others",
        ),
        "stop_conditions.ignore_eos": (_MAPPED, "stopping.ignore_eos"),
        "stop_conditions.max_thinking_tokens": (_REFUSED, "no reasoning budget in OpenEngine v0.1.0"),
        "sampling_options.n": (_MAPPED, "sampling.num_sequences, always sent; ≤ Capabilities.max_num_sequences"),
        "sampling_options.best_of": (_REFUSED, "unless equal to n"),
        "sampling_options.temperature": (_MAPPED, "sampling.temperature, ≥ 0"),
        "sampling_options.top_p": (_MAPPED, "sampling.top_p, in [0, 1]"),
        "sampling_options.top_k": (_MAPPED, "sampling.top_k; -1/0 mean unset, other negatives refused"),
        "sampling_options.min_p": (_MAPPED, "sampling.min_p, in [0, 1]"),
        "sampling_options.frequency_penalty": (_MAPPED, "sampling.frequency_penalty, in [-2, 2]"),
        "sampling_options.presence_penalty": (_MAPPED, "sampling.presence_penalty, in [-2, 2]"),
        "sampling_options.repetition_penalty": (_MAPPED, "sampling.repetition_penalty, > 0"),
        "sampling_options.seed": (_MAPPED, "sampling.seed, uint64; negatives refused"),
        "sampling_options.use_beam_search": (_REFUSED, "beam search is not in OpenEngine v0.1.0"),
        "sampling_options.length_penalty": (_REFUSED, "a beam-search parameter (1.0 is the default)"),
        "sampling_options.include_stop_str_in_output": (
            _MAPPED,
            "stopping.include_stop_in_output when generation.supports_stop_in_output, else refused; a kept stop "
            "token id is taken out of the output again (the frontend never shows it but would count it)",
        ),
        "sampling_options.guided_decoding": (
            _MAPPED,
            "guided: json→json_schema ({'type':'object'} → json_object when advertised), regex, grammar→ebnf_grammar, "
            "structural_tag, choice; one guide; mode must be advertised; backend/whitespace_pattern refused",
        ),
        "output_options.logprobs": (
            _MAPPED,
            "response.return_output_logprobs + output_candidates.top_n = max(1, logprobs), within max_top_n",
        ),
        "output_options.prompt_logprobs": (
            _MAPPED,
            "response.return_prompt_logprobs + prompt_candidates.top_n = max(1, k) when advertised; aggregated only; "
            "returned on the final chunk as engine_data.prompt_logprobs",
        ),
        "output_options.skip_special_tokens": (_IGNORED, "the frontend detokenizes"),
        "output_options.formatted_prompt": (_REFUSED, "not mapped (as Dynamo's engine-neutral sidecar)"),
        "output_options.return_tokens_as_token_ids": (_IGNORED, "the frontend renders tokens"),
        "routing.priority": (_MAPPED, "metadata openengine-priority when supports_priority, else refused (0: omitted)"),
        "routing.dp_rank": (
            _MAPPED,
            "metadata openengine-target-dp-rank when the engine advertises DP-rank targeting and the rank is in range "
            "(else refused); ignored when it names the only rank; omitted on decode legs (kv.session decides)",
        ),
        "routing.prefill_dp_rank": (
            _MAPPED,
            "as routing.dp_rank, on prefill legs (which fall back to dp_rank); ignored on other legs",
        ),
        "routing.lora_name": (_MAPPED, "GenerateRequest.lora_name when supports_lora, else refused; empty: base model"),
        "routing.cache_salt": (_MAPPED, "kv.cache_salt when supports_cache_salt, else refused"),
        "routing.cache_namespace": (_MAPPED, "as routing.cache_salt; conflicting salts refused"),
        "routing.*": (_IGNORED, "worker ids, expected_output_tokens, priority_jump: the router's business"),
        "extra_args.bypass_prefix_cache": (
            _MAPPED,
            "kv.bypass_prefix_cache when supports_prefix_cache_bypass, else refused",
        ),
        "extra_args.disable_prefix_cache": (_MAPPED, "as extra_args.bypass_prefix_cache"),
        "extra_args.nvext.cache_salt": (_MAPPED, "as routing.cache_salt (the frontend sends both)"),
        "extra_args.messages": (_MAPPED, "the media order (read only when the request carries media)"),
        "extra_args.formatted_prompt": (
            _MAPPED,
            "GenerateRequest.prompt instead of token_ids when media are present and supports_text_input",
        ),
        "extra_args.mm_hashes": (_MAPPED, "images' MediaItem.uuid (the frontend's media hashes), one per image"),
        "extra_args.mm_hashes_by_modality": (_MAPPED, "MediaItem.uuid per modality, as mm_hashes"),
        "extra_args.*": (_IGNORED, "frontend-level (nvext response fields, ...)"),
        "prefill_result": (
            _MAPPED,
            "decode role: disaggregated_params → kv.session (validated, number-faithful), "
            "prompt_tokens_details.cached_tokens → usage; refused on aggregated and prefill workers",
        ),
        "bootstrap_info": (_REFUSED, "client-bootstrap (SGLang-style) handoff is not supported; context-first only"),
        "multi_modal_data": (
            _MAPPED,
            "GenerateRequest.media in message order when supports_multimodal, else refused: data: URLs → data_uri, "
            "http(s) → url, other schemes refused; pre-decoded and uuid-only media refused; mixed modalities need "
            "extra_args.messages",
        ),
        "multi_modal_uuids": (_MAPPED, "MediaItem.uuid (wins over the frontend's hashes); refused without media"),
        "mm_routing_info": (_IGNORED, "the KV router's view of the same media; refused without media"),
        "mm_processor_kwargs": (_REFUSED, "no per-request media processing options in OpenEngine v0.1.0"),
        "media_io_kwargs": (_REFUSED, "no per-request media loading options in OpenEngine v0.1.0"),
        "encoder_result": (_REFUSED, "encoder handoff not supported"),
        "prompt_embeds": (_REFUSED, "prompt embeddings are not in OpenEngine v0.1.0"),
        "require_reasoning": (_REFUSED, "not mapped (as Dynamo's engine-neutral sidecar)"),
        "agent_context.session_id": (
            _MAPPED,
            "extra.conversation_id (trimmed; none when blank) on every leg, for TensorRT-LLM (newer builds place a "
            "conversation's turns on one rank; the merged server ignores the key); the frontend fills it from the "
            "client's X-Dynamo-Session-ID header; an openengine-extra annotation's own conversation_id wins",
        ),
        "agent_context.*": (_IGNORED, "agent tracing (trajectory, headers, input trigger): the frontend's"),
        "*": (_IGNORED, "router/frontend bookkeeping (router_config_override, kv_hint, migration_link, ...)"),
    }
)

# Top-level fields refused whenever they carry a value (None, empty containers and all-None
# objects count as absent).
_REFUSED_TOP_LEVEL: Final = (
    ("bootstrap_info", "client-bootstrap disaggregation is not supported (context-first handoffs only)"),
    ("mm_processor_kwargs", "per-request media processing options are not supported by OpenEngine v0.1.0"),
    ("media_io_kwargs", "per-request media loading options are not supported by OpenEngine v0.1.0"),
    ("encoder_result", "encoder handoff is not supported"),
    ("prompt_embeds", "prompt embeddings are not supported by OpenEngine v0.1.0"),
)

# gRPC metadata keys an annotation may never set: transport headers, the reserved OpenEngine
# prefix (priority and DP targeting are capability-gated) and the trace headers (from `trace`).
_RESERVED_KEYS: Final = frozenset(
    {"te", "content-type", "user-agent", "host", "connection", "authorization", "traceparent", "tracestate"}
)
_RESERVED_PREFIXES: Final = ("grpc-", "openengine-", ":")
_KEY_CHARS: Final = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_.")

_EMPTY: Final[Mapping[str, Any]] = MappingProxyType({})


@dataclass(frozen=True, slots=True, eq=False)
class GenerateCall:
    """One ready-to-send ``Generate`` call and what the response side needs to know about it."""

    #: The upb request.
    request: generation_pb2.GenerateRequest
    #: gRPC metadata, in order: ``traceparent``, ``tracestate``, ``openengine-priority``,
    #: ``openengine-target-dp-rank`` (each when present), then annotations.
    metadata: tuple[tuple[str, str], ...]
    #: Outputs asked for (``num_sequences``); chunk ``index`` ranges over ``0 … n − 1``.
    n: int
    #: Output logprobs asked for: None = not asked, 0 = selected token only, k = top-k alternatives.
    logprobs: int | None
    #: ``output_candidates.top_n`` sent (``max(1, logprobs)``), None when logprobs were not asked.
    top_n: int | None
    #: Prompt length in tokens.
    prompt_tokens: int
    #: ``stopping.max_tokens`` sent (explicit, clamped, or derived; 1 on a prefill leg).
    max_tokens: int
    #: The leg this call is: ``aggregated`` (a whole request, also a decode worker's bypass), ``prefill`` or
    #: ``decode`` (with ``kv.session``).
    leg: Role = "aggregated"
    #: Cached prompt tokens reported by the prefill leg (decode legs only; None = not reported).
    prefill_cached_tokens: int | None = None
    #: Prompt logprobs asked for: None = not asked, 0 = prompt token only, k = top-k alternatives.
    prompt_logprobs: int | None = None

    @property
    def handoff(self) -> bool:
        """Whether this is a decode leg replaying a prefill handoff (its client cancellation is deferred)."""
        return self.leg == "decode"

    @property
    def request_id(self) -> str:
        """The request id carried by the request (and expected on every response)."""
        request_id: str = self.request.request_id
        return request_id

    @property
    def stop_texts(self) -> tuple[str, ...]:
        """The stop strings sent (the frontend matches them on its own text, see :mod:`.response`)."""
        return tuple(c.stop_text for c in self.request.stopping.conditions if c.WhichOneof("condition") == "stop_text")

    def response_mapper(self, eos_token_ids: Iterable[int] = ()) -> ResponseMapper:
        """A fresh :class:`ResponseMapper` for this call's response stream.

        ``eos_token_ids``: the request's EOS ids (``PreprocessedRequest.eos_token_ids``, which the engine is not sent);
        with the stop token ids they are the tokens whose chunk waits for the engine's terminal (unless
        ``ignore_eos``).
        """
        stopping = self.request.stopping
        terminal = {c.stop_token_id for c in stopping.conditions if c.WhichOneof("condition") == "stop_token_id"}
        detokenize = self.request.extra.fields.get(DETOKENIZE_KEY)
        engine_text = detokenize is None or detokenize.WhichOneof("kind") != "bool_value" or detokenize.bool_value
        # A stop token kept in the output (include_stop_in_output) is one the frontend will not show: the mapper takes
        # it out again, so the text and the usage agree (the engine's flag is shared with stop strings, which the
        # frontend does show).
        hidden_stop_ids = frozenset(terminal) if stopping.include_stop_in_output else frozenset()
        if not stopping.ignore_eos:
            terminal.update(eos_token_ids)
        return ResponseMapper(
            self.request_id,
            n=self.n,
            logprobs=self.logprobs,
            prompt_tokens=self.prompt_tokens,
            leg=self.leg,
            cached_tokens=self.prefill_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
            terminal_ids=terminal,
            min_tokens=stopping.min_tokens,
            max_tokens=self.max_tokens,
            stop_strings=self.stop_texts if engine_text else (),
            hidden_stop_ids=hidden_stop_ids,
        )


# ------------------------------------------------------------------------------------------ readers


def _is_empty(value: object) -> bool:
    return value is None or (isinstance(value, list | tuple | str | bytes | Mapping) and len(value) == 0)


def _is_unset(value: object) -> bool:
    """None, an empty container, or an object whose members are all None or empty.

    One level deep on purpose: serde serializes an unset Rust struct as ``{"a": null, ...}``, and
    anything nested deeper that carries a value is a value.
    """
    if isinstance(value, Mapping):
        return all(_is_empty(member) for member in value.values())
    return _is_empty(value)


def _section(request: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = request.get(key)
    if value is None:
        return _EMPTY
    if not isinstance(value, Mapping):
        raise RequestRejected(key, f"must be an object, got {type(value).__name__}")
    return value


def _int(value: object, field: str, lo: int, hi: int) -> int | None:
    if value is None:
        return None
    # bool is an int subclass; JSON true is not a count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestRejected(field, f"must be an integer, got {type(value).__name__}")
    if value < lo:
        raise RequestRejected(field, f"must be ≥ {lo}, got {value}")
    if value > hi:
        raise RequestRejected(field, f"must be ≤ {hi}, got {value}")
    return value


def _float(value: object, field: str, lo: float | None = None, hi: float | None = None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestRejected(field, f"must be a number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond the double range
        raise RequestRejected(field, f"{value} is out of range") from None
    if not math.isfinite(number):
        raise RequestRejected(field, f"must be a finite number, got {number}")
    if lo is not None and number < lo:
        raise RequestRejected(field, f"must be ≥ {lo}, got {number}")
    if hi is not None and number > hi:
        raise RequestRejected(field, f"must be ≤ {hi}, got {number}")
    return number


def _bool(value: object, field: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise RequestRejected(field, f"must be a boolean, got {type(value).__name__}")


def _list(value: object, field: str) -> Sequence[object]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise RequestRejected(field, f"must be a list, got {type(value).__name__}")
    return value


def _token_ids(request: Mapping[str, Any]) -> Sequence[int]:
    ids = request.get("token_ids")
    if not isinstance(ids, list | tuple):
        raise RequestRejected("token_ids", "must be a non-empty list of token ids")
    if not ids:
        raise RequestRejected("token_ids", "must not be empty")
    return ids


# ------------------------------------------------------------------------------------------- build


def build_generate_request(
    request: Mapping[str, Any],
    *,
    request_id: str,
    model: str,
    caps: Capabilities,
    context_length: int,
    trace: Mapping[str, str] | None = None,
    role: Role = "aggregated",
    engine_detokenize: bool = True,
) -> GenerateCall:
    """Map one Dynamo ``PreprocessedRequest`` dict to a ``Generate`` call for a worker of ``role``.

    ``context_length`` is the window in force (configured, else ``ModelInfo.max_context_length``);
    ``trace`` holds the caller's ``traceparent``/``tracestate``. ``engine_detokenize=False``: the engine is known to
    accept ``extra.detokenize`` (a bool) and is asked not to detokenize, unless the request needs the engine's token
    text (see :func:`_skip_engine_detokenize`). Raises only :class:`~sidecar.errors.RequestRejected`, naming the
    offending field (``sampling_options.top_k``).
    """
    checked: object = request  # the binding hands us Any; check what it really is
    if not isinstance(checked, Mapping):
        raise RequestRejected("request", f"must be an object, got {type(checked).__name__}")
    stop = _section(request, "stop_conditions")
    sampling = _section(request, "sampling_options")
    output = _section(request, "output_options")
    routing = _section(request, "routing")
    extra_args = _section(request, "extra_args")

    _refuse_unmapped(request, stop, sampling, output, routing)
    leg = _leg(request, role)

    _check_request_id(request_id)
    result = generation_pb2.GenerateRequest(request_id=request_id, model=model)
    ids = _token_ids(request)
    try:
        result.token_ids.ids.extend(ids)
    except (TypeError, ValueError):
        # upb checks every id (int, not bool, 0 ≤ id < 2^32) in C; find the culprit only on failure.
        bad = next(
            (i for i, t in enumerate(ids) if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= UINT32_MAX),
            0,
        )
        reason = f"must be a token id in [0, {UINT32_MAX}], got {ids[bad]!r}"
        raise RequestRejected(f"token_ids[{bad}]", reason) from None
    prompt_tokens = len(ids)

    n = _map_sampling(result.sampling, sampling, caps)
    if n > 1 and leg != "aggregated":
        reason = f"a disaggregated ({leg}) request serves one output; asked for {n}"
        raise RequestRejected("sampling_options.n", reason)
    max_tokens = _map_stopping(
        result.stopping, stop, sampling, caps, prompt_tokens, context_length, one_token_leg=leg == "prefill"
    )
    logprobs, top_n = _map_logprobs(result, output, caps)
    prompt_logprobs = _map_prompt_logprobs(result, output, caps, leg)
    _map_guided(result, sampling, caps)
    _map_kv_options(result, routing, extra_args, caps)
    _map_lora(result, routing, caps)
    _map_media(result, request, extra_args, caps)
    _map_extra(result, request)
    _map_conversation(result, request, caps)
    if not engine_detokenize:
        _skip_engine_detokenize(result, logprobs, prompt_logprobs)
    engine_metadata = _engine_metadata(routing, caps, leg, n)
    cached: int | None = None
    if leg == "prefill":
        max_tokens = _prefill_leg(result)
    elif leg == "decode":
        cached = _decode_leg(result, _section(request, "prefill_result"), caps, prompt_tokens)

    return GenerateCall(
        request=result,
        metadata=_metadata(request, trace, engine_metadata),
        n=n,
        logprobs=logprobs,
        top_n=top_n,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        leg=leg,
        prefill_cached_tokens=cached,
        prompt_logprobs=prompt_logprobs,
    )


def _leg(request: Mapping[str, Any], role: Role) -> Role:
    """Which leg the request is on a worker of ``role``: a decode worker without a handoff runs the whole request."""
    has_handoff = not _is_unset(request.get("prefill_result"))
    if role == "decode":
        return "decode" if has_handoff else "aggregated"
    if has_handoff:
        reason = f"a prefill handoff must be routed to a decode worker; this worker is {role}"
        raise RequestRejected("prefill_result", reason)
    return role


def _prefill_leg(result: generation_pb2.GenerateRequest) -> int:
    """Make ``result`` a context-only leg: one token, ``min_tokens`` kept, ``extra.request_type``; returns 1."""
    stopping = result.stopping
    stopping.max_tokens = 1
    # min_tokens was validated against the request's own max_tokens. Any min_tokens ≥ 1 means the same thing for a
    # one-token leg (EOS may not end it), and a value above max_tokens could be refused by the engine.
    if stopping.HasField("min_tokens") and stopping.min_tokens > 1:
        stopping.min_tokens = 1
    result.extra.fields["request_type"].string_value = CONTEXT_ONLY
    return 1


def _decode_leg(
    result: generation_pb2.GenerateRequest, prefill_result: Mapping[str, Any], caps: Capabilities, prompt_tokens: int
) -> int | None:
    """Replay the prefill handoff as ``kv.session``; returns the prefill leg's cached prompt tokens (or None)."""
    params = prefill_result.get("disaggregated_params")
    if params is None:
        reason = "missing: the prefill leg returned no handoff (is the prefill worker an OpenEngine prefill worker?)"
        raise RequestRejected("prefill_result.disaggregated_params", reason)
    result.kv.session.CopyFrom(handoff_to_session(params, connector=caps.kv_connector))
    details = prefill_result.get("prompt_tokens_details")
    if details is None:
        return None
    if not isinstance(details, Mapping):
        reason = f"must be an object, got {type(details).__name__}"
        raise RequestRejected("prefill_result.prompt_tokens_details", reason)
    cached = _int(details.get("cached_tokens"), "prefill_result.prompt_tokens_details.cached_tokens", 0, UINT32_MAX)
    return None if cached is None else min(cached, prompt_tokens)


def _refuse_unmapped(
    request: Mapping[str, Any],
    stop: Mapping[str, Any],
    sampling: Mapping[str, Any],
    output: Mapping[str, Any],
    routing: Mapping[str, Any],
) -> None:
    """Reject every field this mapping cannot honour yet, when it carries a non-default value."""
    for key, reason in _REFUSED_TOP_LEVEL:
        if not _is_unset(request.get(key)):
            raise RequestRejected(key, reason)
    if _bool(request.get("require_reasoning"), "require_reasoning"):
        raise RequestRejected("require_reasoning", "forced reasoning is not supported")

    if _bool(sampling.get("use_beam_search"), "sampling_options.use_beam_search"):
        raise RequestRejected("sampling_options.use_beam_search", "beam search is not supported by OpenEngine v0.1.0")
    length_penalty = _float(sampling.get("length_penalty"), "sampling_options.length_penalty")
    if length_penalty is not None and length_penalty != 1.0:
        raise RequestRejected("sampling_options.length_penalty", "a beam-search parameter; beam search is unsupported")

    if not _is_unset(stop.get("stop_token_ids_visible")):
        raise RequestRejected(
            "stop_conditions.stop_token_ids_visible",
            "visible stop token ids cannot be represented (one include_stop_in_output flag for all stops)",
        )
    if stop.get("max_thinking_tokens") is not None:
        raise RequestRejected("stop_conditions.max_thinking_tokens", "no reasoning-token budget in OpenEngine v0.1.0")

    if _bool(output.get("formatted_prompt"), "output_options.formatted_prompt"):
        raise RequestRejected("output_options.formatted_prompt", "returning the formatted prompt is not supported")


# ----------------------------------------------------------------------------- capability-gated request features

#: Dynamo's ``guided_decoding`` keys that name a guide → (``GuidedDecoding`` oneof member, advertised mode).
_GUIDES: Final = (
    ("json", "json_schema", GuidedDecodingMode.JSON_SCHEMA),
    ("regex", "regex", GuidedDecodingMode.REGEX),
    ("grammar", "ebnf_grammar", GuidedDecodingMode.EBNF_GRAMMAR),
    ("structural_tag", "structural_tag", GuidedDecodingMode.STRUCTURAL_TAG),
    ("choice", "choice", GuidedDecodingMode.CHOICE),
)
_MODE_NAMES: Final[dict[GuidedDecodingMode, str]] = {
    GuidedDecodingMode.JSON_SCHEMA: "json_schema",
    GuidedDecodingMode.REGEX: "regex",
    GuidedDecodingMode.EBNF_GRAMMAR: "ebnf_grammar",
    GuidedDecodingMode.STRUCTURAL_TAG: "structural_tag",
    GuidedDecodingMode.CHOICE: "choice",
    GuidedDecodingMode.JSON_OBJECT: "json_object",
}
#: The schema Dynamo's frontend sends for ``response_format: {"type": "json_object"}``.
_ANY_OBJECT_SCHEMA: Final[Mapping[str, Any]] = MappingProxyType({"type": "object"})
#: Bound on one guide's text (a schema, grammar, regex or all choices together).
MAX_GUIDE_BYTES: Final = 1 << 20
#: The annotation whose value (a JSON object) becomes ``GenerateRequest.extra``.
EXTRA_ANNOTATION: Final = "openengine-extra"
#: ``extra`` keys the sidecar owns (the disaggregation phase).
_RESERVED_EXTRA: Final = frozenset({"request_type"})
#: Bound on ``kv.cache_salt``.
MAX_CACHE_SALT_BYTES: Final = 1024


def _json_text(value: object, field: str) -> str:
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise RequestRejected(field, f"is not JSON: {exc}") from None
    if not text:
        raise RequestRejected(field, "must not be empty")
    if len(text) > MAX_GUIDE_BYTES:
        raise RequestRejected(field, f"longer than {MAX_GUIDE_BYTES} characters")
    return text


def _map_guided(target: generation_pb2.GenerateRequest, sampling: Mapping[str, Any], caps: Capabilities) -> None:
    """``sampling_options.guided_decoding`` → ``GenerateRequest.guided`` (one guide, advertised mode only)."""
    field = "sampling_options.guided_decoding"
    guided = sampling.get("guided_decoding")
    if _is_unset(guided):
        return
    if not isinstance(guided, Mapping):
        raise RequestRejected(field, f"must be an object, got {type(guided).__name__}")
    if not _is_empty(guided.get("backend")):
        raise RequestRejected(f"{field}.backend", "per-request guided-decoding backends are not supported")
    if not _is_empty(guided.get("whitespace_pattern")):
        raise RequestRejected(f"{field}.whitespace_pattern", "a guided whitespace pattern cannot be represented")
    # Empty members count as absent (as everywhere in this module: serde sends unset fields as null or empty).
    present = [entry for entry in _GUIDES if not _is_empty(guided.get(entry[0]))]
    if not present:
        return
    if len(present) > 1:
        names = ", ".join(key for key, _, _ in present)
        raise RequestRejected(field, f"at most one guide per request, got {names}")
    key, member, mode = present[0]
    value = guided[key]
    support = caps.guided_decoding
    if key == "json" and value == _ANY_OBJECT_SCHEMA and GuidedDecodingMode.JSON_OBJECT in support.modes:
        # response_format json_object arrives as this schema; the engine's dedicated mode is the faithful one.
        member, mode = "json_object", GuidedDecodingMode.JSON_OBJECT
    if support.supported is not True:
        raise RequestRejected(field, "the engine does not advertise guided decoding")
    if mode not in support.modes:
        offered = ", ".join(sorted(_MODE_NAMES[m] for m in support.modes if m in _MODE_NAMES)) or "none"
        raise RequestRejected(f"{field}.{key}", f"the engine does not offer {_MODE_NAMES[mode]} (offers: {offered})")
    guide = target.guided
    if member == "json_object":
        guide.json_object.SetInParent()
    elif member == "choice":
        choices = _list(value, f"{field}.choice")
        if not choices:
            raise RequestRejected(f"{field}.choice", "must list at least one choice")
        total = 0
        for i, choice in enumerate(choices):
            if not isinstance(choice, str) or not choice:
                raise RequestRejected(f"{field}.choice[{i}]", "must be a non-empty string")
            total += len(choice)
        if total > MAX_GUIDE_BYTES:
            raise RequestRejected(f"{field}.choice", f"longer than {MAX_GUIDE_BYTES} characters together")
        guide.choice.choices.extend(choices)
    elif member in ("json_schema", "structural_tag"):
        setattr(guide, member, _json_text(value, f"{field}.{key}"))
    else:  # regex, ebnf_grammar: text only
        if not isinstance(value, str):
            raise RequestRejected(f"{field}.{key}", f"must be a string, got {type(value).__name__}")
        setattr(guide, member, _json_text(value, f"{field}.{key}"))


def _map_prompt_logprobs(
    target: generation_pb2.GenerateRequest, output: Mapping[str, Any], caps: Capabilities, leg: Role
) -> int | None:
    field = "output_options.prompt_logprobs"
    k = _int(output.get("prompt_logprobs"), field, 0, UINT32_MAX)
    if k is None:
        return None
    if leg != "aggregated":
        raise RequestRejected(field, f"prompt logprobs are not supported on a disaggregated ({leg}) request")
    support = caps.prompt_logprobs
    if support.supported is not True:
        raise RequestRejected(field, "the engine does not advertise prompt logprob support")
    if not support.top_n_allowed:
        raise RequestRejected(field, "the engine does not offer top-N candidates for prompt logprobs")
    top_n = max(1, k)  # as output logprobs: 0 travels as top_n = 1, the mapper drops the alternatives
    if support.max_top_n is not None and top_n > support.max_top_n:
        raise RequestRejected(field, f"the engine returns at most {support.max_top_n} alternatives, asked for {top_n}")
    target.response.return_prompt_logprobs = True
    target.response.prompt_candidates.top_n = top_n
    return k


def _cache_salt(routing: Mapping[str, Any], extra_args: Mapping[str, Any]) -> tuple[str, str] | None:
    """The one cache salt the request carries, with the field it came from; conflicting salts are refused."""
    found: list[tuple[str, str]] = []
    nvext = extra_args.get("nvext")
    sources: list[tuple[str, object]] = [
        ("routing.cache_salt", routing.get("cache_salt")),
        ("routing.cache_namespace", routing.get("cache_namespace")),
    ]
    if isinstance(nvext, Mapping):
        sources.append(("extra_args.nvext.cache_salt", nvext.get("cache_salt")))
    for field, value in sources:
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise RequestRejected(field, f"must be a string, got {type(value).__name__}")
        if len(value) > MAX_CACHE_SALT_BYTES:
            raise RequestRejected(field, f"longer than {MAX_CACHE_SALT_BYTES} characters")
        found.append((field, value))
    if not found:
        return None
    if len({value for _, value in found}) > 1:
        raise RequestRejected(found[1][0], f"conflicts with {found[0][0]}")
    return found[0]


def _map_kv_options(
    target: generation_pb2.GenerateRequest,
    routing: Mapping[str, Any],
    extra_args: Mapping[str, Any],
    caps: Capabilities,
) -> None:
    salt = _cache_salt(routing, extra_args)
    if salt is not None:
        field, value = salt
        if caps.supports_cache_salt is not True:
            raise RequestRejected(field, "the engine does not advertise supports_cache_salt")
        target.kv.cache_salt = value
    for key in ("bypass_prefix_cache", "disable_prefix_cache"):
        field = f"extra_args.{key}"
        if _bool(extra_args.get(key), field):
            if caps.supports_prefix_cache_bypass is not True:
                raise RequestRejected(field, "the engine does not advertise supports_prefix_cache_bypass")
            target.kv.bypass_prefix_cache = True


def _map_lora(target: generation_pb2.GenerateRequest, routing: Mapping[str, Any], caps: Capabilities) -> None:
    """``routing.lora_name`` → ``GenerateRequest.lora_name`` (the frontend sets it for a LoRA model's requests)."""
    name = routing.get("lora_name")
    if name is None or name == "":
        return  # the base model
    if not isinstance(name, str):
        raise RequestRejected("routing.lora_name", f"must be a string, got {type(name).__name__}")
    if caps.supports_lora is not True:
        raise RequestRejected("routing.lora_name", "the engine does not advertise supports_lora")
    target.lora_name = name


def _map_media(
    target: generation_pb2.GenerateRequest,
    request: Mapping[str, Any],
    extra_args: Mapping[str, Any],
    caps: Capabilities,
) -> None:
    """``multi_modal_data`` → ``media`` in message order; with a text-capable engine, the rendered prompt as input."""
    if _is_unset(request.get("multi_modal_data")):
        for key in ("multi_modal_uuids", "mm_routing_info"):
            if not _is_unset(request.get(key)):
                raise RequestRejected(key, "describes media the request does not carry (no multi_modal_data)")
        return
    if caps.supports_multimodal is not True:
        raise RequestRejected("multi_modal_data", "the engine does not advertise supports_multimodal")
    map_media(target, request, extra_args)
    prompt = extra_args.get("formatted_prompt")
    if prompt is None or caps.supports_text_input is not True:
        return
    if not isinstance(prompt, str):
        raise RequestRejected("extra_args.formatted_prompt", f"must be a string, got {type(prompt).__name__}")
    if prompt:
        # As Dynamo's engine-neutral sidecar: an engine that takes text runs its own multimodal processor (placeholder
        # expansion) over the rendered chat template. The token ids stay the measure of the prompt (window, usage
        # fallback): the frontend tokenized this very text.
        target.prompt = prompt


def _engine_metadata(routing: Mapping[str, Any], caps: Capabilities, leg: Role, n: int) -> list[tuple[str, str]]:
    """``openengine-priority`` and ``openengine-target-dp-rank``, each only when the engine can take it."""
    metadata: list[tuple[str, str]] = []
    priority = _int(routing.get("priority"), "routing.priority", -(2**31), INT32_MAX)
    if priority:
        if caps.supports_priority is not True:
            raise RequestRejected("routing.priority", "the engine does not advertise supports_priority")
        metadata.append(("openengine-priority", str(priority)))
    ranks = {key: _int(routing.get(key), f"routing.{key}", 0, UINT32_MAX) for key in ("dp_rank", "prefill_dp_rank")}
    if leg == "decode":
        # The prefill leg's kv.session names the rank that holds the KV cache: it decides, not a header.
        return metadata
    # prefill_dp_rank outside a prefill leg is the router's note about another worker's rank: not ours to target.
    key = "prefill_dp_rank" if leg == "prefill" and ranks["prefill_dp_rank"] is not None else "dp_rank"
    rank = ranks[key]
    if rank is None or _only_rank(rank, caps):
        return metadata
    size = caps.data_parallel_size
    if caps.dp_rank_targeting is not True or not size:
        raise RequestRejected(f"routing.{key}", "the engine does not advertise data-parallel rank targeting")
    start = caps.data_parallel_start_rank or 0
    if not start <= rank < start + size:
        raise RequestRejected(f"routing.{key}", f"rank {rank} is outside the engine's ranks [{start}, {start + size})")
    if n > 1:
        # TensorRT-LLM refuses a rank target with several outputs (INVALID_ARGUMENT); the router's rank is a
        # placement hint, so the request goes untargeted rather than failing.
        return metadata
    metadata.append(("openengine-target-dp-rank", str(rank)))
    return metadata


#: ``GenerateRequest.extra`` key of TensorRT-LLM's detokenization switch (a bool: the string "false" is refused).
DETOKENIZE_KEY: Final = "detokenize"
#: ``GenerateRequest.extra`` key of TensorRT-LLM's conversation id (a string: another type is refused).
CONVERSATION_ID_KEY: Final = "conversation_id"
#: Engines that take ``extra.conversation_id`` as a string: TensorRT-LLM's newer builds read it (conversation
#: affinity), its merged server ignores unknown ``extra`` keys. Others are not sent it (``extra`` is not portable).
CONVERSATION_ID_ENGINES: Final = frozenset({"tensorrt_llm"})
#: Longest request id sent: TensorRT-LLM's multi-frontend server refuses longer ones (UTF-8 bytes) in ``Generate``
#: and ``Abort``. Dynamo's ids are 36-character UUIDs, the sidecar's canary ids shorter still.
MAX_REQUEST_ID_BYTES: Final = 1024


def _check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_BYTES or len(request_id.encode()) > MAX_REQUEST_ID_BYTES:
        reason = f"{len(request_id.encode())} UTF-8 bytes; an engine request id is at most {MAX_REQUEST_ID_BYTES}"
        raise RequestRejected("request_id", reason)


def _map_conversation(target: generation_pb2.GenerateRequest, request: Mapping[str, Any], caps: Capabilities) -> None:
    """``agent_context.session_id`` (trimmed) → ``extra.conversation_id``, the same on every leg and every turn of a
    conversation, for the engines of :data:`CONVERSATION_ID_ENGINES`."""
    context = request.get("agent_context")
    if _is_unset(context):
        return
    if not isinstance(context, Mapping):
        raise RequestRejected("agent_context", f"must be an object, got {type(context).__name__}")
    session = context.get("session_id")
    if session is None:
        return
    if not isinstance(session, str):
        raise RequestRejected("agent_context.session_id", f"must be a string, got {type(session).__name__}")
    session = session.strip()
    if not session or caps.engine_name not in CONVERSATION_ID_ENGINES or CONVERSATION_ID_KEY in target.extra.fields:
        return
    if len(session) > MAX_METADATA_BYTES:
        raise RequestRejected("agent_context.session_id", f"longer than {MAX_METADATA_BYTES} characters")
    target.extra.fields[CONVERSATION_ID_KEY].string_value = session


def _skip_engine_detokenize(
    target: generation_pb2.GenerateRequest, logprobs: int | None, prompt_logprobs: int | None
) -> None:
    """``extra.detokenize = false``: the frontend detokenizes from the token ids, so the engine's text of every token
    is thrown away (newer TensorRT-LLM builds then send an empty ``TokenOutput.text``; its merged server ignores the
    flag). Kept on when the sidecar forwards the engine's token strings (top logprobs, prompt logprobs), when the
    request has stop strings (the text the engine holds back tells the terminal hold that a stop string may be
    completing) and when the request's own ``openengine-extra`` annotation decides."""
    if (logprobs or 0) > 0 or prompt_logprobs is not None or DETOKENIZE_KEY in target.extra.fields:
        return
    if any(c.WhichOneof("condition") == "stop_text" for c in target.stopping.conditions):
        return  # the engine's text shows a stop string in progress (ResponseMapper.awaits_terminal)
    target.extra.fields[DETOKENIZE_KEY].bool_value = False


def _map_extra(target: generation_pb2.GenerateRequest, request: Mapping[str, Any]) -> None:
    """The ``openengine-extra:{...}`` annotation → ``GenerateRequest.extra`` (engine-specific, non-portable)."""
    found: str | None = None
    for annotation in _list(request.get("annotations"), "annotations"):
        if not isinstance(annotation, str):
            continue  # _metadata names the culprit
        key, sep, value = annotation.partition(":")
        if sep and key.strip().lower() == EXTRA_ANNOTATION:
            if found is not None:
                raise RequestRejected("annotations", f"{EXTRA_ANNOTATION} given more than once")
            found = value.strip()
    if found is None:
        return
    field = f"annotations[{EXTRA_ANNOTATION}]"
    if len(found) > MAX_METADATA_BYTES:
        raise RequestRejected(field, f"longer than {MAX_METADATA_BYTES} characters")
    try:
        knobs = json.loads(found)
    except ValueError as exc:
        raise RequestRejected(field, f"must be a JSON object: {exc}") from None
    if not isinstance(knobs, dict):
        raise RequestRejected(field, f"must be a JSON object, got {type(knobs).__name__}")
    reserved = sorted(_RESERVED_EXTRA.intersection(knobs))
    if reserved:
        raise RequestRejected(f"{field}.{reserved[0]}", "is set by the sidecar (the disaggregation phase)")
    try:
        target.extra.CopyFrom(json_to_pb_struct(knobs))
    except StructValueError as exc:
        raise RequestRejected(f"{field}.{exc.path}" if exc.path else field, exc.reason) from None


def _only_rank(rank: int, caps: Capabilities) -> bool:
    # A rank hint that names the single rank this engine has changes nothing; ignore it rather than
    # refuse every request from a KV router that stamps dp_rank on everything.
    if caps.data_parallel_size is not None and caps.data_parallel_size > 1:
        return False
    return rank == (caps.data_parallel_start_rank or 0)


def _map_sampling(target: generation_pb2.SamplingParams, sampling: Mapping[str, Any], caps: Capabilities) -> int:
    temperature = _float(sampling.get("temperature"), "sampling_options.temperature", lo=0.0)
    if temperature is not None:
        target.temperature = temperature
    top_p = _float(sampling.get("top_p"), "sampling_options.top_p", lo=0.0, hi=1.0)
    if top_p is not None:
        target.top_p = top_p
    top_k = sampling.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise RequestRejected("sampling_options.top_k", f"must be an integer, got {type(top_k).__name__}")
        if top_k < -1:
            raise RequestRejected("sampling_options.top_k", f"must be -1, 0 (both: no limit) or positive, got {top_k}")
        if top_k > INT32_MAX:
            raise RequestRejected("sampling_options.top_k", f"must be ≤ {INT32_MAX}, got {top_k}")
        if top_k > 0:
            target.top_k = top_k
    min_p = _float(sampling.get("min_p"), "sampling_options.min_p", lo=0.0, hi=1.0)
    if min_p is not None:
        target.min_p = min_p
    frequency = _float(sampling.get("frequency_penalty"), "sampling_options.frequency_penalty", lo=-2.0, hi=2.0)
    if frequency is not None:
        target.frequency_penalty = frequency
    presence = _float(sampling.get("presence_penalty"), "sampling_options.presence_penalty", lo=-2.0, hi=2.0)
    if presence is not None:
        target.presence_penalty = presence
    repetition = _float(sampling.get("repetition_penalty"), "sampling_options.repetition_penalty")
    if repetition is not None:
        if repetition <= 0.0:
            raise RequestRejected("sampling_options.repetition_penalty", f"must be > 0, got {repetition}")
        target.repetition_penalty = repetition
    seed = _int(sampling.get("seed"), "sampling_options.seed", 0, UINT64_MAX)
    if seed is not None:
        target.seed = seed

    n = _int(sampling.get("n"), "sampling_options.n", 1, UINT32_MAX) or 1
    if n > caps.max_num_sequences:
        limit = caps.max_num_sequences
        raise RequestRejected("sampling_options.n", f"the engine serves at most {limit} outputs, asked for {n}")
    best_of = _int(sampling.get("best_of"), "sampling_options.best_of", 1, UINT32_MAX)
    if best_of is not None and best_of != n:
        raise RequestRejected("sampling_options.best_of", f"must equal n ({n}); best-of selection is not supported")
    # Sent even for 1: explicit beats each engine's idea of the default.
    target.num_sequences = n
    return n


def _map_stopping(
    target: generation_pb2.StoppingOptions,
    stop: Mapping[str, Any],
    sampling: Mapping[str, Any],
    caps: Capabilities,
    prompt_tokens: int,
    context_length: int,
    *,
    one_token_leg: bool = False,
) -> int:
    window = context_length - prompt_tokens
    if window < 1:
        raise RequestRejected(
            "token_ids", f"the prompt ({prompt_tokens} tokens) fills the {context_length}-token context window"
        )
    explicit = _int(stop.get("max_tokens"), "stop_conditions.max_tokens", 1, UINT32_MAX)
    limit = caps.max_output_tokens
    if explicit is None:
        max_tokens = window if limit is None else min(window, limit)
        if max_tokens < 1:
            raise RequestRejected("stop_conditions.max_tokens", f"the engine allows {limit} output tokens")
    else:
        if limit is not None and explicit > limit:
            reason = f"the engine allows at most {limit}, asked for {explicit}"
            raise RequestRejected("stop_conditions.max_tokens", reason)
        max_tokens = min(explicit, window)
    target.max_tokens = max_tokens

    min_tokens = _int(stop.get("min_tokens"), "stop_conditions.min_tokens", 0, UINT32_MAX)
    if min_tokens is not None:
        # A prefill leg gets max_tokens=1 from the frontend with the client's own min_tokens: _prefill_leg clamps it.
        if min_tokens > max_tokens and not one_token_leg:
            raise RequestRejected("stop_conditions.min_tokens", f"{min_tokens} exceeds max_tokens ({max_tokens})")
        target.min_tokens = min_tokens

    ignore_eos = _bool(stop.get("ignore_eos"), "stop_conditions.ignore_eos")
    if ignore_eos is not None:
        target.ignore_eos = ignore_eos

    if _bool(sampling.get("include_stop_str_in_output"), "sampling_options.include_stop_str_in_output"):
        if caps.supports_stop_in_output is not True:
            raise RequestRejected(
                "sampling_options.include_stop_str_in_output", "the engine does not advertise supports_stop_in_output"
            )
        target.include_stop_in_output = True

    texts = _stop_texts(stop)
    token_ids = _stop_token_ids(stop)
    count = len(texts) + len(token_ids)
    if count > MAX_STOP_CONDITIONS:
        reason = f"at most {MAX_STOP_CONDITIONS} stop strings and stop token ids together, got {count}"
        raise RequestRejected("stop_conditions.stop", reason)
    conditions = target.conditions
    for text in texts:
        conditions.add(stop_text=text)
    for token_id in token_ids:
        conditions.add(stop_token_id=token_id)
    return max_tokens


def _stop_texts(stop: Mapping[str, Any]) -> list[str]:
    raw = stop.get("stop")
    if isinstance(raw, str):  # tolerate a single string where a list is expected
        raw = [raw]
    texts: set[str] = set()
    for i, text in enumerate(_list(raw, "stop_conditions.stop")):
        if not isinstance(text, str):
            raise RequestRejected(f"stop_conditions.stop[{i}]", f"must be a string, got {type(text).__name__}")
        # An empty stop string can never end anything; the engine would refuse it as an empty condition.
        if text:
            texts.add(text)
    return sorted(texts)


def _stop_token_ids(stop: Mapping[str, Any]) -> list[int]:
    ids: set[int] = set()
    for key in ("stop_token_ids", "stop_token_ids_hidden"):
        field = f"stop_conditions.{key}"
        for i, token_id in enumerate(_list(stop.get(key), field)):
            checked = _int(token_id, f"{field}[{i}]", 0, UINT32_MAX)
            if checked is None:
                raise RequestRejected(f"{field}[{i}]", "must be a token id, got null")
            ids.add(checked)
    return sorted(ids)


def _map_logprobs(
    target: generation_pb2.GenerateRequest, output: Mapping[str, Any], caps: Capabilities
) -> tuple[int | None, int | None]:
    field = "output_options.logprobs"
    logprobs = _int(output.get("logprobs"), field, 0, UINT32_MAX)
    if logprobs is None:
        return None, None
    support = caps.output_logprobs
    if support.supported is None:
        raise RequestRejected(field, "the engine does not report output logprob support")
    if not support.supported:
        raise RequestRejected(field, "the engine does not support output logprobs")
    if not support.top_n_allowed:
        raise RequestRejected(field, "the engine does not offer top-N candidates for output logprobs")
    # TensorRT-LLM computes the selected token's logprob only when at least one candidate is asked
    # for, so logprobs=0 travels as top_n=1; the mapper then leaves the alternatives out.
    top_n = max(1, logprobs)
    if support.max_top_n is not None and top_n > support.max_top_n:
        raise RequestRejected(field, f"the engine returns at most {support.max_top_n} alternatives, asked for {top_n}")
    target.response.return_output_logprobs = True
    target.response.output_candidates.top_n = top_n
    return logprobs, top_n


def _metadata(
    request: Mapping[str, Any], trace: Mapping[str, str] | None, engine: Sequence[tuple[str, str]] = ()
) -> tuple[tuple[str, str], ...]:
    metadata: list[tuple[str, str]] = []
    if trace:
        for key in ("traceparent", "tracestate"):
            value = trace.get(key)
            # A malformed trace header is dropped, not fatal: tracing must never fail a request.
            if isinstance(value, str) and value and _header_value_ok(value):
                metadata.append((key, value))
    metadata.extend(engine)
    size = 0
    annotations = request.get("annotations")
    for i, annotation in enumerate(_list(annotations, "annotations")):
        if not isinstance(annotation, str):
            raise RequestRejected(f"annotations[{i}]", f"must be a string, got {type(annotation).__name__}")
        key, sep, value = annotation.partition(":")
        # Entries without a value ("formatted_prompt", "llm_metrics") are frontend switches.
        key = key.strip().lower()
        value = value.strip()
        if not sep or not _annotation_key_ok(key) or not _header_value_ok(value):
            continue
        size += len(key) + len(value)
        if size > MAX_METADATA_BYTES:
            raise RequestRejected("annotations", f"more than {MAX_METADATA_BYTES} bytes of metadata")
        metadata.append((key, value))
    return tuple(metadata)


def _annotation_key_ok(key: str) -> bool:
    if not key or key in _RESERVED_KEYS or key.startswith(_RESERVED_PREFIXES) or key.endswith("-bin"):
        return False
    return all(char in _KEY_CHARS for char in key)


def _header_value_ok(value: str) -> bool:
    # gRPC ASCII metadata: printable ASCII and space only.
    return value.isascii() and value.isprintable()
