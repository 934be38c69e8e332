"""The engine-transport flags of the worker and of ``probe``: TLS files and Unix socket paths refused in one line
(exit 2) naming the flag, never a traceback or a passphrase prompt; ``probe`` speaks TLS with the worker's flags."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from sidecar.cli import parse_config
from tests.engine.conftest import start_mock
from tests.helpers.cli import assert_refused, base_argv
from tests.helpers.pki import Pki


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki.create(tmp_path)


def tls_argv(pki: Pki, *extra: str) -> list[str]:
    return [
        "--grpc-endpoint",
        "https://127.0.0.1:50051",
        "--model-path",
        base_argv()[3],
        "--grpc-tls-ca",
        str(pki.ca_pem),
        *extra,
    ]


def test_tls_flags_parse_to_absolute_unresolved_paths(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pki.write_client(passphrase=b"pw")
    (tmp_path / "pass").write_text("pw\n")
    monkeypatch.chdir(tmp_path)
    config = parse_config(
        tls_argv(
            pki,
            "--grpc-tls-cert",
            "client.crt",
            "--grpc-tls-key",
            "client.key",
            "--grpc-tls-key-password-file",
            "pass",
        )
    )
    assert config.grpc_tls_cert == tmp_path / "client.crt"
    assert config.grpc_tls_key_password_file == tmp_path / "pass"


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("ca-without-certificate", "--grpc-tls-ca: no PEM certificate in"),
        ("encrypted-key", "is encrypted; give its passphrase in a file with --grpc-tls-key-password-file"),
        ("wrong-passphrase", "--grpc-tls-key-password-file: the passphrase in"),
        ("password-file-alone", "--grpc-tls-key-password-file needs --grpc-tls-key"),
        ("key-of-another-certificate", "does not belong to the certificate"),
        ("unix-with-tls", "is a Unix socket, which is spoken in plaintext"),
    ],
)
def test_unusable_tls_files_are_refused_in_one_line(
    case: str,
    message: str,
    pki: Pki,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    client = ["--grpc-tls-cert", str(pki.client_crt), "--grpc-tls-key", str(pki.client_key)]
    if case == "ca-without-certificate":
        pki.ca_pem.write_text("# the CA bundle was never filled in\n")
        argv = tls_argv(pki)
    elif case in ("encrypted-key", "wrong-passphrase"):
        pki.write_client(passphrase=b"right")
        (tmp_path / "pass").write_text("wrong")
        argv = tls_argv(
            pki, *client, *(["--grpc-tls-key-password-file", str(tmp_path / "pass")] * (case != "encrypted-key"))
        )
    elif case == "password-file-alone":
        argv = tls_argv(pki, "--grpc-tls-key-password-file", str(pki.ca_pem))
    elif case == "key-of-another-certificate":
        (tmp_path / "other").mkdir()
        other = Pki.create(tmp_path / "other")
        argv = tls_argv(pki, "--grpc-tls-cert", str(pki.client_crt), "--grpc-tls-key", str(other.client_key))
    else:
        argv = tls_argv(pki)
        argv[1] = f"unix://{tmp_path / 'engine.sock'}"
    assert_refused(argv, {}, message, monkeypatch, capsys)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("regular-file", "is a regular file, not a Unix socket"),
        ("directory", "is a directory, not a Unix socket"),
        ("no-such-directory", "does not exist"),
    ],
)
def test_bad_unix_socket_paths_are_refused_in_one_line(
    case: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "engine.sock"
    if case == "regular-file":
        path.write_text("")
    elif case == "directory":
        path.mkdir()
    else:
        path = tmp_path / "missing" / "engine.sock"
    argv = base_argv()
    argv[1] = f"unix://{path}"
    assert_refused(argv, {}, f"--grpc-endpoint: {path}", monkeypatch, capsys)
    assert_refused(argv, {}, message, monkeypatch, capsys)


def test_a_socket_that_is_not_there_yet_is_waited_for(tmp_path: Path) -> None:
    # The engine may start after the worker: a missing socket in an existing directory is not a bad flag.
    argv = base_argv()
    argv[1] = f"unix:{tmp_path / 'engine.sock'}"
    assert parse_config(argv).grpc_endpoint == argv[1]
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "engine.sock"))
        assert parse_config(argv).grpc_endpoint == argv[1]


def test_an_encrypted_key_is_refused_at_once_never_prompted_for(pki: Pki) -> None:
    # Before: OpenSSL asked "Enter PEM pass phrase:" on the terminal and the worker hung past its deadline.
    pki.write_client(passphrase=b"secret")
    argv = tls_argv(pki, "--grpc-tls-cert", str(pki.client_crt), "--grpc-tls-key", str(pki.client_key))
    done = subprocess.run(
        [sys.executable, "-m", "sidecar", *argv],
        input="secret\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error:" in line]  # after argparse's usage lines
    assert len(errors) == 1, done.stderr
    assert "--grpc-tls-key-password-file" in errors[0]
    assert "Traceback" not in done.stderr
    assert "pass phrase" not in done.stdout + done.stderr


# ---------------------------------------------------------------------------------------------- probe


async def probe(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    with trio.fail_after(60):
        result = await trio.run_process(
            [sys.executable, "-m", "sidecar", "probe", "--timeout-secs", "10", *argv],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env={**os.environ, **(env or {})},
        )
    return result.returncode, (result.stdout + result.stderr).decode()


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
async def test_probe_speaks_tls_with_the_workers_flags(pki: Pki, mutual: bool) -> None:
    flags = ["--grpc-tls-ca", str(pki.ca_pem)]
    if mutual:
        flags += ["--grpc-tls-cert", str(pki.client_crt), "--grpc-tls-key", str(pki.client_key)]
    mock_tls = pki.mock_flags(client_ca=pki.ca_pem if mutual else None)
    async with start_mock(*mock_tls) as mock:
        endpoint = f"https://127.0.0.1:{mock.endpoint.port}"
        status, output = await probe("--grpc-endpoint", endpoint, *flags)
        assert (status, "READY" in output) == (0, True), output
        # ... and with the worker's environment variables instead of flags.
        env = {"DYN_SIDECAR_GRPC_ENDPOINT": endpoint, "DYN_SIDECAR_GRPC_TLS_CA": str(pki.ca_pem)}
        if mutual:
            env |= {"DYN_SIDECAR_GRPC_TLS_CERT": str(pki.client_crt), "DYN_SIDECAR_GRPC_TLS_KEY": str(pki.client_key)}
        status, output = await probe(env=env)
        assert (status, "READY" in output) == (0, True), output
        if mutual:
            status, output = await probe("--grpc-endpoint", endpoint, "--grpc-tls-ca", str(pki.ca_pem))
            assert status == 1
            assert "--grpc-tls-cert" in output, output


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--grpc-endpoint", "https://127.0.0.1:1"], "--grpc-tls-ca"),
        (["--grpc-endpoint", "https://127.0.0.1:1", "--grpc-tls-ca", "{empty}"], "--grpc-tls-ca: no PEM certificate"),
        (["--grpc-endpoint", "unix://{tmp}"], "is a directory, not a Unix socket"),
    ],
)
async def test_probe_refuses_bad_transport_flags_in_one_line(tmp_path: Path, argv: list[str], message: str) -> None:
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    status, output = await probe(*(arg.format(empty=empty, tmp=tmp_path) for arg in argv))
    assert status == 2
    assert message in output
    assert len(output.strip().splitlines()) == 1, output
    assert "Traceback" not in output
