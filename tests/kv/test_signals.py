"""Load polling, source discovery and the signals task as a whole, against fakes, in virtual time.

Every sleep here is virtual (``autojump_clock``): it moves the clock past poll periods; none waits for another thread
or process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

import pytest
import trio
import trio.testing

from openengine_bp.openengine.v1 import LoadInfo
from sidecar.errors import EngineRpcError, GrpcCode
from sidecar.kv import GrpcSource, RoutingConfig, RoutingPlan, ZmqSource, discover_routing, run_routing_signals
from sidecar.kv._load import EngineIdentity, estimate_blocks, poll_load
from sidecar.ops import metrics
from tests.helpers.waits import wait_until

from .factories import grpc_source, load, zmq_source
from .fakes import FakeClient, ModelEngine, RecordingLoad, RecordingPublishers

CONFIG = RoutingConfig(load_poll_interval_s=1.0, load_max_age_s=5.0)


def sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def rejected(reason: str) -> float:
    return sample("openengine_sidecar_load_snapshots_rejected_total", reason=reason)


def fresh_load(used: int, total: int = 10) -> LoadInfo:
    return load(time.time_ns(), [(0, used, total)])


# -- load ---------------------------------------------------------------------------------------------------------


async def test_load_is_polled_at_the_interval_and_published(autojump_clock: trio.testing.MockClock) -> None:
    client = FakeClient()
    client.loads.extend([fresh_load(1), fresh_load(2), fresh_load(3)])
    sink = RecordingLoad()
    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        await nursery.start(poll_load, client, sink, (0,), CONFIG)
        assert sink.figures == [[(0, 1)]], "the first poll is published before started()"
        await trio.sleep(2.5)
        nursery.cancel_scope.cancel()
    assert sink.figures == [[(0, 1)], [(0, 2)], [(0, 3)]]
    assert client.load_calls == 3
    assert trio.current_time() - start == pytest.approx(2.5)
    assert sample("openengine_sidecar_load_fresh") == 1.0
    assert sample("openengine_sidecar_engine_kv_blocks", rank="0", kind="used") == 3.0


@pytest.mark.parametrize(
    ("make_bad", "reason"),
    [
        (lambda: load(time.time_ns(), [(0, 1, 10)], age_s=60.0), "too_old"),
        (lambda: load(time.time_ns(), [(0, 11, 10)]), "used_over_total"),
        (lambda: load(time.time_ns(), [(1, 1, 10)]), "missing_rank"),
        (lambda: EngineRpcError("GetLoad", GrpcCode.UNAVAILABLE, "down"), "rpc_failed"),
        (lambda: EngineRpcError("GetLoad", GrpcCode.DEADLINE_EXCEEDED, "slow"), "rpc_failed"),
    ],
    ids=["too_old", "used_over_total", "missing_rank", "unavailable", "deadline"],
)
async def test_a_bad_poll_publishes_nothing_and_is_counted(
    make_bad: Callable[[], LoadInfo | EngineRpcError],
    reason: str,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bad = make_bad()  # stamped now: a snapshot built at collection time would be stale by the time the test runs
    caplog.set_level(logging.INFO, logger="sidecar.kv")
    client = FakeClient()
    client.loads.extend([fresh_load(4), bad, bad, fresh_load(5)])
    sink = RecordingLoad()
    before = rejected(reason)
    async with trio.open_nursery() as nursery:
        await nursery.start(poll_load, client, sink, (0,), CONFIG)
        await trio.sleep(1.5)
        assert sample("openengine_sidecar_load_fresh") == 0.0, "load is unknown, not stale"
        await trio.sleep(2.0)
        nursery.cancel_scope.cancel()
    assert sink.figures == [[(0, 4)], [(0, 5)]], "nothing at all was published while load was unknown"
    assert rejected(reason) == before + 2
    # An unreachable engine is the engine watch's to report (the worker leaves serving): INFO here, once.
    level = "INFO" if isinstance(bad, EngineRpcError) and bad.code is GrpcCode.UNAVAILABLE else "WARNING"
    lines = [r for r in caplog.records if reason in r.getMessage()]
    assert [r.levelname for r in lines] == [level], "said once, at its level"
    assert sample("openengine_sidecar_load_fresh") == 1.0


async def test_an_engine_without_getload_stops_polling(autojump_clock: trio.testing.MockClock) -> None:
    client = FakeClient()
    client.loads.append(EngineRpcError("GetLoad", GrpcCode.UNIMPLEMENTED, ""))
    sink = RecordingLoad()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(poll_load, client, sink, (0,), CONFIG)
    assert client.load_calls == 1
    assert sink.figures == []


def baseline_load(running: int, instance_id: str = "engine") -> LoadInfo:
    """TensorRT-LLM's baseline GetLoad: ``running_requests`` only, no KV usage."""
    return LoadInfo(instance_id=instance_id, timestamp_unix_nanos=time.time_ns(), running_requests=running)


async def test_without_kv_usage_the_blocks_of_the_requests_in_flight_are_published(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 14 item 7: before, such an engine got nothing published (and a warning every minute)."""
    client = FakeClient()
    client.loads.extend([baseline_load(0), baseline_load(2), baseline_load(3)])
    sink = RecordingLoad()
    in_flight: list[list[int]] = [[], [17, 5], [17, 32, 40]]  # tokens (prompt + generated) of each request
    answers = iter(in_flight)
    poller = partial(poll_load, in_flight=lambda: next(answers), block_size=16)
    before = rejected("no_kv_usage")
    with caplog.at_level(logging.INFO, logger="sidecar.kv"):
        async with trio.open_nursery() as nursery:
            await nursery.start(poller, client, sink, (0,), CONFIG)
            await trio.sleep(2.5)
            nursery.cancel_scope.cancel()
    assert sink.figures == [[(0, 0)], [(0, 2 + 1)], [(0, 2 + 2 + 3)]]
    assert rejected("no_kv_usage") == before
    assert sample("openengine_sidecar_load_fresh") == 1.0
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert sum("publishing an estimate" in r.getMessage() for r in caplog.records) == 1


async def test_a_multi_rank_worker_without_kv_usage_publishes_nothing(autojump_clock: trio.testing.MockClock) -> None:
    client = FakeClient()
    client.loads.append(LoadInfo(instance_id="engine", timestamp_unix_nanos=time.time_ns(), ranks=[]))
    sink = RecordingLoad()
    poller = partial(poll_load, in_flight=lambda: [40], block_size=16)
    async with trio.open_nursery() as nursery:
        await nursery.start(poller, client, sink, (0, 1), CONFIG)
        nursery.cancel_scope.cancel()
    assert sink.figures == []


def test_estimated_blocks_count_one_partial_block_per_request() -> None:
    assert estimate_blocks([], 16) == 0
    assert estimate_blocks([1, 16, 17, 0], 16) == 1 + 1 + 2


async def test_the_poller_reports_a_new_engine_instance_and_every_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Issue 14 item 5: GetLoad's instance_id was polled every second and never compared."""
    client = FakeClient()
    client.loads.extend([fresh_load(1), fresh_load(1), baseline_load(0, instance_id="engine-2")])
    identity = EngineIdentity("engine")
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(poll_load, identity=identity), client, RecordingLoad(), (0,), CONFIG)
        assert identity.answered.is_set()
        assert not identity.changed.is_set()
        await trio.sleep(1.5)
        assert not identity.changed.is_set()
        with trio.fail_after(1.0):
            await identity.changed.wait()
        nursery.cancel_scope.cancel()
    assert identity.seen == "engine-2"
    identity.expect("engine-2")
    assert not identity.changed.is_set()


# -- discovery ----------------------------------------------------------------------------------------------------


class Caps:
    """The part of ``Capabilities`` discovery reads."""

    def __init__(self, block_size: int | None = 16, dp_size: int | None = 1, dp_start: int | None = None) -> None:
        self.kv_block_size = block_size
        self.total_kv_blocks = 1000
        self.data_parallel_size = dp_size
        self.data_parallel_start_rank = dp_start


async def discover(client: FakeClient, caps: Caps, config: RoutingConfig | None = None) -> RoutingPlan:
    return await discover_routing(client, caps, config)  # type: ignore[arg-type]


async def test_discovery_finds_grpc_and_zmq_sources() -> None:
    client = FakeClient()
    client.set_sources(grpc_source(2), zmq_source(3, topic="kv@3"))
    plan = await discover(client, Caps(dp_size=2, dp_start=2))
    assert plan.ranks == (2, 3)
    assert plan.sources == {2: GrpcSource(2), 3: ZmqSource(3, "tcp://127.0.0.1:5557", "kv@3")}
    assert plan.kv_events
    assert plan.total_kv_blocks == 1000


@pytest.mark.parametrize(
    ("setup", "caps", "config"),
    [
        ("none", Caps(), None),
        ("unimplemented", Caps(), None),
        ("unavailable", Caps(), None),
        ("unusable", Caps(), None),
        ("grpc", Caps(block_size=None), None),
        ("grpc", Caps(block_size=0), None),
        ("grpc", Caps(), RoutingConfig(kv_events="off")),
    ],
)
async def test_without_usable_events_the_worker_routes_by_load(
    setup: str, caps: Caps, config: RoutingConfig | None
) -> None:
    client = FakeClient()
    if setup == "grpc":
        client.set_sources(grpc_source(0))
    elif setup == "unimplemented":
        client.sources = EngineRpcError("GetKvEventSources", GrpcCode.UNIMPLEMENTED, "")
    elif setup == "unavailable":
        client.sources = EngineRpcError("GetKvEventSources", GrpcCode.UNAVAILABLE, "")
    elif setup == "unusable":
        client.set_sources(zmq_source(0, host="0.0.0.0"))
    plan = await discover(client, caps, config)
    assert not plan.kv_events
    assert plan.sources == {}


# -- the task -----------------------------------------------------------------------------------------------------


async def test_signals_start_every_part_and_close_publishers(autojump_clock: trio.testing.MockClock) -> None:
    engine = ModelEngine()
    client = FakeClient([[engine.snapshot(), engine.store([1, 2])], "hang"])
    client.loads.append(fresh_load(2))
    plan = RoutingPlan(
        ranks=(0, 1), block_size=4, sources={0: GrpcSource(0), 1: ZmqSource(1, "tcp://127.0.0.1:9", "t")}
    )
    publishers = RecordingPublishers()
    client.loads.clear()
    client.loads.append(load(time.time_ns(), [(0, 2, 10), (1, 0, 10)]))
    async with trio.open_nursery() as nursery:
        signals = await nursery.start(partial(run_routing_signals, publishers=publishers), client, None, plan, CONFIG)
        assert publishers.load_sink.figures == [[(0, 2), (1, 0)]]
        assert publishers.relays == {1: ZmqSource(1, "tcp://127.0.0.1:9", "t")}
        with trio.fail_after(5):
            await signals.subscriptions[0].synced.wait()
        await wait_until(lambda: publishers.views[0].blocks, timeout=5)
        assert list(signals.subscriptions) == [0], "only gRPC ranks are subscribed; ZMQ ranks are Dynamo's"
        assert publishers.views[0].blocks == {1: None, 2: 1}
        nursery.cancel_scope.cancel()
    assert publishers.views[0].closed
    assert publishers.views[1].closed
    assert signals.subscriptions[0].lifecycle.state == "stopped"


async def test_signals_without_events_publish_load_only(autojump_clock: trio.testing.MockClock) -> None:
    client = FakeClient()
    client.loads.append(fresh_load(1))
    publishers = RecordingPublishers()
    async with trio.open_nursery() as nursery:
        plan = RoutingPlan(ranks=(0,), block_size=16)
        signals = await nursery.start(partial(run_routing_signals, publishers=publishers), client, None, plan, CONFIG)
        nursery.cancel_scope.cancel()
    assert signals.subscriptions == {}
    assert publishers.views == {}
    assert publishers.load_sink.figures == [[(0, 1)]]
    assert client.requests == []


async def test_signals_need_a_dynamo_worker_or_publishers() -> None:
    with pytest.raises(ValueError, match="DynamoWorker or a publisher factory"):
        await run_routing_signals(FakeClient(), None, RoutingPlan(ranks=(0,), block_size=16))


def test_flags_and_environment_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.cli import parse_config
    from sidecar.kv import routing_config
    from tests.helpers.stack import MODEL_DIR

    base = ["--grpc-endpoint", "127.0.0.1:50051", "--model-path", str(MODEL_DIR)]
    default = routing_config(parse_config(base))
    assert (default.kv_events, default.load_poll_interval_s, default.load_max_age_s) == ("auto", 1.0, 5.0)
    monkeypatch.setenv("DYN_SIDECAR_KV_EVENTS", "off")
    monkeypatch.setenv("DYN_SIDECAR_LOAD_POLL_INTERVAL_SECS", "0.25")
    config = routing_config(parse_config([*base, "--load-max-age-secs", "2"]))
    assert (config.kv_events, config.load_poll_interval_s, config.load_max_age_s) == ("off", 0.25, 2.0)
    monkeypatch.setenv("DYN_SIDECAR_KV_EVENTS", "sometimes")
    with pytest.raises(SystemExit):
        parse_config(base)
