"""The log reader of ``bench.chaos``: every line of a process log is a record it knows (a timestamp and a level at
its start) or counted as unknown — never an exception.

The logs the report reads mix several writers in one file (stdout and stderr of a process, ``2>&1``):

* the sidecar's own lines, ``2026-01-01T10:00:00.123Z INFO sidecar.requests [worker=… req=…]: …`` (UTC);
* Dynamo's Rust lines in the same process, ``2026-01-01T10:00:00.123456Z  INFO dynamo_runtime::…: …`` (UTC);
* the mock's lines, ``2026-01-01 10:00:00,123 openengine-mock INFO …`` (Python logging's local ``asctime``);
* lines with no timestamp at all: Dynamo's exception lines (``dynamo._core.EngineShutdown: worker is not
  serving …``, one per request that reaches a withdrawn worker), Python tracebacks, a banner.

With ``PYTHONUNBUFFERED=1`` Python writes an exception line in pieces (type, ``": "``, message, newline), so a
whole line of another thread can land in the middle of one: ``dynamo._core.EngineShutdown: 2026-…Z INFO …``. The
reader therefore splits a line at every record start (a timestamp followed by a level), and what comes before the
first one is a fragment it does not know: counted, its first examples kept, and the reading goes on.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

_ANSI: Final = re.compile(r"\x1b\[[0-9;]*m")
#: A record start: an ISO-like time, optionally a logger name (the mock's), then a level. ``Z`` marks UTC; without it
#: the time is local (the mock's ``asctime``).
_RECORD: Final = re.compile(
    r"(?P<stamp>\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d{1,9})?(?P<utc>Z)?)\s+(?:\S+\s+)?"
    r"(?P<level>TRACE|DEBUG|INFO|WARN|WARNING|ERROR|CRITICAL)\b"
)
#: Examples of unknown lines kept per tally (the report shows them).
EXAMPLES: Final = 3


@dataclass(frozen=True, slots=True)
class Record:
    """One log record: its time (Unix) and its text from the timestamp on."""

    at: float
    text: str


@dataclass
class Tally:
    """Lines a reader did not know, by the kind of process that wrote them (``sidecar``, ``engine``)."""

    unknown: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    def count(self, kind: str, fragment: str) -> None:
        self.unknown[kind] = self.unknown.get(kind, 0) + 1
        if len(self.examples) < EXAMPLES and fragment not in self.examples:
            self.examples.append(fragment[:160])

    @property
    def total(self) -> int:
        return sum(self.unknown.values())


def stamp_unix(stamp: str, *, utc: bool) -> float | None:
    """A record's timestamp as a Unix time; None when it is not a valid time."""
    try:
        moment = datetime.fromisoformat(stamp.removesuffix("Z"))
    except ValueError:
        return None
    return (moment.replace(tzinfo=UTC) if utc else moment).timestamp()


def split_line(line: str) -> tuple[str, list[Record]]:
    """A line's records, and the fragment before the first one (empty when the line starts with a record).

    A record ends where the next one starts (two writers interleaved on one line)."""
    line = _ANSI.sub("", line.rstrip("\n"))
    starts = [m for m in _RECORD.finditer(line) if stamp_unix(m["stamp"], utc=bool(m["utc"])) is not None]
    if not starts:
        return line, []
    records = []
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(line)
        at = stamp_unix(match["stamp"], utc=bool(match["utc"]))
        assert at is not None
        records.append(Record(at, line[match.start() : end].rstrip()))
    return line[: starts[0].start()].strip(), records


def records(path: Path, tally: Tally, kind: str) -> Iterator[Record]:
    """Every record of the log at ``path`` (none when it does not exist), line by line (a log of an hour is never
    held whole); each line or fragment without a record start is counted in ``tally`` under ``kind``."""
    try:
        handle = path.open(errors="replace")
    except FileNotFoundError:
        return
    with handle:
        for line in handle:
            fragment, found = split_line(line)
            if fragment:
                tally.count(kind, fragment)
            yield from found


__all__ = ["EXAMPLES", "Record", "Tally", "records", "split_line", "stamp_unix"]
