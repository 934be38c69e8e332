"""Start-up decisions (sidecar.startup): each refusal is one clear line naming what to change."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from openengine_bp.openengine.v1 import DeploymentCapacity, EngineRole, ModelInfo, ServerInfo
from sidecar.cli import parse_config
from sidecar.convert import Capabilities
from sidecar.startup import (
    Discovery,
    StartupRefused,
    check_unchanged,
    discover,
    registration_for,
    resolve_context_length,
    resolve_role,
    resolve_total_kv_blocks,
    select_model,
)

MODEL_DIR = Path(__file__).resolve().parents[1] / "sidecar" / "testing" / "mock" / "model"


@pytest.mark.parametrize(
    ("supported", "wanted", "expected"),
    [(["a"], None, "a"), (["a", "b"], "b", "b"), ([], None, ""), ([], "x", "x")],
)
def test_select_model_picks_the_only_or_the_requested_model(
    supported: list[str], wanted: str | None, expected: str
) -> None:
    assert select_model(supported, wanted) == expected


def test_select_model_refuses_an_ambiguous_engine_naming_the_flag() -> None:
    with pytest.raises(StartupRefused, match="--model"):
        select_model(["a", "b"], None)


def test_select_model_refuses_a_model_the_engine_does_not_serve() -> None:
    with pytest.raises(StartupRefused, match="'c' is not served"):
        select_model(["a", "b"], "c")


@pytest.mark.parametrize(
    ("engine", "mode", "expected"),
    [
        (EngineRole.UNSPECIFIED, None, "aggregated"),
        (EngineRole.UNSPECIFIED, "prefill", "prefill"),
        (EngineRole.DECODE, None, "decode"),
        (EngineRole.AGGREGATED, "agg", "aggregated"),
    ],
)
def test_the_engine_role_wins_and_the_flag_fills_in(engine: EngineRole, mode: str | None, expected: str) -> None:
    assert resolve_role(engine, mode) == expected


def test_a_flag_contradicting_the_engine_role_is_refused() -> None:
    with pytest.raises(StartupRefused, match="contradicts"):
        resolve_role(EngineRole.PREFILL, "decode")


def test_context_length_flag_wins_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert resolve_context_length(1024, 2048) == 1024
    assert "differs" in caplog.text


def test_context_length_falls_back_to_the_engine_and_refuses_without_either() -> None:
    assert resolve_context_length(None, 2048) == 2048
    with pytest.raises(StartupRefused, match="--context-length"):
        resolve_context_length(None, None)


def discovery(role: str = "aggregated", model: str = "tiny", alias: str = "") -> Discovery:
    server = ServerInfo(
        engine_name="mock",
        supported_models=[model],
        schema_revision=1,
        minimum_client_revision=1,
        capacity=DeploymentCapacity(kv_block_size=16, total_kv_blocks=4096, max_running_requests=64),
    )
    info = ModelInfo(model_id=model, served_model_name=model, served_model_aliases=[alias] if alias else [])
    return Discovery(server, info, Capabilities.from_discovery(server, info), model, role, 2048)  # type: ignore[arg-type]


def test_a_changed_role_or_model_between_discoveries_is_refused() -> None:
    check_unchanged(discovery(), discovery())
    with pytest.raises(StartupRefused, match="role changed"):
        check_unchanged(discovery(), discovery(role="decode"))
    with pytest.raises(StartupRefused, match="model changed"):
        check_unchanged(discovery(), discovery(model="other"))


def test_registration_carries_what_discovery_reported() -> None:
    config = parse_config(["--grpc-endpoint", "127.0.0.1:1", "--model-path", str(MODEL_DIR)])
    reg = registration_for(discovery(alias="tiny-alias"), config)
    assert reg.served_model_name == str(MODEL_DIR)
    assert reg.aliases == ("tiny", "tiny-alias")
    assert (reg.context_length, reg.kv_block_size, reg.total_kv_blocks, reg.max_num_seqs) == (2048, 16, 4096, 64)
    assert reg.worker_type == "aggregated"
    assert reg.runtime_data["openengine_engine"] == "mock"


# --------------------------------------- issue 36: the name and the card of a worker started with Dynamo's flags


@pytest.mark.parametrize(
    ("flags", "served", "aliases"),
    [
        # Dynamo's own sidecar has no --served-model-name: the model is named after --model-path as given.
        (["--model-path", "Qwen/Qwen3-0.6B"], "Qwen/Qwen3-0.6B", ("tiny",)),
        (["--model-path", str(MODEL_DIR)], str(MODEL_DIR), ("tiny",)),
        # The engine's own name is the name clients used before: it stays routable, as an alias.
        (["--model-path", str(MODEL_DIR), "--served-model-name", "tiny"], "tiny", ()),
        (["--model-path", "tiny"], "tiny", ()),
        (["--model-path", str(MODEL_DIR), "--served-model-name", "chat"], "chat", ("tiny",)),
    ],
)
def test_the_model_is_named_after_the_model_path_as_given_unless_served_model_name_says(
    flags: list[str], served: str, aliases: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(MODEL_DIR)  # `--model-path tiny` must not be a directory here: an id, as the first case
    reg = registration_for(discovery(), parse_config(["--grpc-endpoint", "127.0.0.1:1", *flags]))
    assert (reg.served_model_name, reg.aliases) == (served, aliases)


def test_the_card_level_flags_reach_the_registration(tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    argv = ["--grpc-endpoint", "127.0.0.1:1", "--model-path", str(MODEL_DIR), "--custom-jinja-template", str(template)]
    argv += ["--exclude-tools-when-tool-choice-none", "false", "--dyn-default-thinking-mode", "enabled"]
    reg = registration_for(discovery(), parse_config(argv))
    assert reg.custom_template_path == str(template.resolve())
    assert reg.exclude_tools_when_tool_choice_none is False
    # Where Dynamo's frontend reads it (dynamo.frontend's runtime_default_thinking_mode), as Dynamo's workers put it.
    assert reg.runtime_data["default_thinking_mode"] == "enabled"
    plain = registration_for(discovery(), parse_config(["--grpc-endpoint", "127.0.0.1:1", "--model-path", "x/y"]))
    assert (plain.custom_template_path, plain.exclude_tools_when_tool_choice_none) == (None, True)
    assert "default_thinking_mode" not in plain.runtime_data
    assert plain.model_path == "x/y", "a Hugging Face id reaches register_model as given: Dynamo fetches it"


def test_total_kv_blocks_flag_fills_in_for_an_engine_that_reports_none(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 27 item 8: TensorRT-LLM reports no pool size; Dynamo's overload filter needs it in the card."""
    argv = ["--grpc-endpoint", "127.0.0.1:1", "--model-path", str(MODEL_DIR), "--total-kv-blocks", "512"]
    assert registration_for(discovery(), parse_config(argv)).total_kv_blocks == 512  # the engine says 4096
    assert "differs" in caplog.text
    assert resolve_total_kv_blocks(None, None) is None
    assert resolve_total_kv_blocks(64, None) == 64


def test_every_dynamo_listener_defaults_to_loopback_unless_set() -> None:
    from sidecar.worker import LOOPBACK_DEFAULTS, apply_loopback_defaults

    env = {"DYN_TCP_RPC_HOST": "10.1.2.3"}
    applied = apply_loopback_defaults(env)
    assert env["DYN_TCP_RPC_HOST"] == "10.1.2.3", "an operator's choice stands"
    assert set(applied) == set(LOOPBACK_DEFAULTS) - {"DYN_TCP_RPC_HOST"}
    assert all(env[name] == "127.0.0.1" for name in applied)


@pytest.mark.parametrize("backend", ["kubernetes", "etcd"])
def test_the_planes_other_hosts_dial_are_not_loopback_when_discovery_spans_hosts(backend: str) -> None:
    """With etcd or Kubernetes discovery a frontend in another pod dials the address this worker advertises: a
    loopback default would make the worker unreachable (the manifests set only DYN_SYSTEM_HOST). Failed before: the
    request and event planes were 127.0.0.1 whatever the discovery."""
    from sidecar.worker import apply_loopback_defaults

    env: dict[str, str] = {}
    applied = apply_loopback_defaults(env, backend)
    assert "DYN_TCP_RPC_HOST" not in env
    assert "DYN_EVENT_PLANE_HOST" not in env
    assert env["DYN_SYSTEM_HOST"] == "127.0.0.1"  # the operator opens the system port (the manifests do)
    assert set(applied) == {"DYN_SYSTEM_HOST", "DYN_TCP_RESPONSE_STREAM_HOST"}


class _Engine:
    """Discovery's two RPCs, answered from fixed messages."""

    def __init__(self, server: ServerInfo, info: ModelInfo) -> None:
        self.server, self.info = server, info

    async def get_server_info(self) -> ServerInfo:
        return self.server

    async def get_model_info(self, model: str) -> ModelInfo:
        del model
        return self.info


@pytest.mark.parametrize("release", ["", "   "])
async def test_an_expected_schema_release_refuses_an_engine_that_reports_none(release: str) -> None:
    """``--expected-schema-release`` is an assertion: an engine reporting an empty release (TensorRT-LLM without its
    bindings metadata) cannot be shown to match it. Without the flag the same engine is accepted with a warning."""
    found = discovery()
    found.server.schema_release = release
    engine = _Engine(found.server, found.model_info)
    argv = ["--grpc-endpoint", "127.0.0.1:1", "--model-path", str(MODEL_DIR), "--context-length", "2048"]
    assert (await discover(engine, parse_config(argv))).model == "tiny"  # type: ignore[arg-type]
    expecting = parse_config([*argv, "--expected-schema-release", "768a93c7b44e"])
    with pytest.raises(StartupRefused, match="empty schema_release, so it cannot be shown to match the expected"):
        await discover(engine, expecting)  # type: ignore[arg-type]
