"""Measured recovery times, printed at the end of the run (see ``conftest.pytest_terminal_summary``)."""

from __future__ import annotations

RESULTS: list[str] = []


def record(what: str, seconds: float | None, note: str = "") -> None:
    """Keep one measurement (also printed, so ``-s`` shows it at once); ``seconds`` None for a note alone."""
    measured = "" if seconds is None else f"{seconds:.2f} s"
    line = f"{what}: " + (f"{measured} ({note})" if measured and note else measured or note)
    RESULTS.append(line)
    print(line)
