"""The worker's command line in tests: a minimal valid argv, and the rule every bad flag must follow."""

from __future__ import annotations

import pytest

from sidecar.cli import parse_config

from .stack import MODEL_DIR


def base_argv(*extra: str) -> list[str]:
    """The smallest valid ``openengine-sidecar`` argv (the mock's committed model), plus ``extra``."""
    return ["--grpc-endpoint", "127.0.0.1:50051", "--model-path", str(MODEL_DIR), *extra]


def assert_refused(
    argv: list[str],
    env: dict[str, str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With ``env`` set, ``argv`` makes the worker exit 2 at once with an error that names ``message``."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exited:
        parse_config(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
