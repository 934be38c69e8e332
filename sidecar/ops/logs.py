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

What is written to ``sys.stderr`` outside logging -- above all Dynamo's bindings printing each exception a request
handler raised (``PyErr_Display``: ``dynamo._core.EngineShutdown: worker is not serving …``, one per request reaching a
withdrawn worker), also Python's warnings -- becomes log lines too (:func:`capture_stray_output`): one record per line,
a traceback with its exception line as one record, the level by what it is.
"""

from __future__ import annotations

import io
import json
import logging
import re
import sys
import threading
import time
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final, Literal

if TYPE_CHECKING:
    from collections.abc import MutableMapping

    from statemachines import WorkerLifecycle

__all__ = [
    "DYNAMO_QUIET",
    "LEVELS",
    "LOG_FORMATS",
    "QUIET_LOGGERS",
    "REQUEST_ID",
    "STRAY_LOGGER",
    "ContextFilter",
    "JsonFormatter",
    "LatestLine",
    "LogFormat",
    "StrayLines",
    "TextFormatter",
    "capture_stray_output",
    "configure_logging",
    "dynamo_logging_environment",
    "latest_line",
    "parse_levels",
    "release_stray_output",
]

LogFormat = Literal["text", "json"]
LOG_FORMATS: Final[tuple[LogFormat, ...]] = ("text", "json")

#: Level names ``--log-level`` accepts (Python's; ``warn`` too, as Dynamo spells it).
LEVELS: Final = ("debug", "info", "warning", "warn", "error")
#: Loggers held at WARNING unless a ``--log-level`` directive names them (or a logger below them).
QUIET_LOGGERS: Final = ("hpack", "h2", "grpclib")
#: Dynamo's tracing targets held down unless a ``--log-level`` directive names them, a target within them or one
#: they are within (``tower_http``, ``dynamo_runtime``): (target, level, why).
DYNAMO_QUIET: Final = (
    # An ERROR for every non-2xx answer of its HTTP servers, i.e. for every readiness probe while the worker is
    # rightly not ready.
    ("tower_http::trace::on_failure", "off", "an ERROR per readiness probe answered 503"),
    # Its endpoint teardown deletes the instance the worker withdrew itself before (the drain withdraws first, and
    # reports its own failure), and with file discovery it races the store's own deletion of the same file at
    # shutdown (4 of 6 plain shutdowns): a WARN "Failed to unregister endpoint from discovery … Could not find key"
    # on every stop. Its ERRORs stay; its INFO lines (instance out of / back in discovery) the worker writes itself.
    ("dynamo_runtime::component::endpoint", "error", "a WARN on every stop for an instance already withdrawn"),
)

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
    stream = sys.stderr
    # Never into our own capture of stray output: every line would come back to this handler.
    handler = logging.StreamHandler(stream.original if isinstance(stream, StrayLines) else stream)
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

    * ``DYN_LOG``: our directives, plus one for each of :data:`DYNAMO_QUIET` that no directive names (nor a target
      within it or around it): ``tower_http::trace::on_failure=off`` (every 503 of a readiness probe would be an
      ERROR line), ``dynamo_runtime::component::endpoint=error`` (a WARN on every stop). An operator's own
      ``DYN_LOG`` is ``--log-level``'s environment twin, so this is the same text with those additions.
    * ``DYN_LOGGING_JSONL=1`` with ``--log-format json``; ``DYN_SDK_DISABLE_ANSI_LOGGING=1`` when stderr is not a
      terminal. Either is left alone when the operator set it.
    """
    applied: list[str] = []
    directives = ",".join(p.strip() for p in level.split(",") if p.strip())
    named = [p.split("=")[0].strip() for p in directives.split(",") if "=" in p]
    for target, quiet_level, _why in DYNAMO_QUIET:
        if not any(_related(target, name) for name in named):
            directives = f"{directives},{target}={quiet_level}"
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


def _related(target: str, name: str) -> bool:
    """Does a directive for ``name`` speak about ``target`` (the same target, one around it or one within it)?"""
    return name == target or target.startswith(name + "::") or name.startswith(target + "::")


#: The logger of what reached ``sys.stderr`` outside logging (not ``sidecar.*``: it never is the worker's latest line).
STRAY_LOGGER: Final = "stderr"
#: Exceptions of Dynamo's that the worker's request handler raises on purpose (``sidecar.errors`` kinds): Dynamo prints
#: each one, and the request's own log line has already said why at its level, so the print is INFO.
_EXPECTED_DYNAMO_ERRORS: Final = frozenset(
    {
        "EngineShutdown",
        "Disconnected",
        "CannotConnect",
        "ConnectionTimeout",
        "StreamIncomplete",
        "WorkerUnavailable",
        "Cancelled",
        "InvalidArgument",
    }
)
_EXCEPTION_LINE: Final = re.compile(r"^(?P<module>(?:[A-Za-z_]\w*\.)*)(?P<name>[A-Za-z_]\w*)(?::\s|$)")


def _stray_level(text: str, traceback: bool) -> int:
    """The level of one stray record: Dynamo's print of an error the worker raised on purpose is INFO; any other
    traceback is an ERROR; anything else (a Python warning, unknown text) a WARNING."""
    last = text.rsplit("\n", 1)[-1]
    match = _EXCEPTION_LINE.match(last)
    if match is not None and match.group("module").startswith("dynamo."):
        return logging.INFO if match.group("name") in _EXPECTED_DYNAMO_ERRORS else logging.WARNING
    return logging.ERROR if traceback else logging.WARNING


class StrayLines(io.TextIOBase):
    """``sys.stderr`` while the worker runs: whatever is written to it outside logging becomes log records.

    Lines are collected until their newline; a Python traceback (``Traceback (most recent call last):``, indented
    lines, then its unindented exception line) is one record. ``original`` is the stream replaced, where the log
    handler writes; ``fileno`` is its descriptor, so that C-level writers (faulthandler) bypass the capture.
    Thread-safe: Dynamo prints from its own threads.
    """

    def __init__(self, original: io.TextIOBase | Any, logger: logging.Logger | None = None) -> None:
        super().__init__()
        self.original = original
        self._logger = logger or logging.getLogger(STRAY_LOGGER)
        self._lock = threading.RLock()
        self._partial = ""
        self._traceback: list[str] = []
        self._inside = threading.local()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self.original, "encoding", "utf-8"))

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return bool(self.original.isatty())

    def fileno(self) -> int:
        return int(self.original.fileno())

    def write(self, text: str) -> int:
        if getattr(self._inside, "active", False):
            # Logging itself failed and reports it here: straight out, or it would come back forever.
            return int(self.original.write(text))
        with self._lock:
            self._partial += text
            while "\n" in self._partial:
                line, self._partial = self._partial.split("\n", 1)
                self._line(line)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            self.original.flush()

    def close_out(self) -> None:
        """Emit what is still held (a line without its newline, an unfinished traceback)."""
        with self._lock:
            if self._partial:
                self._line(self._partial)
                self._partial = ""
            if self._traceback:
                self._emit("\n".join(self._traceback), traceback=True)
                self._traceback = []

    def _line(self, line: str) -> None:
        if self._traceback:
            self._traceback.append(line)
            if line[:1] not in (" ", "\t") and line.strip():
                self._emit("\n".join(self._traceback), traceback=True)
                self._traceback = []
        elif line.startswith("Traceback (most recent call last):"):
            self._traceback = [line]
        elif line.strip():
            self._emit(line, traceback=False)

    def _emit(self, text: str, *, traceback: bool) -> None:
        self._inside.active = True
        try:
            self._logger.log(_stray_level(text, traceback), "%s", text)
        finally:
            self._inside.active = False


def capture_stray_output(logger: logging.Logger | None = None) -> StrayLines:
    """Replace ``sys.stderr`` with a :class:`StrayLines` (once: an installed one is returned as is). Undo with
    :func:`release_stray_output`."""
    current = sys.stderr
    if isinstance(current, StrayLines):
        return current
    stray = StrayLines(current, logger)
    sys.stderr = stray
    return stray


def release_stray_output() -> None:
    """Put the original ``sys.stderr`` back, after logging what the capture still held."""
    current = sys.stderr
    if isinstance(current, StrayLines):
        current.close_out()
        sys.stderr = current.original
