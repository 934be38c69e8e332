"""``DynamoWorker.republish`` over file discovery, without a runtime: each lost entry is restored on its own.

The entries here are the kind written back byte for byte (event channels), so no Dynamo call is involved; the other
kinds go through the same loop (``tests/e2e/test_registration.py`` covers them against a real runtime).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import trio

from sidecar.dynamo import DynamoSettings, DynamoWorker
from sidecar.dynamo._entries import Entry

if TYPE_CHECKING:
    from pathlib import Path


async def test_an_entry_that_cannot_be_written_does_not_stop_the_next_one_from_being_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29 item 4 (c): two entries lost, the first one unwritable (a directory took its path). Failed with the
    mutant that stops at the first failure (``continue`` -> ``break``): the second one stayed lost until the first
    could be written. One check must restore the second and report the first."""
    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path))
    worker = DynamoWorker(None, DynamoSettings(discovery_backend="file"), None, None, 0x1D8)  # type: ignore[arg-type]
    bucket = tmp_path / "v1" / "event_channels"
    bucket.mkdir(parents=True)
    first, second = bucket / "kv-events-a", bucket / "kv_metrics-b"
    entries = [
        Entry("event_channel", first, "KV event channel", "kv", data=b'{"topic": "kv-events"}'),
        Entry("event_channel", second, "load (kv_metrics) channel", "load", data=b'{"topic": "kv_metrics"}'),
    ]
    with trio.fail_after(10):
        await worker._track(entries)
        first.mkdir()  # the first one lost, and its path taken: it cannot be written back
        assert not second.exists()
        report = await worker.republish()
    assert [entry.path for entry in report.lost] == [first, second]
    assert [entry.path for entry, _ in report.failed] == [first]
    assert [entry.path for entry in report.restored] == [second]
    assert second.read_bytes() == b'{"topic": "kv_metrics"}'
