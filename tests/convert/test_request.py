"""PreprocessedRequest → GenerateRequest, field by field: mapped, refused (naming the field), ignored."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openengine.v1 import generation_pb2
from openengine_bp.openengine.v1 import (
    CandidateTokenSelectionMode,
    GenerationCapabilities,
    LogprobCapabilities,
)
from sidecar.convert import HEALTH_CANARY_PAYLOAD, Capabilities, GenerateCall
from sidecar.convert.capabilities import LogprobSupport
from sidecar.convert.request import FIELD_POLICY, MAX_METADATA_BYTES, MAX_STOP_CONDITIONS
from sidecar.errors import DynamoErrorKind, RequestRejected

from .factories import (
    BASE_REQUEST,
    CAPS,
    CONTEXT,
    MODEL,
    REQUEST_ID,
    build,
    caps,
    finished,
    merge,
    model_info,
    server_info,
    token,
    usage,
)

ABSENT = object()


def field_value(message: Any, path: str) -> Any:
    """``sampling.temperature`` → the value, or ABSENT when a presence-tracking field is unset."""
    *parents, last = path.split(".")
    for name in parents:
        if not message.HasField(name):
            return ABSENT
        message = getattr(message, name)
    descriptor = message.DESCRIPTOR.fields_by_name[last]
    if descriptor.has_presence and not message.HasField(last):
        return ABSENT
    value = getattr(message, last)
    return list(value) if descriptor.is_repeated else value


# ------------------------------------------------------------------------------------------- mapped

# (id, request patch, expected {path: value})
MAPPED: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    (
        "base",
        {},
        {
            "request_id": REQUEST_ID,
            "model": MODEL,
            "token_ids.ids": [11, 12, 13],
            "sampling.num_sequences": 1,
            "sampling.temperature": ABSENT,
            "sampling.top_p": ABSENT,
            "sampling.top_k": ABSENT,
            "sampling.seed": ABSENT,
            "stopping.max_tokens": CONTEXT - 3,
            "stopping.min_tokens": ABSENT,
            "stopping.ignore_eos": ABSENT,
            "stopping.include_stop_in_output": ABSENT,
            "stopping.conditions": [],
            "response": ABSENT,
            "kv": ABSENT,
            "guided": ABSENT,
            "extra": ABSENT,
            "lora_name": "",
            "media": [],
        },
    ),
    ("temperature 0 is sent (greedy)", {"sampling_options": {"temperature": 0.0}}, {"sampling.temperature": 0.0}),
    ("temperature int", {"sampling_options": {"temperature": 1}}, {"sampling.temperature": 1.0}),
    ("temperature", {"sampling_options": {"temperature": 0.7}}, {"sampling.temperature": 0.7}),
    ("top_p", {"sampling_options": {"top_p": 0.9}}, {"sampling.top_p": 0.9}),
    ("top_p 0", {"sampling_options": {"top_p": 0}}, {"sampling.top_p": 0.0}),
    ("top_p 1", {"sampling_options": {"top_p": 1.0}}, {"sampling.top_p": 1.0}),
    ("top_k", {"sampling_options": {"top_k": 40}}, {"sampling.top_k": 40}),
    ("top_k -1 is unset", {"sampling_options": {"top_k": -1}}, {"sampling.top_k": ABSENT}),
    ("top_k 0 is unset", {"sampling_options": {"top_k": 0}}, {"sampling.top_k": ABSENT}),
    ("min_p", {"sampling_options": {"min_p": 0.05}}, {"sampling.min_p": 0.05}),
    ("min_p 0", {"sampling_options": {"min_p": 0.0}}, {"sampling.min_p": 0.0}),
    ("frequency_penalty", {"sampling_options": {"frequency_penalty": -1.5}}, {"sampling.frequency_penalty": -1.5}),
    ("presence_penalty", {"sampling_options": {"presence_penalty": 2.0}}, {"sampling.presence_penalty": 2.0}),
    ("presence_penalty 0", {"sampling_options": {"presence_penalty": 0}}, {"sampling.presence_penalty": 0.0}),
    ("repetition_penalty", {"sampling_options": {"repetition_penalty": 1.1}}, {"sampling.repetition_penalty": 1.1}),
    ("seed 0", {"sampling_options": {"seed": 0}}, {"sampling.seed": 0}),
    ("seed max", {"sampling_options": {"seed": 2**64 - 1}}, {"sampling.seed": 2**64 - 1}),
    ("n", {"sampling_options": {"n": 3}}, {"sampling.num_sequences": 3}),
    ("n at the limit", {"sampling_options": {"n": 4}}, {"sampling.num_sequences": 4}),
    ("best_of equal to n", {"sampling_options": {"n": 2, "best_of": 2}}, {"sampling.num_sequences": 2}),
    ("max_tokens", {"stop_conditions": {"max_tokens": 10}}, {"stopping.max_tokens": 10}),
    ("max_tokens 1", {"stop_conditions": {"max_tokens": 1}}, {"stopping.max_tokens": 1}),
    ("max_tokens filling the window", {"stop_conditions": {"max_tokens": 97}}, {"stopping.max_tokens": 97}),
    ("max_tokens clamped to the window", {"stop_conditions": {"max_tokens": 500}}, {"stopping.max_tokens": 97}),
    ("max_tokens None derived", {"stop_conditions": {"max_tokens": None}}, {"stopping.max_tokens": 97}),
    ("min_tokens 0", {"stop_conditions": {"min_tokens": 0}}, {"stopping.min_tokens": 0}),
    ("min_tokens", {"stop_conditions": {"max_tokens": 10, "min_tokens": 10}}, {"stopping.min_tokens": 10}),
    ("ignore_eos true", {"stop_conditions": {"ignore_eos": True}}, {"stopping.ignore_eos": True}),
    ("ignore_eos false is sent", {"stop_conditions": {"ignore_eos": False}}, {"stopping.ignore_eos": False}),
    (
        "include_stop_str_in_output",
        {"sampling_options": {"include_stop_str_in_output": True}},
        {"stopping.include_stop_in_output": True},
    ),
    (
        "include_stop_str_in_output false",
        {"sampling_options": {"include_stop_str_in_output": False}},
        {"stopping.include_stop_in_output": ABSENT},
    ),
    (
        "logprobs",
        {"output_options": {"logprobs": 3}},
        {
            "response.return_output_logprobs": True,
            "response.output_candidates.top_n": 3,
            "response.return_prompt_logprobs": ABSENT,
            "response.prompt_candidates": ABSENT,
        },
    ),
    (
        "logprobs 0 asks top_n 1",
        {"output_options": {"logprobs": 0}},
        {"response.return_output_logprobs": True, "response.output_candidates.top_n": 1},
    ),
    (
        "logprobs at max_top_n",
        {"output_options": {"logprobs": 5}},
        {"response.output_candidates.top_n": 5},
    ),
    ("logprobs None", {"output_options": {"logprobs": None}}, {"response": ABSENT}),
    ("token ids tuple", {"token_ids": (1, 2**32 - 1)}, {"token_ids.ids": [1, 2**32 - 1]}),
    ("token id 0", {"token_ids": [0]}, {"token_ids.ids": [0], "stopping.max_tokens": CONTEXT - 1}),
]


@pytest.mark.parametrize(("case", "patch", "expected"), MAPPED, ids=[c[0] for c in MAPPED])
def test_mapped(case: str, patch: dict[str, Any], expected: dict[str, Any]) -> None:
    call = build(merge(BASE_REQUEST, patch))
    for path, value in expected.items():
        assert field_value(call.request, path) == value, path
    # Whatever we build is a well-formed message that survives the wire.
    data = call.request.SerializeToString()
    assert generation_pb2.GenerateRequest.FromString(data) == call.request


def test_stop_conditions_deduplicated_sorted_and_merged() -> None:
    call = build(
        merge(
            BASE_REQUEST,
            {
                "stop_conditions": {
                    "stop": ["world", "hello", "world", ""],
                    "stop_token_ids": [7, 3, 7],
                    "stop_token_ids_hidden": [3, 1],
                }
            },
        )
    )
    conditions = call.request.stopping.conditions
    assert [c.WhichOneof("condition") for c in conditions] == ["stop_text"] * 2 + ["stop_token_id"] * 3
    assert [c.stop_text for c in conditions[:2]] == ["hello", "world"]
    assert [c.stop_token_id for c in conditions[2:]] == [1, 3, 7]


def test_stop_token_id_zero_is_kept() -> None:
    call = build(merge(BASE_REQUEST, {"stop_conditions": {"stop_token_ids": [0]}}))
    (condition,) = call.request.stopping.conditions
    assert condition.HasField("stop_token_id")
    assert condition.stop_token_id == 0


def test_single_stop_string_tolerated() -> None:
    call = build(merge(BASE_REQUEST, {"stop_conditions": {"stop": "END"}}))
    assert [c.stop_text for c in call.request.stopping.conditions] == ["END"]


def test_stop_condition_limit() -> None:
    ids = list(range(MAX_STOP_CONDITIONS - 1))
    call = build(merge(BASE_REQUEST, {"stop_conditions": {"stop": ["x"], "stop_token_ids": ids}}))
    assert len(call.request.stopping.conditions) == MAX_STOP_CONDITIONS
    # Duplicates do not count.
    call = build(merge(BASE_REQUEST, {"stop_conditions": {"stop_token_ids": ids, "stop_token_ids_hidden": ids}}))
    assert len(call.request.stopping.conditions) == MAX_STOP_CONDITIONS - 1


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "max_output", "expected"),
    [
        (3, None, None, 97),  # derived: context − prompt
        (99, None, None, 1),  # one slot left
        (3, None, 50, 50),  # derived, capped by max_output_tokens
        (90, None, 50, 10),  # window smaller than the cap
        (3, 50, 50, 50),  # explicit at the cap
        (90, 50, 50, 10),  # explicit clamped to the window
        (3, 30, None, 30),
    ],
)
def test_max_tokens(prompt_len: int, max_tokens: int | None, max_output: int | None, expected: int) -> None:
    request = {"token_ids": [5] * prompt_len, "stop_conditions": {"max_tokens": max_tokens}}
    call = build(request, capabilities=caps(max_output_tokens=max_output))
    assert call.max_tokens == expected
    assert call.request.stopping.max_tokens == expected
    assert call.prompt_tokens == prompt_len


def test_generate_call_fields() -> None:
    call = build(merge(BASE_REQUEST, {"sampling_options": {"n": 2}, "output_options": {"logprobs": 0}}))
    assert call.request_id == REQUEST_ID
    assert (call.n, call.logprobs, call.top_n, call.prompt_tokens, call.max_tokens) == (2, 0, 1, 3, 97)
    mapper = call.response_mapper()
    assert not mapper.done
    plain = build(BASE_REQUEST)
    assert (plain.n, plain.logprobs, plain.top_n) == (1, None, None)


def test_a_call_keeping_stop_tokens_in_the_output_has_its_mapper_take_them_out() -> None:
    """``include_stop_str_in_output`` with stop token ids: the engine keeps the stop token, the mapper drops it again
    (the frontend would count it and never show it); without the flag the engine's own output stands."""
    stops = {"stop_conditions": {"stop_token_ids": [7]}}
    kept = build(merge(BASE_REQUEST, {**stops, "sampling_options": {"include_stop_str_in_output": True}}))
    assert kept.request.stopping.include_stop_in_output
    ending = [token(0, 5, 7), finished(0, stop_match=generation_pb2.StopMatch(stop_token_id=7), with_usage=usage(3, 2))]
    [chunk] = kept.response_mapper(eos_token_ids=[2]).map(ending)
    assert (chunk["token_ids"], chunk["completion_usage"]["completion_tokens"]) == ([5], 1)
    [chunk] = build(merge(BASE_REQUEST, stops)).response_mapper(eos_token_ids=[2]).map(ending)
    assert (chunk["token_ids"], chunk["completion_usage"]["completion_tokens"]) == ([5, 7], 2)


def test_health_canary() -> None:
    call = build(HEALTH_CANARY_PAYLOAD)
    request = call.request
    assert list(request.token_ids.ids) == [1]
    assert request.stopping.max_tokens == 1
    assert request.stopping.HasField("ignore_eos")
    assert request.stopping.ignore_eos
    assert request.sampling.HasField("temperature")
    assert request.sampling.temperature == 0.0
    # Also with an engine that reports nothing optional at all.
    bare = Capabilities.from_discovery(server_info(capacity=None), model_info(generation=None))
    assert build(HEALTH_CANARY_PAYLOAD, capabilities=bare, context_length=2).max_tokens == 1


# ------------------------------------------------------------------------------------------ refused

NO_STOP_IN_OUTPUT = caps(supports_stop_in_output=False)
UNKNOWN_STOP_IN_OUTPUT = caps(supports_stop_in_output=None)
NO_LOGPROBS = caps(output_logprobs=LogprobSupport(supported=False, max_top_n=None, modes=frozenset()))
UNKNOWN_LOGPROBS = caps(output_logprobs=LogprobSupport(supported=None, max_top_n=None, modes=frozenset()))
ALL_ONLY_LOGPROBS = caps(
    output_logprobs=LogprobSupport(supported=True, max_top_n=None, modes=frozenset({CandidateTokenSelectionMode.ALL}))
)
OUTPUT_CAP_50 = caps(max_output_tokens=50)
TWO_DP_RANKS = caps(data_parallel_size=2, data_parallel_start_rank=0)

# (id, request patch, field named by the rejection, capabilities)
REFUSED: list[tuple[str, dict[str, Any], str, Capabilities]] = [
    # --- input
    ("no token_ids", {"token_ids": None}, "token_ids", CAPS),
    ("empty token_ids", {"token_ids": []}, "token_ids", CAPS),
    ("token_ids a string", {"token_ids": "1 2 3"}, "token_ids", CAPS),
    ("token_ids an object", {"token_ids": {"0": 1}}, "token_ids", CAPS),
    ("negative token id", {"token_ids": [1, -1]}, "token_ids[1]", CAPS),
    ("token id ≥ 2^32", {"token_ids": [1, 2, 2**32]}, "token_ids[2]", CAPS),
    ("bool token id", {"token_ids": [True]}, "token_ids[0]", CAPS),
    ("float token id", {"token_ids": [1.0]}, "token_ids[0]", CAPS),
    ("null token id", {"token_ids": [1, None]}, "token_ids[1]", CAPS),
    ("prompt fills the window", {"token_ids": [1] * CONTEXT}, "token_ids", CAPS),
    ("prompt exceeds the window", {"token_ids": [1] * (CONTEXT + 1)}, "token_ids", CAPS),
    # --- sections of the wrong type
    ("stop_conditions a list", {"stop_conditions": [1]}, "stop_conditions", CAPS),
    ("sampling_options a string", {"sampling_options": "x"}, "sampling_options", CAPS),
    ("output_options a number", {"output_options": 3}, "output_options", CAPS),
    ("routing a bool", {"routing": True}, "routing", CAPS),
    ("extra_args a list", {"extra_args": []}, "extra_args", CAPS),
    # --- sampling
    ("negative temperature", {"sampling_options": {"temperature": -0.1}}, "sampling_options.temperature", CAPS),
    ("temperature a string", {"sampling_options": {"temperature": "hot"}}, "sampling_options.temperature", CAPS),
    ("temperature a bool", {"sampling_options": {"temperature": True}}, "sampling_options.temperature", CAPS),
    ("temperature NaN", {"sampling_options": {"temperature": float("nan")}}, "sampling_options.temperature", CAPS),
    ("temperature inf", {"sampling_options": {"temperature": float("inf")}}, "sampling_options.temperature", CAPS),
    ("temperature overflow", {"sampling_options": {"temperature": 10**400}}, "sampling_options.temperature", CAPS),
    ("top_p > 1", {"sampling_options": {"top_p": 1.5}}, "sampling_options.top_p", CAPS),
    ("top_p < 0", {"sampling_options": {"top_p": -0.1}}, "sampling_options.top_p", CAPS),
    ("top_k -2", {"sampling_options": {"top_k": -2}}, "sampling_options.top_k", CAPS),
    ("top_k beyond int32", {"sampling_options": {"top_k": 2**31}}, "sampling_options.top_k", CAPS),
    ("top_k a float", {"sampling_options": {"top_k": 1.5}}, "sampling_options.top_k", CAPS),
    ("top_k a bool", {"sampling_options": {"top_k": True}}, "sampling_options.top_k", CAPS),
    ("min_p > 1", {"sampling_options": {"min_p": 1.1}}, "sampling_options.min_p", CAPS),
    (
        "frequency_penalty > 2",
        {"sampling_options": {"frequency_penalty": 2.5}},
        "sampling_options.frequency_penalty",
        CAPS,
    ),
    (
        "presence_penalty < -2",
        {"sampling_options": {"presence_penalty": -3}},
        "sampling_options.presence_penalty",
        CAPS,
    ),
    (
        "repetition_penalty 0",
        {"sampling_options": {"repetition_penalty": 0}},
        "sampling_options.repetition_penalty",
        CAPS,
    ),
    (
        "repetition_penalty < 0",
        {"sampling_options": {"repetition_penalty": -1.0}},
        "sampling_options.repetition_penalty",
        CAPS,
    ),
    ("negative seed", {"sampling_options": {"seed": -1}}, "sampling_options.seed", CAPS),
    ("seed beyond uint64", {"sampling_options": {"seed": 2**64}}, "sampling_options.seed", CAPS),
    ("seed a float", {"sampling_options": {"seed": 1.5}}, "sampling_options.seed", CAPS),
    ("n 0", {"sampling_options": {"n": 0}}, "sampling_options.n", CAPS),
    ("n above the limit", {"sampling_options": {"n": 5}}, "sampling_options.n", CAPS),
    ("n a string", {"sampling_options": {"n": "2"}}, "sampling_options.n", CAPS),
    ("best_of without n", {"sampling_options": {"best_of": 2}}, "sampling_options.best_of", CAPS),
    ("best_of ≠ n", {"sampling_options": {"n": 2, "best_of": 3}}, "sampling_options.best_of", CAPS),
    ("beam search", {"sampling_options": {"use_beam_search": True}}, "sampling_options.use_beam_search", CAPS),
    ("beam search not a bool", {"sampling_options": {"use_beam_search": 1}}, "sampling_options.use_beam_search", CAPS),
    ("length_penalty", {"sampling_options": {"length_penalty": 0.5}}, "sampling_options.length_penalty", CAPS),
    (
        "guided json",
        {"sampling_options": {"guided_decoding": {"json": {"type": "object"}}}},
        "sampling_options.guided_decoding",
        CAPS,
    ),
    (
        "guided regex",
        {"sampling_options": {"guided_decoding": {"regex": "a+"}}},
        "sampling_options.guided_decoding",
        CAPS,
    ),
    (
        "include_stop_str_in_output unsupported",
        {"sampling_options": {"include_stop_str_in_output": True}},
        "sampling_options.include_stop_str_in_output",
        NO_STOP_IN_OUTPUT,
    ),
    (
        "include_stop_str_in_output unreported",
        {"sampling_options": {"include_stop_str_in_output": True}},
        "sampling_options.include_stop_str_in_output",
        UNKNOWN_STOP_IN_OUTPUT,
    ),
    # --- stopping
    ("max_tokens 0", {"stop_conditions": {"max_tokens": 0}}, "stop_conditions.max_tokens", CAPS),
    ("max_tokens beyond uint32", {"stop_conditions": {"max_tokens": 2**32}}, "stop_conditions.max_tokens", CAPS),
    ("max_tokens a string", {"stop_conditions": {"max_tokens": "10"}}, "stop_conditions.max_tokens", CAPS),
    (
        "max_tokens above max_output",
        {"stop_conditions": {"max_tokens": 51}},
        "stop_conditions.max_tokens",
        OUTPUT_CAP_50,
    ),
    (
        "max_output_tokens 0 reported",
        {},
        "stop_conditions.max_tokens",
        caps(max_output_tokens=0),
    ),
    (
        "min_tokens > max_tokens",
        {"stop_conditions": {"max_tokens": 10, "min_tokens": 11}},
        "stop_conditions.min_tokens",
        CAPS,
    ),
    ("min_tokens > derived", {"stop_conditions": {"min_tokens": 98}}, "stop_conditions.min_tokens", CAPS),
    ("negative min_tokens", {"stop_conditions": {"min_tokens": -1}}, "stop_conditions.min_tokens", CAPS),
    ("stop not strings", {"stop_conditions": {"stop": ["a", 1]}}, "stop_conditions.stop[1]", CAPS),
    ("stop an object", {"stop_conditions": {"stop": {"a": 1}}}, "stop_conditions.stop", CAPS),
    ("negative stop token", {"stop_conditions": {"stop_token_ids": [-1]}}, "stop_conditions.stop_token_ids[0]", CAPS),
    ("stop token ≥ 2^32", {"stop_conditions": {"stop_token_ids": [2**32]}}, "stop_conditions.stop_token_ids[0]", CAPS),
    (
        "stop token a string",
        {"stop_conditions": {"stop_token_ids": [1, "5"]}},
        "stop_conditions.stop_token_ids[1]",
        CAPS,
    ),
    ("stop token null", {"stop_conditions": {"stop_token_ids": [None]}}, "stop_conditions.stop_token_ids[0]", CAPS),
    (
        "hidden stop token a bool",
        {"stop_conditions": {"stop_token_ids_hidden": [True]}},
        "stop_conditions.stop_token_ids_hidden[0]",
        CAPS,
    ),
    (
        "too many stop conditions",
        {"stop_conditions": {"stop": ["x"], "stop_token_ids": list(range(MAX_STOP_CONDITIONS))}},
        "stop_conditions.stop",
        CAPS,
    ),
    (
        "visible stop tokens",
        {"stop_conditions": {"stop_token_ids_visible": [5]}},
        "stop_conditions.stop_token_ids_visible",
        CAPS,
    ),
    (
        "max_thinking_tokens",
        {"stop_conditions": {"max_thinking_tokens": 100}},
        "stop_conditions.max_thinking_tokens",
        CAPS,
    ),
    (
        "max_thinking_tokens 0",
        {"stop_conditions": {"max_thinking_tokens": 0}},
        "stop_conditions.max_thinking_tokens",
        CAPS,
    ),
    ("ignore_eos a string", {"stop_conditions": {"ignore_eos": "yes"}}, "stop_conditions.ignore_eos", CAPS),
    # --- output options
    ("negative logprobs", {"output_options": {"logprobs": -1}}, "output_options.logprobs", CAPS),
    ("logprobs a string", {"output_options": {"logprobs": "3"}}, "output_options.logprobs", CAPS),
    ("logprobs a bool", {"output_options": {"logprobs": True}}, "output_options.logprobs", CAPS),
    ("logprobs above max_top_n", {"output_options": {"logprobs": 6}}, "output_options.logprobs", CAPS),
    ("logprobs unsupported", {"output_options": {"logprobs": 1}}, "output_options.logprobs", NO_LOGPROBS),
    ("logprobs unreported", {"output_options": {"logprobs": 1}}, "output_options.logprobs", UNKNOWN_LOGPROBS),
    ("logprobs without top-N", {"output_options": {"logprobs": 1}}, "output_options.logprobs", ALL_ONLY_LOGPROBS),
    ("prompt_logprobs", {"output_options": {"prompt_logprobs": 5}}, "output_options.prompt_logprobs", CAPS),
    ("prompt_logprobs 0", {"output_options": {"prompt_logprobs": 0}}, "output_options.prompt_logprobs", CAPS),
    ("formatted_prompt", {"output_options": {"formatted_prompt": True}}, "output_options.formatted_prompt", CAPS),
    # --- routing
    ("priority", {"routing": {"priority": 5}}, "routing.priority", CAPS),
    ("negative priority", {"routing": {"priority": -1}}, "routing.priority", CAPS),
    ("priority a string", {"routing": {"priority": "high"}}, "routing.priority", CAPS),
    ("dp_rank of another rank", {"routing": {"dp_rank": 1}}, "routing.dp_rank", CAPS),
    ("dp_rank on a multi-rank engine", {"routing": {"dp_rank": 0}}, "routing.dp_rank", TWO_DP_RANKS),
    ("negative dp_rank", {"routing": {"dp_rank": -1}}, "routing.dp_rank", CAPS),
    ("lora_name", {"routing": {"lora_name": "adapter"}}, "routing.lora_name", CAPS),
    ("cache_salt", {"routing": {"cache_salt": "tenant-a"}}, "routing.cache_salt", CAPS),
    ("cache_namespace", {"routing": {"cache_namespace": "ns"}}, "routing.cache_namespace", CAPS),
    # --- extra_args
    ("bypass_prefix_cache", {"extra_args": {"bypass_prefix_cache": True}}, "extra_args.bypass_prefix_cache", CAPS),
    ("disable_prefix_cache", {"extra_args": {"disable_prefix_cache": True}}, "extra_args.disable_prefix_cache", CAPS),
    ("nvext cache_salt", {"extra_args": {"nvext": {"cache_salt": "s"}}}, "extra_args.nvext.cache_salt", CAPS),
    # --- disaggregation, media, embeddings
    (
        "prefill_result",
        {"prefill_result": {"disaggregated_params": {"session_id": "1"}}},
        "prefill_result",
        CAPS,
    ),
    ("bootstrap_info", {"bootstrap_info": {"bootstrap_room": 1}}, "bootstrap_info", CAPS),
    (
        "multi_modal_data",
        {"multi_modal_data": {"image_url": [{"Url": "http://x/y.png"}]}},
        "multi_modal_data",
        CAPS,
    ),
    ("multi_modal_uuids", {"multi_modal_uuids": {"image_url": ["u"]}}, "multi_modal_uuids", CAPS),
    ("mm_routing_info", {"mm_routing_info": {"routing_token_ids": [1]}}, "mm_routing_info", CAPS),
    ("mm_processor_kwargs", {"mm_processor_kwargs": {"max_pixels": 10}}, "mm_processor_kwargs", CAPS),
    ("media_io_kwargs", {"media_io_kwargs": {"video": {"num_frames": 4}}}, "media_io_kwargs", CAPS),
    ("encoder_result", {"encoder_result": {"x": 1}}, "encoder_result", CAPS),
    ("prompt_embeds", {"prompt_embeds": "AAAA"}, "prompt_embeds", CAPS),
    ("require_reasoning", {"require_reasoning": True}, "require_reasoning", CAPS),
    # --- metadata
    ("annotations not a list", {"annotations": "k:v"}, "annotations", CAPS),
    ("annotation not a string", {"annotations": ["a:b", 1]}, "annotations[1]", CAPS),
    (
        "annotations too large",
        {"annotations": [f"k{i}:{'v' * 1000}" for i in range(MAX_METADATA_BYTES // 1000 + 1)]},
        "annotations",
        CAPS,
    ),
]


@pytest.mark.parametrize(("case", "patch", "field", "capabilities"), REFUSED, ids=[c[0] for c in REFUSED])
def test_refused(case: str, patch: dict[str, Any], field: str, capabilities: Capabilities) -> None:
    with pytest.raises(RequestRejected) as info:
        build(merge(BASE_REQUEST, patch), capabilities=capabilities)
    assert info.value.field == field
    assert info.value.reason
    assert info.value.kind is DynamoErrorKind.INVALID_ARGUMENT
    assert str(info.value).startswith(f"{field}: ")


def test_request_must_be_a_mapping() -> None:
    bad: Any
    for bad in (None, [], "x", 3):
        with pytest.raises(RequestRejected) as info:
            build(bad)
        assert info.value.field == "request"


def test_every_refused_field_in_the_policy_has_a_refusal_case() -> None:
    refused_fields = {field.split("[")[0] for _, _, field, _ in REFUSED}
    for name, (policy, _) in FIELD_POLICY.items():
        if policy == "refused":
            assert name in refused_fields, name


# ------------------------------------------------------------------------------------------ ignored

BASELINE = build(BASE_REQUEST)

# (id, request patch) — the request on the wire and its metadata equal the baseline's.
IGNORED: list[tuple[str, dict[str, Any]]] = [
    ("model", {"model": "some-other-name"}),
    ("mdc_sum", {"mdc_sum": "abc123"}),
    ("eos_token_ids", {"eos_token_ids": [2, 3]}),
    ("skip_special_tokens false", {"output_options": {"skip_special_tokens": False}}),
    ("skip_special_tokens true", {"output_options": {"skip_special_tokens": True}}),
    ("return_tokens_as_token_ids", {"output_options": {"return_tokens_as_token_ids": True}}),
    ("formatted_prompt false", {"output_options": {"formatted_prompt": False}}),
    ("prompt_logprobs None", {"output_options": {"prompt_logprobs": None}}),
    (
        "routing bookkeeping",
        {
            "routing": {
                "prefill_worker_id": 1,
                "decode_worker_id": 2,
                "backend_instance_id": 3,
                "expected_output_tokens": 10,
                "priority_jump": 2.0,
                "priority": 0,
                "dp_rank": None,
                "prefill_dp_rank": None,
                "lora_name": None,
                "cache_salt": "",
            }
        },
    ),
    ("dp_rank naming the only rank", {"routing": {"dp_rank": 0}}),
    ("prefill_dp_rank outside a prefill leg", {"routing": {"prefill_dp_rank": 3}}),
    ("dp_rank naming the only rank (start rank)", {"routing": {"dp_rank": 0, "prefill_dp_rank": 0}}),
    (
        "extra_args frontend data",
        {
            "extra_args": {
                "messages": [{"role": "user", "content": "hi"}],
                "nvext": {"extra_fields": ["worker_id"], "cache_salt": None},
                "bypass_prefix_cache": False,
                "disable_prefix_cache": None,
            }
        },
    ),
    ("prefill_result None", {"prefill_result": None}),
    ("multi_modal_data empty", {"multi_modal_data": {}}),
    ("multi_modal_data all None", {"multi_modal_data": {"image_url": None, "video_url": None}}),
    ("guided_decoding None", {"sampling_options": {"guided_decoding": None}}),
    ("guided_decoding all None", {"sampling_options": {"guided_decoding": {"json": None, "regex": None}}}),
    ("use_beam_search false", {"sampling_options": {"use_beam_search": False}}),
    ("length_penalty 1", {"sampling_options": {"length_penalty": 1.0}}),
    ("best_of None", {"sampling_options": {"best_of": None}}),
    ("best_of 1", {"sampling_options": {"best_of": 1}}),
    ("n 1", {"sampling_options": {"n": 1}}),
    ("visible stop tokens empty", {"stop_conditions": {"stop_token_ids_visible": []}}),
    ("max_thinking_tokens None", {"stop_conditions": {"max_thinking_tokens": None}}),
    ("empty stop string", {"stop_conditions": {"stop": [""]}}),
    ("empty stop lists", {"stop_conditions": {"stop": [], "stop_token_ids": [], "stop_token_ids_hidden": None}}),
    ("require_reasoning false", {"require_reasoning": False}),
    ("router_config_override", {"router_config_override": {"overlap_score_weight": 1.0}}),
    ("kv_hint, migration_link, jail_seed", {"kv_hint": {"x": 1}, "migration_link": "l", "jail_seed": 7}),
    ("unknown field", {"some_future_field": [1, 2, 3]}),
    ("null sections", {"stop_conditions": None, "sampling_options": None, "output_options": None, "routing": None}),
    ("annotations without values", {"annotations": ["formatted_prompt", "llm_metrics"]}),
    ("annotations with unusable keys", {"annotations": ["Bad Key:v", ":v", "x-bin:v", "grpc-timeout:1S"]}),
    ("annotations overriding reserved keys", {"annotations": ["openengine-priority:9", "traceparent:x", "te:gzip"]}),
    ("annotation with a non-ASCII value", {"annotations": ["x-tenant:caf\u00e9", "x-tab:a\tb"]}),
]


@pytest.mark.parametrize(("case", "patch"), IGNORED, ids=[c[0] for c in IGNORED])
def test_ignored(case: str, patch: dict[str, Any]) -> None:
    call = build(merge(BASE_REQUEST, patch))
    assert call.request.SerializeToString(deterministic=True) == BASELINE.request.SerializeToString(deterministic=True)
    assert call.metadata == BASELINE.metadata == ()


# ----------------------------------------------------------------------------------------- metadata


def test_trace_and_annotation_metadata() -> None:
    trace = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "k=v", "x": "y"}
    call = build(
        merge(BASE_REQUEST, {"annotations": ["X-Tenant: acme ", "formatted_prompt", "route.key:a:b"]}),
        trace=trace,
    )
    assert call.metadata == (
        ("traceparent", trace["traceparent"]),
        ("tracestate", "k=v"),
        ("x-tenant", "acme"),
        ("route.key", "a:b"),
    )


@pytest.mark.parametrize(
    "trace",
    [None, {}, {"traceparent": ""}, {"traceparent": "caf\u00e9"}, {"traceparent": "a\nb"}, {"tracestate": 5}],
)
def test_malformed_trace_headers_are_dropped(trace: Any) -> None:
    assert build(BASE_REQUEST, trace=trace).metadata == ()


# --------------------------------------------------------------------------------------------- fuzz

_json = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | st.text(max_size=6),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)
_number = (
    st.none() | st.booleans() | st.integers(min_value=-(2**66), max_value=2**66) | st.floats() | st.text(max_size=3)
)
_small = st.none() | st.integers(min_value=-3, max_value=130) | st.floats(min_value=-3, max_value=3) | st.booleans()
_ids = st.lists(st.integers(min_value=-2, max_value=2**32 + 1), max_size=8)


def _section(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    return st.fixed_dictionaries({}, optional=fields) | _json


_requests = st.fixed_dictionaries(
    {},
    optional={
        "token_ids": st.lists(st.integers(min_value=-1, max_value=2**32), min_size=0, max_size=120) | _json,
        "stop_conditions": _section(
            {
                "max_tokens": _small | _number,
                "min_tokens": _small | _number,
                "stop": st.lists(st.text(max_size=3), max_size=70) | _json,
                "stop_token_ids": _ids | _json,
                "stop_token_ids_hidden": _ids | _json,
                "stop_token_ids_visible": _ids | _json,
                "ignore_eos": _json,
                "max_thinking_tokens": _json,
            }
        ),
        "sampling_options": _section(
            {
                key: _small | _number
                for key in (
                    "n",
                    "best_of",
                    "temperature",
                    "top_p",
                    "top_k",
                    "min_p",
                    "frequency_penalty",
                    "presence_penalty",
                    "repetition_penalty",
                    "seed",
                    "length_penalty",
                )
            }
            | {"use_beam_search": _json, "include_stop_str_in_output": _json, "guided_decoding": _json}
        ),
        "output_options": _section(
            {
                "logprobs": _small | _number,
                "prompt_logprobs": _json,
                "skip_special_tokens": _json,
                "formatted_prompt": _json,
                "return_tokens_as_token_ids": _json,
            }
        ),
        "routing": _section(
            {"priority": _small | _number, "dp_rank": _small | _number, "lora_name": _json, "cache_salt": _json}
        ),
        "extra_args": _section({"bypass_prefix_cache": _json, "nvext": _json}),
        "annotations": st.lists(st.text(max_size=12), max_size=4) | _json,
        "prefill_result": _json,
        "multi_modal_data": _json,
        "require_reasoning": _json,
        "eos_token_ids": _json,
        "model": _json,
    },
)


def _mostly(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Usually (19 in 20) a plausible value, sometimes anything at all."""
    return st.integers(min_value=0, max_value=19).flatmap(lambda k: valid if k else _json)


def _maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return _mostly(st.none() | valid)


_unit = st.floats(min_value=0, max_value=1)
_penalty = st.floats(min_value=-2, max_value=2)

# Requests close to what the frontend sends, so that the fuzz reaches every mapping step.
_plausible_requests = st.fixed_dictionaries(
    {"token_ids": _mostly(st.lists(st.integers(min_value=0, max_value=50_000), min_size=1, max_size=40))},
    optional={
        "stop_conditions": st.fixed_dictionaries(
            {},
            optional={
                "max_tokens": _maybe(st.integers(min_value=0, max_value=300)),
                "min_tokens": _maybe(st.integers(min_value=0, max_value=40)),
                "stop": _maybe(st.lists(st.text(max_size=3), max_size=5)),
                "stop_token_ids": _maybe(st.lists(st.integers(min_value=0, max_value=99), max_size=5)),
                "stop_token_ids_hidden": _maybe(st.lists(st.integers(min_value=0, max_value=99), max_size=5)),
                "stop_token_ids_visible": _maybe(st.just([])),
                "ignore_eos": _maybe(st.booleans()),
                "max_thinking_tokens": st.none(),
            },
        ),
        "sampling_options": st.fixed_dictionaries(
            {},
            optional={
                "n": _maybe(st.integers(min_value=1, max_value=5)),
                "best_of": st.none(),
                "temperature": _maybe(st.floats(min_value=0, max_value=2)),
                "top_p": _maybe(_unit),
                "top_k": _maybe(st.integers(min_value=-1, max_value=100)),
                "min_p": _maybe(_unit),
                "frequency_penalty": _maybe(_penalty),
                "presence_penalty": _maybe(_penalty),
                "repetition_penalty": _maybe(st.floats(min_value=0.01, max_value=2)),
                "seed": _maybe(st.integers(min_value=0, max_value=2**64 - 1)),
                "use_beam_search": _maybe(st.just(False)),
                "include_stop_str_in_output": _maybe(st.booleans()),
                "guided_decoding": st.none(),
            },
        ),
        "output_options": st.fixed_dictionaries(
            {}, optional={"logprobs": _maybe(st.integers(min_value=0, max_value=6))}
        ),
        "routing": st.fixed_dictionaries({}, optional={"priority": _maybe(st.just(0)), "dp_rank": _maybe(st.just(0))}),
        "annotations": _maybe(st.lists(st.text(max_size=12), max_size=4)),
        "eos_token_ids": _json,
    },
)

_fuzz_caps = st.sampled_from(
    [
        CAPS,
        caps(max_output_tokens=10),
        Capabilities.from_discovery(server_info(engine_name="tensorrt_llm"), model_info(generation=None)),
        Capabilities.from_discovery(
            server_info(),
            model_info(
                generation=GenerationCapabilities(
                    output_logprobs=LogprobCapabilities(supported=True, max_top_n=0), supports_stop_in_output=False
                )
            ),
        ),
    ]
)


def _check_call(call: GenerateCall, capabilities: Capabilities, context: int) -> None:
    request = call.request
    assert generation_pb2.GenerateRequest.FromString(request.SerializeToString()) == request
    assert request.WhichOneof("input") == "token_ids"
    assert len(request.token_ids.ids) == call.prompt_tokens >= 1
    assert 1 <= call.max_tokens == request.stopping.max_tokens <= context - call.prompt_tokens
    if capabilities.max_output_tokens is not None:
        assert call.max_tokens <= capabilities.max_output_tokens
    assert 1 <= call.n == request.sampling.num_sequences <= capabilities.max_num_sequences
    assert len(request.stopping.conditions) <= MAX_STOP_CONDITIONS
    if request.stopping.HasField("min_tokens"):
        assert request.stopping.min_tokens <= call.max_tokens
    if call.logprobs is None:
        assert not request.HasField("response")
    else:
        assert call.top_n == request.response.output_candidates.top_n == max(1, call.logprobs)
    for key, value in call.metadata:
        assert key == key.lower()
        assert not key.startswith("openengine-")
        assert value.isascii()
        assert value.isprintable()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    request=st.integers(min_value=0, max_value=5).flatmap(
        lambda k: _plausible_requests if k > 1 else _requests if k else _json
    ),
    capabilities=_fuzz_caps,
    context=st.sampled_from([2, 41, 100, 200, 1000]),
)
def test_fuzz_build_generate_request(request: Any, capabilities: Capabilities, context: int) -> None:
    outcome: GenerateCall | RequestRejected
    try:
        outcome = build(request, capabilities=capabilities, context_length=context)
    except RequestRejected as rejected:  # the only exception allowed out
        outcome = rejected
    if isinstance(outcome, RequestRejected):
        assert outcome.field
        assert outcome.reason
    else:
        _check_call(outcome, capabilities, context)
