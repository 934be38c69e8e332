"""The mock in each of its configurations passes the whole kit, and the docs' result table says so; a mock that
breaks one stream rule on every Generate fails exactly the matching check."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.testing.mock.profiles import PROFILES

from .conftest import MOCK_SPEED, MockFactory, failed, run_kit
from .doc_table import DOC, Column, columns, read_table, run_column, verdicts


def _column_ids() -> list[str]:
    return [c.name for c in columns()]


def test_every_mock_profile_has_a_column() -> None:
    """A new engine record (``sidecar/testing/mock/profiles.py``) gets its own run of the kit and column."""
    assert set(PROFILES) <= set(_column_ids())
    table = read_table(DOC.read_text())
    assert set(PROFILES) <= set(table), (
        f"{DOC.name} lacks a profile's column: run python -m tests.conformance.doc_table"
    )


@pytest.mark.timeout(420)  # the kit's own bound (KIT_TIMEOUT_S) plus the engine around it
@pytest.mark.parametrize("column", columns(), ids=_column_ids())
def test_each_mock_configuration_passes_and_matches_the_docs_table(column: Column, tmp_path: Path) -> None:
    report = run_column(column, tmp_path)
    found = verdicts(report)
    assert "fail" not in found.values(), {k: v for k, v in found.items() if v == "fail"}
    if column.include_stop:
        assert found["stop.graceful"] == "pass"
    if column.lora:
        assert found["lora.lifecycle"] == "pass"
    if column.decode_mock is not None:
        assert found["disagg.prefill_ready"] == "pass"
        assert found["disagg.decode"] == "pass"
        evidence = {str(c["id"]): str(c["evidence"]) for c in report["checks"]}  # type: ignore[attr-defined]
        assert "first token replayed" in evidence["disagg.decode"]
        assert "prefill engine holds 0 KV sessions" in evidence["disagg.decode"]
        # A PREFILL engine still gets the validation rules (its requests are sent as context-only legs).
        assert found["validation.too_many_stops"] == "pass"
    table = read_table(DOC.read_text())
    assert column.name in table, f"{DOC.name} has no column {column.name!r}: run python -m tests.conformance.doc_table"
    assert table[column.name] == found, f"{DOC.name} is out of date: run python -m tests.conformance.doc_table"


#: ``--fault-violation KIND`` breaks one rule on every Generate; the kit must fail exactly that rule's check.
FAULTS = {
    "cumulative_deltas": "stream.non_cumulative",
    "usage_on_every_finish": "stream.usage_on_last",
    "missing_output_index": "stream.output_index_set",
    "event_after_terminal": "stream.nothing_after_terminal",
}


@pytest.mark.parametrize("profile", ["trtllm", "full"])
@pytest.mark.parametrize(("kind", "check_id"), FAULTS.items(), ids=list(FAULTS))
def test_a_fault_violation_fails_exactly_its_check(
    kind: str, check_id: str, profile: str, mock_factory: MockFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    mock = mock_factory(*MOCK_SPEED, "--profile", profile, "--fault-violation", kind)
    run = run_kit(capsys, "--engine", mock.address, "--json")
    assert run.code == 1
    assert list(failed(run)) == [check_id], failed(run)


def test_a_unix_socket_engine(mock_factory: MockFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "engine.sock"
    mock_factory(*MOCK_SPEED, "--uds", str(path))
    run = run_kit(capsys, "--engine", f"unix://{path}", "--json", "--only", "discovery", "--only", "stream")
    assert run.code == 0, failed(run)
    assert run.verdicts()["stream.plain_request"] == "pass"


def test_the_graceful_stop_sees_goaway_with_grace(
    mock_factory: MockFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    mock = mock_factory("--decode-ms-per-token", "5", "--stop-grace-secs", "5")
    stop = f"kill -TERM {mock.proc.pid}"
    run = run_kit(
        capsys, "--engine", mock.address, "--json", "--only", "stop", "--include-stop", "--stop-command", stop
    )
    assert run.code == 0, failed(run)
    assert "GOAWAY at +" in run.evidence("stop.graceful")
