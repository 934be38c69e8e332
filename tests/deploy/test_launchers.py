"""``launch/*.sh`` as a user meets them before anything starts: ``--help`` and bad flags.

* ``--help`` prints the script's header comment and nothing else (no shell line leaks into it), and names every flag
  the script parses (its own ``case`` and the shared parsers of ``launch/_local.sh`` it calls).
* A bad flag, a missing value or an impossible port is one line on stderr naming it, exit status 2, nothing started.
* Every script of ``launch/`` -- the installers too -- answers ``--help``/``-h`` with its usage and exit status 0,
  and refuses an unknown flag in one line, without running anything (``setup-system.sh --help`` used to run
  ``apt-get install`` as root); the sourced libraries (``_*.sh``) refuse to be run.
* The tiered stop judges each child by its exit status (``stop_verdict``): 0, or 128 + the stop signal for a program
  that stops by re-raising it (etcd); anything else is named in the summary and makes the launcher's status non-zero.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from .sessions import kill_session

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
LOCAL = (LAUNCH / "_local.sh").read_text()
LAUNCHERS = sorted(
    p.name
    for p in LAUNCH.glob("*.sh")
    if not p.name.startswith("_") and p.name.startswith(("agg", "disagg", "cluster", "demo"))
)
#: Every script of launch/ a user runs, and the libraries the launchers source.
SCRIPTS = sorted(p.name for p in LAUNCH.glob("*.sh") if not p.name.startswith("_"))
LIBRARIES = sorted(p.name for p in LAUNCH.glob("_*.sh"))
_FLAG = re.compile(r"^\s+(--[a-z][a-z-]*)(?:\|[^)]*)?\)", re.MULTILINE)


def _function(name: str) -> str:
    """The body of a shell function of ``_local.sh``."""
    match = re.search(rf"^{name}\(\) \{{\n(.*?)^\}}", LOCAL, re.MULTILINE | re.DOTALL)
    assert match is not None, name
    return match.group(1)


def parsed_flags(script: str) -> set[str]:
    """Every flag the launcher accepts: its own case labels plus those of the shared parsers it calls."""
    text = (LAUNCH / script).read_text()
    flags = set(_FLAG.findall(text))
    calls = {parser for parser in ("agg_flag", "disagg_flag", "lora_flag") if re.search(rf"\b{parser}\b", text)}
    for parser in calls:
        flags |= set(_FLAG.findall(_function(parser)))
    if calls & {"agg_flag", "disagg_flag"}:
        flags |= set(_FLAG.findall(_function("common_flag")))
    return flags - {"--help"}


def run(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a launcher that should stop before starting anything; if it does start something, all of it is killed."""
    with subprocess.Popen(
        ["bash", str(LAUNCH / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = "", "timed out: it started something"
        finally:
            kill_session(proc.pid)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_sourcing(script: str, tmp_path: Path, *, check: bool) -> subprocess.CompletedProcess[str]:
    """``script`` (it sources ``_common.sh``) run as a file, as the launchers are: when SIGINT arrives blocked --
    after an in-process Dynamo runtime in the same pytest process, which blocks it -- ``_common.sh`` starts its
    script once more with SIGINT unblocked, which ``bash -c`` (``$0`` is ``bash``) cannot be (status 126)."""
    path = tmp_path / "sourcing.sh"
    path.write_text(script + "\n")
    return subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=30, check=check)


def test_every_launcher_is_covered() -> None:
    assert set(SCRIPTS) >= {"setup.sh", "setup-system.sh", "demo.sh", *LAUNCHERS}
    assert set(LAUNCHERS) >= {
        "agg.sh",
        "disagg.sh",
        "agg_multimodal.sh",
        "disagg_multimodal.sh",
        "agg_audio.sh",
        "agg_lora.sh",
        "disagg_lora.sh",
        "cluster.sh",
    }


@pytest.mark.parametrize("script", LAUNCHERS)
def test_help_is_the_header_and_names_every_flag(script: str) -> None:
    done = run(script, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    header = [
        line.removeprefix("#").removeprefix(" ")
        for line in (LAUNCH / script).read_text().splitlines()[1:]
        if line.startswith("#")
    ]
    lines = done.stdout.splitlines()
    assert lines, "empty --help"
    assert all(line in header for line in lines), [line for line in lines if line not in header]
    assert not any(line.startswith(("set ", ". ", "root=")) for line in lines), "a shell line in --help"
    missing = sorted(f for f in parsed_flags(script) if f not in done.stdout)
    assert not missing, f"{script} --help does not mention {missing}"
    assert "usage: launch/" + script in done.stdout


@pytest.mark.parametrize("script", LAUNCHERS)
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--bogus",), "unknown argument: --bogus"),
        (("--http-port", "80x"), "--http-port: expected a port number"),
        (("--http-port",), "--http-port needs a value"),
        (("--log-dir", "--once"), "--log-dir needs a value"),
    ],
    ids=["unknown", "bad-port", "no-value", "flag-as-value"],
)
def test_a_bad_flag_is_one_line_and_status_2(script: str, args: tuple[str, ...], needle: str) -> None:
    done = run(script, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert needle in done.stderr
    assert done.stderr.startswith(f"{script}: ")


@pytest.mark.parametrize(
    ("script", "args", "needle"),
    [
        ("agg.sh", ("--system-port", "40000"), "signed 16-bit"),
        ("agg.sh", ("--engine", "127.0.0.1:1"), "needs --model-path"),
        ("agg.sh", ("--demo", "--engine", "127.0.0.1:1", "--model-path", "."), "--demo starts openengine-mock"),
        ("disagg.sh", ("--system-ports", "8081"), "PREFILL,DECODE"),
        ("disagg.sh", ("--system-ports", "8081,8081"), "must differ"),
        ("disagg.sh", ("--prefill-engine", "127.0.0.1:1"), "both --prefill-engine and --decode-engine"),
        ("agg_lora.sh", ("--engine", "127.0.0.1:1", "--model-path", "."), "needs --lora-root"),
        ("agg_lora.sh", ("--lora-root", "/nonexistent-lora-root"), "--lora-root: not a directory"),
        ("disagg_lora.sh", ("--adapter", "."), "no adapter_config.json"),
        ("cluster.sh", ("--workers", "12"), "--frontends/--workers take 1-9"),
        ("cluster.sh", ("--etcd-port", "2379x"), "--etcd-port: expected a port number"),
        ("cluster.sh", ("--system-port", "32767", "--workers", "3"), "at most 32767"),
    ],
)
def test_launcher_specific_refusals(script: str, args: tuple[str, ...], needle: str) -> None:
    done = run(script, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert needle in done.stderr


def test_cluster_ports_are_flags() -> None:
    """Every port cluster.sh listens on can be moved (the tests and a second cluster need other ports)."""
    flags = parsed_flags("cluster.sh")
    assert {"--etcd-port", "--nats-port", "--http-port", "--system-port", "--engine-port", "--log-dir"} <= flags
    text = (LAUNCH / "cluster.sh").read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    for port in ("2379", "2380", "4222", "8000", "8081", "50051"):
        # Only as the defaults of the flags.
        assert len(re.findall(rf"\b{port}\b", code)) <= 1, port


# ------------------------------------------- issue 27 item 9: --help and bad flags never run anything, in every script

#: What a script of launch/ may run once it is past its flags: installers, interpreters, the processes it starts.
#: In the tests below each is a stub that records its call and fails.
_SIDE_EFFECTS = (
    "apt-get",
    "dpkg-query",
    "systemctl",
    "python",
    "python3",
    "python3.11",
    "pip",
    "curl",
    "openengine-mock",
    "openengine-sidecar",
    "etcd",
    "nats-server",
    "ip",
    "mktemp",
)


@pytest.fixture
def stubbed(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose PATH finds a recording stub first for every command in :data:`_SIDE_EFFECTS` (and no
    project virtual environment to activate: ``OPENENGINE_VENV`` points at a scratch path that must stay absent)."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    calls = tmp_path / "calls"
    for name in _SIDE_EFFECTS:
        stub = stubs / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >>"{calls}"\nexit 1\n')
        stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{stubs}:{env['PATH']}"
    env["OPENENGINE_VENV"] = str(tmp_path / "venv")
    return env, calls


def _ran(calls: Path, tmp_path: Path) -> str:
    return (calls.read_text() if calls.exists() else "") + ("venv created" if (tmp_path / "venv").exists() else "")


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help_with_its_usage_and_runs_nothing(
    script: str, flag: str, stubbed: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    env, calls = stubbed
    done = run(script, flag, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert f"usage: launch/{script}" in done.stdout
    header = [line.removeprefix("#").removeprefix(" ") for line in (LAUNCH / script).read_text().splitlines()[1:]]
    assert all(line in header for line in done.stdout.splitlines()), done.stdout
    assert _ran(calls, tmp_path) == "", f"{script} {flag} ran something"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_refuses_an_unknown_flag_in_one_line_and_runs_nothing(
    script: str, stubbed: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    env, calls = stubbed
    done = run(script, "--no-such-flag", env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    assert done.stderr == f"{script}: unknown argument: --no-such-flag (see --help)\n"
    assert _ran(calls, tmp_path) == "", f"{script} --no-such-flag ran something"


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_sourced_libraries_refuse_to_be_run(library: str, stubbed: tuple[dict[str, str], Path]) -> None:
    env, _ = stubbed
    done = run(library, "--help", env=env)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"{library}: sourced by the")


@pytest.mark.parametrize(
    ("status", "signal", "killed", "dies", "clean", "says"),
    [
        (0, "TERM", 0, 0, True, "sidecar 0"),
        (0, "INT", 0, 0, True, "sidecar 0"),  # NATS on SIGINT
        (143, "TERM", 0, 1, True, "sidecar 143 (ended by the SIGTERM that stopped it, as sidecar does)"),  # etcd
        (143, "TERM", 0, 0, False, "sidecar 143 (killed by SIGTERM, not a clean stop)"),
        (130, "TERM", 0, 1, False, "sidecar 130 (killed by SIGINT, not a clean stop)"),
        (1, "TERM", 0, 0, False, "sidecar 1 (exited with an error on SIGTERM, not a clean stop)"),  # NATS on SIGTERM
        (1, "TERM", 0, 1, False, "sidecar 1 (exited with an error on SIGTERM, not a clean stop)"),
        (137, "TERM", 1, 0, False, "sidecar 137 (did not stop on SIGTERM within its grace period: killed)"),
    ],
)
def test_a_stopped_child_is_clean_only_by_its_own_clean_stop(
    status: int, signal: str, killed: int, dies: int, clean: bool, says: str, tmp_path: Path
) -> None:
    """``cluster.sh --loopback`` printed "nats 1, etcd 143" and exited 0: tier 3 was clean whatever its status."""
    script = f'. "{LAUNCH}/_common.sh"; stop_verdict sidecar {status} {signal} {killed} {dies}; echo "$clean|$verdict"'
    done = run_sourcing(script, tmp_path, check=True)
    assert done.stdout == f"{int(clean)}|{says}\n"


@pytest.mark.parametrize(("unclean", "status", "expected"), [("", 0, 0), ("nats 1 (...)", 0, 1), ("x", 130, 130)])
def test_an_unclean_child_decides_the_launchers_status(
    unclean: str, status: int, expected: int, tmp_path: Path
) -> None:
    script = f'. "{LAUNCH}/_common.sh"; logs={tmp_path}; end_stop {status} "nats 0" "{unclean}"'
    done = run_sourcing(script, tmp_path, check=False)
    assert done.returncode == expected
    assert ("not a clean stop: " + unclean in done.stderr) == bool(unclean)
