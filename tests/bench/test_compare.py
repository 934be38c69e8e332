"""``python -m bench.compare``: ours beside Dynamo's own TensorRT-LLM sidecar.

* The quick run end to end (``--quick`` into a temporary document, never ``docs/``): every quick scenario produced
  its rows against both sidecars, nothing crashed, each row carries a verdict and the document its block. Skipped
  with one line when Dynamo's sidecar is not installed.
* The rules, without processes: each verdict turns on the figure it names, and the rule common to all rows (a
  sidecar that died or an engine left holding a request loses) comes first.
* The document: its generated block is exactly what its saved figures (``docs/comparison.json``) render, so the
  table was written by a run, not by hand.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import compare
from bench._compare_scenarios import SCENARIOS, judge_bad_request, judge_engine_sigkill, judge_sidecar_sigterm
from tests.helpers.stack import dynamo_sidecar_missing

ROOT = Path(__file__).resolve().parents[2]


def _back(*steady: float | None) -> list[dict[str, float | None]]:
    return [{"first": s, "steady": s} for s in steady]


def _sigkill(backs: list[dict[str, float | None]], **figures: Any) -> dict[str, Any]:
    return {"truncated": 0, "served": True, "kinds": {"SSE 503": 8}, "backs": backs, **figures}


def test_the_way_back_is_judged_on_its_slowest_outage_beyond_the_poll_interval() -> None:
    ours = _sigkill(_back(0.05, 0.2, 0.4))
    theirs = _sigkill(_back(0.1, 0.1, 0.11), kinds={"SSE 500": 8})
    assert judge_engine_sigkill(ours, theirs)[0] == "worse"
    # Within the 50 ms poll interval the way back is a tie, and the retryable 503 decides.
    assert judge_engine_sigkill(_sigkill(_back(0.1, 0.15)), theirs)[0] == "better"
    # Never serving steadily again is the slowest of all.
    assert judge_engine_sigkill(_sigkill(_back(0.1, None)), theirs)[0] == "worse"
    # A truncated 200 loses before anything else.
    assert judge_engine_sigkill(_sigkill(_back(0.01), truncated=1), theirs)[0] == "worse"


def test_a_drain_is_judged_on_streams_then_exit_status_then_time() -> None:
    def drain(complete: int, code: int | None, took: float) -> dict[str, Any]:
        return {"complete": complete, "code": code, "took": took}

    assert judge_sidecar_sigterm(drain(8, 0, 1.4), drain(8, 0, 5.1))[0] == "better"
    assert judge_sidecar_sigterm(drain(8, 0, 1.4), drain(8, 0, 1.6))[0] == "equal"  # within 0.5 s
    assert judge_sidecar_sigterm(drain(7, 0, 1.4), drain(8, 0, 5.1))[0] == "worse"
    assert judge_sidecar_sigterm(drain(8, 1, 1.4), drain(8, 0, 5.1))[0] == "worse"


def test_a_bad_request_that_takes_the_model_out_of_serving_loses_whatever_it_answered() -> None:
    named = {"outcome": "refused, naming it", "unserved": 0.0}
    assert judge_bad_request(named, {"outcome": "failed", "unserved": 4.8})[0] == "better"
    assert judge_bad_request({**named, "unserved": 0.5}, {"outcome": "refused", "unserved": 0.0})[0] == "worse"
    assert judge_bad_request(named, {"outcome": "refused", "unserved": 0.0})[0] == "better"
    assert judge_bad_request(named, named)[0] == "equal"


def test_a_sidecar_that_died_or_left_its_engine_busy_loses_the_row_before_its_rule() -> None:
    scenario = next(s for s in SCENARIOS if s.key == "sidecar_sigterm")
    figures = {"key": "sidecar_sigterm", "title": "", "complete": 8, "code": 0, "took": 1.0}
    slow = {**figures, "took": 5.0}
    fine = {"alive": True, "leak": False}

    def runs(ours_end: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {
            "ours": {"rows": [figures], "end": ours_end, "error": None},
            "dynamo": {"rows": [slow], "end": fine, "error": None},
        }

    assert compare.judge_rows(scenario, runs(fine))[0]["verdict"] == "better"
    assert compare.judge_rows(scenario, runs({"alive": True, "leak": True}))[0]["verdict"] == "worse"
    assert compare.judge_rows(scenario, runs({"alive": False, "leak": False}))[0]["verdict"] == "worse"
    crashed = runs(fine)
    crashed["dynamo"] = {"rows": [], "end": {}, "error": "TimeoutError: …"}
    assert compare.judge_rows(scenario, crashed)[0]["verdict"] == "crashed"


def test_a_quick_or_partial_run_never_writes_into_docs_by_default() -> None:
    for argv in (["--quick"], ["--only", "engine_sigkill"], ["--stall-secs", "5"]):
        with pytest.raises(SystemExit) as refused:
            compare.parse_args(argv)
        assert refused.value.code == 2
    with pytest.raises(SystemExit):
        compare.parse_args(["--only", "no_such_scenario", "--out", "/tmp/x.md"])


def test_the_documents_table_is_what_its_saved_figures_render() -> None:
    saved = ROOT / "docs" / "comparison.json"
    document = (ROOT / "docs" / "comparison.md").read_text()
    assert compare.block(json.loads(saved.read_text())) in document, (
        "docs/comparison.md's block was edited by hand or its figures changed: run `python -m bench.compare`, or "
        "`python -m bench.compare --render docs/comparison.json --out docs/comparison.md` after changing the text"
    )


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(480)  # the run's own bound plus two minutes
def test_the_quick_comparison_runs_every_quick_scenario_against_both_sidecars(tmp_path: Path) -> None:
    missing = dynamo_sidecar_missing()
    if missing is not None:
        pytest.skip(missing)
    out = tmp_path / "comparison.md"
    done = subprocess.run(
        [sys.executable, "-m", "bench.compare", "--quick", "--out", str(out), "--log-dir", str(tmp_path / "logs")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=360,
        check=False,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    data = json.loads(out.with_suffix(".json").read_text())
    quick = [s.key for s in SCENARIOS if s.quick]
    assert [entry["key"] for entry in data["scenarios"]] == quick
    for entry in data["scenarios"]:
        for side in ("ours", "dynamo"):
            assert entry["runs"][side]["error"] is None, (entry["key"], side, entry["runs"][side])
        assert entry["rows"], entry["key"]
        for row in entry["rows"]:
            assert row["verdict"] in ("equal", "better", "worse"), (entry["key"], row)
            assert row["ours"]["saw"], row
            assert row["dynamo"]["saw"], row
    text = out.read_text()
    assert compare.block(data) in text
    assert text.count("| **") == sum(len(entry["rows"]) for entry in data["scenarios"])
