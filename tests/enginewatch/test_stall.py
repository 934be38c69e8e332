"""A stalled engine that comes back (issue 38 §1), in virtual time: the worker withdraws and fails nothing.

Health polls every 0.5 s, each bounded by 0.5 s, two missed in a row stall the worker (~1 s into a stop); streams
time out after 5 s of silence. The end-to-end twins, against a SIGSTOPped ``openengine-mock`` through the real
frontend, are in ``tests/faults/test_engine_stall.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
import trio.testing

from sidecar.dynamo import RequestContext
from sidecar.errors import WorkerDraining
from sidecar.requests import HungEngine
from sidecar.worker import _client_config
from statemachines import WORKER, WorkerLifecycle
from tests.helpers.scripted_engine import serve
from tests.helpers.waits import wait_until

from .fakes import FakeEngine, config, serving_watch

Clock = trio.testing.MockClock
TIMEOUT = 5.0
ABORT = 1.0
FLAGS = (
    "--request-inactivity-timeout-secs", str(TIMEOUT), "--health-poll-interval-secs", "0.5",
    "--health-timeout-secs", "0.5", "--health-failure-threshold", "2", "--abort-timeout-secs", str(ABORT),
)  # fmt: skip
TOKENS = 20


@dataclass
class Result:
    tokens: int = 0
    error: BaseException | None = None
    ended: float | None = None
    finish: list[str] = field(default_factory=list)


def body() -> dict[str, Any]:
    return {"token_ids": [5, 6, 7], "stop_conditions": {"max_tokens": TOKENS}, "sampling_options": {}}


async def request(watch: Any, request_id: str, into: dict[str, Result]) -> None:
    result = into[request_id] = Result()
    try:
        async for batch in serve(watch.requests, body(), RequestContext(request_id=request_id)):
            for chunk in batch:
                result.tokens += len(chunk.get("token_ids") or ())
                if "finish_reason" in chunk:
                    result.finish.append(chunk["finish_reason"])
    except Exception as exc:
        result.error = exc
    result.ended = trio.current_time()


@pytest.fixture
def transitions() -> Iterator[list[tuple[float, str, str]]]:
    seen: list[tuple[float, str, str]] = []

    def observe(model: WorkerLifecycle, event: str, source: str, dest: str) -> None:
        seen.append((trio.current_time(), event, dest))

    WORKER.observers.append(observe)
    yield seen
    WORKER.observers.remove(observe)


def events(transitions: list[tuple[float, str, str]]) -> list[str]:
    return [event for _, event, _ in transitions]


async def test_a_stall_shorter_than_the_timeout_completes_every_stream_and_the_late_request(
    autojump_clock: Clock, transitions: list[tuple[float, str, str]]
) -> None:
    """Failed before: two timed-out polls counted as an engine lost (reconnecting), which failed both streams at once;
    a request that arrived while withdrawn was refused."""
    engine = FakeEngine(tokens=TOKENS, token_s=0.1)
    watch, host, _ = await serving_watch(engine, *FLAGS)
    transitions.clear()
    results: dict[str, Result] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        nursery.start_soon(request, watch, "a", results)
        nursery.start_soon(request, watch, "b", results)
        await trio.sleep(0.5)
        engine.stop()
        stopped_at = trio.current_time()
        await wait_until(lambda: watch.lifecycle.state == "stalled", timeout=5, interval=0.01)
        assert not host.routable, "withdrawn"
        # Routed here before the withdrawal landed: served as the streams in flight are, not refused.
        nursery.start_soon(request, watch, "late", results)
        await wait_until(lambda: "late" in engine.generates, timeout=1, interval=0.01)
        await trio.sleep_until(stopped_at + 4.0)  # stopped 4 s: inside every stream's 5 s
        engine.resume()
        await wait_until(lambda: len([r for r in results.values() if r.ended]) == 3, timeout=10, interval=0.01)
        await wait_until(lambda: watch.lifecycle.state == "serving", timeout=5, interval=0.01)
        nursery.cancel_scope.cancel()
    assert {rid: (r.tokens, r.error) for rid, r in results.items()} == {rid: (TOKENS, None) for rid in results}
    assert events(transitions) == ["stall", "recover", "registered"]
    assert host.names() == ["withdraw", "restore"]
    stalled_at = next(t for t, e, _ in transitions if e == "stall")
    # Two missed polls (0.5 s each, 0.5 s apart); a poll under way at the stop saw tokens meanwhile and counts as busy.
    assert stalled_at - stopped_at <= 3.0
    assert engine.open_streams == 0


async def test_a_stall_longer_than_the_timeout_fails_each_stream_at_its_own_timeout(
    autojump_clock: Clock, transitions: list[tuple[float, str, str]]
) -> None:
    """Each stream fails with HungEngine (migratable) 5 s after the last token it got -- the late request 5 s after
    it was sent -- never at the moment the stall is noticed; the worker is back once the engine answers again, and
    the engine holds no stream. Failed before: all failed at once, ~1 s into the stall."""
    engine = FakeEngine(tokens=TOKENS, token_s=0.1)
    watch, host, _ = await serving_watch(engine, *FLAGS)
    transitions.clear()
    results: dict[str, Result] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        nursery.start_soon(request, watch, "a", results)
        await trio.sleep(0.35)
        nursery.start_soon(request, watch, "b", results)
        await trio.sleep(0.3)
        engine.stop()
        stopped_at = trio.current_time()
        await wait_until(lambda: watch.lifecycle.state == "stalled", timeout=5, interval=0.01)
        late_at = trio.current_time()
        nursery.start_soon(request, watch, "late", results)
        await wait_until(lambda: len([r for r in results.values() if r.ended]) == 3, timeout=20, interval=0.01)
        assert str(watch.lifecycle.state) == "stalled", "still withdrawn, still watching"
        engine.resume()
        await wait_until(lambda: watch.lifecycle.state == "serving", timeout=5, interval=0.01)
        nursery.cancel_scope.cancel()
    for rid, result in results.items():
        assert isinstance(result.error, HungEngine), (rid, result)
    # The last token of a stream came at most one step (0.1 s) before the stop. ``serve`` returns once the request
    # task is over: its Abort too, which the stopped engine leaves unanswered for the 1 s it is given.
    for rid in ("a", "b"):
        ended = results[rid].ended
        assert ended is not None
        assert TIMEOUT - 0.1 <= ended - stopped_at <= TIMEOUT + ABORT + 0.01, (rid, ended - stopped_at)
    late = results["late"].ended
    assert late is not None
    assert late - late_at == pytest.approx(TIMEOUT + ABORT, abs=0.05)
    assert events(transitions) == ["stall", "recover", "registered"]
    assert host.names() == ["withdraw", "restore"]
    assert engine.open_streams == 0, "every stream left was reset"


async def test_an_engine_that_answers_not_ready_after_a_stall_degrades_the_worker(
    autojump_clock: Clock, transitions: list[tuple[float, str, str]]
) -> None:
    """Answering again but not READY: ``stalled -> degraded``, and a request that arrives now is sent elsewhere."""
    engine = FakeEngine()
    watch, host, _ = await serving_watch(engine, *FLAGS)
    transitions.clear()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        engine.stop()
        await wait_until(lambda: watch.lifecycle.state == "stalled", timeout=5, interval=0.01)
        engine.ready = False
        engine.resume()
        await wait_until(lambda: watch.lifecycle.state == "degraded", timeout=5, interval=0.01)
        with pytest.raises(WorkerDraining):
            async for _ in serve(watch.requests, body(), RequestContext(request_id="refused")):
                pass
        engine.ready = True
        await wait_until(lambda: watch.lifecycle.state == "serving", timeout=5, interval=0.01)
        nursery.cancel_scope.cancel()
    assert events(transitions) == ["stall", "degrade", "recover", "registered"]
    assert host.names() == ["withdraw", "restore"]


async def test_an_engine_killed_during_a_stall_is_lost_at_once_and_the_worker_comes_back(
    autojump_clock: Clock, transitions: list[tuple[float, str, str]]
) -> None:
    """Its port refuses: the engine is gone, not stalled; the way back rediscovers the restarted one."""
    engine = FakeEngine()
    watch, _, _ = await serving_watch(engine, *FLAGS)
    transitions.clear()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        engine.stop()
        await wait_until(lambda: watch.lifecycle.state == "stalled", timeout=5, interval=0.01)
        engine.kill()
        killed_at = trio.current_time()
        await wait_until(lambda: watch.lifecycle.state == "reconnecting", timeout=5, interval=0.01)
        lost_after = trio.current_time() - killed_at
        engine.start(instance="engine-2")
        await wait_until(lambda: watch.lifecycle.state == "serving", timeout=5, interval=0.01)
        nursery.cancel_scope.cancel()
    assert lost_after <= 1.0, "the next poll finds the port refusing"
    assert events(transitions) == ["stall", "engine_lost", "reconnected", "discovered", "ready", "registered"]
    assert watch.discovery is not None
    assert watch.discovery.caps.instance_id == "engine-2"


@pytest.mark.parametrize(("timeout", "keepalive"), [("60", 60.0), ("5", 20.0), ("90", 90.0)])
def test_the_keepalive_never_closes_a_stopped_engines_connections_before_the_inactivity_timeout(
    timeout: str, keepalive: float
) -> None:
    """A stopped engine answers no HTTP/2 PING: with the client's default 20 s the connections (and their streams)
    went 20-50 s into a stall, before the default 60 s inactivity timeout. Failed before: 20 s whatever the timeout."""
    client = _client_config(config("--request-inactivity-timeout-secs", timeout))
    assert client.keepalive_timeout_s == keepalive
