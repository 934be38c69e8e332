"""Structured logs: one line per event, each carrying the request id (if any) and the worker's state.

    configure_logging(level="info", fmt="json", worker=lifecycle)

* The request id comes from a context variable (:data:`REQUEST_ID`), set by the request task: trio gives every task
  its own copy of the context, so a line logged anywhere below a request's task -- engine client, abort, the request
  code itself -- names that request, and lines of other tasks name none (``-`` in text, ``null`` in JSON).
* The worker state is read from the worker's lifecycle model when the line is formatted, so it is always current.
* One event is one line: in JSON the traceback is a field; in text its newlines are escaped (``\\n``).

Levels: ``--log-level`` (``DYN_LOG``) is ``LEVEL[,LOGGER=LEVEL...]`` -- the syntax of Dynamo's own ``DYN_LOG``,
which its Rust logging reads from the same variable. The wire-level loggers of the HTTP/2 stack (``hpack``, ``h2``,
``grpclib``) stay at WARNING unless a directive names them: at DEBUG they log every header frame (about 60 lines a
second on an idle worker), burying everything else.

Dynamo's own (Rust) log lines do not pass through Python logging; :func:`dynamo_logging_environment` sets what makes
them match ours before Dynamo is imported (JSON lines with ``--log-format json``, no colour codes off a terminal, no
ERROR line for every 503 a readiness probe gets while the worker is not serving).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final, Literal

if TYPE_CHECKING:
    from collections.abc import MutableMapping

    from statemachines import WorkerLifecycle

__all__ = [
    "LEVELS",
    "LOG_FORMATS",
    "QUIET_LOGGERS",
    "REQUEST_ID",
    "ContextFilter",
    "JsonFormatter",
    "LatestLine",
    "LogFormat",
    "TextFormatter",
    "configure_logging",
    "dynamo_logging_environment",
    "latest_line",
    "parse_levels",
]

LogFormat = Literal["text", "json"]
LOG_FORMATS: Final[tuple[LogFormat, ...]] = ("text", "json")

#: Level names ``--log-level`` accepts (Python's; ``warn`` too, as Dynamo spells it).
LEVELS: Final = ("debug", "info", "warning", "warn", "error")
#: Loggers held at WARNING unless a ``--log-level`` directive names them (or a logger below them).
QUIET_LOGGERS: Final = ("hpack", "h2", "grpclib")
#: Dynamo's tracing target that logs an ERROR for every non-2xx answer of its HTTP servers, i.e. for every readiness
#: probe while the worker is rightly not ready.
_PROBE_NOISE: Final = "tower_http::trace::on_failure"

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


class LatestLine(logging.Handler):
    """The last line a ``sidecar.*`` logger wrote (at the root's level or above), with the worker state it was
    written in: what the worker is doing *right now*, for the health answers (``sidecar.ops.health``) -- e.g. the
    last connection attempt's error while it retries a bad certificate, which the state's reason (the endpoint)
    does not say."""

    def __init__(self) -> None:
        super().__init__()
        self._latest: tuple[str | None, str] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("sidecar.") and record.name != "sidecar.ops":
            self._latest = (getattr(record, "worker_state", None), record.getMessage())

    def latest(self, state: str) -> str | None:
        """The last line, if it was written in ``state`` (an older one describes another phase)."""
        latest = self._latest
        return latest[1] if latest is not None and latest[0] == state else None


_LATEST: Final = LatestLine()
_LATEST.set_name("openengine-sidecar-latest")


def latest_line(state: str) -> str | None:
    """The last ``sidecar.*`` log line written while the worker was in ``state`` (see :class:`LatestLine`)."""
    return _LATEST.latest(state)


def parse_levels(text: str) -> tuple[str, dict[str, str]]:
    """``"debug,hpack=debug"`` → ``("debug", {"hpack": "debug"})``; ``ValueError`` (one line) when malformed."""
    default: str | None = None
    loggers: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, eq, level = part.rpartition("=")
        level = level.strip().lower()
        if level not in LEVELS:
            raise ValueError(f"unknown level {level!r} in {text!r} (one of {', '.join(LEVELS)})")
        if not eq:
            if default is not None:
                raise ValueError(f"two default levels in {text!r}: give one, then LOGGER=LEVEL overrides")
            default = level
        elif not name.strip():
            raise ValueError(f"a directive without a logger name in {text!r}")
        else:
            loggers[name.strip()] = level
    return default or "info", loggers


def _python_level(level: str) -> int:
    return logging.WARNING if level == "warn" else logging.getLevelNamesMapping()[level.upper()]


def configure_logging(level: str, fmt: LogFormat, worker: WorkerLifecycle | None = None) -> logging.Handler:
    """Route the root logger to stderr through one handler with :class:`ContextFilter` and the chosen format.

    ``level`` is ``--log-level``'s value (see :func:`parse_levels`). Replaces handlers installed by an earlier call
    (idempotent for tests); returns the handler.
    """
    default, overrides = parse_levels(level)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter(worker))
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.set_name("openengine-sidecar")
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "openengine-sidecar"]:
        root.removeHandler(old)
    root.addHandler(handler)
    _LATEST.filters[:] = [ContextFilter(worker)]
    if _LATEST not in root.handlers:
        root.addHandler(_LATEST)
    root.setLevel(_python_level(default))
    for quiet in QUIET_LOGGERS:
        named = any(name == quiet or name.startswith(quiet + ".") for name in overrides)
        logging.getLogger(quiet).setLevel(logging.NOTSET if named else logging.WARNING)
    for name, value in overrides.items():
        logging.getLogger(name).setLevel(_python_level(value))
    return handler


def dynamo_logging_environment(level: str, fmt: str, environ: MutableMapping[str, str], *, tty: bool) -> list[str]:
    """Make Dynamo's own log lines follow ours; returns the variables set. Call before ``dynamo`` is imported: its
    logging reads the environment once, at import.

    * ``DYN_LOG``: our directives, plus ``tower_http::trace::on_failure=off`` unless a directive names ``tower_http``
      (every 503 of a readiness probe would be an ERROR line). An operator's own ``DYN_LOG`` is ``--log-level``'s
      environment twin, so this is the same text with that one addition.
    * ``DYN_LOGGING_JSONL=1`` with ``--log-format json``; ``DYN_SDK_DISABLE_ANSI_LOGGING=1`` when stderr is not a
      terminal. Either is left alone when the operator set it.
    """
    applied: list[str] = []
    directives = ",".join(p.strip() for p in level.split(",") if p.strip())
    if not any(p.split("=")[0].strip().startswith("tower_http") for p in directives.split(",") if "=" in p):
        directives = f"{directives},{_PROBE_NOISE}=off"
    if environ.get("DYN_LOG") != directives:
        environ["DYN_LOG"] = directives
        applied.append("DYN_LOG")
    if fmt == "json" and not environ.get("DYN_LOGGING_JSONL"):
        environ["DYN_LOGGING_JSONL"] = "1"
        applied.append("DYN_LOGGING_JSONL")
    if not tty and not environ.get("DYN_SDK_DISABLE_ANSI_LOGGING"):
        environ["DYN_SDK_DISABLE_ANSI_LOGGING"] = "1"
        applied.append("DYN_SDK_DISABLE_ANSI_LOGGING")
    return applied
