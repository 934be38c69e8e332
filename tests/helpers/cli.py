"""The worker's command line in tests: a minimal valid argv, the rule every bad flag must follow, and the flags of
Dynamo's own TensorRT-LLM sidecar as its ``--help`` states them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

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


@dataclass(frozen=True)
class TheirFlag:
    """One flag of Dynamo's own TensorRT-LLM sidecar, as its ``--help`` states it."""

    flag: str
    takes_value: bool
    env: str | None
    default: str | None
    choices: tuple[str, ...]


_QUIET = {"DYN_SKIP_SGLANG_LOG_FORMATTING": "1"}
_FLAG_LINE = re.compile(r"^\s+(?:-\w, )?(--[a-z][a-z-]*)(?: <[A-Z_]+>)?\s*$")


def dynamo_sidecar_flags() -> list[TheirFlag]:
    """Every flag of ``python -m dynamo.trtllm.sidecar --help`` (clap's long help) with its variable, default and
    values: read from the installed wheel, so a new Dynamo release that adds one makes the tests name it."""
    out = subprocess.run(
        [sys.executable, "-m", "dynamo.trtllm.sidecar", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        # Its launcher runs Dynamo's logging setup first, which would leave a $TMPDIR/tmp*.json (issue 36 §3).
        env={**{k: v for k, v in os.environ.items() if not k.startswith(("DYN_", "TRTLLM_"))}, **_QUIET},
    ).stdout
    blocks: list[tuple[str, bool, list[str]]] = []
    for line in out.splitlines():
        match = _FLAG_LINE.match(line)
        if match:
            blocks.append((match.group(1), "<" in line, []))
        elif blocks:
            blocks[-1][2].append(line)
    flags = []
    for flag, takes_value, lines in blocks:
        if flag == "--help":
            continue
        text = "\n".join(lines)
        env = re.search(r"\[env: ([A-Z0-9_]+)=", text)
        default = re.search(r"\[default: ([^\]]*)\]", text)
        values = re.search(r"\[possible values: ([^\]]*)\]", text)
        choices = tuple(v.strip() for v in values.group(1).split(",")) if values else ()
        if not choices and "Possible values:" in text:
            choices = tuple(re.findall(r"^\s+- ([a-z]+):", text, re.MULTILINE))
        flags.append(
            TheirFlag(flag, takes_value, env.group(1) if env else None, default.group(1) if default else None, choices)
        )
    return flags
