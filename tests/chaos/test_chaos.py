"""The chaos soak as a test: ``python -m bench.chaos`` seeded, with its own checker (``tests/chaos/test_checker.py``
shows that the checker catches every kind of wrong answer).

The file-discovery run is three minutes of load (about five in all on two cores); the etcd + NATS run is shorter and
skipped without etcd and nats-server (as ``tests/cluster``; under CI a missing install fails). Both assert zero
violations, every post-condition (engines idle with no KV session, every worker serving and listed by both
frontends, on etcd one set of discovery entries per live worker, the sidecars' counters reconciled with what the
clients saw), the witness sidecar's tasks back to their idle count, and that the run did what it claims: faults of
many kinds injected, answers completed exactly across migrations.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from bench._chaos_report import Report
from bench.chaos import Args, soak
from tests.cluster.topology import missing_binaries

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _show(report: Report) -> None:
    print(report.table())
    for transcript, verdict, answer in report.violations():
        print(report.transcript_text(transcript, verdict, answer))


def _assert_clean(report: Report, *, kinds: int, complete: int) -> None:
    _show(report)
    assert report.violation_kinds() == {}, "violations (transcripts above)"
    assert report.passed_post, [p for p in report.postconditions if not p[1]]
    executed = {r.kind for r in report.executed()}
    assert len(executed) >= kinds, f"only {sorted(executed)} injected"
    assert report.outcomes()["complete"] >= complete
    assert report.extra["complete_after_migration"] > 0, "no answer was completed across a migration"
    # Clock-independent: idle after the load, every sidecar that lived through it has its tasks back (too short a
    # run for slopes; the 10- and 60-minute forms judge those).
    assert report.resources is not None
    assert not [grown for grown in report.resources.grown() if " idle " in grown]
    witness = report.resources.idles["sidecar w3"]
    assert set(witness) == {"trio_tasks", "asyncio_tasks"}, "the witness sidecar lived through the run"


@pytest.mark.timeout(1020)  # the soak's bound plus two minutes
async def test_a_seeded_three_minute_soak_on_file_discovery_has_no_violation(tmp_path: Path) -> None:
    args = Args(3.0, 1, "file", "auto", tmp_path / "report.json", False, tmp_path / "logs")
    with trio.fail_after(900):
        report = await soak(args)
    _assert_clean(report, kinds=10, complete=500)


@pytest.mark.timeout(720)  # the soak's bound plus two minutes
async def test_a_seeded_soak_on_etcd_and_nats_has_no_violation(tmp_path: Path) -> None:
    missing = missing_binaries()
    if missing:
        message = f"{' and '.join(missing)} not installed (apt-get install -y etcd-server nats-server)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    args = Args(1.5, 7, "etcd", "auto", tmp_path / "report.json", False, tmp_path / "logs")
    with trio.fail_after(600):
        report = await soak(args)
    _assert_clean(report, kinds=6, complete=200)
