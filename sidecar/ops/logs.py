"""Structured logs: one line per event, each carrying the request id (if any) and the worker's state.

    configure_logging(level="info", fmt="json", worker=lifecycle)

* The request id comes from a context variable (:data:`REQUEST_ID`), set by the request task: trio gives every task
  its own copy of the context, so a line logged anywhere below a request's task -- engine client, abort, the request
  code itself -- names that request, and lines of other tasks name none (``-`` in text, ``null`` in JSON).
* The worker state is read from the worker's lifecycle model when the line is formatted, so it is always current.
* One event is one line: in JSON the traceback is a field; in text its newlines are escaped (``\\n``).

Dynamo's own (Rust) log lines do not pass through Python logging; ``DYN_LOGGING_JSONL=1`` makes those JSON too.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final, Literal

if TYPE_CHECKING:
    from statemachines import WorkerLifecycle

__all__ = [
    "LOG_FORMATS",
    "REQUEST_ID",
    "ContextFilter",
    "JsonFormatter",
    "LogFormat",
    "TextFormatter",
    "configure_logging",
]

LogFormat = Literal["text", "json"]
LOG_FORMATS: Final[tuple[LogFormat, ...]] = ("text", "json")

REQUEST_ID: Final[ContextVar[str | None]] = ContextVar("openengine_sidecar_request_id", default=None)
"""The id of the request whose task is running (``None`` outside request tasks)."""

# Attributes every LogRecord has; anything else a caller passed through ``extra=`` goes into the JSON line.
_STANDARD_ATTRS: Final = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys() | {"message", "asctime", "request_id", "worker_state"}
)


class ContextFilter(logging.Filter):
    """Adds ``record.request_id`` and ``record.worker_state`` to every record (attached to the handler)."""

    def __init__(self, worker: WorkerLifecycle | None = None) -> None:
        super().__init__()
        self.worker = worker

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        record.worker_state = self.worker.state if self.worker is not None else None
        return True


def _timestamp(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``msg``, ``request_id``, ``worker_state``, extras."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
            "worker_state": getattr(record, "worker_state", None),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``<ts> <LEVEL> <logger> [worker=<state> req=<id>]: <message>`` on one line (newlines escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", None) or "-"
        state = getattr(record, "worker_state", None) or "-"
        text = record.getMessage()
        if record.exc_info:
            text = f"{text}\n{self.formatException(record.exc_info)}"
        if record.stack_info:
            text = f"{text}\n{self.formatStack(record.stack_info)}"
        text = text.replace("\\", "\\\\").replace("\n", "\\n")
        return f"{_timestamp(record)} {record.levelname} {record.name} [worker={state} req={request_id}]: {text}"


def configure_logging(level: str, fmt: LogFormat, worker: WorkerLifecycle | None = None) -> logging.Handler:
    """Route the root logger to stderr through one handler with :class:`ContextFilter` and the chosen format.

    Replaces handlers installed by an earlier call (idempotent for tests); returns the handler.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter(worker))
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.set_name("openengine-sidecar")
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "openengine-sidecar"]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
