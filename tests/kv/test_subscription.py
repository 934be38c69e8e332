"""One rank's subscription against a scripted engine: forwarding, every resync trigger, snapshots, failure, stop.

Virtual time (``autojump_clock``). The publisher is a :class:`~tests.kv.fakes.DynamoView`, which applies events the
way Dynamo's router index does; after every resync it must hold exactly the engine's blocks -- nothing stale.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import trio
import trio.testing

from openengine_bp.openengine.v1 import ErrorCode
from sidecar.errors import GrpcCode
from sidecar.kv import RankSubscription, RoutingConfig
from sidecar.kv._subscription import dynamo_events
from sidecar.ops import metrics
from statemachines import KV_SUBSCRIPTION
from tests.helpers.waits import wait_until

from .factories import BS, batch, error, removed_raw, stored
from .fakes import HANG, DynamoView, FakeClient, ModelEngine, Step, rpc_error

CONFIG = RoutingConfig(resync_backoff_s=0.1, resync_backoff_max_s=0.4, healthy_stream_s=30.0)


def subscription(client: FakeClient, config: RoutingConfig = CONFIG) -> tuple[RankSubscription, DynamoView]:
    view = DynamoView()
    return RankSubscription(client, view, 0, BS, config), view


def state_of(sub: RankSubscription) -> str:
    return sub.lifecycle.state


def resyncs(reason: str) -> float:
    value = metrics.REGISTRY.get_sample_value("openengine_sidecar_kv_event_resyncs_total", {"reason": reason})
    return value or 0.0


async def test_batches_in_sequence_are_forwarded(autojump_clock: trio.testing.MockClock) -> None:
    engine = ModelEngine()
    first = engine.snapshot()
    b1, b2 = engine.store([1, 2]), engine.store([3], parent=2)
    b3 = engine.remove([3])
    client = FakeClient([[first], [b1, b2], [b3], HANG])
    sub, view = subscription(client)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sub.run)
        await wait_until(lambda: len(view.calls) == 2)
        assert sub.lifecycle.state == "streaming"
        assert view.blocks == engine.blocks == {1: None, 2: 1}
        assert view.calls[0][0]["type"] == "stored"
        assert view.calls[0][0]["num_block_tokens"] == [BS, BS]
        assert client.requests[0].include_snapshot
        assert client.requests[0].data_parallel_ranks == [0]
        assert sub.resynced == 0
        nursery.cancel_scope.cancel()
    assert state_of(sub) == "stopped"


def _fault_scripts(kind: str) -> tuple[ModelEngine, list[Sequence[Step]]]:
    """The engine stores A=[1,2] and B=[3]; then removes B in a batch the fault corrupts; the resubscription's
    snapshot is the truth (A only). Without a resync B would stay attributed: stale."""
    engine = ModelEngine()
    start = engine.snapshot()
    stored_a = engine.store([1, 2])
    stored_b = engine.store([3], parent=2)
    lost = engine.remove([3])
    after = engine.store([4], parent=2)
    faults: dict[str, list[Step]] = {
        "gap": [[after]],
        "repeat": [[stored_b]],
        "engine_error": [[error(ErrorCode.INTERNAL)]],
        "dropped": [rpc_error(GrpcCode.UNAVAILABLE, "Connection lost")],
        "ended": [],
        "wrong_rank": [[batch(lost.batch.sequence_number, *lost.batch.events, rank=7)]],  # type: ignore[union-attr]
        "invalid_removal": [[batch(lost.batch.sequence_number, removed_raw([(b"3", "bytes")]))]],  # type: ignore[union-attr]
    }
    first: list[Step] = [[start], [stored_a, stored_b], *faults[kind]]
    if kind != "ended" and kind != "dropped":
        first.append(HANG)
    return engine, [first, [[engine.snapshot()], HANG]]


@pytest.mark.parametrize("kind", ["gap", "repeat", "engine_error", "dropped", "ended", "wrong_rank", "invalid_removal"])
async def test_every_fault_resyncs_and_leaves_nothing_stale(kind: str, autojump_clock: trio.testing.MockClock) -> None:
    engine, scripts = _fault_scripts(kind)
    client = FakeClient(*scripts)
    sub, view = subscription(client)
    before = resyncs(kind)
    states: list[str] = []

    def observe(model: object, event: str, source: str, dest: str) -> None:
        if model is sub.lifecycle:
            states.append(dest)

    KV_SUBSCRIPTION.observers.append(observe)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sub.run)
            await wait_until(lambda: sub.resynced == 1 and sub.lifecycle.state == "streaming")
            assert view.blocks == engine.blocks == {1: None, 2: 1, 4: 2}
            assert 3 not in view.blocks, "the removed block is not attributed after the resync"
            assert view.unknown_removed == 0
            assert view.unknown_parent == 0
            nursery.cancel_scope.cancel()
    finally:
        KV_SUBSCRIPTION.observers.remove(observe)
    assert states == ["subscribing", "streaming", "resyncing", "subscribing", "streaming", "stopped"]
    assert resyncs(kind) == before + 1
    assert len(client.requests) == 2
    assert all(r.include_snapshot for r in client.requests)
    # The resync published a clear-all of exactly what had been published.
    clear = [call for call in view.calls if call and call[0]["type"] == "removed" and len(call[0]["block_hashes"]) >= 2]
    assert clear, view.calls


async def test_a_refused_snapshot_is_not_asked_again(autojump_clock: trio.testing.MockClock) -> None:
    engine = ModelEngine()
    live = engine.store([1])
    client = FakeClient([rpc_error(GrpcCode.UNIMPLEMENTED, "no snapshots")], [[live], HANG])
    sub, view = subscription(client)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sub.run)
        await wait_until(lambda: sub.lifecycle.state == "streaming")
        assert [r.include_snapshot for r in client.requests] == [True, False]
        assert view.blocks == {1: None}
        nursery.cancel_scope.cancel()


async def test_an_in_band_snapshot_refusal_downgrades_too(autojump_clock: trio.testing.MockClock) -> None:
    client = FakeClient([[error(ErrorCode.UNSUPPORTED_FEATURE, retryable=False)]], [HANG])
    sub, _ = subscription(client)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sub.run)
        await wait_until(lambda: len(client.requests) == 2)
        assert [r.include_snapshot for r in client.requests] == [True, False]
        nursery.cancel_scope.cancel()


async def test_an_engine_without_subscribe_fails_the_rank(autojump_clock: trio.testing.MockClock) -> None:
    client = FakeClient([rpc_error(GrpcCode.UNIMPLEMENTED)], [rpc_error(GrpcCode.UNIMPLEMENTED)])
    sub, _ = subscription(client)
    with trio.fail_after(10):
        await sub.run()  # returns: a failed rank never raises into the worker
    assert sub.lifecycle.state == "failed"
    assert "does not implement" in (sub.lifecycle.reason or "")


async def test_backoff_doubles_up_to_the_cap(autojump_clock: trio.testing.MockClock) -> None:
    drops: list[Sequence[Step]] = [[rpc_error(GrpcCode.UNAVAILABLE)] for _ in range(6)]
    client = FakeClient(*drops)
    sub, _ = subscription(client, RoutingConfig(snapshot=False, resync_backoff_s=0.1, resync_backoff_max_s=0.4))
    stamps: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sub.run)
        for count in range(1, 7):
            await wait_until(lambda: len(client.requests) >= count)  # noqa: B023 (awaited within the iteration)
            stamps.append(trio.current_time())
        nursery.cancel_scope.cancel()
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    for gap, nominal in zip(gaps, [0.1, 0.2, 0.4, 0.4, 0.4], strict=True):
        assert nominal * 0.75 <= gap <= nominal * 1.25 + 0.05, (gaps, nominal)


async def test_a_long_healthy_stream_resets_the_backoff(autojump_clock: trio.testing.MockClock) -> None:
    engine = ModelEngine()
    snap = engine.snapshot()

    client = FakeClient(
        [rpc_error(GrpcCode.UNAVAILABLE)],
        [rpc_error(GrpcCode.UNAVAILABLE)],
        [[snap], rpc_error(GrpcCode.UNAVAILABLE)],
        [HANG],
    )
    config = RoutingConfig(resync_backoff_s=0.1, resync_backoff_max_s=10.0, healthy_stream_s=0.0)
    sub, _ = subscription(client, config)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sub.run)
        await wait_until(lambda: len(client.requests) == 3)
        third = trio.current_time()
        await wait_until(lambda: len(client.requests) == 4)
        assert trio.current_time() - third <= 0.1 * 1.25, "streamed: back to the first backoff"
        nursery.cancel_scope.cancel()


async def test_a_bug_fails_the_rank_and_clears_what_it_published(autojump_clock: trio.testing.MockClock) -> None:
    engine = ModelEngine()

    class Broken(DynamoView):
        async def publish(self, events: Sequence[dict[str, object]]) -> None:
            await super().publish(events)
            if len(self.calls) == 1:
                raise RuntimeError("bug in a publisher")

    client = FakeClient([[engine.snapshot(), engine.store([1])], HANG])
    view = Broken()
    sub = RankSubscription(client, view, 0, BS, CONFIG)
    with trio.fail_after(10):
        await sub.run()
    assert sub.lifecycle.state == "failed"
    assert view.blocks == {}, "the failed rank took back what it had published"


async def test_skipped_events_are_counted_not_forwarded(autojump_clock: trio.testing.MockClock) -> None:
    before = metrics.REGISTRY.get_sample_value("openengine_sidecar_kv_events_skipped_total", {"reason": "block_size"})
    client = FakeClient([[batch(0), batch(1, stored([1], block_size=8), stored([2]))], HANG])
    sub, view = subscription(client)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sub.run)
        await wait_until(lambda: bool(view.calls))
        nursery.cancel_scope.cancel()
    assert view.blocks == {2: None}
    after = metrics.REGISTRY.get_sample_value("openengine_sidecar_kv_events_skipped_total", {"reason": "block_size"})
    assert (after or 0) - (before or 0) == 1


def test_publish_ops_are_dynamo_publish_batch_dicts() -> None:
    from sidecar.kv._convert import RemovedBlocks, StoredBlocks

    events = dynamo_events(
        [
            StoredBlocks((1, 2), None, tuple(range(8)), 4, "lora-a"),
            StoredBlocks((3,), 2, (0, 1, 2, 3), 4, None),
            RemovedBlocks((1,)),
        ]
    )
    assert events == [
        {
            "type": "stored",
            "token_ids": list(range(8)),
            "num_block_tokens": [4, 4],
            "block_hashes": [1, 2],
            "parent_hash": None,
            "lora_name": "lora-a",
        },
        {"type": "stored", "token_ids": [0, 1, 2, 3], "num_block_tokens": [4], "block_hashes": [3], "parent_hash": 2},
        {"type": "removed", "block_hashes": [1]},
    ]
