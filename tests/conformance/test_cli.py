"""``openengine-conformance`` flags: bad input is one line and exit 2; the console script is wired."""

from __future__ import annotations

import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sidecar.conformance import main, selected_checks

from .conftest import run_kit

ROOT = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((), "--engine is required"),
        (("--engine", "localhost"), "--engine: missing port"),
        (("--engine", "127.0.0.1:99999"), "--engine: port 99999 out of range"),
        (("--engine", "https://127.0.0.1:5"), "--engine: TLS is not enabled"),
        (("--engine", "unix://"), "--engine: 'unix://' names no socket path"),
        (("--engine", "127.0.0.1:5", "--decode-engine", "ftp://x:1"), "--decode-engine: unsupported scheme"),
        (("--engine", "127.0.0.1:5", "--grpc-tls-ca", "/nonexistent/ca.pem"), "--grpc-tls-ca: no such file"),
        (("--engine", "127.0.0.1:5", "--rpc-timeout", "0"), "--rpc-timeout: must be a positive number"),
        (("--engine", "127.0.0.1:5", "--rpc-timeout", "soon"), "argument --rpc-timeout: invalid float value"),
        (("--engine", "127.0.0.1:5", "--only", "nope.*"), "matches no check"),
        (("--engine", "127.0.0.1:5", "--stop-command", "true"), "--stop-command needs --include-stop"),
        (("--engine", "127.0.0.1:5", "--lora-dir", "adapters"), "--lora-dir: must be an absolute path"),
        (("--engine", "127.0.0.1:5", "--json", "--markdown"), "not allowed with argument --json"),
        (("--engine", "127.0.0.1:5", "--frobnicate"), "unrecognized arguments: --frobnicate"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("openengine-conformance: error: ")
    assert captured.err.count("\n") == 1, captured.err
    assert message in captured.err


def test_mutual_tls_flags_follow_the_sidecars_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("not a certificate\n")
    for argv, message in (
        (("--grpc-tls-cert", str(pem)), "--grpc-tls-cert and --grpc-tls-key go together"),
        (("--grpc-tls-cert", str(pem), "--grpc-tls-key", str(pem)), "--grpc-tls-cert needs --grpc-tls-ca"),
        (("--grpc-tls-ca", str(pem)), "TLS files unusable"),
    ):
        with pytest.raises(SystemExit) as exited:
            main(["--engine", "127.0.0.1:5", *argv])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert message in err


def test_an_unreachable_engine_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    address = f"127.0.0.1:{_closed_port()}"
    run = run_kit(capsys, "--engine", address, "--json")
    assert run.code == 2
    assert run.out == ""
    assert run.err.startswith(f"openengine-conformance: cannot reach an engine at {address}: ")
    assert "ConnectionRefusedError" in run.err
    assert run.err.count("\n") == 1


def test_a_missing_unix_socket_is_unreachable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = run_kit(capsys, "--engine", f"unix://{tmp_path / 'engine.sock'}")
    assert run.code == 2
    assert "cannot reach an engine at unix://" in run.err
    assert run.err.count("\n") == 1


def test_list_names_every_check_with_its_citation(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--list"])
    assert exited.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [c.id for c in selected_checks()]
    assert all("wire §" in line or "trtllm §" in line for line in lines)


def test_every_check_cites_the_references() -> None:
    checks = selected_checks()
    assert len({c.id for c in checks}) == len(checks)
    for check in checks:
        assert "wire §" in check.cites or "trtllm §" in check.cites, check.id
    groups = {c.group for c in checks}
    assert groups == {"discovery", "control", "validation", "stream", "abort", "kv", "lora", "disagg", "stop"}


def test_the_console_script_is_declared_and_runs_as_a_process() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["openengine-conformance"] == "sidecar.conformance:main"
    address = f"127.0.0.1:{_closed_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "sidecar.conformance", "--engine", address, "--rpc-timeout", "5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith(f"openengine-conformance: cannot reach an engine at {address}")
    assert done.stderr.count("\n") == 1, done.stderr
