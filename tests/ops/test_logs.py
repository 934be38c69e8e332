"""Structured logs: one line per event, with the request id (per trio task) and the worker state on every line."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import trio

from sidecar.ops.logs import REQUEST_ID, ContextFilter, JsonFormatter, TextFormatter, configure_logging
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
        await trio.sleep(delay)
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
