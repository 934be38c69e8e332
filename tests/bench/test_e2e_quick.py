"""``python -m bench.e2e --quick`` end to end: every path (Dynamo's own sidecar, D, included) and row kind (the
one-token row and the paced engine-clock row included) runs, every response checks out, the run ends with its goal
lines.

The benchmark itself never runs in the test suite; this bounded smoke run (a few hundred short requests, < 60 s on
two cores) only proves that the command works, finds no lost or mis-ordered request, and reports what the full run
reports.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.e2e import GOALS, dynamo_sidecar_missing, render

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
GOAL_LINE = re.compile(r"^goal ([a-z0-9_]+): (not measured|-?\d+\.\d+) \(target (≤|≥) (\d+\.\d+)\) (met|MISSED)$")


def test_quick_run_measures_every_path_and_ends_with_the_goal_lines(tmp_path: Path) -> None:
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
    # Path D runs wherever Dynamo's sidecar is installed (the project's environment); elsewhere the run says why.
    missing = dynamo_sidecar_missing()
    assert data["dynamo_missing"] == missing
    sidecars = "BD" if missing is None else "B"
    saturated = {(p["path"], p["interval"]) for p in points if p["pace_ms"] == 0 and not p["one_token"]}
    assert saturated == {(path, i) for path in "AC" + sidecars for i in (1, 5)}
    paced = {(p["path"], p["clock"]) for p in points if p["pace_ms"] > 0}
    assert paced == {(path, "engine") for path in "A" + sidecars}  # --quick: the engine-wide step clock's row
    one_token = [p for p in points if p["one_token"]]
    assert {p["path"] for p in one_token} == set("A" + sidecars)
    for point in one_token:  # one token per request: CPU per token is CPU per request
        assert point["tokens"] == point["requests"] > 0, point
        assert 0 < point["ttft_p50_ms"] <= point["ttft_p99_ms"], point
    for point in points:
        assert point["completed"] == point["requests"], point
        assert point["failed"] == point["lost"] == 0, point
        assert point["tokens_per_s"] > 0, point
        assert point["tokens_per_event"] >= 1, point
        if not point["one_token"]:  # every path reports what a user feels: the gaps between events
            assert 0 <= point["gap_p50_ms"] <= point["gap_p99_ms"], point
    for path in sidecars:  # each sidecar's own CPU was measured on its own runs
        own = {"B": "sidecar", "D": "sidecar_d"}[path]
        assert all(p["cpu_us_per_token"][own] > 0 for p in points if p["path"] == path and p["pace_ms"] > 0)
    # Path A follows the engine's tokens per message (A5: five-token chunks).
    a5 = next(p for p in points if (p["path"], p["interval"], p["pace_ms"]) == ("A", 5, 0))
    assert a5["tokens_per_event"] >= 4.5, a5
    paced_a = next(p for p in points if p["path"] == "A" and p["pace_ms"] > 0)
    assert paced_a["tokens_per_event"] < 1.2, paced_a
    assert paced_a["gap_p50_ms"] >= paced_a["pace_ms"] * 0.9, paced_a  # it sleeps the engine's steps
    assert data["summary"]["bad_requests"] == 0
    memory = data["memory"]
    assert memory["failed"] == 0
    assert memory["peak_in_flight_seen_by_client"] == memory["requests"]
    assert memory["baseline_cold"]["per_request_kib"] is not None
    if missing is None:
        assert memory["dynamo"]["failed"] == 0
        assert memory["dynamo"]["peak_in_flight_seen_by_client"] == memory["requests"]
    for name in ("throughput", "gaps", "cpu"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The run ends with one line per goal, in order, each parsing; nothing after them.
    tail = done.stdout.rstrip("\n").splitlines()[-len(GOALS) :]
    matches = [GOAL_LINE.match(line) for line in tail]
    assert all(matches), tail
    assert [m.group(1) for m in matches if m] == [goal.name for goal in GOALS]
    for match, goal in zip(matches, GOALS, strict=True):
        assert match is not None
        if missing is not None and goal.name.endswith("_vs_dynamo"):
            assert match.group(2) == "not measured", match.group(0)
            assert match.group(5) == "MISSED", match.group(0)
            continue
        value = float(match.group(2))
        assert math.isfinite(value), match.group(0)  # every goal's rows were measured
        assert (match.group(5) == "met") == goal.met(value)
    # The saved JSON renders to the same goal lines (how the baseline's block in docs/performance.md was made).
    rendered = render(tmp_path / "e2e.json").splitlines()
    assert [line for line in rendered if line.startswith("goal ")] == tail
