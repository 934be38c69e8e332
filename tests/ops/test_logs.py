"""Structured logs: one line per event, with the request id (per trio task) and the worker state on every line."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import trio

from sidecar.ops.logs import (
    REQUEST_ID,
    ContextFilter,
    JsonFormatter,
    TextFormatter,
    configure_logging,
    dynamo_logging_environment,
    parse_levels,
)
from statemachines import WorkerLifecycle


@pytest.fixture
def worker() -> Iterator[WorkerLifecycle]:
    life = WorkerLifecycle()
    yield life
    life.forget()


def capture(fmt: logging.Formatter, worker: WorkerLifecycle) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(ContextFilter(worker))
    handler.setFormatter(fmt)
    logger = logging.getLogger(f"test.ops.logs.{id(out)}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger, out


def test_json_lines_carry_request_id_worker_state_extras_and_the_traceback(worker: WorkerLifecycle) -> None:
    logger, out = capture(JsonFormatter(), worker)
    logger.info("plain %s", "line")
    worker.fire("connect")
    token = REQUEST_ID.set("req-7")
    try:
        try:
            raise ValueError("multi\nline")
        except ValueError:
            logger.exception("failed", extra={"engine": "127.0.0.1:1"})
    finally:
        REQUEST_ID.reset(token)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["msg"] == "plain line"
    assert first["request_id"] is None
    assert first["worker_state"] == "starting"
    assert first["level"] == "info"
    assert first["ts"].endswith("Z")
    assert second["request_id"] == "req-7"
    assert second["worker_state"] == "connecting"
    assert second["engine"] == "127.0.0.1:1"
    assert "ValueError: multi\nline" in second["exc"]


def test_text_lines_are_one_line_even_with_a_traceback(worker: WorkerLifecycle) -> None:
    logger, out = capture(TextFormatter(), worker)
    token = REQUEST_ID.set("req-8")
    try:
        try:
            raise RuntimeError("first\nsecond")
        except RuntimeError:
            logger.exception("oops")
    finally:
        REQUEST_ID.reset(token)
    logger.warning("after")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert "[worker=starting req=req-8]: oops\\nTraceback" in lines[0]
    assert "RuntimeError: first\\nsecond" in lines[0]
    assert lines[1].endswith("[worker=starting req=-]: after")


async def test_each_request_task_sees_only_its_own_id(worker: WorkerLifecycle) -> None:
    logger, out = capture(JsonFormatter(), worker)

    async def request_task(rid: str, delay: float) -> None:
        REQUEST_ID.set(rid)
        await trio.sleep(delay)  # not a synchronisation: interleaves the tasks (their order is not asserted on)
        logger.info("done")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request_task, "a", 0.02)
        nursery.start_soon(request_task, "b", 0.01)
    logger.info("outside")
    ids = [json.loads(line)["request_id"] for line in out.getvalue().splitlines()]
    assert ids == ["b", "a", None]


def test_configure_logging_replaces_its_own_handler(worker: WorkerLifecycle) -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        first = configure_logging("debug", "json", worker)
        second = configure_logging("warning", "text", worker)
        ours = [h for h in root.handlers if h.get_name() == "openengine-sidecar"]
        assert ours == [second]
        assert first not in root.handlers
        assert isinstance(second.formatter, TextFormatter)
        assert root.level == logging.WARNING
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


@pytest.fixture
def restore_levels() -> Iterator[None]:
    names = ("", "hpack", "hpack.hpack", "h2", "grpclib", "sidecar.kv")
    saved = {name: logging.getLogger(name).level for name in names}
    handlers = logging.getLogger().handlers[:]
    yield
    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)
    logging.getLogger().handlers[:] = handlers


def test_debug_keeps_the_http2_wire_loggers_at_warning(restore_levels: None) -> None:
    """--log-level debug: our loggers at DEBUG, hpack/h2/grpclib (a line per header frame) still at WARNING."""
    configure_logging("debug", "text")
    assert logging.getLogger("sidecar.requests").isEnabledFor(logging.DEBUG)
    for name in ("hpack.hpack", "hpack.table", "h2.connection", "grpclib.protocol"):
        assert not logging.getLogger(name).isEnabledFor(logging.INFO), name
        assert logging.getLogger(name).isEnabledFor(logging.WARNING), name


def test_the_wire_loggers_log_when_asked_for_by_name(restore_levels: None) -> None:
    configure_logging("info,hpack=debug,sidecar.kv=warning", "text")
    assert logging.getLogger("hpack.hpack").isEnabledFor(logging.DEBUG)
    assert not logging.getLogger("h2.connection").isEnabledFor(logging.INFO)
    assert not logging.getLogger("sidecar.kv").isEnabledFor(logging.INFO)
    assert logging.getLogger("sidecar.worker").isEnabledFor(logging.INFO)


@pytest.mark.parametrize(
    ("text", "says"),
    [("verbose", "unknown level 'verbose'"), ("info,debug", "two default levels"), ("info,=debug", "without a logger")],
)
def test_malformed_levels_are_refused_in_one_line(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_levels(text)


def test_dynamos_own_lines_follow_ours() -> None:
    env: dict[str, str] = {}
    applied = dynamo_logging_environment("debug,hpack=debug", "json", env, tty=False)
    assert set(applied) == {"DYN_LOG", "DYN_LOGGING_JSONL", "DYN_SDK_DISABLE_ANSI_LOGGING"}
    assert env["DYN_LOG"] == "debug,hpack=debug,tower_http::trace::on_failure=off"
    assert env["DYN_LOGGING_JSONL"] == "1"
    assert env["DYN_SDK_DISABLE_ANSI_LOGGING"] == "1"
    # On a terminal, in text, with the operator's own choices: only the probe noise is added.
    env = {"DYN_LOG": "info,tower_http=debug", "DYN_LOGGING_JSONL": "0"}
    assert dynamo_logging_environment("info,tower_http=debug", "json", env, tty=True) == []
    assert env == {"DYN_LOG": "info,tower_http=debug", "DYN_LOGGING_JSONL": "0"}


def test_the_worker_cli_sets_dynamos_logging_before_dynamo_is_imported(model_dir: object) -> None:
    """Dynamo reads its logging variables once, at import: parsing the flags must not import it."""
    import subprocess
    import sys

    code = (
        "import sys; from sidecar.cli import parse_config; "
        "parse_config(['--grpc-endpoint', '127.0.0.1:1', '--model-path', sys.argv[1]]); "
        "print('dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(model_dir)], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
