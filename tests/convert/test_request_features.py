"""Capability-gated request features (issue #7): guided decoding, prompt logprobs, priority, DP rank, cache controls,
``extra`` passthrough — mapped when advertised, refused (naming the field) when not; and prompt logprobs on the
response side."""

from __future__ import annotations

import json
from typing import Any

import pytest

from openengine.v1 import generation_pb2
from openengine_bp.openengine.v1 import (
    CandidateTokenSelectionMode,
    GuidedDecodingMode,
)
from sidecar.convert import ResponseMapper
from sidecar.convert.capabilities import GuidedDecodingSupport, LogprobSupport
from sidecar.convert.request import FIELD_POLICY
from sidecar.convert.structjson import pb_struct_to_json
from sidecar.errors import ProtocolViolation, RequestRejected, Violation

from .factories import BASE_REQUEST, REQUEST_ID, build, caps, finished, merge, usage

ALL_MODES = frozenset(GuidedDecodingMode) - {GuidedDecodingMode.UNSPECIFIED}
GUIDED_ALL = caps(guided_decoding=GuidedDecodingSupport(supported=True, modes=ALL_MODES))
# What openengine-mock advertises with --capability guided=true.
GUIDED_MOCK = caps(
    guided_decoding=GuidedDecodingSupport(
        supported=True, modes=frozenset({GuidedDecodingMode.JSON_OBJECT, GuidedDecodingMode.CHOICE})
    )
)
PROMPT_LP = caps(
    prompt_logprobs=LogprobSupport(supported=True, max_top_n=5, modes=frozenset({CandidateTokenSelectionMode.TOP_N}))
)


def guided(guide: dict[str, Any]) -> dict[str, Any]:
    return merge(BASE_REQUEST, {"sampling_options": {"guided_decoding": guide}})


def rejected(request: dict[str, Any], field: str, **kwargs: Any) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        build(request, **kwargs)
    assert info.value.field == field, info.value
    return info.value


# ------------------------------------------------------------------------------------------------ guided decoding


@pytest.mark.parametrize(
    ("guide", "member", "value"),
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}, "json_schema", None),
        ({"json": '{"type":"string"}'}, "json_schema", '{"type":"string"}'),
        ({"json": {"type": "object"}}, "json_object", None),
        ({"regex": "[a-z]+"}, "regex", "[a-z]+"),
        ({"grammar": 'root ::= "a"'}, "ebnf_grammar", 'root ::= "a"'),
        ({"structural_tag": {"structures": [], "triggers": ["<a>"]}}, "structural_tag", None),
        ({"choice": ["yes", "no"]}, "choice", None),
        ({"json": {"type": "object"}, "regex": None, "backend": None, "whitespace_pattern": ""}, "json_object", None),
    ],
)
def test_guided_modes_mapped(guide: dict[str, Any], member: str, value: str | None) -> None:
    request = build(guided(guide), capabilities=GUIDED_ALL).request
    assert request.guided.WhichOneof("guide") == member
    if value is not None:
        assert getattr(request.guided, member) == value
    if member == "json_schema" and not isinstance(guide["json"], str):
        assert json.loads(request.guided.json_schema) == guide["json"]
    if member == "structural_tag":
        assert json.loads(request.guided.structural_tag) == guide["structural_tag"]
    if member == "choice":
        assert list(request.guided.choice.choices) == ["yes", "no"]
    assert not request.guided.backend


def test_any_object_schema_is_json_schema_without_json_object_mode() -> None:
    only_schema = caps(
        guided_decoding=GuidedDecodingSupport(supported=True, modes=frozenset({GuidedDecodingMode.JSON_SCHEMA}))
    )
    request = build(guided({"json": {"type": "object"}}), capabilities=only_schema).request
    assert request.guided.WhichOneof("guide") == "json_schema"


def test_empty_guides_are_absent() -> None:
    guides: list[dict[str, Any]] = [{"choice": []}, {"regex": ""}, {"choice": [], "regex": "a"}]
    for guide in guides:
        request = build(guided(guide), capabilities=GUIDED_ALL).request
        assert request.guided.WhichOneof("guide") in (None, "regex")


def test_mock_modes() -> None:
    assert build(guided({"json": {"type": "object"}}), capabilities=GUIDED_MOCK).request.guided.HasField("json_object")
    assert build(guided({"choice": ["a"]}), capabilities=GUIDED_MOCK).request.guided.HasField("choice")
    err = rejected(guided({"regex": "a+"}), "sampling_options.guided_decoding.regex", capabilities=GUIDED_MOCK)
    assert "choice, json_object" in err.reason


@pytest.mark.parametrize(
    ("guide", "field", "capabilities"),
    [
        ({"json": {"type": "object"}}, "sampling_options.guided_decoding", None),
        ({"choice": ["a"]}, "sampling_options.guided_decoding", None),
        ({"regex": "a", "choice": ["a"]}, "sampling_options.guided_decoding", GUIDED_ALL),
        ({"json": {}, "backend": "xgrammar"}, "sampling_options.guided_decoding.backend", GUIDED_ALL),
        ({"json": {}, "whitespace_pattern": " "}, "sampling_options.guided_decoding.whitespace_pattern", GUIDED_ALL),
        ({"choice": ["a", ""]}, "sampling_options.guided_decoding.choice[1]", GUIDED_ALL),
        ({"choice": ["a", 3]}, "sampling_options.guided_decoding.choice[1]", GUIDED_ALL),
        ({"choice": "a"}, "sampling_options.guided_decoding.choice", GUIDED_ALL),
        ({"regex": 5}, "sampling_options.guided_decoding.regex", GUIDED_ALL),
        ({"json": float("nan")}, "sampling_options.guided_decoding.json", GUIDED_ALL),
        ("json", "sampling_options.guided_decoding", GUIDED_ALL),
        (
            {"json": {"type": "string"}},
            "sampling_options.guided_decoding",
            caps(guided_decoding=GuidedDecodingSupport(supported=False, modes=ALL_MODES)),
        ),
    ],
)
def test_guided_refused(guide: Any, field: str, capabilities: Any) -> None:
    kwargs = {} if capabilities is None else {"capabilities": capabilities}
    rejected(guided(guide), field, **kwargs)


# ------------------------------------------------------------------------------------------------ prompt logprobs


@pytest.mark.parametrize(("k", "top_n"), [(0, 1), (1, 1), (5, 5)])
def test_prompt_logprobs_mapped(k: int, top_n: int) -> None:
    call = build(merge(BASE_REQUEST, {"output_options": {"prompt_logprobs": k}}), capabilities=PROMPT_LP)
    assert call.request.response.return_prompt_logprobs
    assert call.request.response.prompt_candidates.top_n == top_n
    assert call.prompt_logprobs == k
    assert not call.request.response.HasField("return_output_logprobs")


@pytest.mark.parametrize(
    ("k", "capabilities", "kwargs"),
    [
        (2, caps(), {}),
        (6, PROMPT_LP, {}),
        (-1, PROMPT_LP, {}),
        (2, caps(prompt_logprobs=LogprobSupport(supported=False, max_top_n=5, modes=frozenset())), {}),
        (
            2,
            caps(
                prompt_logprobs=LogprobSupport(
                    supported=True, max_top_n=5, modes=frozenset({CandidateTokenSelectionMode.ALL})
                )
            ),
            {},
        ),
        (2, PROMPT_LP, {"role": "prefill"}),
    ],
)
def test_prompt_logprobs_refused(k: int, capabilities: Any, kwargs: dict[str, Any]) -> None:
    rejected(
        merge(BASE_REQUEST, {"output_options": {"prompt_logprobs": k}}),
        "output_options.prompt_logprobs",
        capabilities=capabilities,
        **kwargs,
    )


def _prompt_event(*infos: generation_pb2.TokenInfo) -> generation_pb2.GenerateResponse:
    return generation_pb2.GenerateResponse(request_id=REQUEST_ID, prompt=generation_pb2.PromptOutput(tokens=infos))


def _prompt_infos() -> list[generation_pb2.TokenInfo]:
    first = generation_pb2.TokenInfo(token_id=11, token="a")
    second = generation_pb2.TokenInfo(
        token_id=12,
        token="b",
        logprob=-1.5,
        rank=2,
        candidates=[
            generation_pb2.LogProb(token_id=7, logprob=-0.5, token="x", rank=1),
            generation_pb2.LogProb(token_id=12, logprob=-1.5, token="b", rank=2),
        ],
    )
    third = generation_pb2.TokenInfo(token_id=13, logprob=float("-inf"))
    return [first, second, third]


def test_prompt_logprobs_on_the_final_chunk() -> None:
    mapper = ResponseMapper(REQUEST_ID, n=1, logprobs=None, prompt_tokens=3, prompt_logprobs=2)
    chunks = mapper.map([_prompt_event(*_prompt_infos())])
    assert chunks == []
    [chunk] = mapper.map([finished(0, with_usage=usage())])
    assert chunk["engine_data"] == {
        "prompt_logprobs": [
            None,
            {
                "12": {"logprob": -1.5, "rank": 2, "decoded_token": "b"},
                "7": {"logprob": -0.5, "rank": 1, "decoded_token": "x"},
            },
            {"13": {"logprob": -9999.0, "rank": None, "decoded_token": None}},
        ]
    }
    assert mapper.done


def test_prompt_logprobs_zero_keeps_the_prompt_token_only() -> None:
    mapper = ResponseMapper(REQUEST_ID, n=2, logprobs=None, prompt_tokens=3, prompt_logprobs=0)
    mapper.map([_prompt_event(*_prompt_infos())])
    [first] = mapper.map([finished(0)])
    assert "engine_data" not in first
    [last] = mapper.map([finished(1, with_usage=usage())])
    assert last["engine_data"]["prompt_logprobs"][1] == {"12": {"logprob": -1.5, "rank": 2, "decoded_token": "b"}}


def test_prompt_logprobs_asked_but_not_sent_is_an_empty_list() -> None:
    mapper = ResponseMapper(REQUEST_ID, n=1, logprobs=None, prompt_tokens=3, prompt_logprobs=1)
    [chunk] = mapper.map([finished(0, with_usage=usage())])
    assert chunk["engine_data"] == {"prompt_logprobs": []}


@pytest.mark.parametrize(
    ("prompt_logprobs", "batch", "violation"),
    [
        (None, [_prompt_event()], Violation.UNEXPECTED_EVENT),
        (1, [_prompt_event(), _prompt_event()], Violation.UNEXPECTED_EVENT),
    ],
)
def test_prompt_event_violations(prompt_logprobs: int | None, batch: list[Any], violation: Violation) -> None:
    mapper = ResponseMapper(REQUEST_ID, n=1, logprobs=None, prompt_tokens=3, prompt_logprobs=prompt_logprobs)
    with pytest.raises(ProtocolViolation) as info:
        mapper.map(batch)
    assert info.value.violation == violation


def test_prompt_event_with_usage_is_a_violation() -> None:
    event = _prompt_event()
    event.usage.CopyFrom(usage())
    mapper = ResponseMapper(REQUEST_ID, n=1, logprobs=None, prompt_tokens=3, prompt_logprobs=1)
    with pytest.raises(ProtocolViolation) as info:
        mapper.map([event])
    assert info.value.violation == Violation.USAGE_BEFORE_END


def test_generate_call_passes_prompt_logprobs_to_its_mapper() -> None:
    call = build(merge(BASE_REQUEST, {"output_options": {"prompt_logprobs": 1}}), capabilities=PROMPT_LP)
    mapper = call.response_mapper()
    mapper.map([_prompt_event(*_prompt_infos())])
    [chunk] = mapper.map([finished(0, with_usage=usage())])
    assert chunk["engine_data"]["prompt_logprobs"][0] is None


# ----------------------------------------------------------------------------------------------------- metadata

PRIORITY = caps(supports_priority=True)
DP4 = caps(data_parallel_size=4, data_parallel_start_rank=0, dp_rank_targeting=True)


def test_priority_mapped_when_advertised() -> None:
    call = build(merge(BASE_REQUEST, {"routing": {"priority": -7}}), capabilities=PRIORITY, trace={"traceparent": "t"})
    assert call.metadata[:2] == (("traceparent", "t"), ("openengine-priority", "-7"))
    assert ("openengine-priority", "0") not in build(
        merge(BASE_REQUEST, {"routing": {"priority": 0}}), capabilities=PRIORITY
    ).metadata


def test_priority_refused_when_not_advertised() -> None:
    err = rejected(merge(BASE_REQUEST, {"routing": {"priority": 3}}), "routing.priority")
    assert "supports_priority" in err.reason
    rejected(
        merge(BASE_REQUEST, {"routing": {"priority": 3}}),
        "routing.priority",
        capabilities=caps(supports_priority=False),
    )


def test_priority_annotation_cannot_smuggle_the_header() -> None:
    call = build(merge(BASE_REQUEST, {"annotations": ["openengine-priority:9"]}), capabilities=PRIORITY)
    assert call.metadata == ()


@pytest.mark.parametrize(
    ("routing", "role", "header"),
    [
        ({"dp_rank": 2}, "aggregated", "2"),
        ({"dp_rank": 0}, "aggregated", "0"),
        ({"dp_rank": 1, "prefill_dp_rank": 3}, "prefill", "3"),
        ({"dp_rank": 1}, "prefill", "1"),
    ],
)
def test_dp_rank_targeting(routing: dict[str, Any], role: Any, header: str) -> None:
    call = build(merge(BASE_REQUEST, {"routing": routing}), capabilities=DP4, role=role)
    assert dict(call.metadata)["openengine-target-dp-rank"] == header


def test_dp_rank_on_a_decode_leg_is_left_to_the_session() -> None:
    from tests.disagg.test_legs import NIXL, decode_request

    decode_caps = caps(data_parallel_size=4, data_parallel_start_rank=0, dp_rank_targeting=True, kv_connector=NIXL)
    call = build(decode_request(routing={"dp_rank": 9}), capabilities=decode_caps, role="decode")
    assert call.leg == "decode"
    assert "openengine-target-dp-rank" not in dict(call.metadata)


@pytest.mark.parametrize(
    ("routing", "capabilities", "field"),
    [
        ({"dp_rank": 4}, DP4, "routing.dp_rank"),
        ({"dp_rank": 1}, caps(data_parallel_size=4, dp_rank_targeting=None), "routing.dp_rank"),
        ({"dp_rank": 1}, caps(data_parallel_size=4, dp_rank_targeting=False), "routing.dp_rank"),
        ({"dp_rank": 1}, caps(data_parallel_size=None, dp_rank_targeting=True), "routing.dp_rank"),
    ],
)
def test_dp_rank_refused(routing: dict[str, Any], capabilities: Any, field: str) -> None:
    rejected(merge(BASE_REQUEST, {"routing": routing}), field, capabilities=capabilities)


def test_prefill_dp_rank_is_refused_on_a_prefill_leg_without_targeting() -> None:
    rejected(merge(BASE_REQUEST, {"routing": {"prefill_dp_rank": 3}}), "routing.prefill_dp_rank", role="prefill")


def test_the_only_rank_is_ignored_without_targeting() -> None:
    call = build(merge(BASE_REQUEST, {"routing": {"dp_rank": 0}}), capabilities=caps(data_parallel_size=1))
    assert call.metadata == ()


# ------------------------------------------------------------------------------------------------- cache controls

SALT = caps(supports_cache_salt=True)
BYPASS = caps(supports_prefix_cache_bypass=True)


@pytest.mark.parametrize(
    "patch",
    [
        {"routing": {"cache_salt": "tenant-a"}},
        {"routing": {"cache_namespace": "tenant-a"}},
        {"extra_args": {"nvext": {"cache_salt": "tenant-a"}}},
        {"routing": {"cache_salt": "tenant-a"}, "extra_args": {"nvext": {"cache_salt": "tenant-a"}}},
    ],
)
def test_cache_salt_mapped(patch: dict[str, Any]) -> None:
    request = build(merge(BASE_REQUEST, patch), capabilities=SALT).request
    assert request.kv.cache_salt == "tenant-a"
    assert not request.kv.HasField("bypass_prefix_cache")


@pytest.mark.parametrize(
    ("patch", "capabilities", "field"),
    [
        ({"routing": {"cache_salt": "a"}}, caps(supports_cache_salt=False), "routing.cache_salt"),
        ({"routing": {"cache_salt": "a", "cache_namespace": "b"}}, SALT, "routing.cache_namespace"),
        ({"routing": {"cache_salt": 5}}, SALT, "routing.cache_salt"),
        ({"routing": {"cache_salt": "x" * 1025}}, SALT, "routing.cache_salt"),
        (
            {"extra_args": {"bypass_prefix_cache": True}},
            caps(supports_prefix_cache_bypass=False),
            "extra_args.bypass_prefix_cache",
        ),
        ({"extra_args": {"disable_prefix_cache": True}}, caps(), "extra_args.disable_prefix_cache"),
        ({"extra_args": {"bypass_prefix_cache": "yes"}}, BYPASS, "extra_args.bypass_prefix_cache"),
    ],
)
def test_cache_controls_refused(patch: dict[str, Any], capabilities: Any, field: str) -> None:
    rejected(merge(BASE_REQUEST, patch), field, capabilities=capabilities)


@pytest.mark.parametrize("key", ["bypass_prefix_cache", "disable_prefix_cache"])
def test_prefix_cache_bypass_mapped(key: str) -> None:
    request = build(merge(BASE_REQUEST, {"extra_args": {key: True}}), capabilities=BYPASS).request
    assert request.kv.bypass_prefix_cache is True
    assert not build(merge(BASE_REQUEST, {"extra_args": {key: False}})).request.HasField("kv")


# ---------------------------------------------------------------------------------------------------------- extra


def test_extra_annotation_passthrough() -> None:
    annotations = ['openengine-extra:{"detokenize": false, "conversation_id": "c-1"}', "x-tenant:a"]
    call = build(merge(BASE_REQUEST, {"annotations": annotations}))
    assert pb_struct_to_json(call.request.extra) == {"detokenize": False, "conversation_id": "c-1"}
    assert call.metadata == (("x-tenant", "a"),)


def test_extra_on_a_prefill_leg_keeps_the_phase() -> None:
    call = build(merge(BASE_REQUEST, {"annotations": ['openengine-extra:{"a": 1}']}), role="prefill")
    assert pb_struct_to_json(call.request.extra) == {"a": 1, "request_type": "context_only"}


@pytest.mark.parametrize(
    "annotations",
    [
        ["openengine-extra:[1]"],
        ["openengine-extra:{not json"],
        ['openengine-extra:{"request_type": "generation_only"}'],
        ['openengine-extra:{"a": 1}', 'openengine-extra:{"b": 1}'],
        ['openengine-extra:{"a": ' + "1" * 9000 + "}"],
        ['openengine-extra:{"a": 123456789012345678901}'],
    ],
)
def test_extra_refused(annotations: list[str]) -> None:
    with pytest.raises(RequestRejected) as info:
        build(merge(BASE_REQUEST, {"annotations": annotations}))
    assert info.value.field.startswith("annotations")


def test_field_policy_lists_the_features_as_mapped() -> None:
    for key in (
        "sampling_options.guided_decoding",
        "output_options.prompt_logprobs",
        "routing.priority",
        "routing.dp_rank",
        "routing.cache_salt",
        "extra_args.bypass_prefix_cache",
    ):
        assert FIELD_POLICY[key][0] == "mapped", key
