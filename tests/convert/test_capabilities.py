"""Capabilities from discovery: absent = unknown, present false/0 = a real answer."""

from __future__ import annotations

from openengine_bp.google.protobuf import Struct, Value
from openengine_bp.openengine.v1 import (
    CandidateTokenSelectionMode,
    DeploymentCapacity,
    EngineRole,
    GenerationCapabilities,
    GuidedDecodingCapabilities,
    GuidedDecodingMode,
    KvConnectorInfo,
    KvEndpoint,
    LogprobCapabilities,
    ParallelismInfo,
)
from sidecar.convert import Capabilities
from sidecar.convert.capabilities import DP_RANK_TARGETING_KEY

from .factories import MODEL, model_info, server_info


def test_everything_absent_is_unknown() -> None:
    caps = Capabilities.from_discovery(server_info(capacity=None), model_info(max_context_length=None, generation=None))
    assert caps.max_context_length is None
    assert caps.max_output_tokens is None
    assert caps.kv_block_size is None
    assert caps.total_kv_blocks is None
    assert caps.max_running_requests is None
    assert caps.max_batched_tokens is None
    assert caps.data_parallel_size is None
    assert caps.data_parallel_start_rank is None
    assert caps.supports_priority is None
    assert caps.supports_stop_in_output is None
    assert caps.supports_cache_salt is None
    assert caps.supports_prefix_cache_bypass is None
    assert caps.supports_lora is None
    assert caps.supports_multimodal is None
    assert caps.supports_text_input is None
    assert caps.advertised_max_num_sequences is None
    assert caps.max_num_sequences == 1
    assert caps.output_logprobs.supported is None
    assert caps.output_logprobs.max_top_n is None
    assert caps.prompt_logprobs.supported is None
    assert caps.guided_decoding.supported is None
    assert caps.dp_rank_targeting is None
    assert caps.kv_connector is None


def test_present_false_and_zero_are_kept() -> None:
    generation = GenerationCapabilities(
        output_logprobs=LogprobCapabilities(supported=False, max_top_n=0),
        guided_decoding=GuidedDecodingCapabilities(supported=False),
        max_num_sequences=0,
        supports_priority=False,
        supports_stop_in_output=False,
        supports_cache_salt=False,
        supports_prefix_cache_bypass=False,
    )
    caps = Capabilities.from_discovery(
        server_info(capacity=DeploymentCapacity(kv_block_size=0, total_kv_blocks=0)),
        model_info(max_output_tokens=0, supports_lora=False, supports_multimodal=False, generation=generation),
    )
    assert caps.kv_block_size == 0
    assert caps.total_kv_blocks == 0
    assert caps.max_output_tokens == 0
    assert caps.supports_lora is False
    assert caps.supports_multimodal is False
    assert caps.supports_priority is False
    assert caps.supports_stop_in_output is False
    assert caps.supports_cache_salt is False
    assert caps.supports_prefix_cache_bypass is False
    assert caps.output_logprobs.supported is False
    assert caps.output_logprobs.max_top_n == 0
    assert caps.guided_decoding.supported is False
    assert caps.advertised_max_num_sequences == 0
    assert caps.max_num_sequences == 1  # n = 1 is always allowed


def test_full_discovery() -> None:
    server = server_info(
        engine_name="tensorrt_llm",
        engine_role=EngineRole.AGGREGATED,
        capacity=DeploymentCapacity(
            kv_block_size=32, total_kv_blocks=4096, max_running_requests=256, max_batched_tokens=8192, max_loras=2
        ),
        parallelism=ParallelismInfo(data_parallel_size=2, data_parallel_rank=1, data_parallel_start_rank=0),
        kv_connector=KvConnectorInfo(
            enabled=True,
            transfer_backend="NIXL",
            local_endpoints=[KvEndpoint(host="10.0.0.1", port=5555, protocol="tcp")],
            supported_protocols=["tcp"],
            supports_remote_prefill=True,
            supports_decode_pull=False,
            supports_abort_cleanup=False,
            schema_version=1,
        ),
        extra=Struct(fields={DP_RANK_TARGETING_KEY: Value(bool_value=True)}),
    )
    model = model_info(
        served_model_aliases=["alias"],
        max_output_tokens=50,
        supports_text_input=True,
        reasoning_parser="qwen3",
        generation=GenerationCapabilities(
            prompt_logprobs=LogprobCapabilities(supported=True, max_top_n=3),
            output_logprobs=LogprobCapabilities(
                supported=True,
                candidate_selection_modes=[CandidateTokenSelectionMode.TOP_N, CandidateTokenSelectionMode(99)],
                max_top_n=20,
            ),
            guided_decoding=GuidedDecodingCapabilities(
                supported=True, modes=[GuidedDecodingMode.JSON_SCHEMA, GuidedDecodingMode(42)]
            ),
            max_num_sequences=8,
            supports_priority=False,
            supports_stop_in_output=True,
            supports_cache_salt=True,
            supports_prefix_cache_bypass=False,
        ),
    )
    caps = Capabilities.from_discovery(server, model)
    assert caps.engine_name == "tensorrt_llm"
    assert caps.engine_role is EngineRole.AGGREGATED
    assert (caps.kv_block_size, caps.total_kv_blocks, caps.max_running_requests) == (32, 4096, 256)
    assert (caps.max_batched_tokens, caps.max_loras) == (8192, 2)
    assert (caps.data_parallel_size, caps.data_parallel_rank, caps.data_parallel_start_rank) == (2, 1, 0)
    assert caps.dp_rank_targeting is True
    assert caps.kv_connector is not None
    assert caps.kv_connector.transfer_backend == "NIXL"
    assert caps.kv_connector.local_endpoints[0].port == 5555
    assert caps.kv_connector.supports_abort_cleanup is False
    assert caps.kv_connector.schema_version == 1
    assert caps.model_names == (MODEL, "alias")
    assert caps.max_context_length == 100
    assert caps.max_output_tokens == 50
    assert caps.reasoning_parser == "qwen3"
    assert caps.max_num_sequences == 8
    # Unknown enum numbers from a newer engine are dropped, never an error.
    assert caps.output_logprobs.modes == frozenset({CandidateTokenSelectionMode.TOP_N})
    assert caps.output_logprobs.top_n_allowed
    assert caps.guided_decoding.modes == frozenset({GuidedDecodingMode.JSON_SCHEMA})
    assert caps.prompt_logprobs.max_top_n == 3
    assert caps.prompt_logprobs.top_n_allowed  # no modes reported: top-N not forbidden


def test_unknown_role_reads_unspecified() -> None:
    caps = Capabilities.from_discovery(server_info(engine_role=EngineRole(7)), model_info())
    assert caps.engine_role is EngineRole.UNSPECIFIED


def test_top_n_forbidden_when_modes_exclude_it() -> None:
    generation = GenerationCapabilities(
        output_logprobs=LogprobCapabilities(supported=True, candidate_selection_modes=[CandidateTokenSelectionMode.ALL])
    )
    caps = Capabilities.from_discovery(server_info(), model_info(generation=generation))
    assert not caps.output_logprobs.top_n_allowed


def test_max_num_sequences_for_tensorrt_llm_without_advertisement() -> None:
    # TensorRT-LLM leaves max_num_sequences unset but accepts n > 1: bounded by its running slots.
    generation = GenerationCapabilities(supports_stop_in_output=True)
    trt = Capabilities.from_discovery(server_info(engine_name="tensorrt_llm"), model_info(generation=generation))
    assert trt.max_num_sequences == 64
    unknown_slots = Capabilities.from_discovery(
        server_info(engine_name="tensorrt_llm", capacity=None), model_info(generation=generation)
    )
    assert unknown_slots.max_num_sequences == 1
    other = Capabilities.from_discovery(server_info(engine_name="vllm"), model_info(generation=generation))
    assert other.max_num_sequences == 1


def test_dp_targeting_flag_must_be_a_real_bool() -> None:
    for value, expected in [
        (Value(bool_value=False), False),
        (Value(string_value="true"), None),
        (Value(number_value=1.0), None),
    ]:
        server = server_info(extra=Struct(fields={DP_RANK_TARGETING_KEY: value}))
        assert Capabilities.from_discovery(server, model_info()).dp_rank_targeting is expected
    assert Capabilities.from_discovery(server_info(extra=Struct()), model_info()).dp_rank_targeting is None
