"""Builders shared by the convert tests: capabilities of a typical engine, responses, requests."""

from __future__ import annotations

import dataclasses
from typing import Any

from openengine.v1 import error_pb2, generation_pb2
from openengine_bp.openengine.v1 import (
    CandidateTokenSelectionMode,
    DeploymentCapacity,
    GenerationCapabilities,
    LogprobCapabilities,
    ModelInfo,
    ServerInfo,
)
from sidecar.convert import Capabilities, GenerateCall, build_generate_request

REQUEST_ID = "req-1"
MODEL = "served-model"
CONTEXT = 100

#: The smallest valid request: three prompt tokens, everything else default.
BASE_REQUEST: dict[str, Any] = {"token_ids": [11, 12, 13]}


def server_info(**overrides: Any) -> ServerInfo:
    """A ServerInfo as a generic engine reports it."""
    fields: dict[str, Any] = {
        "engine_name": "mock",
        "engine_version": "1.0",
        "instance_id": "i-1",
        "supported_models": [MODEL],
        "schema_revision": 1,
        "minimum_client_revision": 1,
        "capacity": DeploymentCapacity(kv_block_size=32, total_kv_blocks=1000, max_running_requests=64),
    }
    fields.update(overrides)
    return ServerInfo(**fields)


def model_info(**overrides: Any) -> ModelInfo:
    """A ModelInfo advertising logprobs (top-5), n ≤ 4 and stop-in-output."""
    fields: dict[str, Any] = {
        "model_id": MODEL,
        "served_model_name": MODEL,
        "max_context_length": CONTEXT,
        "supports_token_ids_input": True,
        "generation": GenerationCapabilities(
            output_logprobs=LogprobCapabilities(
                supported=True, candidate_selection_modes=[CandidateTokenSelectionMode.TOP_N], max_top_n=5
            ),
            max_num_sequences=4,
            supports_stop_in_output=True,
        ),
    }
    fields.update(overrides)
    return ModelInfo(**fields)


CAPS = Capabilities.from_discovery(server_info(), model_info())


def caps(**overrides: Any) -> Capabilities:
    """:data:`CAPS` with some fields replaced."""
    return dataclasses.replace(CAPS, **overrides)


def build(request: dict[str, Any], *, capabilities: Capabilities = CAPS, **kwargs: Any) -> GenerateCall:
    """build_generate_request with the test defaults."""
    return build_generate_request(
        request,
        request_id=kwargs.pop("request_id", REQUEST_ID),
        model=kwargs.pop("model", MODEL),
        caps=capabilities,
        context_length=kwargs.pop("context_length", CONTEXT),
        **kwargs,
    )


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``patch`` into a copy of ``base`` (one level of sections)."""
    result = dict(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = {**result[key], **value}
        else:
            result[key] = value
    return result


# ------------------------------------------------------------------------------------------ responses


def token(
    index: int | None = 0, *ids: int, request_id: str = REQUEST_ID, **info: Any
) -> generation_pb2.GenerateResponse:
    """A token event; ``info`` applies to every TokenInfo (e.g. ``logprob=-0.5``)."""
    output = generation_pb2.TokenOutput(tokens=[generation_pb2.TokenInfo(token_id=i, **info) for i in ids])
    if index is not None:
        output.output_index = index
    return generation_pb2.GenerateResponse(request_id=request_id, token=output)


def usage(prompt: int = 3, completion: int = 1, **extra: int) -> generation_pb2.Usage:
    """A Usage message."""
    return generation_pb2.Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion, **extra
    )


def finished(
    index: int | None = 0,
    reason: int = generation_pb2.FINISH_REASON_STOP,
    *,
    with_usage: generation_pb2.Usage | None = None,
    request_id: str = REQUEST_ID,
    **fields: Any,
) -> generation_pb2.GenerateResponse:
    """A finished event (usage only when given)."""
    event = generation_pb2.GenerationFinished(reason=reason, **fields)  # type: ignore[arg-type]
    if index is not None:
        event.output_index = index
    response = generation_pb2.GenerateResponse(request_id=request_id, finished=event)
    if with_usage is not None:
        response.usage.CopyFrom(with_usage)
    return response


def error(code: int = error_pb2.ERROR_CODE_INTERNAL, message: str = "boom", retryable: bool = False) -> Any:
    """A terminal EngineError event."""
    return generation_pb2.GenerateResponse(
        request_id=REQUEST_ID,
        error=error_pb2.EngineError(code=code, message=message, retryable=retryable),  # type: ignore[arg-type]
    )
