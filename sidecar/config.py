"""The worker's configuration: one frozen :class:`SidecarConfig`, filled by :mod:`sidecar.cli`, read by everything else.

It lives apart from the command line so that the rooms reading it (worker, start-up, routing signals) never import the
CLI, which imports the worker to run it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "ENDPOINT_TYPES",
    "ConfigError",
    "DisaggregationMode",
    "EngineDetokenize",
    "SidecarConfig",
    "ThinkingMode",
]

DisaggregationMode = Literal["agg", "prefill", "decode"]
EngineDetokenize = Literal["auto", "on", "off"]
ThinkingMode = Literal["enabled", "disabled"]
ENDPOINT_TYPES = ("chat", "completions")


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    """Everything the worker needs to know, validated."""

    grpc_endpoint: str
    grpc_connections: int
    grpc_connect_attempt_timeout_s: float
    grpc_retry_interval_s: float
    grpc_startup_deadline_s: float
    grpc_rpc_timeout_s: float
    #: What the model card is built from: an absolute local directory, or a Hugging Face model id that Dynamo
    #: resolves through the hub and its cache (as Dynamo's own sidecar does).
    model_path: str
    served_model_name: str | None
    context_length: int | None
    namespace: str
    component: str | None
    endpoint: str
    endpoint_types: tuple[str, ...]
    disaggregation_mode: DisaggregationMode | None
    expected_engine: str | None
    expected_schema_release: str | None
    model: str | None
    tool_call_parser: str | None
    reasoning_parser: str | None
    discovery_backend: str
    request_plane: str
    event_plane: str
    abort_timeout_s: float
    drain_timeout_s: float
    request_inactivity_timeout_s: float
    health_poll_interval_s: float
    health_timeout_s: float
    health_failure_threshold: int
    exit_on_engine_loss: bool
    reconnect_backoff_max_s: float
    registration_check_interval_s: float
    grpc_tls_ca: Path | None
    grpc_tls_cert: Path | None
    grpc_tls_key: Path | None
    log_level: str
    log_format: str = "text"
    ops_host: str = "127.0.0.1"
    ops_port: int | None = None
    kv_events: Literal["auto", "off"] = "auto"
    load_poll_interval_s: float = 1.0
    load_max_age_s: float = 5.0
    control_plane_deadline_s: float = 60.0
    lora_root: Path | None = None
    lora_load_timeout_s: float = 120.0
    lora_fetch_timeout_s: float = 600.0
    grpc_tls_key_password_file: Path | None = None
    #: With a TLS engine, forward KV events a non-loopback ZMQ publisher sends in plaintext (refused otherwise).
    kv_events_allow_plaintext: bool = False
    #: ``auto``: ask the engine not to detokenize (``extra.detokenize = false``) when it is known to accept that
    #: (TensorRT-LLM); ``on``: let it detokenize; ``off``: ask any engine not to.
    engine_detokenize: EngineDetokenize = "auto"
    #: ``--total-kv-blocks``: the engine's KV pool in blocks for the model card, when the engine reports none
    #: (TensorRT-LLM) or to correct it; Dynamo's overload filter compares the published KV usage with it.
    total_kv_blocks: int | None = None
    #: The port of Dynamo's own system server behind the sidecar's system port; 0: the OS picks when Dynamo binds.
    dynamo_system_port: int = 0
    #: How ``Generate`` streams are received: straight from the HTTP/2 events, or through grpclib's streams.
    grpc_receive: Literal["direct", "grpclib"] = "direct"
    #: ``--model-path`` exactly as given: the model's name when ``--served-model-name`` is not set (Dynamo's rule).
    model_path_given: str = ""
    #: Dynamo's response plane (``tcp`` or ``quic``); the frontends must use the same.
    response_plane: Literal["tcp", "quic"] = "tcp"
    dynamo_egress: Literal["push", "pull"] = "push"
    cpu_scheduling: Literal["batch", "normal"] = "batch"
    #: A chat template for the model card, used by the frontend instead of the model's own.
    custom_jinja_template: Path | None = None
    #: The card tells the frontend to leave tools out of the chat template when ``tool_choice`` is ``none``.
    exclude_tools_when_tool_choice_none: bool = True
    #: The deployment's default thinking mode, published in the card's runtime data for the frontend's templates.
    default_thinking_mode: ThinkingMode | None = None
    #: Serve the RL discovery endpoint (``DYN_RL_ENDPOINT``, default ``rl``) describing the system port's routes.
    enable_rl: bool = False
    #: The RL discovery endpoint's name (``DYN_RL_ENDPOINT``).
    rl_endpoint: str = "rl"


class ConfigError(ValueError):
    """A flag (or its environment twin) has a bad value; the message names it."""
