"""The way back after a lost engine (issue 38 §1), in virtual time: probe the port often, back off the expensive part.

The end-to-end twin, through the real frontend against ``openengine-mock`` killed and restarted, is
``tests/faults/test_way_back.py``; ``python -m bench.way_back`` prints the figures beside Dynamo's own sidecar.
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from sidecar.dynamo import RequestContext
from sidecar.enginewatch import PROBE_INTERVAL_S, EngineWatch
from sidecar.kv import RoutingConfig
from sidecar.kv._load import poll_load
from sidecar.requests import RequestServer
from statemachines import WorkerLifecycle
from tests.helpers.scripted_engine import serve
from tests.helpers.waits import wait_until

from .fakes import FakeEngine, Host, Port, config, serving_watch

Clock = trio.testing.MockClock


def state(watch: Any) -> str:
    return str(watch.lifecycle.state)


async def serving(watch: Any, within: float = 120.0) -> float:
    await wait_until(lambda: state(watch) == "serving", timeout=within, interval=0.001)
    return trio.current_time()


async def test_after_a_40_s_outage_the_worker_serves_within_a_probe_of_the_port_accepting(
    autojump_clock: Clock,
) -> None:
    """No load poller (an engine without GetLoad): the backoff alone, 1 s doubling up to 30 s, would have the worker
    retry up to 30 s after the engine is back. The port is probed every 25 ms instead, and nothing expensive is asked
    of an engine that is not there. Failed before: 27.6 s after the engine was back (in this scenario, without the
    load poller's answers that cut the backoff short)."""
    engine = FakeEngine()
    watch, _, port = await serving_watch(engine, "--reconnect-backoff-max-secs", "30")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.watch_health)
        engine.kill()
        await wait_until(lambda: state(watch) == "reconnecting", timeout=10, interval=0.01)
        asked = engine.calls.get("GetServerInfo", 0)
        await trio.sleep(40.0)  # the outage
        assert engine.calls.get("GetServerInfo", 0) == asked, "nothing but the port asked while it refused"
        assert port.probes >= 40.0 / PROBE_INTERVAL_S * 0.9
        engine.start()
        back_at = trio.current_time()
        resumed = await serving(watch)
        nursery.cancel_scope.cancel()
    assert resumed - back_at <= PROBE_INTERVAL_S + 0.005


async def test_a_port_that_accepts_before_the_engine_answers_gets_backed_off_attempts(autojump_clock: Clock) -> None:
    """The port accepts at once but GetServerInfo fails for 20 s (a server still starting its gRPC service): the
    attempts come 1, 2, 4, 8 s apart (±20 %), the first at once. The mutant that jumps to the cap (``min`` -> ``max``)
    waits 30 s after the first failure; one without backoff asks every probe."""
    engine = FakeEngine()
    watch, _, _ = await serving_watch(engine, "--grpc-retry-interval-secs", "1", "--reconnect-backoff-max-secs", "30")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.watch_health)
        engine.kill()
        await wait_until(lambda: state(watch) == "reconnecting", timeout=10, interval=0.01)
        engine.call_times["GetServerInfo"] = []
        await trio.sleep(1.0)
        engine.start(answering=False)
        accepted_at = trio.current_time()
        await trio.sleep(20.0)
        engine.answering = True
        answering_at = trio.current_time()
        resumed = await serving(watch)
        nursery.cancel_scope.cancel()
    attempts = [t for t in engine.call_times["GetServerInfo"] if t <= answering_at]
    gaps = [later - earlier for earlier, later in itertools.pairwise(attempts)]
    print("attempts after the port accepted:", [round(t - accepted_at, 2) for t in attempts])
    assert attempts[0] - accepted_at <= PROBE_INTERVAL_S + 0.005, "the first attempt when the port accepts"
    assert all(0.8 * 2**i <= gap <= 1.2 * 2**i for i, gap in enumerate(gaps[:4])), gaps
    assert len(gaps) == 4, gaps  # 1 + 2 + 4 + 8 = 15 s of 20; the next one (16 s) comes after the engine answers
    assert resumed - answering_at <= 1.2 * 16 + PROBE_INTERVAL_S


@pytest.mark.parametrize("refused", [True, False], ids=["port refuses", "port accepts"])
async def test_health_unavailable_is_an_engine_lost_at_once_when_nothing_accepts_connections(
    autojump_clock: Clock, refused: bool
) -> None:
    """A failed Health poll with the port refusing is an engine that is gone: lost at once, not after the threshold
    (3 polls, 2 s apart: every request routed here meanwhile fails). A port that accepts while Health fails
    UNAVAILABLE (a connection reset, a server restarting its service) still gets the threshold. Failed before: lost
    after three polls either way."""
    engine = FakeEngine()
    watch, _, _ = await serving_watch(engine, "--health-poll-interval-secs", "2", "--health-failure-threshold", "3")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.watch_health)
        await trio.sleep(0.5)
        if refused:
            engine.kill()
        else:
            engine.answering = False
        gone_at = trio.current_time()
        await wait_until(lambda: state(watch) == "reconnecting", timeout=20, interval=0.01)
        lost_after = trio.current_time() - gone_at
        nursery.cancel_scope.cancel()
    if refused:
        assert lost_after <= 2.0, "the next poll"
    else:
        assert lost_after >= 4.0, "three polls, 2 s apart"


async def test_the_way_back_asks_a_ready_engine_three_questions(autojump_clock: Clock) -> None:
    """GetServerInfo (the attempt that found it), GetModelInfo, Health READY: the discovery is not read twice when
    the engine is ready at once. Failed before: six calls (GetServerInfo, then discovery, readiness, discovery)."""
    engine = FakeEngine()
    watch, _, _ = await serving_watch(engine)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.watch_health)
        engine.kill()
        await wait_until(lambda: state(watch) == "reconnecting", timeout=10, interval=0.01)
        engine.calls.clear()
        engine.start(instance="engine-2")
        await serving(watch)
        nursery.cancel_scope.cancel()
    assert engine.calls == {"GetServerInfo": 1, "GetModelInfo": 1, "Health": 1}


async def test_a_restart_noticed_by_its_new_instance_leaves_the_requests_on_the_new_engine_alone(
    autojump_clock: Clock,
) -> None:
    """The engine restarted between two health polls; a request already runs on the new one when the load poller
    sees the new instance id. The rediscovery re-registers the card and leaves that request to finish. Failed before:
    it was cancelled ("engine lost: 1 in-flight request(s) failed over") although its engine serves it."""
    engine = FakeEngine(tokens=30, token_s=0.1)
    watch, host, _ = await serving_watch(engine, "--health-poll-interval-secs", "10")
    out: list[dict[str, Any]] = []
    async with trio.open_nursery() as nursery:

        class Sink:
            async def publish(self, figures: Any) -> None:
                await trio.lowlevel.checkpoint()

        poller = partial(poll_load, identity=watch.identity)
        await nursery.start(poller, engine, Sink(), (0,), RoutingConfig(load_poll_interval_s=1.0))
        nursery.start_soon(watch.run)
        engine.kill()
        engine.start(instance="engine-2")  # back before anything noticed

        async def one() -> None:
            async for batch in serve(watch.requests, _body(30), RequestContext(request_id="on-the-new-engine")):
                out.extend(batch)

        nursery.start_soon(one)
        await wait_until(lambda: "register" in host.names(), timeout=5, interval=0.01)
        await wait_until(lambda: out and "finish_reason" in out[-1], timeout=10, interval=0.01)
        nursery.cancel_scope.cancel()
    assert sum(len(c.get("token_ids") or ()) for c in out) == 30
    assert out[-1]["finish_reason"] == "length"
    assert watch.discovery is not None
    assert watch.discovery.caps.instance_id == "engine-2"


def _body(tokens: int) -> dict[str, Any]:
    return {"token_ids": [5, 6, 7], "stop_conditions": {"max_tokens": tokens}, "sampling_options": {}}


async def test_at_start_up_the_first_question_follows_the_port_opening_within_a_probe(autojump_clock: Clock) -> None:
    """An engine whose port opens 10.3 s after the worker starts (its model loading): the worker probes the port
    every 25 ms and asks nothing until it accepts, so its first GetServerInfo goes out within a probe of the port
    opening -- not up to ``--grpc-retry-interval-secs`` (1 s) later, where Dynamo's sidecar's fixed retry stands.
    Failed before: start-up went straight to gRPC attempts once a second (the 0.94 s median of bench.compare)."""
    engine = FakeEngine()
    engine.kill()
    cfg = config()
    port = Port(engine)
    watch = EngineWatch(
        cfg,
        WorkerLifecycle(),
        RequestServer(),
        engine,  # type: ignore[arg-type]
        Host(cfg, engine),
        trio.Event(),
        probe=port,
    )
    async with trio.open_nursery() as nursery:

        async def open_port_later() -> None:
            await trio.sleep(10.3)
            engine.start()

        nursery.start_soon(open_port_later)
        await watch.wait_listening(trio.current_time() + 60)
        listened = trio.current_time()
    assert engine.calls.get("GetServerInfo", 0) == 0
    assert 10.3 <= listened <= 10.3 + PROBE_INTERVAL_S + 0.001
    assert port.probes >= 10.3 / PROBE_INTERVAL_S * 0.9


async def test_at_start_up_the_probe_gives_up_at_the_deadline(autojump_clock: Clock) -> None:
    engine = FakeEngine()
    engine.kill()
    cfg = config()
    watch = EngineWatch(
        cfg,
        WorkerLifecycle(),
        RequestServer(),
        engine,  # type: ignore[arg-type]
        Host(cfg, engine),
        trio.Event(),
        probe=Port(engine),
    )
    start = trio.current_time()
    await watch.wait_listening(start + 5)
    assert 5 <= trio.current_time() - start <= 5 + PROBE_INTERVAL_S
