"""Structured logs: one line per event, with the request id (per trio task) and the worker state on every line."""

from __future__ import annotations

import ctypes
import io
import json
import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import dynamo.llm.exceptions
import pytest
import trio

from sidecar.ops.logs import (
    REQUEST_ID,
    ContextFilter,
    JsonFormatter,
    StrayLines,
    TextFormatter,
    capture_stray_output,
    configure_logging,
    dynamo_logging_environment,
    parse_levels,
    release_stray_output,
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
    quiet = "tower_http::trace::on_failure=off,dynamo_runtime::component::endpoint=error"
    assert env["DYN_LOG"] == f"debug,hpack=debug,{quiet}"
    assert env["DYN_LOGGING_JSONL"] == "1"
    assert env["DYN_SDK_DISABLE_ANSI_LOGGING"] == "1"
    # On a terminal, in text, with the operator's own choices: a target they name (or one around it) is theirs.
    own = "info,tower_http=debug,dynamo_runtime=debug"
    env = {"DYN_LOG": own, "DYN_LOGGING_JSONL": "0"}
    assert dynamo_logging_environment(own, "json", env, tty=True) == []
    assert env == {"DYN_LOG": own, "DYN_LOGGING_JSONL": "0"}
    env = {}
    dynamo_logging_environment("info,dynamo_runtime::component::endpoint::x=debug", "text", env, tty=True)
    assert env["DYN_LOG"] == "info,dynamo_runtime::component::endpoint::x=debug,tower_http::trace::on_failure=off"


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


def pyerr_display(error: BaseException) -> None:
    """What Dynamo's bindings do with an exception a request handler raised: ``PyErr_Display`` on sys.stderr."""
    ctypes.pythonapi.PyErr_Display(ctypes.py_object(type(error)), ctypes.py_object(error), ctypes.py_object(None))


@contextmanager
def stray_capture(worker: WorkerLifecycle) -> Iterator[tuple[StrayLines, io.StringIO]]:
    """Install the capture inside the test body: pytest puts its own sys.stderr back between setup and call."""
    logger, out = capture(TextFormatter(), worker)
    stray = capture_stray_output(logger)
    try:
        yield stray, out
    finally:
        release_stray_output()


_STAMPED = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z (INFO|WARNING|ERROR) \S+ \[worker=\S+ req=-\]: ")


def test_dynamos_bare_exception_line_becomes_a_log_line(worker: WorkerLifecycle) -> None:
    """Issue 31 item 4: Dynamo prints every exception a handler raised with PyErr_Display -- for a request reaching
    a withdrawn worker, ``dynamo._core.EngineShutdown: worker is not serving …``, bare, without time or level (the
    chaos report's log reader crashed on it). Now it is an INFO line: the request's own line already told why."""
    with stray_capture(worker) as (_, out):
        pyerr_display(dynamo.llm.exceptions.EngineShutdown("worker is not serving (starting, degraded or draining)"))
    (line,) = out.getvalue().splitlines()
    assert _STAMPED.match(line), line
    assert " INFO " in line
    assert line.endswith("dynamo._core.EngineShutdown: worker is not serving (starting, degraded or draining)")


def test_a_traceback_on_stderr_is_one_error_line_and_other_text_a_warning(worker: WorkerLifecycle) -> None:
    with stray_capture(worker) as (stream, out):
        try:
            raise ValueError("boom")
        except ValueError as exc:
            pyerr_display(exc)
        pyerr_display(dynamo.llm.exceptions.Unknown("ValueError: a bug"))
        print("an unexplained line", file=sys.stderr)
        print("half a li", end="", file=sys.stderr)
        print("ne", end="", file=sys.stderr)
        stream.close_out()
    lines = out.getvalue().splitlines()
    levels = [match.group(1) if (match := _STAMPED.match(line)) else line for line in lines]
    assert levels == ["ERROR", "WARNING", "WARNING", "WARNING"], lines
    assert "Traceback (most recent call last):\\n" in lines[0]
    assert lines[0].endswith("ValueError: boom")
    assert lines[1].endswith("dynamo._core.Unknown: ValueError: a bug")
    assert lines[2].endswith("an unexplained line")
    assert lines[3].endswith("half a line")


def test_configure_logging_never_writes_into_the_capture(worker: WorkerLifecycle) -> None:
    """The worker configures logging with the capture installed (tests do it repeatedly): its handler writes to the
    stream the capture replaced, never back into the capture."""
    original = sys.stderr
    stray = capture_stray_output()
    try:
        handler = configure_logging("info", "text", worker)
        assert isinstance(handler, logging.StreamHandler)
        assert handler.stream is original
    finally:
        release_stray_output()
        logging.getLogger().removeHandler(handler)
    assert sys.stderr is original
    assert stray.original is original
