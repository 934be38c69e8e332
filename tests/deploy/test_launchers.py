"""``launch/*.sh`` as a user meets them before anything starts: ``--help`` and bad flags.

* ``--help`` prints the script's header comment and nothing else (no shell line leaks into it), and names every flag
  the script parses (its own ``case`` and the shared parsers of ``launch/_local.sh`` it calls).
* A bad flag, a missing value or an impossible port is one line on stderr naming it, exit status 2, nothing started.
"""

from __future__ import annotations

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
    if not p.name.startswith("_") and p.name.startswith(("agg", "disagg", "cluster"))
)
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


def run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run a launcher that should stop before starting anything; if it does start something, all of it is killed."""
    with subprocess.Popen(
        ["bash", str(LAUNCH / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
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


def test_every_launcher_is_covered() -> None:
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
