"""What one engine says it can do, read once from discovery (``GetServerInfo`` + ``GetModelInfo``).

Discovery scalars are proto3 ``optional``: **absent means unknown** (the engine cannot report it),
a present ``0`` / ``false`` is a real answer. Every field here keeps that distinction as
``None`` versus a value — nothing is replaced by a client-side default, except where a decision is
documented on the field (:attr:`Capabilities.max_num_sequences`).

Unknown enum numbers (a newer engine) read as ``UNSPECIFIED`` and are dropped from mode sets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from openengine_bp.openengine.v1 import (
    CandidateTokenSelectionMode,
    EngineRole,
    GuidedDecodingCapabilities,
    GuidedDecodingMode,
    KvConnectorInfo,
    LogprobCapabilities,
    ModelInfo,
    ServerInfo,
)

from .enums import bp_enum

__all__ = [
    "DP_RANK_TARGETING_KEY",
    "Capabilities",
    "GuidedDecodingSupport",
    "KvConnector",
    "KvEndpointInfo",
    "LogprobSupport",
]

#: ``ServerInfo.extra`` key (bool) with which newer TensorRT-LLM builds say they honour
#: ``openengine-target-dp-rank``; the baseline answers UNIMPLEMENTED to that header whatever its value.
DP_RANK_TARGETING_KEY: Final = "trtllm_supports_dp_rank_targeting"

# Engines known to accept num_sequences > 1 although they leave max_num_sequences unset
# (TensorRT-LLM: n > 1 sets n and best_of; see Capabilities.max_num_sequences).
_UNADVERTISED_MULTI_SEQUENCE_ENGINES: Final = frozenset({"tensorrt_llm"})


@dataclass(frozen=True, slots=True)
class LogprobSupport:
    """``LogprobCapabilities`` of one direction (prompt or output)."""

    #: None = not reported (treated as unsupported by request mapping), False = reported unsupported.
    supported: bool | None
    #: Largest ``top_n`` the engine accepts; None = no limit reported.
    max_top_n: int | None
    #: Advertised selection modes; empty = not reported.
    modes: frozenset[CandidateTokenSelectionMode]

    @property
    def top_n_allowed(self) -> bool:
        """Whether top-N candidate selection may be asked for (an empty mode list does not forbid it)."""
        return not self.modes or CandidateTokenSelectionMode.TOP_N in self.modes

    @classmethod
    def from_message(cls, message: LogprobCapabilities | None) -> LogprobSupport:
        """Read the sub-message; an absent one is "not reported"."""
        if message is None:
            return cls(supported=None, max_top_n=None, modes=frozenset())
        modes = frozenset(bp_enum(mode) for mode in message.candidate_selection_modes)
        return cls(
            supported=message.supported,
            max_top_n=message.max_top_n,
            modes=modes - {CandidateTokenSelectionMode.UNSPECIFIED},
        )


@dataclass(frozen=True, slots=True)
class GuidedDecodingSupport:
    """``GuidedDecodingCapabilities``: whether guides are accepted and which kinds."""

    supported: bool | None
    modes: frozenset[GuidedDecodingMode]

    @classmethod
    def from_message(cls, message: GuidedDecodingCapabilities | None) -> GuidedDecodingSupport:
        """Read the sub-message; an absent one is "not reported"."""
        if message is None:
            return cls(supported=None, modes=frozenset())
        modes = frozenset(bp_enum(mode) for mode in message.modes)
        return cls(supported=message.supported, modes=modes - {GuidedDecodingMode.UNSPECIFIED})


@dataclass(frozen=True, slots=True)
class KvEndpointInfo:
    """One ``KvEndpoint`` (host, port, protocol)."""

    host: str
    port: int
    protocol: str


@dataclass(frozen=True, slots=True)
class KvConnector:
    """``ServerInfo.kv_connector``: the engine's KV transfer connector (disaggregated serving)."""

    enabled: bool | None
    transfer_backend: str
    local_endpoints: tuple[KvEndpointInfo, ...]
    supported_protocols: tuple[str, ...]
    supports_remote_prefill: bool | None
    supports_decode_pull: bool | None
    supports_abort_cleanup: bool | None
    schema_version: int | None

    @classmethod
    def from_message(cls, message: KvConnectorInfo) -> KvConnector:
        """Copy the message into an immutable value."""
        return cls(
            enabled=message.enabled,
            transfer_backend=message.transfer_backend,
            local_endpoints=tuple(KvEndpointInfo(e.host, e.port, e.protocol) for e in message.local_endpoints),
            supported_protocols=tuple(message.supported_protocols),
            supports_remote_prefill=message.supports_remote_prefill,
            supports_decode_pull=message.supports_decode_pull,
            supports_abort_cleanup=message.supports_abort_cleanup,
            schema_version=message.schema_version,
        )


@dataclass(frozen=True, slots=True)
class Capabilities:
    """Everything request mapping and registration need to know about one engine and its model.

    ``None`` always means "the engine did not report it"; ``False``/``0`` mean what they say.
    """

    # -- ServerInfo
    engine_name: str
    engine_version: str
    #: ``UNSPECIFIED`` for TensorRT-LLM, which picks the phase per request.
    engine_role: EngineRole
    instance_id: str
    kv_block_size: int | None
    total_kv_blocks: int | None
    max_running_requests: int | None
    max_batched_tokens: int | None
    max_loras: int | None
    data_parallel_size: int | None
    data_parallel_rank: int | None
    data_parallel_start_rank: int | None
    #: Whether ``openengine-target-dp-rank`` may be sent (``ServerInfo.extra``, TensorRT-LLM only).
    dp_rank_targeting: bool | None
    #: None when the engine reports no connector (TensorRT-LLM baseline omits it when unset).
    kv_connector: KvConnector | None

    # -- ModelInfo
    model_id: str
    served_model_name: str
    served_model_aliases: tuple[str, ...]
    max_context_length: int | None
    max_output_tokens: int | None
    supports_text_input: bool | None
    supports_token_ids_input: bool | None
    supports_lora: bool | None
    supports_multimodal: bool | None
    reasoning_parser: str
    tool_call_parser: str

    # -- ModelInfo.generation
    supports_priority: bool | None
    supports_stop_in_output: bool | None
    supports_cache_salt: bool | None
    supports_prefix_cache_bypass: bool | None
    #: The advertised ``generation.max_num_sequences``, verbatim (None = not reported).
    advertised_max_num_sequences: int | None
    #: Largest ``n`` a request may ask for. The advertised value when present (at least 1: n = 1 is
    #: always the default). When absent: 1, except for engines known to accept more without saying
    #: so (TensorRT-LLM), where each sequence takes a running slot and the bound is
    #: ``max_running_requests`` (1 if that is unknown too). The engine still validates the rest
    #: (TensorRT-LLM refuses greedy sampling with n > 1).
    max_num_sequences: int
    output_logprobs: LogprobSupport
    prompt_logprobs: LogprobSupport
    guided_decoding: GuidedDecodingSupport

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the model may be addressed by, served name first, without duplicates."""
        names = [self.served_model_name, self.model_id, *self.served_model_aliases]
        return tuple(dict.fromkeys(name for name in names if name))

    @classmethod
    def from_discovery(cls, server: ServerInfo, model: ModelInfo) -> Capabilities:
        """Build from the betterproto2 ``ServerInfo`` and ``ModelInfo`` answers."""
        capacity = server.capacity
        parallelism = server.parallelism
        generation = model.generation
        max_running = capacity.max_running_requests if capacity is not None else None
        advertised = generation.max_num_sequences if generation is not None else None
        if advertised is not None:
            max_sequences = max(1, advertised)
        elif server.engine_name in _UNADVERTISED_MULTI_SEQUENCE_ENGINES and max_running:
            max_sequences = max_running
        else:
            max_sequences = 1
        return cls(
            engine_name=server.engine_name,
            engine_version=server.engine_version,
            engine_role=bp_enum(server.engine_role),
            instance_id=server.instance_id,
            kv_block_size=capacity.kv_block_size if capacity is not None else None,
            total_kv_blocks=capacity.total_kv_blocks if capacity is not None else None,
            max_running_requests=max_running,
            max_batched_tokens=capacity.max_batched_tokens if capacity is not None else None,
            max_loras=capacity.max_loras if capacity is not None else None,
            data_parallel_size=parallelism.data_parallel_size if parallelism is not None else None,
            data_parallel_rank=parallelism.data_parallel_rank if parallelism is not None else None,
            data_parallel_start_rank=parallelism.data_parallel_start_rank if parallelism is not None else None,
            dp_rank_targeting=_extra_bool(server, DP_RANK_TARGETING_KEY),
            kv_connector=KvConnector.from_message(server.kv_connector) if server.kv_connector is not None else None,
            model_id=model.model_id,
            served_model_name=model.served_model_name,
            served_model_aliases=tuple(model.served_model_aliases),
            max_context_length=model.max_context_length,
            max_output_tokens=model.max_output_tokens,
            supports_text_input=model.supports_text_input,
            supports_token_ids_input=model.supports_token_ids_input,
            supports_lora=model.supports_lora,
            supports_multimodal=model.supports_multimodal,
            reasoning_parser=model.reasoning_parser,
            tool_call_parser=model.tool_call_parser,
            supports_priority=generation.supports_priority if generation is not None else None,
            supports_stop_in_output=generation.supports_stop_in_output if generation is not None else None,
            supports_cache_salt=generation.supports_cache_salt if generation is not None else None,
            supports_prefix_cache_bypass=generation.supports_prefix_cache_bypass if generation is not None else None,
            advertised_max_num_sequences=advertised,
            max_num_sequences=max_sequences,
            output_logprobs=LogprobSupport.from_message(generation.output_logprobs if generation else None),
            prompt_logprobs=LogprobSupport.from_message(generation.prompt_logprobs if generation else None),
            guided_decoding=GuidedDecodingSupport.from_message(generation.guided_decoding if generation else None),
        )


def _extra_bool(server: ServerInfo, key: str) -> bool | None:
    # `extra` is outside the portable contract: only a real JSON bool counts; anything else
    # (absent, a string "true", a number) is "not reported", never an error.
    if server.extra is None:
        return None
    value = server.extra.fields.get(key)
    if value is None:
        return None
    return value.bool_value
