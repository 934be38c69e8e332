"""docs/state-machines.md is generated from the tables: drift fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

import statemachines

if TYPE_CHECKING:
    from types import ModuleType

    import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_state_docs.py"


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_state_docs", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_docs_match_the_tables(capsys: pytest.CaptureFixture[str]) -> None:
    script = _load_script()
    status = script.main(["--check"])
    out = capsys.readouterr().out
    assert status == 0, f"docs/state-machines.md is stale; run `python scripts/gen_state_docs.py`:\n{out}"


def test_check_reports_drift_with_a_diff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _load_script()
    stale = tmp_path / "docs" / "state-machines.md"
    stale.parent.mkdir()
    stale.write_text(script.render().replace("| `serving` |", "| `serving-old` |"), encoding="utf-8")
    monkeypatch.setattr(script, "ROOT", tmp_path)
    monkeypatch.setattr(script, "DOC", stale)
    assert script.main(["--check"]) == 1
    diff = capsys.readouterr().out
    assert "-| `serving-old` |" in diff
    assert "+| `serving` |" in diff


def test_output_is_deterministic_and_free_of_active_state_styling() -> None:
    script = _load_script()
    first = script.render()
    assert script.render() == first
    assert "Class " not in first
    assert "classDef" not in first
    assert "s_active" not in first
    assert first.count("```mermaid") == len(statemachines.KINDS)
    assert "  failed --> [*]" in first
    assert "  [*] --> starting" in first
    assert "  [*] --> received" in first
