"""Start-up decisions: which model, which role, which context window, what to register — and when to refuse.

Pure decisions (:func:`select_model`, :func:`resolve_role`, :func:`check_role_connector`,
:func:`resolve_context_length`, :func:`registration_for`) are separate from the two trio steps that talk to the engine
(:func:`discover`, :func:`wait_ready`) so each refusal is tested by a table. A refusal is one :class:`StartupRefused`
line naming what to change.

Roles (``docs/disaggregation.md``): the engine's ``ServerInfo.engine_role`` wins; an engine that reports none
(TensorRT-LLM: UNSPECIFIED, it takes the phase per request) gets ``--disaggregation-mode``. A prefill or decode worker
needs the engine's KV connector: a connector reported disabled, without a transfer backend, unable to serve remote
prefill (prefill role) or listing an endpoint protocol it does not support is refused; a connector not reported at all
(TensorRT-LLM's baseline omits it when the transceiver backend is left unset) and one that cannot abort KV sessions
are warnings, compensated per request (handoffs are checked as far as the engine reported; decode cancellation is
deferred until the first token). A prefill worker registers ``ModelType.Prefill`` under the ``prefill`` component
with ``needs=[[decode]]``; a decode worker registers chat/completions with ``needs=[[prefill]]``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

import trio

from openengine_bp.openengine.v1 import EngineRole, HealthState
from sidecar.convert import Capabilities
from sidecar.convert.enums import bp_enum
from sidecar.dynamo import Registration
from sidecar.engine import PINNED_SCHEMA_RELEASE, check_server_compat
from sidecar.errors import EngineRpcError, GrpcCode

if TYPE_CHECKING:
    from openengine_bp.openengine.v1 import ModelInfo, ServerInfo
    from sidecar.config import SidecarConfig
    from sidecar.engine import EngineClient

log: Final = logging.getLogger("sidecar.startup")

Role = Literal["aggregated", "prefill", "decode"]

_ROLE_OF_ENGINE: Final[dict[EngineRole, Role]] = {
    EngineRole.AGGREGATED: "aggregated",
    EngineRole.PREFILL: "prefill",
    EngineRole.DECODE: "decode",
}
_ROLE_OF_MODE: Final[dict[str, Role]] = {"agg": "aggregated", "prefill": "prefill", "decode": "decode"}

# While waiting for READY, a status that says "not up yet" is retried; anything else is the engine's final word.
_RETRYABLE_CODES: Final = frozenset({GrpcCode.UNAVAILABLE, GrpcCode.DEADLINE_EXCEEDED})


class StartupRefused(Exception):
    """The worker will not serve this engine as configured; the message is the one line an operator reads."""


@dataclass(frozen=True, slots=True)
class Discovery:
    """What the engine reported, and what the worker decided from it."""

    server: ServerInfo
    model_info: ModelInfo
    caps: Capabilities
    #: The engine-side model name (``GenerateRequest.model``).
    model: str
    role: Role
    context_length: int


def select_model(supported: list[str], wanted: str | None) -> str:
    """The engine model to serve: ``--model`` if given (and listed), else the only one listed."""
    if wanted is not None:
        if supported and wanted not in supported:
            raise StartupRefused(f"--model {wanted!r} is not served by the engine (it serves: {', '.join(supported)})")
        return wanted
    if len(supported) > 1:
        raise StartupRefused(f"the engine serves several models ({', '.join(supported)}): choose one with --model")
    # TensorRT-LLM lists exactly one; an engine listing none resolves any name (GetModelInfo decides).
    return supported[0] if supported else ""


def resolve_role(engine_role: EngineRole, mode: str | None) -> Role:
    """The engine's own role wins; TensorRT-LLM reports UNSPECIFIED and takes the phase per request (the flag)."""
    engine = _ROLE_OF_ENGINE.get(engine_role)
    configured = _ROLE_OF_MODE[mode] if mode is not None else None
    if engine is not None:
        if configured is not None and configured != engine:
            raise StartupRefused(f"--disaggregation-mode {mode} contradicts the engine's role {engine}")
        return engine
    return configured or "aggregated"


def resolve_context_length(configured: int | None, engine: int | None) -> int:
    """``--context-length`` wins (with a warning on disagreement); without either the worker refuses."""
    if configured is not None:
        if engine is not None and engine != configured:
            log.warning(
                "--context-length %d differs from the engine's max_context_length %d; using %d",
                configured,
                engine,
                configured,
            )
        return configured
    if engine is None or engine <= 0:
        raise StartupRefused(
            "the engine reports no max_context_length (TensorRT-LLM without --max_seq_len): pass --context-length"
        )
    return engine


def resolve_total_kv_blocks(configured: int | None, engine: int | None) -> int | None:
    """``--total-kv-blocks`` wins (with a warning on disagreement); neither: unknown (TensorRT-LLM reports none)."""
    if configured is not None and engine is not None and engine != configured:
        log.warning(
            "--total-kv-blocks %d differs from the engine's total_kv_blocks %d; using %d",
            configured,
            engine,
            configured,
        )
    return configured if configured is not None else engine


def check_role_connector(role: Role, caps: Capabilities) -> list[str]:
    """Refuse a prefill/decode role the engine's KV connector cannot serve; return warnings for what it cannot tell."""
    if role == "aggregated":
        return []
    connector = caps.kv_connector
    if connector is None:
        return [
            f"role {role}: the engine reports no KV connector (TensorRT-LLM omits it when cache_transceiver_config "
            "has no backend); handoffs cannot be checked against its transfer backend"
        ]
    if connector.enabled is False:
        raise StartupRefused(
            f"role {role}: the engine's KV connector is disabled, and disaggregated serving moves the KV cache through "
            "it (TensorRT-LLM: configure cache_transceiver_config); run with --disaggregation-mode agg otherwise"
        )
    if not connector.transfer_backend.strip():
        raise StartupRefused(f"role {role}: the engine's KV connector names no transfer backend")
    if role == "prefill" and connector.supports_remote_prefill is False:
        raise StartupRefused("role prefill: the engine's KV connector cannot serve remote prefill")
    if connector.supported_protocols:
        supported = {p.casefold() for p in connector.supported_protocols}
        listed = ", ".join(connector.supported_protocols)
        for endpoint in connector.local_endpoints:
            if endpoint.protocol.casefold() not in supported:
                raise StartupRefused(
                    f"role {role}: the engine's KV endpoint {endpoint.host}:{endpoint.port} uses protocol "
                    f"{endpoint.protocol!r}, which its connector does not list ({listed})"
                )
    warnings: list[str] = []
    if connector.enabled is None:
        warnings.append(f"role {role}: the engine does not say whether its KV connector is enabled; assuming it is")
    if connector.supports_abort_cleanup is not True:
        warnings.append(
            f"role {role}: the engine cannot abort KV sessions (supports_abort_cleanup is not true): decode "
            "cancellation is deferred until the first token, and a handoff no decode claims stays on the prefill "
            "engine until the engine releases it"
        )
    return warnings


async def discover(client: EngineClient, config: SidecarConfig, *, server: ServerInfo | None = None) -> Discovery:
    """GetServerInfo + GetModelInfo, checked against this client and the configuration. ``server``: the ServerInfo
    the engine has just answered (the way back after a lost engine asks it first), instead of asking again."""
    if server is None:
        server = await client.get_server_info()
    try:
        warnings = check_server_compat(
            server, expected_release=config.expected_schema_release, expected_engine=config.expected_engine
        )
    except ValueError as exc:
        raise StartupRefused(str(exc)) from None
    for warning in warnings:
        log.warning("%s", warning)
    model = select_model(list(server.supported_models), config.model)
    model_info = await client.get_model_info(model)
    caps = Capabilities.from_discovery(server, model_info)
    role = resolve_role(bp_enum(server.engine_role), config.disaggregation_mode)
    for warning in check_role_connector(role, caps):
        log.warning("%s", warning)
    if caps.supports_token_ids_input is False:
        raise StartupRefused("the engine does not accept token-id input, which this worker sends")
    context_length = resolve_context_length(config.context_length, caps.max_context_length)
    log.info(
        "engine %s %s (instance %s), schema release %r (client pinned to %s), model %r, role %s, context %d",
        caps.engine_name,
        caps.engine_version,
        caps.instance_id,
        server.schema_release,
        PINNED_SCHEMA_RELEASE,
        model,
        role,
        context_length,
    )
    return Discovery(server, model_info, caps, model or caps.served_model_name, role, context_length)


def check_unchanged(first: Discovery, again: Discovery) -> None:
    """A restarted or swapped engine must still be the one discovered: same role, same model."""
    if again.role != first.role:
        raise StartupRefused(f"the engine's role changed from {first.role} to {again.role} during start-up")
    if again.caps.model_names != first.caps.model_names or again.model != first.model:
        raise StartupRefused(
            f"the engine's model changed from {first.caps.model_names} to {again.caps.model_names} during start-up"
        )


async def wait_ready(client: EngineClient, *, deadline: float, retry_interval_s: float) -> None:
    """Poll ``Control.Health`` until READY; STARTING and "not up yet" statuses are waited on until ``deadline``."""
    last = "no answer yet"
    logged = ""
    while True:
        try:
            response = await client.health()
            state = bp_enum(response.state)
            if state is HealthState.READY:
                return
            last = f"health {state.name}"
        except EngineRpcError as exc:
            if exc.code is GrpcCode.UNIMPLEMENTED:
                log.warning("the engine does not implement Control.Health; assuming it is ready")
                return
            if exc.code not in _RETRYABLE_CODES:
                raise
            last = str(exc)
        if last != logged:
            log.info("waiting for the engine to be READY: %s", last)
            logged = last
        if trio.current_time() + retry_interval_s > deadline:
            raise StartupRefused(f"the engine did not become READY before the start-up deadline (last: {last})")
        await trio.sleep(retry_interval_s)


#: Engines known to accept ``extra.detokenize`` as a bool (TensorRT-LLM's OpenEngine server): ``--engine-detokenize
#: auto`` asks these not to detokenize.
DETOKENIZE_SWITCH_ENGINES: Final = frozenset({"tensorrt_llm"})


def engine_detokenizes(mode: str, engine_name: str) -> bool:
    """Whether requests leave the engine's detokenization on (``--engine-detokenize``): the frontend detokenizes
    from the token ids, so the engine's text is thrown away; an engine that does not know the switch may refuse it."""
    if mode == "on":
        return True
    if mode == "off":
        return False
    return engine_name not in DETOKENIZE_SWITCH_ENGINES


def served_model_name(config: SidecarConfig) -> str:
    """The name clients use: ``--served-model-name``, else ``--model-path`` exactly as given.

    The second is the rule of Dynamo's own TensorRT-LLM sidecar (it has no ``--served-model-name``), so a manifest
    written for it serves the same model under the same name when its command is swapped for this one. The engine's
    own model names stay reachable as aliases (:func:`registration_for`), so clients of a worker that was named after
    the engine before (this sidecar's rule up to issue 36) keep working.
    """
    return config.served_model_name or config.model_path_given or config.model_path


def registration_for(discovery: Discovery, config: SidecarConfig) -> Registration:
    """The model card and runtime config published to Dynamo, from what discovery reported."""
    caps = discovery.caps
    served = served_model_name(config)
    aliases = tuple(name for name in caps.model_names if name != served)
    needs: tuple[tuple[Role, ...], ...] = ()
    if discovery.role == "prefill":
        needs = (("decode",),)
    elif discovery.role == "decode":
        needs = (("prefill",),)
    runtime_data: dict[str, object] = {
        "openengine_engine": caps.engine_name,
        "openengine_schema_release": discovery.server.schema_release or PINNED_SCHEMA_RELEASE,
    }
    if config.default_thinking_mode is not None:
        # Where Dynamo's frontend reads the deployment's default (its chat template kwargs), as its workers put it.
        runtime_data["default_thinking_mode"] = config.default_thinking_mode
    template = config.custom_jinja_template
    return Registration(
        model_path=config.model_path,
        served_model_name=served,
        model_input="tokens",
        endpoint_types=tuple(t for t in config.endpoint_types if t in ("chat", "completions")),  # type: ignore[misc]
        worker_type=discovery.role,
        needs=needs,
        context_length=discovery.context_length,
        kv_block_size=caps.kv_block_size,
        total_kv_blocks=resolve_total_kv_blocks(config.total_kv_blocks, caps.total_kv_blocks),
        max_num_seqs=caps.max_running_requests,
        max_num_batched_tokens=caps.max_batched_tokens,
        data_parallel_size=caps.data_parallel_size or 1,
        data_parallel_start_rank=caps.data_parallel_start_rank or 0,
        reasoning_parser=config.reasoning_parser or caps.reasoning_parser or None,
        tool_call_parser=config.tool_call_parser or caps.tool_call_parser or None,
        aliases=aliases,
        max_loras=caps.max_loras if caps.supports_lora else None,
        runtime_data=runtime_data,
        custom_template_path=None if template is None else str(template),
        exclude_tools_when_tool_choice_none=config.exclude_tools_when_tool_choice_none,
    )
