"""betterproto2 and upb put identical bytes on the wire, for every message of every proto file.

Each case is one spec (plain data) built twice — upb by keyword construction, betterproto2 by a
small builder that follows its field metadata — and the encodings are compared byte for byte.
Struct fields are built by ``sidecar.convert.structjson`` (never by the libraries' own dict
conversion), so these cases also pin the handoff number-fidelity rules on the wire.

A multi-key Struct is a map: upb's deterministic encoding sorts keys, betterproto2 keeps insertion
order, so those cases compare by parsing rather than by raw bytes (single-key Structs compare raw).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, cast

import betterproto2
import pytest

from openengine.v1 import error_pb2, generation_pb2, kv_pb2, lifecycle_pb2, lora_pb2, model_pb2, server_pb2
from openengine_bp.openengine import v1 as bp
from sidecar.convert import structjson
from sidecar.convert.enums import bp_enum, pb_enum

from . import wire

BIG_ID = 2**53 + 1


@dataclass(frozen=True)
class J:
    """A JSON object to become a ``google.protobuf.Struct`` (through sidecar.convert.structjson)."""

    obj: dict[str, Any]
    big_ints: structjson.BigInts = "refuse"


def pb_value(value: Any) -> Any:
    """The spec with J markers replaced by upb Structs (upb takes nested dicts for sub-messages)."""
    if isinstance(value, J):
        return structjson.json_to_pb_struct(value.obj, big_ints=value.big_ints)
    if isinstance(value, dict):
        return {key: pb_value(item) for key, item in value.items()}
    if isinstance(value, list):
        return [pb_value(item) for item in value]
    return value


def bp_build(cls: type[betterproto2.Message], spec: dict[str, Any]) -> Any:
    """Build a betterproto2 message from a spec, one constructor call per message (no oneof reassignment)."""
    # _betterproto is betterproto2's per-class field metadata (a classproperty its stubs cannot express).
    kinds: dict[str, Any] = cast(Any, cls)._betterproto.cls_by_field
    return cls(**{name: _bp_field(kinds[name], value) for name, value in spec.items()})


def _bp_field(kind: Any, value: Any) -> Any:
    if isinstance(value, J):
        return structjson.json_to_bp_struct(value.obj, big_ints=value.big_ints)
    if isinstance(value, list):
        return [_bp_field(kind, item) for item in value]
    if isinstance(value, dict):
        return bp_build(kind, value)
    if isinstance(kind, type) and issubclass(kind, enum.Enum) and isinstance(value, int):
        return kind(value)
    return value


SESSION: dict[str, Any] = {
    "session_id": "9007199254740993",
    "transfer_backend": "NIXL",
    "endpoints": [{"host": "10.0.0.1", "port": 5555, "protocol": "tcp"}, {"host": "::1", "port": 0, "protocol": ""}],
    "dp_rank": 0,
    "attributes_struct": J({"disagg_request_id": BIG_ID}, big_ints="string"),
}

# Every JSON kind at once, with the values a handoff must not re-type.
RICH_ATTRIBUTES = J(
    {
        "ctx_request_id": BIG_ID,
        "first_gen_tokens": [1, 2, 151643],
        "ctx_dp_rank": 0,
        "first_gen_log_probs": [-0.25, [[7, -1.5, 1]]],
        "schedule_style": 1,
        "ok": True,
        "off": False,
        "nothing": None,
        "empty": {},
        "nested": {"a": [[1, {"b": False}], [], ""]},
        "opaque_state": "AAEC",
    },
    big_ints="string",
)

HASH = {"value": b"\x00\xff\x10", "encoding": "bytes"}
ADAPTER = {"lora_id": 2**63 - 1, "lora_name": "adapter", "source_path": "/loras/adapter"}

# (id, upb class, betterproto2 class, spec, raw-byte comparison possible)
CASES: list[tuple[str, Any, type[betterproto2.Message], dict[str, Any], bool]] = [
    # ------------------------------------------------------------------------------- error.proto
    ("EngineError", error_pb2.EngineError, bp.EngineError, {"code": 11, "message": "boom", "retryable": True}, True),
    ("EngineError empty", error_pb2.EngineError, bp.EngineError, {}, True),
    # -------------------------------------------------------------------------- generation.proto
    (
        "GenerateRequest token ids, explicit zeros, empty-message oneofs",
        generation_pb2.GenerateRequest,
        bp.GenerateRequest,
        {
            "request_id": "req-1",
            "model": "m",
            "token_ids": {"ids": [0, 1, 2**32 - 1]},
            "sampling": {
                "temperature": 0.0,
                "top_p": 1.0,
                "top_k": 0,
                "min_p": 0.0,
                "frequency_penalty": -0.5,
                "presence_penalty": 0.0,
                "repetition_penalty": 1.1,
                "seed": 0,
                "num_sequences": 1,
            },
            "stopping": {
                "max_tokens": 0,
                "min_tokens": 0,
                "conditions": [{"stop_text": ""}, {"stop_text": "END"}, {"stop_token_id": 0}],
                "ignore_eos": False,
                "include_stop_in_output": False,
            },
            "response": {
                "return_prompt_logprobs": False,
                "prompt_candidates": {"all": {}},
                "return_output_logprobs": True,
                "output_candidates": {"top_n": 0},
                "prompt_logprob_start": 0,
            },
            "kv": {"session": SESSION, "bypass_prefix_cache": False, "cache_salt": ""},
            "guided": {"json_object": {}, "backend": ""},
            "media": [
                {"modality": 1, "url": "https://x/y.png"},
                {"modality": 2, "data_uri": "data:video/mp4;base64,AAAA"},
                {"modality": 3, "raw_bytes": b"\x00\x01", "mime_type": "audio/wav", "uuid": "u-1"},
                {"modality": 1, "url": ""},
            ],
            "lora_name": "adapter",
            "extra": J({"request_type": "context_only"}),
        },
        True,
    ),
    (
        "GenerateRequest prompt, choice, candidate token ids",
        generation_pb2.GenerateRequest,
        bp.GenerateRequest,
        {
            "request_id": "req-2",
            "prompt": "",
            "response": {"output_candidates": {"token_ids": {"ids": [3, 1]}}},
            "guided": {"choice": {"choices": ["yes", "no", ""]}, "backend": "xgrammar"},
            "kv": {},
            "extra": J({}),
        },
        True,
    ),
    *[
        (
            f"GuidedDecoding {guide}",
            generation_pb2.GuidedDecoding,
            bp.GuidedDecoding,
            {guide: value},
            True,
        )
        for guide, value in [
            ("json_schema", '{"type":"object"}'),
            ("regex", "a+"),
            ("ebnf_grammar", 'root ::= "a"'),
            ("structural_tag", ""),
            ("choice", {}),
        ]
    ],
    (
        "GenerateResponse prompt",
        generation_pb2.GenerateResponse,
        bp.GenerateResponse,
        {
            "request_id": "req-1",
            "prompt": {
                "tokens": [
                    {"token_id": 1, "token": "a"},
                    {
                        "token_id": 2,
                        "token": "b",
                        "logprob": -0.5,
                        "rank": 1,
                        "candidates": [
                            {"token_id": 2, "logprob": -0.5, "token": "b", "rank": 1},
                            {"token_id": 9, "logprob": -9999.0, "token": ""},
                        ],
                    },
                ]
            },
        },
        True,
    ),
    (
        "GenerateResponse token at index 0 with logprob 0",
        generation_pb2.GenerateResponse,
        bp.GenerateResponse,
        {
            "request_id": "req-1",
            "token": {"output_index": 0, "tokens": [{"token_id": 5, "logprob": 0.0, "rank": 0}], "text": "hi"},
        },
        True,
    ),
    (
        "GenerateResponse prefill_ready with usage",
        generation_pb2.GenerateResponse,
        bp.GenerateResponse,
        {
            "request_id": "req-1",
            "prefill_ready": {"kv_session": SESSION},
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4, "cached_prompt_tokens": 0},
        },
        True,
    ),
    *[
        (
            f"GenerateResponse finished {match}",
            generation_pb2.GenerateResponse,
            bp.GenerateResponse,
            {
                "request_id": "req-1",
                "finished": {"output_index": 1, "reason": 1, "message": "", "stop_match": {match: value}},
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "reasoning_tokens": 0},
            },
            True,
        )
        for match, value in [("stop_token_id", 0), ("stop_text", "END"), ("eos_token_id", 151643)]
    ],
    (
        "GenerateResponse error with usage",
        generation_pb2.GenerateResponse,
        bp.GenerateResponse,
        {
            "request_id": "req-1",
            "error": {"code": 5, "message": "response consumer stalled", "retryable": True},
            "usage": {"prompt_tokens": 3},
        },
        True,
    ),
    ("GenerateResponse empty event", generation_pb2.GenerateResponse, bp.GenerateResponse, {"request_id": "x"}, True),
    # ---------------------------------------------------------------------------------- kv.proto
    (
        "KvSessionRef rich attributes",
        kv_pb2.KvSessionRef,
        bp.KvSessionRef,
        {**SESSION, "attributes_struct": RICH_ATTRIBUTES},
        False,
    ),
    (
        "KvConnectorInfo",
        kv_pb2.KvConnectorInfo,
        bp.KvConnectorInfo,
        {
            "enabled": False,
            "transfer_backend": "",
            "local_endpoints": [{"host": "h", "port": 65535, "protocol": "nixl"}],
            "supported_protocols": ["tcp", "nixl"],
            "supports_remote_prefill": True,
            "supports_decode_pull": False,
            "supports_abort_cleanup": False,
            "schema_version": 1,
        },
        True,
    ),
    (
        "GetKvEventSourcesRequest",
        kv_pb2.GetKvEventSourcesRequest,
        bp.GetKvEventSourcesRequest,
        {"data_parallel_ranks": [0, 1, 300]},
        True,
    ),
    (
        "GetKvEventSourcesResponse",
        kv_pb2.GetKvEventSourcesResponse,
        bp.GetKvEventSourcesResponse,
        {
            "sources": [
                {
                    "transport": "zmq",
                    "endpoint_addr": {"host": "10.0.0.2", "port": 5557, "protocol": "tcp"},
                    "topic": "kv",
                    "replay_endpoint": "",
                    "data_parallel_rank": 0,
                    "encoding": "msgpack",
                    "schema_version": 1,
                    "buffer_steps": 0,
                    "hwm": 0,
                    "max_queue_size": 0,
                },
                {"transport": "grpc", "encoding": "protobuf"},
            ]
        },
        True,
    ),
    (
        "SubscribeKvEventsRequest",
        kv_pb2.SubscribeKvEventsRequest,
        bp.SubscribeKvEventsRequest,
        {"data_parallel_ranks": [0], "include_snapshot": True, "start_sequence_number": 2**64 - 1},
        True,
    ),
    (
        "SubscribeKvEventsResponse batch",
        kv_pb2.SubscribeKvEventsResponse,
        bp.SubscribeKvEventsResponse,
        {
            "batch": {
                "sequence_number": 2**64 - 1,
                "timestamp_unix_nanos": 1_700_000_000_000_000_000,
                "data_parallel_rank": 0,
                "events": [
                    {
                        "request_id": "req-1",
                        "kv_session": SESSION,
                        "block_stored": {
                            "block_hashes": [HASH, {"value": b"", "encoding": "int64"}],
                            "parent_block_hash": {"value": b"", "encoding": ""},
                            "token_ids": [1, 2, 0],
                            "block_size": 3,
                            "lora_id": -5,
                            "lora_name": "adapter",
                            "medium": 1,
                            "extra_keys": [{"values": ["trt_mm_v1", "0", "abc", "0"]}, {"values": []}],
                            "group_idx": 0,
                            "kv_cache_spec_kind": "full_attention",
                            "kv_cache_spec_sliding_window": 0,
                        },
                    },
                    {"block_removed": {"block_hashes": [HASH], "medium": 2, "group_idx": 1}},
                    {"all_blocks_cleared": {}},
                ],
            }
        },
        True,
    ),
    (
        "SubscribeKvEventsResponse error",
        kv_pb2.SubscribeKvEventsResponse,
        bp.SubscribeKvEventsResponse,
        {"error": {"code": 11, "message": "publisher gone"}},
        True,
    ),
    # --------------------------------------------------------------------------- lifecycle.proto
    (
        "HealthRequest",
        lifecycle_pb2.HealthRequest,
        bp.HealthRequest,
        {"include_inference_probe": True, "model": "m", "role": 2},
        True,
    ),
    (
        "HealthResponse",
        lifecycle_pb2.HealthResponse,
        bp.HealthResponse,
        {"state": 4, "checks": [{"name": "grpc", "state": 2, "message": "ok"}, {"name": "model", "state": 3}]},
        True,
    ),
    ("AbortRequest request_id", lifecycle_pb2.AbortRequest, bp.AbortRequest, {"request_id": "req-1"}, True),
    ("AbortRequest empty request_id", lifecycle_pb2.AbortRequest, bp.AbortRequest, {"request_id": ""}, True),
    ("AbortRequest kv_session", lifecycle_pb2.AbortRequest, bp.AbortRequest, {"kv_session": SESSION}, True),
    ("AbortRequest all_requests", lifecycle_pb2.AbortRequest, bp.AbortRequest, {"all_requests": {}}, True),
    ("AbortResponse", lifecycle_pb2.AbortResponse, bp.AbortResponse, {"status": 2, "message": "done"}, True),
    # -------------------------------------------------------------------------------- lora.proto
    ("LoadLoraRequest", lora_pb2.LoadLoraRequest, bp.LoadLoraRequest, {"adapter": ADAPTER}, True),
    (
        "LoadLoraResponse",
        lora_pb2.LoadLoraResponse,
        bp.LoadLoraResponse,
        {"adapter": {**ADAPTER, "lora_id": -1}, "already_loaded": True},
        True,
    ),
    ("UnloadLoraRequest", lora_pb2.UnloadLoraRequest, bp.UnloadLoraRequest, {"lora_name": "adapter"}, True),
    ("UnloadLoraResponse", lora_pb2.UnloadLoraResponse, bp.UnloadLoraResponse, {"adapter": ADAPTER}, True),
    ("ListLorasRequest", lora_pb2.ListLorasRequest, bp.ListLorasRequest, {}, True),
    (
        "ListLorasResponse",
        lora_pb2.ListLorasResponse,
        bp.ListLorasResponse,
        {"adapters": [ADAPTER, {"lora_id": 0, "lora_name": "", "source_path": ""}]},
        True,
    ),
    # ------------------------------------------------------------------------------- model.proto
    ("GetModelInfoRequest", model_pb2.GetModelInfoRequest, bp.GetModelInfoRequest, {"model": ""}, True),
    (
        "ModelInfo explicit zeros and an empty sub-message",
        model_pb2.ModelInfo,
        bp.ModelInfo,
        {
            "model_id": "Qwen/Qwen3-0.6B",
            "served_model_name": "qwen",
            "served_model_aliases": ["a", "b"],
            "max_context_length": 0,
            "max_output_tokens": 4096,
            "tokenizer_modes": ["hf"],
            "supports_text_input": False,
            "supports_token_ids_input": True,
            "generation": {
                "prompt_logprobs": {"supported": True, "candidate_selection_modes": [1, 2, 3], "max_top_n": 0},
                "output_logprobs": {},
                "guided_decoding": {"supported": True, "modes": [1, 2, 3, 4, 5, 6]},
                "max_num_sequences": 0,
                "supports_priority": False,
                "supports_stop_in_output": True,
                "supports_cache_salt": False,
                "supports_prefix_cache_bypass": False,
            },
            "supports_lora": False,
            "supports_multimodal": False,
            "reasoning_parser": "",
            "tool_call_parser": "hermes",
            "extra": J({"max_seq_len": 4096}),
        },
        True,
    ),
    ("ModelInfo nothing reported", model_pb2.ModelInfo, bp.ModelInfo, {"model_id": "m", "generation": {}}, True),
    # ------------------------------------------------------------------------------ server.proto
    ("GetServerInfoRequest", server_pb2.GetServerInfoRequest, bp.GetServerInfoRequest, {}, True),
    (
        "ServerInfo",
        server_pb2.ServerInfo,
        bp.ServerInfo,
        {
            "engine_name": "tensorrt_llm",
            "engine_version": "1.3.0rc27",
            "engine_role": 0,
            "instance_id": "llm-1",
            "supported_models": ["qwen"],
            "parallelism": {
                "tensor_parallel_size": 1,
                "pipeline_parallel_size": 1,
                "data_parallel_size": 1,
                "data_parallel_rank": 0,
                "data_parallel_start_rank": 0,
                "decode_context_parallel_size": 1,
            },
            "kv_connector": {"enabled": True, "transfer_backend": "NIXL", "schema_version": 1},
            "schema_revision": 1,
            "minimum_client_revision": 1,
            "schema_release": "768a93c7b44e",
            "capacity": {
                "kv_block_size": 32,
                "total_kv_blocks": 2**40,
                "max_running_requests": 0,
                "max_batched_tokens": 8192,
                "max_loras": 0,
            },
            "extra": J({"trtllm_supports_dp_rank_targeting": True}),
        },
        True,
    ),
    (
        "ServerInfo multi-key extra",
        server_pb2.ServerInfo,
        bp.ServerInfo,
        {
            "engine_name": "tensorrt_llm",
            "extra": J(
                {
                    "trtllm_supports_dp_rank_targeting": False,
                    "kv_event_heartbeat_interval_ms": 1000,
                    "trtllm_kv_event_hash_algo": "v2_sha256_64",
                    "trtllm_node": None,
                }
            ),
        },
        False,
    ),
    ("GetLoadRequest", server_pb2.GetLoadRequest, bp.GetLoadRequest, {"include_per_rank": True}, True),
    (
        "LoadInfo",
        server_pb2.LoadInfo,
        bp.LoadInfo,
        {
            "instance_id": "llm-1",
            "timestamp_unix_nanos": 2**63,
            "running_requests": 0,
            "queued_requests": 0,
            "active_kv_sessions": 0,
            "used_kv_blocks": 0,
            "total_kv_blocks": 100,
            "running_tokens": 0,
            "waiting_tokens": 0,
            "prefill_batch_size": 0,
            "decode_batch_size": 0,
            "ranks": [
                {
                    "data_parallel_rank": 0,
                    "running_requests": 0,
                    "queued_requests": 0,
                    "used_kv_blocks": 0,
                    "total_kv_blocks": 50,
                    "prefill_batch_size": 0,
                    "decode_batch_size": 0,
                },
                {},
            ],
            "attributes": J({"stale": False}),
        },
        True,
    ),
]


def build_both(pb_cls: Any, bp_cls: type[betterproto2.Message], spec: dict[str, Any]) -> tuple[Any, Any]:
    return pb_cls(**pb_value(spec)), bp_build(bp_cls, spec)


@pytest.mark.parametrize(("case", "pb_cls", "bp_cls", "spec", "raw"), CASES, ids=[c[0] for c in CASES])
def test_identical_bytes(
    case: str, pb_cls: Any, bp_cls: type[betterproto2.Message], spec: dict[str, Any], raw: bool
) -> None:
    pb_msg, bp_msg = build_both(pb_cls, bp_cls, spec)
    pb_bytes: bytes = pb_msg.SerializeToString(deterministic=True)
    bp_bytes = bytes(bp_msg)
    if raw:
        assert bp_bytes == pb_bytes
    else:
        # Same message, map entries in another order: equal once parsed, equal once re-encoded deterministically.
        assert pb_cls.FromString(bp_bytes) == pb_msg
        assert pb_cls.FromString(bp_bytes).SerializeToString(deterministic=True) == pb_bytes
    # Each runtime reads the other's bytes back to the same message.
    reparsed = bytes(bp_cls.parse(pb_bytes))
    if raw:
        assert reparsed == pb_bytes
    assert pb_cls.FromString(reparsed) == pb_msg


def _message_types(message: Any) -> set[str]:
    names = {message.DESCRIPTOR.full_name}
    for descriptor, value in message.ListFields():
        # google.protobuf.Struct (a map) is covered by the Struct cases; only our own types count here.
        if descriptor.message_type is None or not descriptor.message_type.full_name.startswith("openengine."):
            continue
        for item in value if descriptor.is_repeated else [value]:
            names |= _message_types(item)
    return names


def test_every_message_type_is_covered() -> None:
    covered: set[str] = set()
    for _, pb_cls, bp_cls, spec, _ in CASES:
        covered |= _message_types(build_both(pb_cls, bp_cls, spec)[0])
    every = set(wire.from_descriptors().messages)
    assert every - covered == set()


def test_explicit_zero_optionals_are_on_the_wire() -> None:
    pb_msg, bp_msg = build_both(
        generation_pb2.TokenOutput, bp.TokenOutput, {"output_index": 0, "tokens": [{"token_id": 0, "logprob": 0.0}]}
    )
    parsed = generation_pb2.TokenOutput.FromString(bytes(bp_msg))
    assert parsed.HasField("output_index")
    assert parsed.tokens[0].HasField("logprob")
    back = bp.TokenOutput.parse(pb_msg.SerializeToString())
    assert back.output_index == 0
    assert back.tokens[0].logprob == 0.0
    assert bp.TokenOutput.parse(b"").output_index is None


EMPTY_MEMBER_CASES: list[tuple[Any, type[betterproto2.Message], dict[str, Any], str, str]] = [
    (lifecycle_pb2.AbortRequest, bp.AbortRequest, {"all_requests": {}}, "target", "all_requests"),
    (generation_pb2.CandidateTokenSelection, bp.CandidateTokenSelection, {"all": {}}, "selection", "all"),
    (generation_pb2.GuidedDecoding, bp.GuidedDecoding, {"json_object": {}}, "guide", "json_object"),
    (kv_pb2.KvEvent, bp.KvEvent, {"all_blocks_cleared": {}}, "event", "all_blocks_cleared"),
]


def test_empty_message_oneof_members_survive() -> None:
    for pb_cls, bp_cls, spec, group, member in EMPTY_MEMBER_CASES:
        pb_msg, bp_msg = build_both(pb_cls, bp_cls, spec)
        assert pb_cls.FromString(bytes(bp_msg)).WhichOneof(group) == member
        assert betterproto2.which_one_of(bp_cls.parse(pb_msg.SerializeToString()), group)[0] == member


def test_struct_attributes_keep_json_types_across_runtimes() -> None:
    pb_msg, bp_msg = build_both(kv_pb2.KvSessionRef, bp.KvSessionRef, {**SESSION, "attributes_struct": RICH_ATTRIBUTES})
    expected = {**RICH_ATTRIBUTES.obj, "ctx_request_id": str(BIG_ID)}
    from_bp = kv_pb2.KvSessionRef.FromString(bytes(bp_msg))
    assert structjson.pb_struct_to_json(from_bp.attributes_struct) == expected
    from_pb = bp.KvSessionRef.parse(pb_msg.SerializeToString())
    assert from_pb.attributes_struct is not None
    decoded = structjson.bp_struct_to_json(from_pb.attributes_struct)
    assert decoded == expected
    assert type(decoded["ctx_dp_rank"]) is int
    assert type(decoded["ok"]) is bool
    assert decoded["ctx_request_id"] == "9007199254740993"


# Unknown enum numbers (a newer engine): kept by both runtimes, read as UNSPECIFIED through our helpers.
UNKNOWN_ENUMS: list[tuple[Any, type[betterproto2.Message], dict[str, Any], str, Any, type[enum.IntEnum]]] = [
    (
        generation_pb2.GenerationFinished,
        bp.GenerationFinished,
        {"reason": 99},
        "reason",
        generation_pb2.FinishReason,
        bp.FinishReason,
    ),
    (error_pb2.EngineError, bp.EngineError, {"code": 99}, "code", error_pb2.ErrorCode, bp.ErrorCode),
    (generation_pb2.MediaItem, bp.MediaItem, {"modality": 99}, "modality", generation_pb2.Modality, bp.Modality),
    (kv_pb2.BlockRemoved, bp.BlockRemoved, {"medium": 99}, "medium", kv_pb2.StorageMedium, bp.StorageMedium),
    (
        lifecycle_pb2.HealthResponse,
        bp.HealthResponse,
        {"state": 99},
        "state",
        lifecycle_pb2.HealthState,
        bp.HealthState,
    ),
    (
        lifecycle_pb2.AbortResponse,
        bp.AbortResponse,
        {"status": 99},
        "status",
        lifecycle_pb2.AbortStatus,
        bp.AbortStatus,
    ),
    (server_pb2.ServerInfo, bp.ServerInfo, {"engine_role": 99}, "engine_role", server_pb2.EngineRole, bp.EngineRole),
    (
        model_pb2.LogprobCapabilities,
        bp.LogprobCapabilities,
        {"candidate_selection_modes": [1, 99]},
        "candidate_selection_modes",
        model_pb2.CandidateTokenSelectionMode,
        bp.CandidateTokenSelectionMode,
    ),
    (
        model_pb2.GuidedDecodingCapabilities,
        bp.GuidedDecodingCapabilities,
        {"modes": [99, 2]},
        "modes",
        model_pb2.GuidedDecodingMode,
        bp.GuidedDecodingMode,
    ),
]


@pytest.mark.parametrize(
    ("pb_cls", "bp_cls", "spec", "field", "pb_enum_type", "bp_enum_type"),
    UNKNOWN_ENUMS,
    ids=[case[3] for case in UNKNOWN_ENUMS],
)
def test_unknown_enum_values_read_as_unspecified(
    pb_cls: Any,
    bp_cls: type[betterproto2.Message],
    spec: dict[str, Any],
    field: str,
    pb_enum_type: Any,
    bp_enum_type: type[enum.IntEnum],
) -> None:
    pb_msg = pb_cls(**spec)
    data: bytes = pb_msg.SerializeToString()
    parsed_bp = bp_cls.parse(data)
    assert bytes(parsed_bp) == data  # kept verbatim, re-sent unchanged
    pb_values = getattr(pb_cls.FromString(data), field)
    bp_values = getattr(parsed_bp, field)
    expected = spec[field]
    if isinstance(expected, list):
        assert [pb_enum(v, pb_enum_type) for v in pb_values] == [0 if v == 99 else v for v in expected]
        assert [bp_enum(v) for v in bp_values] == [bp_enum_type(0 if v == 99 else v) for v in expected]
    else:
        assert pb_values == 99
        assert pb_enum(pb_values, pb_enum_type) == 0
        assert bp_enum(bp_values) is bp_enum_type(0)
