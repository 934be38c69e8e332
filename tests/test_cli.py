"""Flags and their DYN_* twins (sidecar.cli): bad values fail fast with a message naming the flag."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sidecar.cli import parse_config
from tests.helpers.cli import assert_refused, base_argv
from tests.helpers.stack import MODEL_DIR


def test_defaults_follow_dynamos_conventions() -> None:
    config = parse_config(base_argv())
    assert (config.namespace, config.component, config.endpoint) == ("dynamo", None, "generate")
    assert config.grpc_connections == 8
    assert config.endpoint_types == ("chat", "completions")
    assert config.discovery_backend == "file"


def test_environment_twins_apply_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_NAMESPACE", "from-env")
    monkeypatch.setenv("DYN_SIDECAR_GRPC_CONNECTIONS", "3")
    config = parse_config(base_argv())
    assert (config.namespace, config.grpc_connections) == ("from-env", 3)
    assert parse_config(base_argv("--namespace", "from-flag")).namespace == "from-flag"


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--model-path", str(MODEL_DIR)], {}, "--grpc-endpoint is required"),
        (base_argv("--grpc-endpoint", "https://engine:443"), {}, "--grpc-endpoint"),
        (base_argv("--grpc-endpoint", "engine:99999"), {}, "--grpc-endpoint"),
        (base_argv("--grpc-connections", "0"), {}, "--grpc-connections"),
        (base_argv(), {"DYN_SIDECAR_GRPC_CONNECTIONS": "many"}, "--grpc-connections"),
        (base_argv(), {"DYN_DISAGGREGATION_MODE": "both"}, "--disaggregation-mode"),
        (base_argv("--endpoint-types", "chat,embeddings"), {}, "--endpoint-types"),
        (base_argv("--namespace", "a.b"), {}, "--namespace"),
        (["--grpc-endpoint", "127.0.0.1:1", "--model-path", "/nonexistent"], {}, "--model-path"),
        (base_argv("--context-length", "-5"), {}, "--context-length"),
    ],
)
def test_bad_flags_fail_fast_naming_the_flag(
    argv: list[str],
    env: dict[str, str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert_refused(argv, env, message, monkeypatch, capsys)


def test_help_explains_every_flag_with_its_environment_twin() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    for flag, env in [
        ("--grpc-endpoint", "DYN_SIDECAR_GRPC_ENDPOINT"),
        ("--namespace", "DYN_NAMESPACE"),
        ("--drain-timeout-secs", "DYN_SIDECAR_DRAIN_TIMEOUT_SECS"),
    ]:
        assert flag in out
        assert env in out
