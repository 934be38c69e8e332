"""Flags and their DYN_* twins (sidecar.cli): bad values fail fast with a message naming the flag."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.cli import parse_config
from tests.helpers.cli import assert_refused, base_argv
from tests.helpers.pki import Pki
from tests.helpers.stack import MODEL_DIR


def test_defaults_follow_dynamos_conventions() -> None:
    config = parse_config(base_argv())
    assert (config.namespace, config.component, config.endpoint) == ("dynamo", None, "generate")
    assert config.grpc_connections == 8
    assert config.endpoint_types == ("chat", "completions")
    assert config.discovery_backend == "etcd", "as Dynamo's frontend and workers (and its own sidecar) default"


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
        (base_argv("--log-level", "verbose"), {}, "--log-level: unknown level 'verbose'"),
        (base_argv(), {"DYN_LOG": "info,debug"}, "--log-level: two default levels"),
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


@pytest.mark.parametrize("value", ["32768", "40000", "65535", "-1", "ninety"])
def test_a_system_port_dynamo_cannot_read_is_refused_at_start(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Dynamo 1.6.1 reads DYN_SYSTEM_PORT as an i16: refuse before anything starts, naming the setting and limit."""
    assert_refused(
        base_argv(), {"DYN_SYSTEM_PORT": value}, "DYN_SYSTEM_PORT: must be a port in 0..32767", monkeypatch, capsys
    )


def test_a_system_port_below_the_limit_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_SYSTEM_PORT", "32767")
    assert parse_config(base_argv()).grpc_endpoint


def test_the_refusal_is_one_line_without_a_traceback() -> None:
    env = {**os.environ, "DYN_SYSTEM_PORT": "40000"}
    done = subprocess.run(
        [sys.executable, "-m", "sidecar", *base_argv()],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("openengine-sidecar: error")]
    assert errors == [
        "openengine-sidecar: error: DYN_SYSTEM_PORT: must be a port in 0..32767 (Dynamo 1.6.1 reads it as a signed "
        "16-bit number), got '40000'"
    ]
    assert "Traceback" not in done.stderr


# ------------------------------------------------- issue 27 item 9: a refusal is one line, whatever the bad flag


def _one_line_refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        parse_config(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, f"not one line:\n{err}"
    assert err.startswith("openengine-sidecar: error: "), err
    return err


_MUTUAL_TLS = ["--grpc-tls-ca", "{ca}", "--grpc-tls-cert", "{cert}", "--grpc-tls-key", "{key}"]


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--grpc-tls-ca", "{garbage}"], "--grpc-tls-ca: no PEM certificate in"),
        (["--grpc-tls-ca", "{missing}"], "--grpc-tls-ca: no such file"),
        (["--grpc-tls-ca", "{ca}", "--grpc-tls-cert", "{garbage}", "--grpc-tls-key", "{key}"], "--grpc-tls-cert"),
        (["--grpc-tls-ca", "{ca}", "--grpc-tls-cert", "{cert}", "--grpc-tls-key", "{garbage}"], "--grpc-tls-key"),
        ([*_MUTUAL_TLS, "--grpc-tls-key-password-file", "{missing}"], "--grpc-tls-key-password-file: no such file"),
        (["--lora-root", "{garbage}"], "--lora-root: not a directory"),
        (["--model-path", "{garbage}"], "--model-path: not a directory"),
    ],
    ids=["ca-garbage", "ca-missing", "cert-garbage", "key-garbage", "password-file-missing", "lora-root", "model"],
)
def test_a_bad_file_flag_is_one_line_naming_the_flag_and_the_problem(
    flags: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A garbage CA file used to print argparse's whole usage (45 lines) above the one line that said what was wrong."""
    pki = Pki.create(tmp_path)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("this is not a certificate\n")
    paths = {
        "garbage": str(garbage),
        "missing": str(tmp_path / "missing.pem"),
        "ca": str(pki.ca_pem),
        "cert": str(pki.client_crt),
        "key": str(pki.client_key),
    }
    argv = base_argv(*(flag.format(**paths) for flag in flags))
    err = _one_line_refusal(argv, capsys)
    assert needle in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (base_argv("--bogus"), "unrecognized arguments: --bogus"),
        (base_argv("--log-format", "xml"), "--log-format: invalid choice: 'xml'"),
        (base_argv("--grpc-connections", "0"), "--grpc-connections"),
        (base_argv("--expected-schema-release", "main"), "--expected-schema-release: 'main' is not an immutable"),
    ],
    ids=["unknown-flag", "bad-choice", "bad-number", "moving-schema-release"],
)
def test_argparse_refusals_are_one_line_too(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert needle in _one_line_refusal(argv, capsys)


def test_help_still_prints_the_whole_usage() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sidecar", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0
    assert done.stdout.startswith("usage: openengine-sidecar")
    assert "--grpc-tls-ca" in done.stdout


# ------------------------------------------ issue 27 item 9: Dynamo's own system server gets a flag and a DYN_* twin


def test_dynamos_system_port_defaults_to_one_the_os_picks_and_has_an_environment_twin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DYN_SYSTEM_PORT", "9090")
    assert parse_config(base_argv()).dynamo_system_port == 0
    monkeypatch.setenv("DYN_SIDECAR_DYNAMO_SYSTEM_PORT", "9091")
    assert parse_config(base_argv()).dynamo_system_port == 9091
    assert parse_config(base_argv("--dynamo-system-port", "9092")).dynamo_system_port == 9092


@pytest.mark.parametrize(
    ("value", "system_port", "needle"),
    [
        ("40000", "9090", "--dynamo-system-port: must be a port in 0..32767"),
        ("-1", "9090", "--dynamo-system-port: must be a port in 0..32767"),
        ("ninety", "9090", "--dynamo-system-port: must be a port in 0..32767"),
        ("9091", "0", "--dynamo-system-port: needs a system port of the sidecar's own"),
        ("9091", "", "--dynamo-system-port: needs a system port of the sidecar's own"),
        ("9090", "9090", "--dynamo-system-port: 9090 is DYN_SYSTEM_PORT"),
    ],
)
def test_a_dynamo_system_port_that_cannot_work_is_refused_at_start(
    value: str, system_port: str, needle: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DYN_SYSTEM_PORT", system_port)
    assert needle in _one_line_refusal(base_argv("--dynamo-system-port", value), capsys)
