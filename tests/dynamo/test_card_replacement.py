"""``DynamoWorker.register`` replacing a changed card over file discovery, without a runtime, in virtual time.

Dynamo's calls are played by :class:`FileDynamo` on the card's file as the 1.6.1 runtime does (``register_model``
writes it create-if-absent, ``unregister_model`` deletes it). The frontend's side of the race (its watcher dropping a
removal whose key exists again) is end to end in ``tests/faults/test_card_follows.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from sidecar.dynamo import DynamoSettings, DynamoWorker, Registration
from sidecar.dynamo import _bindings as b
from sidecar.dynamo._worker import CARD_ABSENCE_S, file_discovery_keys

IID = 0x1D8
SETTINGS = DynamoSettings(discovery_backend="file")


class FileDynamo:
    """The edge and the runtime in one: ``run(fn, *args)`` plays the Dynamo call ``fn`` on the card file. With
    ``keep_old`` set, that many publications find the old file still there (a create-if-absent write that reports
    success and changes nothing)."""

    def __init__(self, card: Path) -> None:
        self.card = card
        self.keep_old = 0
        self.log: list[tuple[float, str, int | None]] = []

    async def run(self, fn: Any, *args: Any) -> None:
        await trio.lowlevel.checkpoint()
        if fn is b.unregister:
            self.log.append((trio.current_time(), "unregister", None))
            if self.keep_old:
                self.keep_old -= 1  # the old file is still there when the new card is written
            else:
                self.card.unlink()
        elif fn is b.register:
            reg: Registration = args[1]
            self.log.append((trio.current_time(), "register", reg.context_length))
            if not self.card.exists():
                runtime = {"context_length": reg.context_length, "max_num_seqs": reg.max_num_seqs}
                self.card.write_text(json.dumps({"type": "Model", "card_json": {"runtime_config": runtime}}))
        else:
            raise AssertionError(f"unexpected Dynamo call {fn}")


def card(context: int) -> Registration:
    return Registration(model_path="/models/tiny", served_model_name="tiny", context_length=context, max_num_seqs=8)


@pytest.fixture
def dynamo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[DynamoWorker, FileDynamo]:
    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path))
    _, path = file_discovery_keys(SETTINGS, IID, tmp_path)
    path.parent.mkdir(parents=True)
    fake = FileDynamo(path)
    return DynamoWorker(fake, SETTINGS, None, None, IID), fake  # type: ignore[arg-type]


def stored_context(fake: FileDynamo) -> int:
    return int(json.loads(fake.card.read_text())["card_json"]["runtime_config"]["context_length"])


async def test_a_replaced_card_leaves_its_key_empty_long_enough_for_every_watcher(
    autojump_clock: trio.testing.MockClock, dynamo: tuple[DynamoWorker, FileDynamo]
) -> None:
    """Failed before: the new card was written a millisecond after the old one's removal (here: at once), and a
    frontend watcher that read the removal later dropped it and refused the new card as a mutation of the old."""
    worker, fake = dynamo
    await worker.register(card(2048))
    await worker.register(card(1024))
    assert stored_context(fake) == 1024
    (removed_at, _, _), (written_at, _, context) = fake.log[-2:]
    assert context == 1024
    assert written_at - removed_at >= CARD_ABSENCE_S


async def test_a_card_the_store_still_holds_in_its_old_form_is_published_again(
    autojump_clock: trio.testing.MockClock, dynamo: tuple[DynamoWorker, FileDynamo], caplog: pytest.LogCaptureFixture
) -> None:
    """The store kept the old card through a replacement: the worker reads it back, says so, and replaces it again.
    Failed before: it never looked, and served the new engine under the old card."""
    worker, fake = dynamo
    await worker.register(card(2048))
    fake.keep_old = 1
    await worker.register(card(1024))
    assert stored_context(fake) == 1024
    assert [name for _, name, _ in fake.log].count("unregister") == 2
    assert (
        "the store holds another model card than the one just published (context_length 2048, not 1024" in caplog.text
    )


async def test_a_card_that_never_comes_out_right_is_left_to_the_watchdog(
    autojump_clock: trio.testing.MockClock, dynamo: tuple[DynamoWorker, FileDynamo]
) -> None:
    """Bounded: after three publications the error goes to the caller (the worker's registration watchdog holds the
    worker out of routing and tries again), with what the store holds."""
    worker, fake = dynamo
    await worker.register(card(2048))
    fake.keep_old = 3
    with pytest.raises(RuntimeError, match="context_length 2048, not 1024"):
        await worker.register(card(1024))
    assert worker.registration == card(1024), "the new card is what the worker publishes from now on"
