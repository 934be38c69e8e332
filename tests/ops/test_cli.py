"""Flags of the operator surface and the subcommand dispatch of ``openengine-sidecar``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
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


@asynccontextmanager
async def ops_feed(worker: WorkerLifecycle) -> AsyncIterator[str]:
    """The ops port serving ``worker``'s feed on loopback while the body runs; yields its websocket URL."""
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(serve_ops, StateFeed(worker=worker), "127.0.0.1", 0)
        yield f"ws://{host}:{port}/ws"
        nursery.cancel_scope.cancel()


def test_status_without_a_url_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_SIDECAR_OPS_PORT", raising=False)
    with pytest.raises(SystemExit) as exited:
        ops_cli.main(["status"])
    assert exited.value.code == 2


async def test_status_prints_the_snapshot(worker_model: WorkerLifecycle) -> None:
    console = Console(record=True, width=100, force_terminal=False)
    with trio.fail_after(10):
        async with ops_feed(worker_model) as url:
            assert await ops_cli._status(url, 5, False, console) == ops_cli.EXIT_NOT_SERVING  # starting
            text = console.export_text()
            assert await ops_cli._status(url, 5, True, console) == ops_cli.EXIT_NOT_SERVING
            raw = console.export_text()
    assert "worker starting" in text
    assert "request: now" in text
    assert json.loads(raw)["type"] == "snapshot"


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_status_of_a_closed_port_exits_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.helpers.processes import free_port

    url = f"ws://127.0.0.1:{free_port()}/ws"
    assert ops_cli.main(["status", "--ops-url", url, "--timeout-secs", "2"]) == ops_cli.EXIT_UNREACHABLE
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"openengine-sidecar status: {url}: ")
    assert "connect" in line.removeprefix(f"openengine-sidecar status: {url}: "), line  # the reason, not nothing


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://127.0.0.1:9345/ws", "not a websocket URL"),
        ("127.0.0.1:9345", "not a websocket URL"),
        ("ws://127.0.0.1:9345", "path /ws"),
        ("ws://127.0.0.1:9345/", "path /ws"),
    ],
)
def test_an_unusable_ops_url_is_one_line(url: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("status", "watch"):
        assert ops_cli.main([command, "--ops-url", url, "--timeout-secs", "2"]) == ops_cli.EXIT_UNREACHABLE
        assert says in _one_line(capsys.readouterr().err)


async def test_a_server_that_is_not_the_feed_is_one_line_without_its_page(capsys: pytest.CaptureFixture[str]) -> None:
    """Something else answers on that port (the system port, a web page): its status, never a 69 KB body dump."""
    page = b"<html>" + b"x" * 70_000 + b"</html>"

    async def http_page(stream: trio.SocketStream) -> None:
        with trio.move_on_after(5):
            await stream.receive_some(65536)
            head = b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: %d\r\n\r\n" % len(page)
            await stream.send_all(head + page)
            await stream.aclose()

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, http_page, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            url = f"ws://127.0.0.1:{port}/ws"
            status = await trio.to_thread.run_sync(ops_cli.main, ["status", "--ops-url", url, "--timeout-secs", "5"])
            nursery.cancel_scope.cancel()
    assert status == ops_cli.EXIT_UNREACHABLE
    line = _one_line(capsys.readouterr().err)
    assert "HTTP 200" in line
    assert len(line) < 300


async def test_status_exit_code_says_whether_the_worker_serves(
    worker_model: WorkerLifecycle, capsys: pytest.CaptureFixture[str]
) -> None:
    console = Console(record=True, width=100, force_terminal=False)
    with trio.fail_after(10):
        async with ops_feed(worker_model) as url:
            worker_model.fire("connect", reason="127.0.0.1:50051")
            assert await ops_cli._status(url, 5, False, console) == ops_cli.EXIT_NOT_SERVING
            assert "not serving (connecting: 127.0.0.1:50051)" in _one_line(capsys.readouterr().err)
            for event in ("connected", "discovered", "ready", "registered"):
                worker_model.fire(event)
            assert await ops_cli._status(url, 5, False, console) == ops_cli.EXIT_OK
            assert await ops_cli._status(url, 5, True, console) == ops_cli.EXIT_OK


def test_a_bad_probe_endpoint_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for endpoint in ("nonsense:::", "http://engine:1/path", "engine:99999"):
        assert ops_cli.main(["probe", "--grpc-endpoint", endpoint]) == ops_cli.EXIT_UNREACHABLE
        assert _one_line(capsys.readouterr().err).startswith("openengine-sidecar probe: --grpc-endpoint: ")


def _event(seq: int) -> dict[str, object]:
    reason = "drain deadline: retry on another worker " * 3
    return {"seq": seq, "machine": "request", "id": f"req-{seq:032x}", "event": "cancel", "from": "streaming",
            "to": "cancelled", "reason": reason}  # fmt: skip


def test_watch_fits_80_by_24() -> None:
    machines = [
        {"name": "worker", "states": ["starting", "serving"], "terminal": []},
        {"name": "request", "states": ["received", "submitted", "streaming", "finished", "failed"],
         "terminal": ["finished", "failed"]},
        {"name": "kv_subscription", "states": ["connecting", "streaming", "closed"], "terminal": ["closed"]},
        {"name": "lora", "states": ["loading", "loaded", "unloaded"], "terminal": ["unloaded"]},
    ]  # fmt: skip
    snapshot = {
        "machines": machines,
        "worker": {"state": "reconnecting", "reason": "engine lost: UNAVAILABLE " + "very long reason " * 10},
        "counts": {"request": {"submitted": 12, "streaming": 400, "finished": 123456, "failed": 7}},
        "seq": 10,
    }
    console = Console(record=True, width=80, height=24, force_terminal=True)
    view = ops_cli.FeedView(snapshot, events=ops_cli._fit(15, snapshot, console))
    view.apply(
        {
            "type": "events",
            "last_seq": 40,
            "worker": snapshot["worker"],
            "events": [_event(i) for i in range(11, 41)],
        }
    )
    console.print(view.render())
    lines = console.export_text().rstrip("\n").splitlines()
    assert len(lines) <= 24, len(lines)
    assert all(len(line) <= 80 for line in lines)
    assert "worker reconnecting" in lines[0]
    assert any("streaming 400" in line for line in lines)


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
