"""The worker's engine lifecycle in virtual time, against an in-memory engine and Dynamo (issue 14 items 4-6).

* a hung engine (Health READY, Generate silent) withdraws the worker at the first inactivity timeout, before the
  error reaches the frontend; a canary generation brings it back;
* a restarted engine is noticed even when the restart is quick (a new instance id from GetLoad, or a lost
  connection and an engine that answers as someone else): rediscovery, card registered again before routing resumes;
* after a long outage the worker serves within 2 s of the engine answering again.

Every sleep here runs in virtual time (``autojump_clock``): it moves the clock to where the test wants it (an outage
of 40 s, a few watchdog periods) or paces the in-memory engine, deterministically; none waits for another thread or
process. Conditions are awaited with :func:`tests.helpers.waits.wait_until` (virtual time too).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from openengine.v1 import generation_pb2 as pb
from openengine_bp.openengine.v1 import (
    AbortResponse,
    AbortStatus,
    DeploymentCapacity,
    EngineRole,
    GenerationCapabilities,
    GuidedDecodingCapabilities,
    GuidedDecodingMode,
    HealthResponse,
    HealthState,
    LoadInfo,
    ModelInfo,
    ServerInfo,
)
from sidecar.cli import parse_config
from sidecar.dynamo import RequestContext
from sidecar.dynamo._entries import Entry, RestoreReport
from sidecar.engine import PINNED_SCHEMA_RELEASE
from sidecar.enginewatch import EngineWatch
from sidecar.errors import EngineRpcError, GrpcCode, WorkerDraining
from sidecar.kv import RoutingConfig
from sidecar.kv._load import poll_load
from sidecar.requests import HungEngine
from sidecar.worker import Worker
from statemachines import WORKER, WorkerLifecycle
from tests.helpers.scripted_engine import LoopSideGenerate, serve
from tests.helpers.waits import wait_until

MODEL_DIR = Path(__file__).resolve().parents[2] / "sidecar" / "testing" / "mock" / "model"
Clock = trio.testing.MockClock


class Engine(LoopSideGenerate):
    """The engine behind the worker's client: it can go down, come back as a new instance with other capabilities,
    and stop producing while its Health stays READY."""

    def __init__(self) -> None:
        self.instance = "engine-1"
        self.up = True
        self.guided = False
        self.context = 256
        self.producing = True
        #: Health READY (else NOT_READY) while up.
        self.ready = True
        self.generates: list[str] = []
        self.aborts: list[str] = []
        #: Virtual time the engine came back after being down (set by :meth:`restart`).
        self.back_at: float | None = None
        #: The going-away listeners the worker registered (``EngineClient.on_going_away``); this engine never
        #: sends GOAWAY (its outages are refused connections), so they are only kept.
        self.going_away_listeners: list[Callable[[str], None]] = []

    def restart(self, *, instance: str, guided: bool | None = None, context: int | None = None) -> None:
        self.instance = instance
        if guided is not None:
            self.guided = guided
        if context is not None:
            self.context = context
        self.up = True
        self.back_at = trio.current_time()

    # EngineClient's going-away API (GOAWAY), as a client whose engine never says it is going away has it.
    @property
    def going_away(self) -> str | None:
        return None

    @property
    def draining_connections(self) -> int:
        return 0

    def on_going_away(self, listener: Callable[[str], None]) -> None:
        self.going_away_listeners.append(listener)

    async def wait_drained(self, timeout_s: float = math.inf) -> None:
        await trio.lowlevel.checkpoint()

    async def _rpc(self, name: str) -> None:
        await trio.lowlevel.checkpoint()
        if not self.up:
            raise EngineRpcError(name, GrpcCode.UNAVAILABLE, "connection refused")

    async def get_server_info(self, *, trace: Any = None, timeout_s: float | None = None) -> ServerInfo:
        await self._rpc("GetServerInfo")
        return ServerInfo(
            engine_name="fake",
            engine_version="1",
            instance_id=self.instance,
            schema_revision=1,
            minimum_client_revision=1,
            schema_release=PINNED_SCHEMA_RELEASE,
            supported_models=["tiny"],
            capacity=DeploymentCapacity(kv_block_size=16, total_kv_blocks=100, max_running_requests=8),
        )

    async def get_model_info(self, model: str, *, trace: Any = None, timeout_s: float | None = None) -> ModelInfo:
        await self._rpc("GetModelInfo")
        guided = GuidedDecodingCapabilities(supported=True, modes=[GuidedDecodingMode.JSON_SCHEMA])
        return ModelInfo(
            model_id="tiny",
            served_model_name="tiny",
            max_context_length=self.context,
            supports_token_ids_input=True,
            generation=GenerationCapabilities(guided_decoding=guided if self.guided else None),
        )

    async def health(self, *args: Any, timeout_s: float | None = None, **kw: Any) -> HealthResponse:
        await self._rpc("Health")
        return HealthResponse(state=HealthState.READY if self.ready else HealthState.NOT_READY)

    async def get_load(self, include_per_rank: bool = False, *, timeout_s: float | None = None) -> LoadInfo:
        await self._rpc("GetLoad")
        return LoadInfo(instance_id=self.instance, timestamp_unix_nanos=time.time_ns(), running_requests=0)

    async def abort(self, request_id: str, *, timeout_s: float | None = None) -> AbortResponse:
        await self._rpc("Abort")
        self.aborts.append(request_id)
        return AbortResponse(status=AbortStatus.ABORTED)

    @asynccontextmanager
    async def generate(
        self, request: pb.GenerateRequest, *, metadata: Sequence[tuple[str, str]] = ()
    ) -> AsyncIterator[AsyncIterator[list[pb.GenerateResponse]]]:
        await self._rpc("Generate")
        self.generates.append(request.request_id)
        producing = self.producing

        async def stream() -> AsyncIterator[list[pb.GenerateResponse]]:
            first = pb.GenerateResponse(request_id=request.request_id)
            first.token.output_index = 0
            first.token.tokens.add(token_id=7)
            yield [first]
            if not producing:
                await trio.sleep_forever()
            await trio.sleep(0.01)
            done = pb.GenerateResponse(request_id=request.request_id)
            done.finished.output_index = 0
            done.finished.reason = pb.FINISH_REASON_LENGTH
            done.usage.prompt_tokens = len(request.token_ids.ids)
            done.usage.completion_tokens = 1
            yield [done]

        yield stream()


class PortOf:
    """The in-memory engine's port, as the way back's connect probe sees it: accepting while the engine is up."""

    endpoint = "the in-memory engine"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def accepts(self, timeout_s: float) -> bool | None:
        await trio.lowlevel.checkpoint()
        return self.engine.up


class Dynamo:
    """The worker's Dynamo side: what was withdrawn, restored and registered, when; and discovery entries that cannot
    be written (``unwritable``: ``"instance"``, ``"card"`` or another entry's name), as file discovery refuses a
    write whose path someone else took."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, str, Any]] = []
        self.routable = True
        self.unwritable: set[str] = set()

    def _write(self, what: str) -> None:
        if what in self.unwritable:
            self.calls.append((trio.current_time(), f"{what} refused", None))
            raise OSError(f"discovery: cannot write the {what}")

    async def withdraw(self) -> None:
        await trio.lowlevel.checkpoint()
        self.routable = False
        self.calls.append((trio.current_time(), "withdraw", None))

    async def restore(self) -> None:
        await trio.lowlevel.checkpoint()
        self._write("instance")
        self.routable = True
        self.calls.append((trio.current_time(), "restore", None))

    async def register(self, registration: Any) -> None:
        await trio.lowlevel.checkpoint()
        self._write("card")
        self.calls.append((trio.current_time(), "register", registration))

    async def republish(self, *, restore_instance: bool = False) -> RestoreReport:
        """The registration watchdog's check: every entry that cannot be written fails it; otherwise a withdrawn
        instance is put back when asked."""
        await trio.lowlevel.checkpoint()
        report = RestoreReport()
        if self.unwritable:
            for what in sorted(self.unwritable):
                entry = Entry("instance" if what == "instance" else "card", Path(what), what)
                report.lost.append(entry)
                report.failed.append((entry, "path taken"))
        elif restore_instance and not self.routable:
            entry = Entry("instance", Path("instance"), "instance generate")
            report.lost.append(entry)
            report.restored.append(entry)
            self.routable = True
            self.calls.append((trio.current_time(), "restore", None))
        return report

    def names(self) -> list[str]:
        return [name for _, name, _ in self.calls]

    def is_routable(self) -> bool:
        return self.routable


class Sink:
    async def publish(self, figures: Sequence[tuple[int, int]]) -> None:
        await trio.lowlevel.checkpoint()


@pytest.fixture
def transitions() -> Iterator[list[tuple[float, str, str]]]:
    """Worker transitions as ``(time, event, dest)``."""
    seen: list[tuple[float, str, str]] = []

    def observe(model: WorkerLifecycle, event: str, source: str, dest: str) -> None:
        seen.append((trio.current_time(), event, dest))

    WORKER.observers.append(observe)
    yield seen
    WORKER.observers.remove(observe)


def config(*args: str) -> Any:
    return parse_config(
        [
            "--grpc-endpoint",
            "127.0.0.1:1",
            "--model-path",
            str(MODEL_DIR),
            "--grpc-retry-interval-secs",
            "1",
            "--health-poll-interval-secs",
            "1",
            *args,
        ]
    )


async def serving_worker(engine: Engine, dynamo: Dynamo, *args: str) -> Worker:
    """A worker as ``Worker._run`` leaves it once registered (discovered, serving, its Dynamo side attached)."""
    worker = Worker(config(*args))
    life = worker.lifecycle
    worker._client = engine  # type: ignore[assignment]
    worker._dynamo = dynamo  # type: ignore[assignment]
    watch = worker.watch = EngineWatch(
        worker.config,
        life,
        worker.requests,
        engine,  # type: ignore[arg-type]
        worker,
        worker._fatal,
        probe=PortOf(engine),
    )
    life.fire("connect")
    life.fire("connected")
    discovery = await watch.discover_until_ready(trio.current_time() + 30)
    watch.adopt(discovery)
    worker.requests.attach(worker.serving_context(discovery))
    life.fire("registered")
    return worker


def watch_of(worker: Worker) -> EngineWatch:
    assert worker.watch is not None
    return worker.watch


async def run_watchers(nursery: trio.Nursery, worker: Worker, engine: Any, dynamo: Any) -> None:
    """What ``Worker._run`` starts next to serving: the load poller (with the worker's identity) and the watches."""
    watch = watch_of(worker)
    poller = partial(poll_load, identity=watch.identity)
    await nursery.start(poller, engine, Sink(), (0,), RoutingConfig(load_poll_interval_s=1.0))
    nursery.start_soon(watch.run)


async def serving_again(worker: Worker, within: float = 60.0) -> float:
    """Wait until the worker serves (state and request context); the (virtual) time it does."""
    with trio.fail_after(within):
        while worker.lifecycle.state != "serving" or worker.requests.serving is None:
            await trio.sleep(0.05)
    return trio.current_time()


def state(worker: Worker) -> str:
    return worker.lifecycle.state


async def wait_state(worker: Worker, target: str, within: float) -> None:
    await wait_until(lambda: state(worker) == target, timeout=within, interval=0.05, what=f"the worker {target}")


def body(**sampling: Any) -> dict[str, Any]:
    return {"token_ids": [5, 6, 7], "stop_conditions": {"max_tokens": 4}, "sampling_options": sampling}


async def complete(worker: Worker, request: dict[str, Any], request_id: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    async for batch in serve(worker.requests, request, RequestContext(request_id=request_id)):
        out.extend(batch)
    return out


# ------------------------------------------------------------------------------------ item 6: prompt recovery


async def test_after_a_40s_outage_the_worker_serves_within_2s_of_the_engine_answering(
    autojump_clock: Clock, transitions: list[tuple[float, str, str]]
) -> None:
    """Failed before: the reconnect backoff (cap 30 s) kept waiting although the load poller had seen the engine;
    serving resumed 21 s after the engine came back in this scenario."""
    engine, dynamo = Engine(), Dynamo()
    worker = await serving_worker(engine, dynamo, "--reconnect-backoff-max-secs", "30")
    async with trio.open_nursery() as nursery:
        await run_watchers(nursery, worker, engine, dynamo)
        engine.up = False
        await trio.sleep(40.0)
        engine.restart(instance="engine-1")
        resumed = await serving_again(worker)
        nursery.cancel_scope.cancel()
    print(f"serving resumed {resumed - (engine.back_at or 0):.2f}s after the engine answered again")
    assert engine.back_at is not None
    assert ("engine_lost", "reconnecting") in [(e, d) for _, e, d in transitions]
    assert resumed - engine.back_at <= 2.0, f"serving {resumed - engine.back_at:.1f}s after the engine was back"


async def test_without_the_load_poller_a_5s_outage_costs_the_backoff_not_its_cap(
    autojump_clock: Clock, transitions: list[tuple[float, str, str]]
) -> None:
    """Issue 29 item 4 (b): the reconnect backoff grows 1, 2, 4 … s up to its cap. A mutant jumping to the cap
    (``min`` -> ``max``) survived every test because the load poller's answer ends each wait; an engine without
    GetLoad has no poller. Here none runs: a 5 s outage must cost about one backoff step after the engine is back,
    not the 30 s cap (the mutant: 29 s)."""
    engine, dynamo = Engine(), Dynamo()
    worker = await serving_worker(engine, dynamo, "--reconnect-backoff-max-secs", "30")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_of(worker).watch_health)
        nursery.start_soon(watch_of(worker).watch_identity)
        engine.up = False
        await wait_state(worker, "reconnecting", 10)
        await trio.sleep(5.0)
        engine.restart(instance="engine-1")
        resumed = await serving_again(worker)
        nursery.cancel_scope.cancel()
    assert engine.back_at is not None
    print(f"serving resumed {resumed - engine.back_at:.2f}s after the engine answered again (no load poller)")
    # Lost after 3 failed polls, then waits of 1, 2, 4 s (+-20 %): the attempt after the engine's return comes
    # within 4.8 s of it; the cap would have made it 30.
    assert resumed - engine.back_at < 5.0


# --------------------------------------------------------------------------- item 5: a quick restart is noticed


@pytest.mark.parametrize("guided_after", [True, False], ids=["guided added", "guided removed"])
async def test_an_engine_restarted_within_a_second_with_other_capabilities_is_rediscovered(
    autojump_clock: Clock, transitions: list[tuple[float, str, str]], guided_after: bool
) -> None:
    """The engine is down 0.7 s -- too short for the health watch (3 failed polls) -- and comes back with guided
    decoding added (or removed) and a larger context. Failed before: the worker kept the old capabilities (guided
    requests refused, or forwarded to an engine that refuses them) and the old card."""
    engine, dynamo = Engine(), Dynamo()
    engine.guided = not guided_after
    worker = await serving_worker(engine, dynamo)
    transitions.clear()
    guided_body = body(guided_decoding={"json": {"type": "object", "properties": {}}})
    async with trio.open_nursery() as nursery:
        await run_watchers(nursery, worker, engine, dynamo)
        await trio.sleep(0.3)
        engine.up = False
        await trio.sleep(0.7)
        engine.restart(instance="engine-2", guided=guided_after, context=512)
        with trio.fail_after(10):
            while not any(name == "register" for name in dynamo.names()):
                await trio.sleep(0.01)
            while worker.lifecycle.state != "serving" or worker.requests.serving is None:
                await trio.sleep(0.01)
        noticed = trio.current_time() - engine.back_at if engine.back_at is not None else None
        serving = worker.requests.serving
        assert serving.caps.instance_id == "engine-2"
        assert serving.context_length == 512
        if guided_after:
            await complete(worker, guided_body, "guided-1")
            assert engine.generates[-1] == "guided-1", "forwarded: the engine now advertises guided decoding"
        else:
            with pytest.raises(Exception, match="guided"):
                await complete(worker, guided_body, "guided-1")
        nursery.cancel_scope.cancel()
    assert noticed is not None
    assert noticed <= 2.0
    (register,) = [reg for _, name, reg in dynamo.calls if name == "register"]
    assert register.context_length == 512, "the card carries the new engine's limits"
    names = dynamo.names()
    assert names.index("register") < names.index("restore"), "card updated before the instance is routable again"
    assert [e for _, e, _ in transitions if e in ("engine_lost", "reconnected", "registered")] == [
        "engine_lost",
        "reconnected",
        "registered",
    ]


class LoadBalancedEngine(Engine):
    """Two engines behind one address: GetLoad reaches another backend than GetServerInfo, so the load poller keeps
    reporting an instance the worker never discovers."""

    async def get_load(self, include_per_rank: bool = False, *, timeout_s: float | None = None) -> LoadInfo:
        load = await super().get_load(include_per_rank, timeout_s=timeout_s)
        load.instance_id = "engine-behind-the-balancer"
        return load


async def test_a_claim_of_a_new_engine_that_keeps_finding_the_same_one_is_bounded(
    autojump_clock: Clock, transitions: list[tuple[float, str, str]]
) -> None:
    """Issue 29 item 4: a reconnect loop must block and end. Every claim of a new engine that finds the engine the
    worker had waits out of routing (1, 2, 4, 8 s) and the 5th in a row fails the worker with one line. Failed
    before: the worker rediscovered the same engine every second, for ever (and with the quick-restart identity
    check removed, in a loop that never blocked)."""
    engine, dynamo = LoadBalancedEngine(), Dynamo()
    worker = await serving_worker(engine, dynamo)
    transitions.clear()
    async with trio.open_nursery() as nursery:
        await run_watchers(nursery, worker, engine, dynamo)
        with trio.fail_after(120):
            await worker._fatal.wait()
        failed_at = trio.current_time()
        nursery.cancel_scope.cancel()
    assert state(worker) == "failed"
    assert "the same instance 'engine-1'" in (worker.lifecycle.reason or "")
    lost = [t for t, e, _ in transitions if e == "engine_lost"]
    assert len(lost) == 5
    # Waits of 1, 2, 4 and 8 s before serving again, each followed by the next false claim within a poll.
    assert 15.0 <= failed_at <= 15.0 + 5 * 1.5, failed_at


class FlappingEngine(Engine):
    """An engine whose next call of some RPCs fails once more after it is back (a restart still in progress, or an
    engine still draining after its GOAWAY: it answers once, then its port is gone)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_once: set[str] = set()

    async def _rpc(self, name: str) -> None:
        await super()._rpc(name)
        if name in self.fail_once:
            self.fail_once.discard(name)
            raise EngineRpcError(name, GrpcCode.UNAVAILABLE, "the engine closed the connection before HTTP/2 began")


async def test_an_engine_gone_again_during_rediscovery_sends_the_worker_back_to_reconnecting(
    autojump_clock: Clock, transitions: list[tuple[float, str, str]]
) -> None:
    """Found by ``bench.chaos`` (an engine SIGTERMed behind a TCP proxy): the engine answered the reconnect probe,
    then GetModelInfo failed with UNAVAILABLE. Failed before: the error escaped the reconnect and the worker process
    exited 1 with a traceback; now it is lost again, reconnects and serves."""
    engine, dynamo = FlappingEngine(), Dynamo()
    worker = await serving_worker(engine, dynamo)
    transitions.clear()
    async with trio.open_nursery() as nursery:
        await run_watchers(nursery, worker, engine, dynamo)
        engine.up = False
        with trio.fail_after(30):
            while state(worker) != "reconnecting":
                await trio.sleep(0.05)
        engine.fail_once = {"GetModelInfo"}
        engine.restart(instance="engine-1")
        with trio.fail_after(30):
            while state(worker) != "serving" or worker.requests.serving is None:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    events = [e for _, e, _ in transitions if e in ("engine_lost", "reconnected", "registered", "fail")]
    assert events == ["engine_lost", "reconnected", "engine_lost", "reconnected", "registered"]
    assert not engine.fail_once


async def test_a_lost_connection_to_an_engine_that_answers_as_another_instance_is_rediscovered(
    autojump_clock: Clock, transitions: list[tuple[float, str, str]]
) -> None:
    """An engine without GetLoad (the poller cannot see the instance): a request losing its connection is the cue."""
    engine, dynamo = Engine(), Dynamo()
    worker = await serving_worker(engine, dynamo)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_of(worker).watch_identity)
        engine.restart(instance="engine-2", context=512)
        worker.requests.connection_lost.set()  # what a request's UNAVAILABLE does
        with trio.fail_after(10):
            while worker.requests.serving is None or worker.requests.serving.context_length != 512:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert "register" in dynamo.names()


async def test_a_lost_connection_to_the_same_engine_changes_nothing(autojump_clock: Clock) -> None:
    engine, dynamo = Engine(), Dynamo()
    worker = await serving_worker(engine, dynamo)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_of(worker).watch_identity)
        worker.requests.connection_lost.set()
        await trio.sleep(5)
        nursery.cancel_scope.cancel()
    assert dynamo.calls == []
    assert worker.lifecycle.state == "serving"


# --------------------------------------------------------------------- item 4: a hung engine costs one timeout


async def test_a_hung_engine_withdraws_the_worker_at_the_first_timeout_and_a_canary_brings_it_back(
    autojump_clock: Clock, transitions: list[tuple[float, str, str]]
) -> None:
    """Failed before: the worker stayed `serving` (Health READY), so the frontend migrated the request back to it
    three times (4 timeouts); now the first timeout withdraws it before the error is raised."""
    engine, dynamo = Engine(), Dynamo()
    worker = await serving_worker(engine, dynamo, "--request-inactivity-timeout-secs", "5")
    engine.producing = False
    async with trio.open_nursery() as nursery:
        await run_watchers(nursery, worker, engine, dynamo)
        start = trio.current_time()
        with pytest.raises(HungEngine):
            await complete(worker, body(), "hung-1")
        failed_at = trio.current_time()
        assert failed_at - start == pytest.approx(5.0)
        assert worker.lifecycle.state == "degraded"
        assert dynamo.calls[0][1] == "withdraw"
        assert dynamo.calls[0][0] <= failed_at, "withdrawn before the error went to the frontend"
        # A migrated retry finds no worker here: the frontend answers 503 instead of a second timeout.
        with pytest.raises(WorkerDraining):
            await complete(worker, body(), "hung-2")
        # Health stays READY all along; the worker stays withdrawn until a canary generation succeeds.
        await trio.sleep(12)
        assert state(worker) == "degraded"
        engine.producing = True
        await wait_state(worker, "serving", 20)
        assert (await complete(worker, body(), "after"))[-1]["finish_reason"] == "length"
        nursery.cancel_scope.cancel()
    degrade = [(t, e) for t, e, d in transitions if e == "degrade"]
    assert len(degrade) == 1
    assert dynamo.names()[-1] == "restore"
    canaries = [rid for rid in engine.generates if rid.startswith("openengine-sidecar-canary-")]
    assert canaries, "recovery came from a canary generation"
    assert set(engine.aborts) >= set(canaries[:-1]), "every canary left unanswered was aborted"


# ------------------------------------------- the engine lost while the registration watchdog holds the worker out


@pytest.mark.parametrize(
    "unwritable",
    [{"event source"}, {"instance", "card"}],
    ids=["another entry unwritable", "instance and card unwritable"],
)
async def test_an_engine_lost_while_the_registration_watchdog_holds_the_worker_out_keeps_it_out(
    autojump_clock: Clock, transitions: list[tuple[float, str, str]], unwritable: set[str]
) -> None:
    """Failed before: the rediscovery after the engine loss restored the instance regardless -- routable again while
    an entry was still unwritable (until the next check withdrew it), or, when the instance or card itself could not
    be written, the unguarded write raised out of the health watch and took the worker down."""
    engine, dynamo = Engine(), Dynamo()
    worker = await serving_worker(engine, dynamo, "--registration-check-interval-secs", "2")
    async with trio.open_nursery() as nursery:
        await run_watchers(nursery, worker, engine, dynamo)
        nursery.start_soon(worker._watch_registration, dynamo)  # type: ignore[arg-type]
        dynamo.unwritable = set(unwritable)
        await wait_state(worker, "degraded", 10)
        assert not dynamo.is_routable()
        lost_at = trio.current_time()
        engine.up = False
        await wait_state(worker, "reconnecting", 30)
        engine.restart(instance="engine-2")
        # Back from the engine loss, but still out of routing: the watchdog holds it out until it can write.
        with trio.fail_after(30):
            while not any(e == "reconnected" for t, e, _ in transitions if t > lost_at):
                await trio.sleep(0.05)
        await trio.sleep(10)
        assert state(worker) == "degraded"
        assert not dynamo.is_routable()
        assert not [t for t, name, _ in dynamo.calls if name == "restore" and t > lost_at]
        assert worker._fatal.is_set() is False
        # Writable again: the next check restores everything and the worker serves the new engine.
        dynamo.unwritable.clear()
        await wait_state(worker, "serving", 10)
        assert dynamo.is_routable()
        assert (await complete(worker, body(), "after"))[-1]["finish_reason"] == "length"
        nursery.cancel_scope.cancel()
    discovery = watch_of(worker).discovery
    assert discovery is not None
    assert discovery.caps.instance_id == "engine-2"
    assert [d for _, e, d in transitions if e in ("registered", "degrade")][-1] == "serving"


async def test_an_instance_that_cannot_be_written_when_health_recovers_leaves_the_worker_to_the_watchdog(
    autojump_clock: Clock,
) -> None:
    """Failed before: the health watch's recovery restored the instance unguarded; a refused write raised out of the
    watch and ended the worker. Now the worker stays out of routing until the watchdog can write the instance."""
    engine, dynamo = Engine(), Dynamo()
    worker = await serving_worker(engine, dynamo, "--registration-check-interval-secs", "2")
    async with trio.open_nursery() as nursery:
        await run_watchers(nursery, worker, engine, dynamo)
        nursery.start_soon(worker._watch_registration, dynamo)  # type: ignore[arg-type]
        engine.ready = False
        await wait_state(worker, "degraded", 30)
        dynamo.unwritable = {"instance"}
        engine.ready = True
        with trio.fail_after(30):
            while not any(name == "instance refused" for _, name, _ in dynamo.calls):
                await trio.sleep(0.05)
        await trio.sleep(5)
        assert state(worker) == "degraded"
        assert not dynamo.is_routable()
        dynamo.unwritable.clear()
        await wait_state(worker, "serving", 10)
        assert dynamo.is_routable()
        assert (await complete(worker, body(), "after"))[-1]["finish_reason"] == "length"
        nursery.cancel_scope.cancel()


class PrefillEngine(Engine):
    """An engine that reports the prefill role (``openengine-mock --profile full --role prefill``): a plain
    generation is refused with FAILED_PRECONDITION; its Health runs a role-appropriate inference probe on request."""

    def __init__(self) -> None:
        super().__init__()
        self.probes = 0

    async def get_server_info(self, *, trace: Any = None, timeout_s: float | None = None) -> ServerInfo:
        info = await super().get_server_info(trace=trace, timeout_s=timeout_s)
        info.engine_role = EngineRole.PREFILL
        return info

    @asynccontextmanager
    async def generate(
        self, request: pb.GenerateRequest, *, metadata: Sequence[tuple[str, str]] = ()
    ) -> AsyncIterator[AsyncIterator[list[pb.GenerateResponse]]]:
        if request.extra.fields["request_type"].string_value != "context_only":
            await self._rpc("Generate")
            self.generates.append(request.request_id)
            raise EngineRpcError("Generate", GrpcCode.FAILED_PRECONDITION, "this engine serves the prefill role")
        async with super().generate(request, metadata=metadata) as stream:
            yield stream

    async def health(
        self, include_inference_probe: bool = False, *args: Any, timeout_s: float | None = None, **kw: Any
    ) -> HealthResponse:
        await self._rpc("Health")
        if include_inference_probe:
            self.probes += 1
            if not self.producing:
                await trio.sleep(30)
                return HealthResponse(state=HealthState.DEGRADED)
        return HealthResponse(state=HealthState.READY)


async def test_a_stalled_prefill_engine_is_probed_the_way_its_role_allows_and_the_worker_comes_back(
    autojump_clock: Clock, transitions: list[tuple[float, str, str]]
) -> None:
    """Found by ``bench.chaos`` (a prefill engine paused past the inactivity timeout): the stall canary was a plain
    generation, which an engine serving the prefill role refuses (FAILED_PRECONDITION), so the worker stayed
    withdrawn for good. The canary of a prefill or decode engine is Health's inference probe, role-appropriate by the
    schema (OpenEngine v0.1.0's ``Health`` rules); failed before: still degraded after 60 s."""
    engine, dynamo = PrefillEngine(), Dynamo()
    worker = await serving_worker(engine, dynamo, "--request-inactivity-timeout-secs", "5")
    assert worker.requests.serving is not None
    assert worker.requests.serving.worker_role == "prefill"
    engine.producing = False
    async with trio.open_nursery() as nursery:
        await run_watchers(nursery, worker, engine, dynamo)
        with pytest.raises(HungEngine):
            await complete(worker, body(), "hung-1")
        assert state(worker) == "degraded"
        await trio.sleep(12)
        assert state(worker) == "degraded", "a probe that does not answer keeps the worker withdrawn"
        engine.producing = True
        with trio.fail_after(60):
            while state(worker) != "serving":
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert engine.probes >= 2
    assert not [rid for rid in engine.generates if rid.startswith("openengine-sidecar-canary-")]
    assert dynamo.names()[-1] == "restore"


class GoawayEngine(Engine):
    """An engine whose connections can say GOAWAY: the client's going-away state as ``EngineClient`` keeps it (set at
    the first GOAWAY of an episode, listeners told, cleared by ``wait_drained`` once no GOAWAY'd connection is left)."""

    def __init__(self) -> None:
        super().__init__()
        self.goaway: str | None = None

    @property
    def going_away(self) -> str | None:
        return self.goaway

    def send_goaway(self, reason: str = "GOAWAY NO_ERROR") -> None:
        if self.goaway is None:
            self.goaway = reason
            for listener in self.going_away_listeners:
                listener(reason)

    async def wait_drained(self, timeout_s: float = math.inf) -> None:
        await trio.lowlevel.checkpoint()
        self.goaway = None  # the connections that heard it are gone (the engine that sent it stopped)


async def test_a_goaway_heard_while_reconnecting_does_not_take_the_worker_out_again_once_it_serves(
    autojump_clock: Clock, transitions: list[tuple[float, str, str]]
) -> None:
    """Issue 31 item 4 (one unregistration per withdrawal), seen in a 10-minute soak: the engine being left said
    GOAWAY while the worker was already reconnecting; the worker came back serving with the restarted engine, then
    acted on that old GOAWAY -- ``serving -> degraded`` the same millisecond, a second withdrawal and ~0.8 s out of
    routing although the new engine had said nothing. A GOAWAY belongs to the connections of the engine that sent
    it: once another engine answers, it is over."""
    engine, dynamo = GoawayEngine(), Dynamo()
    worker = await serving_worker(engine, dynamo, "--health-failure-threshold", "1")
    async with trio.open_nursery() as nursery:
        await run_watchers(nursery, worker, engine, dynamo)
        engine.up = False
        await wait_state(worker, "reconnecting", within=10)
        engine.send_goaway()  # the old engine's last connection closing down, while the worker reconnects
        await trio.sleep(3.0)  # virtual: the outage goes on a while
        engine.restart(instance="engine-2")
        await serving_again(worker)
        withdrawals = dynamo.names().count("withdraw")
        await trio.sleep(5.0)  # virtual: a few health polls of the serving worker
        nursery.cancel_scope.cancel()
    after = [(e, d) for _, e, d in transitions if d == "degraded"]
    assert state(worker) == "serving"
    assert not after, f"the worker left serving again without a new GOAWAY: {after}"
    assert dynamo.names().count("withdraw") == withdrawals == 1, dynamo.names()
