"""Flags of the operator surface and the subcommand dispatch of ``openengine-sidecar``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest
import trio
from rich.console import Console

from sidecar.cli import main, parse_config
from sidecar.ops import cli as ops_cli
from sidecar.ops.feed import StateFeed
from sidecar.ops.server import serve_ops

if TYPE_CHECKING:
    from pathlib import Path

    from statemachines import WorkerLifecycle


def base(model_dir: Path) -> list[str]:
    return ["--grpc-endpoint", "127.0.0.1:1", "--model-path", str(model_dir)]


def test_ops_and_log_flags_default_to_off_loopback_and_text(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("DYN_SIDECAR_OPS_PORT", "DYN_SIDECAR_OPS_HOST", "DYN_SIDECAR_LOG_FORMAT"):
        monkeypatch.delenv(var, raising=False)
    config = parse_config(base(model_dir))
    assert (config.ops_host, config.ops_port, config.log_format) == ("127.0.0.1", None, "text")
    config = parse_config([*base(model_dir), "--ops-port", "0", "--log-format", "json"])
    assert (config.ops_port, config.log_format) == (0, "json")


def test_environment_twins_and_the_flag_wins(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_SIDECAR_OPS_PORT", "9345")
    monkeypatch.setenv("DYN_SIDECAR_OPS_HOST", "0.0.0.0")
    monkeypatch.setenv("DYN_SIDECAR_LOG_FORMAT", "json")
    config = parse_config(base(model_dir))
    assert (config.ops_host, config.ops_port, config.log_format) == ("0.0.0.0", 9345, "json")
    assert parse_config([*base(model_dir), "--ops-port", "1"]).ops_port == 1


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--ops-port", "70000"], {}, "--ops-port: must be in 0..65535"),
        ([], {"DYN_SIDECAR_OPS_PORT": "http"}, "--ops-port: not a number"),
        ([], {"DYN_SIDECAR_LOG_FORMAT": "xml"}, "--log-format: expected one of text, json"),
    ],
)
def test_bad_values_exit_2_naming_the_flag(
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    env: dict[str, str],
    message: str,
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exited:
        parse_config([*base(model_dir), *args])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["status", "watch", "probe"])
def test_subcommands_are_dispatched(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    assert f"openengine-sidecar {command}" in capsys.readouterr().out


def test_status_without_a_url_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_SIDECAR_OPS_PORT", raising=False)
    with pytest.raises(SystemExit) as exited:
        ops_cli.main(["status"])
    assert exited.value.code == 2


async def test_status_prints_the_snapshot(worker_model: WorkerLifecycle) -> None:
    feed = StateFeed(worker=worker_model)
    console = Console(record=True, width=100, force_terminal=False)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(serve_ops, feed, "127.0.0.1", 0)
            url = f"ws://{host}:{port}/ws"
            assert await ops_cli._status(url, 5, False, console) == 0
            text = console.export_text()
            assert await ops_cli._status(url, 5, True, console) == 0
            raw = console.export_text()
            nursery.cancel_scope.cancel()
    assert "worker starting" in text
    assert "request states" in text
    assert "received" in text
    assert json.loads(raw)["type"] == "snapshot"


def test_status_of_a_closed_port_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.helpers.processes import free_port

    assert ops_cli.main(["status", "--ops-url", f"ws://127.0.0.1:{free_port()}/ws", "--timeout-secs", "2"]) == 1
    assert "openengine-sidecar status" in capsys.readouterr().err


def test_the_view_applies_batches() -> None:
    view = ops_cli.FeedView(
        {"machines": [{"name": "request", "states": ["received", "finished"], "terminal": ["finished"]}], "seq": 3},
        events=2,
    )
    view.apply(
        {
            "type": "events",
            "last_seq": 5,
            "lost": 1,
            "worker": {"state": "serving", "reason": None},
            "counts": {"request": {"received": 0, "finished": 1}},
            "events": [
                {"seq": s, "machine": "request", "id": "r", "event": "e", "from": "a", "to": "b", "reason": None}
                for s in (4, 5, 6)
            ],
        }
    )
    assert view.seq == 5
    assert view.lost == 1
    assert [e["seq"] for e in view.recent] == [5, 6]
    console = Console(record=True, width=100)
    console.print(view.render())
    assert "worker serving" in console.export_text()
