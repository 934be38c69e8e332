"""The engine watch (see the package docstring): health, identity and stall watches, and the way back."""

from __future__ import annotations

import logging
import os
import random
from typing import TYPE_CHECKING, Final, Protocol

import trio

from openengine_bp.openengine.v1 import HealthState
from sidecar.convert.enums import bp_enum
from sidecar.engine import SchemaIncompatible
from sidecar.errors import EngineGone, EngineRpcError, GrpcCode
from sidecar.kv import EngineIdentity
from sidecar.ops import metrics
from sidecar.requests import probe_generation
from sidecar.startup import StartupRefused, check_unchanged, discover, wait_ready

from ._probe import PortProbe

if TYPE_CHECKING:
    from openengine_bp.openengine.v1 import ServerInfo
    from sidecar.config import SidecarConfig
    from sidecar.dynamo import Registration
    from sidecar.engine import EngineClient
    from sidecar.requests import RequestServer, ServingContext
    from sidecar.startup import Discovery
    from statemachines import WorkerLifecycle

log: Final = logging.getLogger("sidecar.worker")

# Health RPC failures that mean "the engine is not there" (restart, crash) rather than "the engine is unwell".
_ENGINE_GONE_CODES: Final = frozenset({GrpcCode.UNAVAILABLE, GrpcCode.DEADLINE_EXCEEDED})
# How often the way back tries a connect to the engine's port while it refuses (the cheap half: see _probe.py), and
# the bound of one try. The expensive half, GetServerInfo, follows at once when the port accepts.
PROBE_INTERVAL_S: Final = 0.025
_PROBE_TIMEOUT_S: Final = 1.0
# Where an engine change or loss starts the way back (reconnecting); elsewhere the worker is on it already.
_WATCHED: Final = ("serving", "degraded", "stalled")
# Claims of a new engine in a row that turn out to be the engine the worker had, each soon after the last, before the
# worker fails: the waits between them (1, 2, 4, 8 s at the default retry interval) sum to 15 s.
_REDISCOVERY_REPEAT_LIMIT: Final = 5


class WatchHost(Protocol):
    """What the engine watch asks of the worker around it (``sidecar.worker.Worker`` is one)."""

    @property
    def registration_held(self) -> bool:
        """The registration watchdog keeps the worker out of routing (an entry it cannot write yet)."""
        ...

    def serving_context(self, discovery: Discovery) -> ServingContext:
        """What requests need to be served against the engine ``discovery`` describes."""
        ...

    def card(self, discovery: Discovery) -> Registration:
        """The model card for the engine ``discovery`` describes."""
        ...

    async def withdraw(self) -> None:
        """Take the worker's instance out of routing (bounded, best effort: never raises)."""
        ...

    async def into_routing(self, card: Registration | None) -> str | None:
        """Register ``card`` (if given), then put the instance back into routing; or say why the worker stays out."""
        ...

    async def engine_restarted(self) -> None:
        """The engine was rediscovered: bring what lives on it (LoRA adapters) up to date before routing resumes."""
        ...


class Probe(Protocol):
    """A connect-only probe of the engine's address (:class:`PortProbe`; an in-memory one in tests)."""

    @property
    def endpoint(self) -> object:
        """What is probed, for log lines."""
        ...

    async def accepts(self, timeout_s: float) -> bool | None:
        """True: a connection was accepted; False: refused (nothing listens); None: no answer within the bound."""
        ...


class EngineWatch:
    """The worker's watch over one engine client: discovery, health, identity, stalls, and the way back."""

    def __init__(
        self,
        config: SidecarConfig,
        lifecycle: WorkerLifecycle,
        requests: RequestServer,
        client: EngineClient,
        host: WatchHost,
        fatal: trio.Event,
        *,
        probe: Probe | None = None,
    ) -> None:
        self.config = config
        self.lifecycle = lifecycle
        self.requests = requests
        self.client = client
        self.host = host
        #: Set when the worker must exit 1 (engine lost with --exit-on-engine-loss, a different engine came back).
        self.fatal = fatal
        #: What the engine reported at the last (re)discovery; None before the first.
        self.discovery: Discovery | None = None
        #: The engine as the load poller sees it between health polls: a restart (new instance id), an answer.
        self.identity = EngineIdentity()
        #: Connect-only probes of the engine's address (the way back, and telling a refused port from a failing RPC).
        self.probe: Probe = probe if probe is not None else PortProbe(client.config.endpoint)
        # One reconnection at a time (the health watch and the identity watch may both find the engine changed);
        # the generation counts completed ones, so a second finder whose engine was already rediscovered stands down.
        self._reconnecting = trio.Lock()
        self._engine_generation = 0
        # When the last reconnection ended (see _bound_repeats).
        self._last_rediscovery: float | None = None
        self._rediscovery_repeats = 0
        # Why the worker is degraded for an engine that stopped producing (None: it is not); a canary generation
        # ends it (watch_not_producing), not Health, which stays READY on a wedged engine.
        self._not_producing: str | None = None
        self._not_producing_noticed = trio.Event()
        self._not_producing_withdrawn = trio.Event()
        requests.on_stall = self._engine_not_producing

    # ------------------------------------------------------------------ discovery

    async def listening(self) -> bool:
        """Whether anything accepts connections on the engine's address (a silent host counts as listening)."""
        return await self.probe.accepts(self._probe_timeout_s) is not False

    async def wait_listening(self, deadline: float) -> None:
        """Start-up's cheap half of waiting for the engine: while nothing accepts connections on its address, a
        connect every :data:`PROBE_INTERVAL_S` and nothing else, so the first GetServerInfo goes out within moments
        of the engine listening rather than wherever ``--grpc-retry-interval-secs`` stands; returns once a connect is
        accepted (or not refused: a silent host is left to the gRPC attempts) or at ``deadline``."""
        logged = False
        while trio.current_time() < deadline:
            if await self.probe.accepts(self._probe_timeout_s) is not False:
                return
            if not logged:
                log.info(
                    "engine at %s not reachable yet: nothing accepts connections there; probing every %.0f ms",
                    self.probe.endpoint,
                    PROBE_INTERVAL_S * 1000,
                )
                logged = True
            await trio.sleep(min(PROBE_INTERVAL_S, max(0.0, deadline - trio.current_time())))

    async def discover_until_ready(self, deadline: float, *, server: ServerInfo | None = None) -> Discovery:
        """discovering → waiting_ready → registering: discover, wait for READY, and when the engine was not READY at
        once, discover again and compare (an engine still loading may report other limits once it is ready).

        ``server``: the ServerInfo the engine just answered (the way back asks it first), so that it is not asked
        twice. Ready at the first ask, what was just read is what the ready engine reports: the way back then costs
        GetModelInfo and one Health beyond that first answer.
        """
        life = self.lifecycle
        config = self.config
        client = self.client
        first = await discover(client, config, server=server)
        if self.discovery is not None:
            # After an engine restart the engine must still be the one this worker registered.
            check_unchanged(self.discovery, first)
        life.fire("discovered", reason=f"{first.caps.engine_name}, model {first.model!r}")
        if await self._ready_now():
            life.fire("ready")
            return first
        await wait_ready(client, deadline=deadline, retry_interval_s=config.grpc_retry_interval_s)
        again = await discover(client, config)
        check_unchanged(first, again)
        life.fire("ready")
        return again

    async def _ready_now(self) -> bool:
        """One Health call: READY now? (Anything else, an error included, is for ``wait_ready`` to wait out.)"""
        try:
            response = await self.client.health(timeout_s=self.config.health_timeout_s)
        except EngineRpcError:
            return False
        return bp_enum(response.state) is HealthState.READY

    @property
    def _probe_timeout_s(self) -> float:
        return min(_PROBE_TIMEOUT_S, self.config.grpc_connect_attempt_timeout_s)

    def adopt(self, discovery: Discovery) -> None:
        """The engine the worker serves from now on (after the start-up discovery)."""
        self.discovery = discovery
        self.identity.expect(discovery.caps.instance_id)

    # ------------------------------------------------------------------ the watches

    async def run(self) -> None:
        """The health, identity and not-producing watches, until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.watch_health)
            nursery.start_soon(self.watch_identity)
            nursery.start_soon(self.watch_not_producing)

    async def watch_health(self) -> None:
        """Poll Control.Health: not READY degrades the worker; no answer while nothing flows stalls it (withdrawn,
        nothing failed: the engine may resume); an engine whose port refuses connections, or that keeps failing
        UNAVAILABLE, sends it the way back; READY again restores it.

        Dynamo's Rust sidecars have no such watch (the 1.6 line) or exit here; this worker withdraws from routing and
        keeps its process, so an engine restart costs the in-flight requests (which migrate) but not the worker, and
        a stall costs nothing but the wait.
        """
        config = self.config
        client = self.client
        failures = 0
        # A GOAWAY wakes this watch at once; handling it here keeps every lifecycle step of the engine in one task.
        client.on_going_away(lambda _reason: self.requests.engine_trouble.set())
        while True:
            with trio.move_on_after(config.health_poll_interval_s):
                await self.requests.engine_trouble.wait()
            self.requests.engine_trouble = trio.Event()
            if client.going_away is not None:
                await self._engine_going_away()
                failures = 0
                continue
            progress = self.requests.progress
            try:
                response = await client.health(timeout_s=config.health_timeout_s)
            except EngineRpcError as exc:
                if exc.code is GrpcCode.DEADLINE_EXCEEDED:
                    if self.requests.progress != progress:
                        # Tokens arrived while Health waited: the engine is busy, not stalled. Withdrawing would take
                        # a working engine out of routing for nothing (seen at ~1,000 in flight).
                        log.warning("engine health timed out while its streams deliver tokens: busy, not stalled")
                        continue
                    failures += 1
                    if failures >= config.health_failure_threshold:
                        await self._stall(f"Health: {exc}")
                    continue
                if exc.code not in _ENGINE_GONE_CODES:
                    failures += 1
                    await self._maybe_degrade(failures, f"Health failed: {exc}")
                    continue
                failures += 1
                refused = await self.probe.accepts(self._probe_timeout_s) is False
                if failures < config.health_failure_threshold and not refused:
                    continue
                failures = 0
                # Nothing accepts connections on the engine's port: it is gone (a crash, a restart) -- no reason to
                # wait for more failed polls, and every moment routable here is a request that fails.
                await self.engine_lost(
                    f"{exc}; nothing accepts connections at {self.probe.endpoint}" if refused else str(exc)
                )
                continue
            state = bp_enum(response.state)
            if state is HealthState.READY:
                failures = 0
                if self.lifecycle.state in ("degraded", "stalled") and not self.host.registration_held:
                    await self._recover()
                continue
            failures += 1
            await self._maybe_degrade(failures, f"engine health {state.name}")

    async def _stall(self, reason: str) -> None:
        """The engine does not answer (Health times out, no stream delivers): withdraw, but fail nothing.

        A stopped process, a long pause or a host swapping may resume: every stream in flight keeps waiting for it up
        to its own inactivity timeout (``--request-inactivity-timeout-secs``), then fails with a migratable error;
        one the engine resumes completes. The serving context stays attached, so a request that still arrives --
        routed before the withdrawal landed -- is sent to the engine and waits the same way. Health READY again
        restores the worker; a refused or lost connection is an engine lost.
        """
        if self.lifecycle.state != "serving":
            return
        self.lifecycle.fire("stall", reason=f"engine not answering ({reason})")
        log.warning(
            "engine not answering: out of routing; %d request(s) in flight wait for it up to their inactivity "
            "timeout (%gs)",
            self.requests.in_flight,
            self.config.request_inactivity_timeout_s,
        )
        await self.host.withdraw()
        metrics.HEALTH_TRANSITIONS.labels(change="degraded").inc()

    async def _maybe_degrade(self, failures: int, reason: str) -> None:
        state = self.lifecycle.state
        if failures < self.config.health_failure_threshold or state not in ("serving", "stalled"):
            return
        self.lifecycle.fire("degrade", reason=reason)
        # New requests go elsewhere; in-flight ones carry on against the engine as long as it serves them.
        self.requests.attach(None)
        if state == "serving":  # a stalled worker is withdrawn already
            await self.host.withdraw()
            metrics.HEALTH_TRANSITIONS.labels(change="degraded").inc()

    async def _recover(self) -> None:
        assert self.discovery is not None
        if self._not_producing is not None:
            # Withdrawn because the engine stopped producing: its Health says READY regardless. Only a canary
            # generation brings the worker back (watch_not_producing).
            return
        self.lifecycle.fire("recover", reason="engine health READY")
        self.requests.attach(self.host.serving_context(self.discovery))
        held = await self.host.into_routing(None)
        if held is not None:
            self.lifecycle.fire("degrade", reason=held)
            return
        self.lifecycle.fire("registered", reason="recovered")
        metrics.HEALTH_TRANSITIONS.labels(change="recovered").inc()

    async def _engine_going_away(self) -> None:
        """The engine sent GOAWAY: it is stopping (TensorRT-LLM: ``server.stop(grace=5)``, open streams may finish).

        Withdraw from routing at once (``degrade``: new requests go elsewhere), let the requests in flight run on the
        draining connections until they end or the engine closes them (a stream cut at the end of its grace fails
        with a migratable error), then come back the way a lost engine does: reconnect, rediscover, register.
        """
        client = self.client
        reason = client.going_away or "GOAWAY"
        life = self.lifecycle
        if life.state in ("serving", "stalled"):
            withdrawn = life.state == "stalled"
            life.fire("degrade", reason=f"the engine is going away ({reason})")
            self.requests.attach(None)
            if not withdrawn:
                await self.host.withdraw()
                metrics.HEALTH_TRANSITIONS.labels(change="degraded").inc()
        log.info(
            "engine going away: %d request(s) in flight continue until they end or the engine closes its connections",
            self.requests.in_flight,
        )
        # Bounded like our own drain: an engine that keeps a GOAWAY'd connection open forever must not pin us here.
        await client.wait_drained(timeout_s=self.config.drain_timeout_s)
        if life.state == "degraded":
            await self.engine_lost(f"the engine went away ({reason})")

    async def watch_identity(self) -> None:
        """A new engine identity runs the rediscovery of a lost engine, even when the restart was too quick for the
        health watch: the load poller reports a new ``instance_id``, or a request lost its connection and the engine
        that answers now reports something else (instance, capabilities, limits, model, role, schema). Changed
        capabilities and limits are registered again (model card) before requests are admitted again."""
        while True:
            changed = self.identity.changed
            lost = self.requests.connection_lost
            await _first_of(changed, lost)
            if changed.is_set():
                seen = self.identity.seen
                reason = f"engine restarted: instance {self.identity.expected!r} is now {seen!r}"
            else:
                self.requests.connection_lost = trio.Event()
                found = await self._engine_changed()
                if found is None:
                    continue
                reason = f"engine changed after a lost connection: {found}"
            if self.lifecycle.state not in _WATCHED:
                self.identity.expect(self.identity.expected)  # reconnecting already: it rediscovers anyway
                continue
            log.warning("%s; rediscovering it", reason)
            await self.engine_lost(reason, claimed_change=True)

    async def _engine_changed(self) -> str | None:
        """What differs in the engine that answers now from the one discovered (None: nothing, or no answer yet --
        the health watch then deals with an engine that is gone)."""
        old = self.discovery
        if old is None:
            return None
        try:
            with trio.fail_after(self.config.grpc_rpc_timeout_s):
                new = await discover(self.client, self.config)
        except (EngineRpcError, StartupRefused, SchemaIncompatible, trio.TooSlowError) as exc:
            # A refusal is for the rediscovery to report (it fails the worker); no answer is the health watch's.
            return None if isinstance(exc, EngineRpcError | trio.TooSlowError) else str(exc)
        return ", ".join(differences(old, new)) or None

    async def _engine_not_producing(self, reason: str) -> None:
        """``RequestServer.on_stall``: the engine stopped producing (an inactivity timeout with nothing received by
        any request). Withdraw from routing before that request's error reaches the frontend, whose migration must
        land on another worker (with one worker the client gets a 503 after one timeout, not four). A canary
        generation brings the worker back (:meth:`watch_not_producing`)."""
        if self.lifecycle.state == "serving":
            self._not_producing = reason
            self._not_producing_withdrawn = trio.Event()
            self.lifecycle.fire("degrade", reason=reason)
            self.requests.attach(None)
            metrics.HEALTH_TRANSITIONS.labels(change="degraded").inc()
            self._not_producing_noticed.set()
            await self.host.withdraw()
            self._not_producing_withdrawn.set()
        elif self._not_producing is not None:
            # Another request is withdrawing the worker: this error waits for the withdrawal too.
            await self._not_producing_withdrawn.wait()
        # stalled (the engine does not answer at all): withdrawn already; Health READY brings it back.

    async def watch_not_producing(self) -> None:
        """While withdrawn for an engine not producing: a one-token canary generation every health poll interval; the
        first that the engine answers to its end restores the worker."""
        probes = 0
        while True:
            await self._not_producing_noticed.wait()
            self._not_producing_noticed = trio.Event()
            while self._not_producing is not None and self.lifecycle.state == "degraded" and self.discovery is not None:
                await trio.sleep(self.config.health_poll_interval_s)
                probes += 1
                failure = await probe_generation(
                    self.host.serving_context(self.discovery),
                    f"openengine-sidecar-canary-{os.getpid()}-{probes}",
                    self.config.request_inactivity_timeout_s,
                )
                if failure is not None:
                    log.warning("canary generation failed (%s): still withdrawn", failure)
                    continue
                if self._not_producing is not None and self.lifecycle.state == "degraded":
                    log.info("canary generation answered: the engine produces again")
                    self._not_producing = None
                    await self._recover()

    # ------------------------------------------------------------------ the way back

    async def engine_lost(self, reason: str, *, claimed_change: bool = False) -> None:
        """reconnecting: withdraw, fail in-flight requests migratably, reconnect with backoff, rediscover.

        Also the way back from a quick engine restart (:meth:`watch_identity`): the same rediscovery, and the model
        card is registered again with what the new engine reports. One at a time: a second caller whose engine was
        rediscovered while it waited stands down.
        """
        generation = self._engine_generation
        async with self._reconnecting:
            if generation != self._engine_generation or self.lifecycle.state not in _WATCHED:
                return
            await self._reconnect(reason, claimed_change=claimed_change)
            self._engine_generation += 1

    async def _reconnect(self, reason: str, *, claimed_change: bool = False) -> None:
        life = self.lifecycle
        config = self.config
        client = self.client
        before = self.discovery
        if config.exit_on_engine_loss:
            life.fire("fail", reason=f"engine lost ({reason}) and --exit-on-engine-loss is set")
            self.fatal.set()
            await trio.sleep_forever()
        life.fire("engine_lost", reason=reason)
        metrics.RECONNECTS.labels(stage="lost").inc()
        self.requests.attach(None)
        await self.host.withdraw()
        if not claimed_change:
            # Streams on a dropped connection fail by themselves; this covers an engine that hangs instead. After a
            # restart the watch found only once another engine answered, the streams of the old one are gone with
            # its connections, and those in flight run on the new one, which took them: they are left alone.
            failed = self.requests.cancel_all(EngineGone(f"engine lost ({reason}); retry on another worker"))
            if failed:
                log.warning("engine lost: %d in-flight request(s) failed over", failed)
        while True:
            accepted_at, server = await self._wait_for_engine()
            answered_at = trio.current_time()
            if client.going_away is not None:
                # A GOAWAY heard while reconnecting came from the engine being left (its last connections closing):
                # the one that answers now said nothing. Its episode ends with those connections (bounded), or the
                # watch would take the worker out again the moment it serves.
                await client.wait_drained(timeout_s=config.drain_timeout_s)
            life.fire("reconnected")
            try:
                deadline = trio.current_time() + config.grpc_startup_deadline_s
                self.discovery = await self.discover_until_ready(deadline, server=server)
                break
            except (StartupRefused, SchemaIncompatible) as exc:
                life.fire("fail", reason=f"the restarted engine is not the one registered: {exc}")
                self.fatal.set()
                await trio.sleep_forever()
            except EngineRpcError as exc:
                if exc.code not in _ENGINE_GONE_CODES:
                    life.fire("fail", reason=f"rediscovering the engine failed: {exc}")
                    self.fatal.set()
                    await trio.sleep_forever()
                # It answered once and is gone again (a restart still in progress, or an engine still draining
                # after its GOAWAY): wait for it again rather than give up.
                life.fire("engine_lost", reason=f"the engine went away again during rediscovery: {exc}")
        ready_at = trio.current_time()
        await self._bound_repeats(before, self.discovery, claimed_change=claimed_change)
        # Before routing resumes: a request for an adapter the restarted engine lacks would fail with NOT_FOUND.
        await self.host.engine_restarted()
        self.identity.expect(self.discovery.caps.instance_id)
        self._not_producing = None  # over with the rediscovered engine
        self.requests.attach(self.host.serving_context(self.discovery))
        held_from = trio.current_time()
        # The card first: what the engine now reports (capabilities, limits) is registered before the instance is
        # routable again.
        held = await self.host.into_routing(self.host.card(self.discovery))
        done = trio.current_time()
        if held is None:
            life.fire("registered", reason="engine back")
            log.info(
                "engine back: serving again %.0f ms after it accepted a connection (GetServerInfo answered after "
                "%.0f ms, discovered and ready after %.0f ms more, %sregistered and routable %.0f ms later)",
                (done - accepted_at) * 1000,
                (answered_at - accepted_at) * 1000,
                (ready_at - answered_at) * 1000,
                f"held out of routing {held_from - ready_at:.1f}s, " if held_from - ready_at >= 0.1 else "",
                (done - held_from) * 1000,
            )
        else:
            # Requests that still arrive are served; routing resumes when the watchdog has written every entry.
            life.fire("degrade", reason=held)
        metrics.RECONNECTS.labels(stage="recovered").inc()
        self._last_rediscovery = trio.current_time()

    async def _bound_repeats(self, before: Discovery | None, found: Discovery, *, claimed_change: bool) -> None:
        """Bound the reconnections that were told the engine changed and found the very engine they had.

        Something keeps claiming a new engine that answers as the old one (two engines behind one address, a load
        balancer answering GetLoad from another backend than GetServerInfo): each such false claim soon after the
        last one (within ``--reconnect-backoff-max-secs``) waits out of routing (1, 2, 4 … s, capped), and the
        :data:`_REDISCOVERY_REPEAT_LIMIT`-th in a row fails the worker (one line) so that a supervisor sees it,
        instead of a reconnect loop that never ends -- or, against an engine that answers at once, never even
        blocks. An outage (health, GOAWAY, a partition) is no claim: the same engine coming back is what it should.
        """
        config = self.config
        if not claimed_change or before is None or differences(before, found):
            self._rediscovery_repeats = 0
            return
        instance = found.caps.instance_id
        last = self._last_rediscovery
        if last is None or trio.current_time() - last >= config.reconnect_backoff_max_s:
            self._rediscovery_repeats = 0  # the last false claim is long past: a new series
        self._rediscovery_repeats += 1
        repeats = self._rediscovery_repeats
        if repeats >= _REDISCOVERY_REPEAT_LIMIT:
            reason = (
                f"told {repeats} times in a row that the engine changed, the worker found the same instance "
                f"{instance!r} each time: something keeps claiming a new engine (two engines behind one address?)"
            )
            self.lifecycle.fire("fail", reason=reason)
            log.error("%s; exiting so that a supervisor starts a fresh worker", reason)
            self.fatal.set()
            await trio.sleep_forever()
        wait_s = min(config.grpc_retry_interval_s * 2 ** (repeats - 1), config.reconnect_backoff_max_s)
        log.warning(
            "told the engine changed, the worker found the same instance %r (%d of %d in a row): waiting %.1fs "
            "before serving it again",
            instance,
            repeats,
            _REDISCOVERY_REPEAT_LIMIT,
            wait_s,
        )
        await trio.sleep(wait_s)

    async def _wait_for_engine(self) -> tuple[float, ServerInfo]:
        """Until the engine answers GetServerInfo again: when its port was first seen accepting connections, and the
        answer.

        Two halves (docs/faults.md, *The way back*). The cheap one: while nothing accepts connections on the engine's
        address, a connect every :data:`PROBE_INTERVAL_S` and nothing else -- a refused connect costs the engine
        nothing, so serving resumes within moments of the engine listening however long the outage. The expensive
        one, a GetServerInfo call, runs at once when the port accepts after refusing, and otherwise with capped
        exponential backoff and jitter (``--grpc-retry-interval-secs`` doubling up to
        ``--reconnect-backoff-max-secs``): an engine that accepts but does not answer yet is not hammered, and many
        workers do not retry in step. A host that answers no connect at all (packets dropped) gets the expensive
        attempts on the backoff schedule. The load poller's first answer from the engine also ends a wait.
        """
        config = self.config
        backoff = config.grpc_retry_interval_s
        next_attempt = trio.current_time()
        accepted_at: float | None = None
        refusing = False
        logged = False
        while True:
            self.identity.answered = trio.Event()
            state = await self.probe.accepts(self._probe_timeout_s)
            now = trio.current_time()
            if state is False:
                if not logged:
                    log.info(
                        "engine at %s not reachable: nothing accepts connections there; probing every %.0f ms",
                        self.probe.endpoint,
                        PROBE_INTERVAL_S * 1000,
                    )
                    logged = True
                refusing, accepted_at = True, None
                with trio.move_on_after(PROBE_INTERVAL_S):
                    await self.identity.answered.wait()
                continue
            if state and accepted_at is None:
                accepted_at = now
            if refusing or now >= next_attempt:
                refusing = False
                try:
                    server = await self.client.get_server_info(timeout_s=config.grpc_connect_attempt_timeout_s)
                    return (accepted_at if accepted_at is not None else now), server
                except EngineRpcError as exc:
                    wait_s = backoff * random.uniform(0.8, 1.2)
                    log.info("engine not back yet (%s); next attempt in %.1fs", exc, wait_s)
                    next_attempt = trio.current_time() + wait_s
                    backoff = min(backoff * 2, config.reconnect_backoff_max_s)
            # Accepting (or silent) but not answering yet: probe on, so that a port that refuses in between (the
            # engine restarting again) is seen; the next attempt comes at its time, or at the load poller's answer.
            with trio.move_on_after(max(0.0, min(PROBE_INTERVAL_S, next_attempt - trio.current_time()))):
                await self.identity.answered.wait()
            if self.identity.answered.is_set():
                next_attempt = trio.current_time()


def differences(old: Discovery, new: Discovery) -> list[str]:
    """What a worker serving ``old`` would have to change for ``new``: instance, role, model, schema, capabilities,
    limits."""
    return [
        what
        for what, before, after in (
            ("instance", old.caps.instance_id, new.caps.instance_id),
            ("role", old.role, new.role),
            ("model", old.model, new.model),
            ("schema release", old.server.schema_release, new.server.schema_release),
            ("capabilities", old.caps, new.caps),
            ("context length", old.context_length, new.context_length),
        )
        if before != after
    ]


async def _first_of(*events: trio.Event) -> None:
    async with trio.open_nursery() as nursery:
        for event in events:

            async def wait(event: trio.Event = event) -> None:
                await event.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(wait)
