"""Roles at start-up (``sidecar.startup``): where the role comes from, KV-connector checks, registration by role."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from openengine_bp.openengine.v1 import (
    DeploymentCapacity,
    EngineRole,
    KvConnectorInfo,
    KvEndpoint,
    ModelInfo,
    ServerInfo,
)
from sidecar.cli import parse_config
from sidecar.convert import Capabilities
from sidecar.startup import Discovery, StartupRefused, check_role_connector, registration_for, resolve_role

MODEL_DIR = Path(__file__).resolve().parents[2] / "sidecar" / "testing" / "mock" / "model"


def caps(connector: KvConnectorInfo | None, role: EngineRole = EngineRole.UNSPECIFIED) -> Capabilities:
    server = ServerInfo(
        engine_name="tensorrt_llm",
        engine_role=role,
        supported_models=["tiny"],
        schema_revision=1,
        minimum_client_revision=1,
        capacity=DeploymentCapacity(kv_block_size=16, max_running_requests=64),
        kv_connector=connector,
    )
    model = ModelInfo(model_id="tiny", served_model_name="tiny", max_context_length=2048, supports_token_ids_input=True)
    return Capabilities.from_discovery(server, model)


def trt_connector(**overrides: Any) -> KvConnectorInfo:
    """What TensorRT-LLM reports with cache_transceiver_config set (no endpoints, no protocols, no abort cleanup)."""
    fields: dict[str, Any] = {
        "enabled": True,
        "transfer_backend": "NIXL",
        "supports_remote_prefill": True,
        "supports_decode_pull": False,
        "supports_abort_cleanup": False,
        "schema_version": 1,
    }
    fields.update(overrides)
    return KvConnectorInfo(**fields)


@pytest.mark.parametrize(
    ("engine", "mode", "expected"),
    [
        (EngineRole.UNSPECIFIED, None, "aggregated"),
        (EngineRole.UNSPECIFIED, "prefill", "prefill"),
        (EngineRole.UNSPECIFIED, "decode", "decode"),
        (EngineRole.PREFILL, None, "prefill"),
        (EngineRole.DECODE, "decode", "decode"),
    ],
)
def test_the_engines_role_wins_and_the_flag_fills_in_for_tensorrt_llm(
    engine: EngineRole, mode: str | None, expected: str
) -> None:
    assert resolve_role(engine, mode) == expected


def test_a_flag_contradicting_the_engine_is_refused_naming_both() -> None:
    with pytest.raises(StartupRefused, match=r"--disaggregation-mode decode contradicts the engine's role prefill"):
        resolve_role(EngineRole.PREFILL, "decode")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_tensorrt_llms_connector_serves_both_roles_with_a_warning_about_abort_cleanup(role: Any) -> None:
    warnings = check_role_connector(role, caps(trt_connector()))
    assert len(warnings) == 1
    assert "cannot abort KV sessions" in warnings[0]
    assert "deferred until the first token" in warnings[0]


def test_an_aggregated_worker_needs_no_connector() -> None:
    assert check_role_connector("aggregated", caps(trt_connector(enabled=False))) == []


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_missing_connector_is_a_warning_not_a_refusal(role: Any) -> None:
    (warning,) = check_role_connector(role, caps(None))
    assert "reports no KV connector" in warning


@pytest.mark.parametrize(
    ("role", "connector", "words"),
    [
        ("prefill", trt_connector(enabled=False), "KV connector is disabled"),
        ("decode", trt_connector(enabled=False), "cache_transceiver_config"),
        ("decode", trt_connector(transfer_backend=" "), "names no transfer backend"),
        ("prefill", trt_connector(supports_remote_prefill=False), "cannot serve remote prefill"),
        (
            "decode",
            trt_connector(supported_protocols=["ucx"], local_endpoints=[KvEndpoint(host="h", port=1, protocol="tcp")]),
            "protocol 'tcp'",
        ),
    ],
    ids=["prefill disabled", "decode disabled", "no backend", "no remote prefill", "protocol not listed"],
)
def test_a_connector_that_cannot_serve_the_role_is_refused(role: Any, connector: KvConnectorInfo, words: str) -> None:
    with pytest.raises(StartupRefused, match=words):
        check_role_connector(role, caps(connector))


def test_a_connector_that_says_everything_gives_no_warning() -> None:
    full = trt_connector(
        supports_abort_cleanup=True,
        supported_protocols=["tcp"],
        local_endpoints=[KvEndpoint(host="10.0.0.5", port=5555, protocol="tcp")],
    )
    assert check_role_connector("decode", caps(full)) == []


def discovery(role: str, connector: KvConnectorInfo | None = None) -> Discovery:
    server = ServerInfo(engine_name="tensorrt_llm", supported_models=["tiny"], schema_revision=1)
    return Discovery(server, ModelInfo(model_id="tiny"), caps(connector), "tiny", role, 2048)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("role", "needs"),
    [("aggregated", ()), ("prefill", (("decode",),)), ("decode", (("prefill",),))],
)
def test_registration_by_role(role: str, needs: tuple[tuple[str, ...], ...]) -> None:
    config = parse_config(["--grpc-endpoint", "127.0.0.1:1", "--model-path", str(MODEL_DIR)])
    reg = registration_for(discovery(role, trt_connector()), config)
    assert reg.worker_type == role
    assert reg.needs == needs
    assert (reg.served_model_name, reg.aliases) == (str(MODEL_DIR), ("tiny",)), "named after --model-path as given"


def test_the_prefill_worker_registers_under_the_prefill_component() -> None:
    from sidecar.worker import _dynamo_settings

    config = parse_config(["--grpc-endpoint", "127.0.0.1:1", "--model-path", str(MODEL_DIR)])
    assert _dynamo_settings(config, "prefill").component == "prefill"
    assert _dynamo_settings(config, "decode").component == "backend"
    assert _dynamo_settings(dataclasses.replace(config, component="ctx"), "prefill").component == "ctx"
