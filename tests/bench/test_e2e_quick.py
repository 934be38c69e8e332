"""``python -m bench.e2e --quick`` end to end: every path runs, every response checks out, the report is written.

The benchmark itself never runs in the test suite; this bounded smoke run (a few hundred short requests, < 60 s on
two cores) only proves that the command works and finds no lost or mis-ordered request.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_measures_every_path_and_checks_every_response(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.e2e", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    data = json.loads((tmp_path / "e2e.json").read_text())
    points = data["points"]
    assert {(p["path"], p["interval"]) for p in points} >= {(path, i) for path in "ABC" for i in (1, 5)}
    for point in points:
        assert point["completed"] == point["requests"], point
        assert point["failed"] == point["lost"] == 0, point
        assert point["tokens_per_s"] > 0, point
    assert data["summary"]["bad_requests"] == 0
    memory = data["memory"]
    assert memory["failed"] == 0
    assert memory["peak_in_flight_seen_by_client"] == memory["requests"]
    assert memory["idle_rss_mib"] > 0
    for name in ("throughput", "itl", "ttft", "cpu"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "B/A" in done.stdout
