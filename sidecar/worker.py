"""The worker: its nursery tree, its lifecycle machine, start-up and drain.

Nursery tree (hypercorn's shape)::

    run_worker
    └── signals ⊃ edge thread ⊃ engine client ⊃ Dynamo runtime
        ├── request nursery: one task per request (sidecar.requests), the Dynamo serve task
        └── watchers: routing signals (sidecar.kv), the engine watch (sidecar.enginewatch: health, identity, stalls,
            the way back after a lost engine), the registration watchdog

The worker is the engine watch's host (``WatchHost``): it routes the instance in and out, builds the model card and
the serving context, and resyncs LoRA adapters after a restart; the watch decides when.

Drain on SIGTERM/SIGINT: stop accepting (new requests get a migratable error, the model card and instance are
withdrawn from discovery first), let in-flight requests finish until ``--drain-timeout-secs``, then cancel the
stragglers with reason "drain deadline" (each aborted on the engine, each client told to retry elsewhere), shut the
runtime down and exit 0. A second signal skips the wait. Every step is a worker-machine transition and a log line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from collections.abc import Awaitable, Mapping, MutableMapping
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import trio

from sidecar.dynamo import (
    ControlPlaneError,
    ControlPlaneUnreachable,
    DynamoSettings,
    RegistrationRefused,
    open_dynamo,
)
from sidecar.edge import loop_tasks, open_edge
from sidecar.engine import EngineClientConfig, SchemaIncompatible, open_engine_client, parse_endpoint
from sidecar.enginewatch import EngineWatch
from sidecar.errors import EngineGone, EngineRpcError, WorkerDraining
from sidecar.http2 import apply_tunings
from sidecar.kv import RoutingPlan, discover_routing, routing_config, run_routing_signals
from sidecar.lora import CONTROLS, LoraManager, LoraSettings, observe_lora
from sidecar.ops import logs, metrics
from sidecar.ops.health import LIVE_ROUTE, SystemPort, liveness
from sidecar.ops.server import serve_live_state
from sidecar.requests import RequestServer, ServingContext
from sidecar.startup import Discovery, StartupRefused, engine_detokenizes, registration_for
from statemachines import LORA, WORKER, WorkerLifecycle

if TYPE_CHECKING:
    from collections.abc import Callable

    from sidecar.config import SidecarConfig
    from sidecar.dynamo import DynamoWorker, Registration, RestoreReport
    from sidecar.engine import EngineClient
    from statemachines import WorkerEvent, WorkerState

log: Final = logging.getLogger("sidecar.worker")

# After the drain deadline has cancelled the stragglers, how long their aborts may take before teardown.
_STRAGGLER_GRACE_S: Final = 5.0
# Registration checks in a row that could not restore what discovery lost before the worker exits 1 (60 s at the
# default 5 s interval): out of routing that long, only a fresh process (or its refusal to start) can tell more.
_REGISTRATION_GIVE_UP_CHECKS: Final = 12


def _observe_worker(model: WorkerLifecycle, event: WorkerEvent, source: WorkerState, dest: WorkerState) -> None:
    reason = f": {model.reason}" if model.reason else ""
    log.info("worker %s -> %s (%s)%s", source, dest, event, reason)
    metrics.WORKER_STATE.labels(state=source).set(0)
    metrics.WORKER_STATE.labels(state=dest).set(1)


def _client_config(config: SidecarConfig) -> EngineClientConfig:
    client = EngineClientConfig(
        endpoint=parse_endpoint(config.grpc_endpoint, tls=config.grpc_tls_ca is not None),
        connections=config.grpc_connections,
        tls_ca=config.grpc_tls_ca,
        tls_cert=config.grpc_tls_cert,
        tls_key=config.grpc_tls_key,
        tls_key_password_file=config.grpc_tls_key_password_file,
        rpc_timeout_s=config.grpc_rpc_timeout_s,
        connect_attempt_timeout_s=config.grpc_connect_attempt_timeout_s,
        retry_interval_s=config.grpc_retry_interval_s,
        startup_deadline_s=config.grpc_startup_deadline_s,
        direct_receive=config.grpc_receive == "direct",
    )
    # A stopped or paused engine answers no HTTP/2 PING either: the keepalive must not close its connections (and
    # fail their streams) before each stream's own inactivity timeout has had its say (docs/faults.md, the stall).
    keepalive_timeout_s = max(client.keepalive_timeout_s, config.request_inactivity_timeout_s)
    return dataclasses.replace(client, keepalive_timeout_s=keepalive_timeout_s)


def _component(config: SidecarConfig, role: str | None) -> str:
    """The Dynamo component: the flag, else by role (before discovery: by --disaggregation-mode)."""
    role = role or config.disaggregation_mode
    return config.component or ("prefill" if role == "prefill" else "backend")


def _dynamo_settings(config: SidecarConfig, role: str) -> DynamoSettings:
    component = _component(config, role)
    return DynamoSettings(
        discovery_backend=config.discovery_backend,  # type: ignore[arg-type]
        request_plane=config.request_plane,  # type: ignore[arg-type]
        event_plane=config.event_plane,  # type: ignore[arg-type]
        response_plane=config.response_plane,
        egress=config.dynamo_egress,
        namespace=config.namespace,
        component=component,
        endpoint=config.endpoint,
    )


class Worker:
    """One worker process: owns the lifecycle machine and the request server."""

    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.lifecycle = WorkerLifecycle()
        self.requests = RequestServer()
        self._stop = trio.Event()
        self._force = trio.Event()
        # Set when the worker must exit 1 (engine lost with --exit-on-engine-loss, a different engine came back).
        self._fatal = trio.Event()
        self._routing: RoutingPlan | None = None
        self._lora: LoraManager | None = None
        # The engine watch (sidecar.enginewatch), made once the engine client is open.
        self.watch: EngineWatch | None = None
        self._client: EngineClient | None = None
        self._dynamo: DynamoWorker | None = None
        self._engine_detokenize: bool | None = None  # the last decision logged
        # The system port, ours for the whole life (None without DYN_SYSTEM_PORT), and Dynamo's readiness switch,
        # set on every transition so its own port behind ours agrees (see sidecar.ops.health).
        self._system_port: SystemPort | None = None
        self._set_ready: Callable[[bool], None] | None = None
        # Set while the registration watchdog keeps the worker out of serving (an entry it cannot restore).
        self._registration_lost = False

    async def watch_signals(self) -> None:
        """First SIGTERM/SIGINT drains; a second one skips waiting for in-flight requests."""
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if not self._stop.is_set():
                    log.info("%s received: draining (a second signal forces a fast exit)", name)
                    self._stop.set()
                else:
                    log.warning("%s received again: cancelling in-flight requests now", name)
                    self._force.set()

    async def run(self) -> int:
        """Run until drained (exit status 0) or refused/failed (1)."""
        config = self.config
        metrics.set_dynamo_labels(config.namespace, _component(config, None), config.endpoint, config.served_model_name)
        WORKER.observers.append(self._push_readiness)
        try:
            async with trio.open_nursery() as top:
                top.start_soon(self.watch_signals)
                metrics.mark_worker_state(self.lifecycle.state)
                refused: str | None = None
                try:
                    # Both ports before anything is contacted: start-up itself can be watched and probed.
                    if config.ops_port is not None:
                        await top.start(serve_live_state, self.lifecycle, config.ops_host, config.ops_port)
                    if port := system_port(os.environ):
                        host = os.environ.get("DYN_SYSTEM_HOST") or LOOPBACK_DEFAULTS["DYN_SYSTEM_HOST"]
                        # A LoRA load answers once the adapter is fetched and loaded: the relay waits that long.
                        control_s = config.lora_fetch_timeout_s + config.lora_load_timeout_s + 30.0
                        self._system_port = SystemPort(
                            self.lifecycle,
                            host,
                            port,
                            control_timeout_s=control_s,
                            dynamo_port=config.dynamo_system_port,
                        )
                        await top.start(self._system_port.run)
                        # Dynamo's runtime binds its own system server behind ours; set now, while no runtime thread
                        # reads the environment.
                        os.environ.update(self._system_port.dynamo_environment())
                except* OSError as group:
                    error = _first_leaf(group)
                    refused = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
                if refused is not None:
                    self.lifecycle.fire("fail", reason=refused)
                    log.error("refusing to start: %s", refused)
                    top.cancel_scope.cancel(reason="a port could not be bound")
                    return 1
                try:
                    status = await self._run()
                except* ControlPlaneError as group:
                    status = self._control_plane_failed(group)
                finally:
                    top.cancel_scope.cancel(reason="worker finished")
        finally:
            WORKER.observers.remove(self._push_readiness)
        return status

    def _push_readiness(
        self, model: WorkerLifecycle, event: WorkerEvent, source: WorkerState, dest: WorkerState
    ) -> None:
        """Dynamo's /health follows the worker: ready exactly while serving (a synchronous observer: posts only)."""
        if model is self.lifecycle and self._set_ready is not None:
            self._set_ready(dest == "serving")

    async def _run(self) -> int:
        config = self.config
        life = self.lifecycle
        async with open_edge() as edge, open_engine_client(edge, _client_config(config)) as client:
            metrics.watch_tasks(trio.lowlevel.current_root_task(), partial(loop_tasks, edge.loop))
            self._client = client
            watch = self.watch = EngineWatch(config, life, self.requests, client, self, self._fatal)
            first = None
            with trio.CancelScope() as startup:
                # A signal during start-up ends it: nothing is registered yet, so nothing needs draining.
                async with trio.open_nursery() as guard:
                    guard.start_soon(_cancel_on, self._stop, startup)
                    try:
                        deadline = trio.current_time() + config.grpc_startup_deadline_s
                        life.fire("connect", reason=config.grpc_endpoint)
                        await watch.wait_listening(deadline)
                        server = await client.wait_connected(deadline)
                        life.fire("connected")
                        first = await watch.discover_until_ready(deadline, server=server)
                    except (StartupRefused, SchemaIncompatible, EngineRpcError) as exc:
                        life.fire("fail", reason=str(exc))
                        log.error("refusing to start: %s", exc)
                        return 1
                    finally:
                        guard.cancel_scope.cancel()
            if startup.cancelled_caught or first is None:
                life.fire("stop", reason="shutdown requested during start-up")
                return 0

            watch.adopt(first)
            # KV event sources are discovered before registering: with events, the model registers for KV routing.
            plan = self._routing = await discover_routing(client, first.caps, routing_config(config))
            registration = self._registration(first)
            settings = _dynamo_settings(config, first.role)
            metrics.set_dynamo_labels(
                settings.namespace, settings.component, settings.endpoint, registration.served_model_name
            )
            if self._system_port is not None:
                # Dynamo's runtime binds the port reserved for it when it is created.
                self._system_port.release_dynamo_port()
            controls = (CONTROLS if first.caps.supports_lora else ()) + (
                (config.rl_endpoint,) if config.enable_rl else ()
            )
            async with open_dynamo(edge, settings, controls=controls) as dynamo, trio.open_nursery() as request_nursery:
                self._dynamo = dynamo
                await self._adopt_system_port(dynamo)
                await dynamo.export_metrics(metrics.exposition, metrics.typed_families)
                self.requests.attach(self.serving_context(first))
                try:
                    await dynamo.register(registration)
                except RegistrationRefused as exc:
                    life.fire("fail", reason=str(exc))
                    log.error("refusing to start: %s", exc)
                    return 1
                # No canary payload: with one, Dynamo 1.6.1 derives /health from its canary and ignores the worker's
                # state (a reconnecting worker answered 200).
                await dynamo.serve(request_nursery, self.requests.handle)
                if config.enable_rl:
                    await dynamo.serve_rl(request_nursery, config.rl_endpoint, await self._rl_system_url(dynamo))
                if first.caps.supports_lora:
                    await self._serve_loras(client, dynamo, request_nursery, registration)
                life.fire("registered", reason=f"model {registration.served_model_name!r}")
                async with trio.open_nursery() as watchers:
                    signals = partial(
                        run_routing_signals, identity=watch.identity, in_flight=self.requests.tokens_in_flight
                    )
                    await watchers.start(signals, client, dynamo, plan, routing_config(config))
                    watchers.start_soon(watch.run)
                    watchers.start_soon(self._watch_registration, dynamo)
                    await _first_of(self._stop, self._fatal)
                    watchers.cancel_scope.cancel(reason="worker stopping")
                if self._fatal.is_set():
                    await self._fail_fast(dynamo)
                    request_nursery.cancel_scope.cancel(reason="worker failed")
                else:
                    quiescent = await self._drain(dynamo, client)
                    request_nursery.cancel_scope.cancel(reason="worker drained")
            self._set_ready = None
            if self._system_port is not None:
                self._system_port.answer_alone()
            if self._fatal.is_set():
                return 1
            life.fire("drained", reason=None if quiescent else "engine quiescence not confirmed")
        return 0 if quiescent else 1

    async def _adopt_system_port(self, dynamo: DynamoWorker) -> None:
        """Dynamo's system server runs behind ours: relay to it; its own /health follows our state too, and its
        /engine/live answers like ours (the only liveness with the state when ``DYN_SYSTEM_PORT=0`` leaves the
        sidecar no port of its own)."""
        life = self.lifecycle

        async def live(body: dict[str, Any]) -> dict[str, Any]:
            del body
            return liveness(life)

        self._set_ready = dynamo.set_health
        # Also covers DYN_SYSTEM_STARTING_HEALTH_STATUS=ready: nothing is ready before `serving`.
        dynamo.set_health(life.state == "serving")
        await dynamo.add_system_route(LIVE_ROUTE, live)
        if self._system_port is not None:
            self._system_port.forward_to_dynamo(await dynamo.system_server_port())

    async def _rl_system_url(self, dynamo: DynamoWorker) -> str:
        """The system port's URL for the RL endpoint's answer (``/engine/<route>`` is relayed from it): ours, else
        Dynamo's own (``DYN_SYSTEM_PORT=0``); an unspecified bind address is advertised as the request plane's."""
        if self._system_port is not None:
            host, port = self._system_port.host, self._system_port.port
        else:
            host = os.environ.get("DYN_SYSTEM_HOST") or LOOPBACK_DEFAULTS["DYN_SYSTEM_HOST"]
            port = await dynamo.system_server_port() or 0
        if host in ("0.0.0.0", "::"):
            host = os.environ.get("DYN_TCP_RPC_HOST") or LOOPBACK_DEFAULTS["DYN_TCP_RPC_HOST"]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def _registration(self, discovery: Discovery) -> Registration:
        """The model card: ``registration_for``, in KV-routing mode when the routing plan says events flow."""
        registration = registration_for(discovery, self.config)
        return self._routing.registration(registration) if self._routing is not None else registration

    async def _serve_loras(
        self, client: EngineClient, dynamo: DynamoWorker, nursery: trio.Nursery, registration: Registration
    ) -> None:
        """The engine advertises LoRA: serve load_lora / unload_lora / list_loras and adopt what the engine holds."""
        config = self.config
        settings = LoraSettings(
            root=config.lora_root,
            load_timeout_s=config.lora_load_timeout_s,
            fetch_timeout_s=config.lora_fetch_timeout_s,
            reserved_names=frozenset({registration.served_model_name, *registration.aliases}),
        )
        manager = self._lora = LoraManager(client, dynamo, settings)
        await dynamo.serve_controls(nursery, manager.routes())
        await manager.sync(engine_restarted=False)
        log.info(
            "LoRA controls served (load_lora, unload_lora, list_loras; root %s)",
            config.lora_root or "unset: loads refused",
        )

    def _control_plane_failed(self, group: BaseExceptionGroup[ControlPlaneError]) -> int:
        """etcd/NATS unreachable at start-up, or the runtime lost its lease while serving: one line, exit 1."""
        error = _first_leaf(group)
        if not self.lifecycle.is_terminal:
            self.lifecycle.fire("fail", reason=str(error))
        log.error("%s%s", "refusing to start: " if isinstance(error, ControlPlaneUnreachable) else "", error)
        return 1

    # ------------------------------------------------------------------ what the engine watch asks (WatchHost)

    @property
    def registration_held(self) -> bool:
        return self._registration_lost

    def card(self, discovery: Discovery) -> Registration:
        return self._registration(discovery)

    async def withdraw(self) -> None:
        assert self._dynamo is not None
        await _best_effort("withdrawal from routing", self._dynamo.withdraw(), self.config.grpc_rpc_timeout_s)

    async def engine_restarted(self) -> None:
        if self._lora is not None:
            await self._lora.sync(engine_restarted=True)

    def serving_context(self, discovery: Discovery) -> ServingContext:
        assert self._client is not None
        detokenize = engine_detokenizes(self.config.engine_detokenize, discovery.caps.engine_name)
        if detokenize != self._engine_detokenize:
            self._engine_detokenize = detokenize
            log.info(
                "engine detokenization %s (--engine-detokenize %s, engine %s)",
                "on" if detokenize else "off for requests without top or prompt logprobs (extra.detokenize=false)",
                self.config.engine_detokenize,
                discovery.caps.engine_name,
            )
        return ServingContext(
            client=self._client,
            caps=discovery.caps,
            model=discovery.model,
            context_length=discovery.context_length,
            abort_timeout_s=self.config.abort_timeout_s,
            inactivity_timeout_s=self.config.request_inactivity_timeout_s,
            role=discovery.role,
            engine_detokenize=detokenize,
        )

    async def into_routing(self, card: Registration | None) -> str | None:
        """Register ``card`` (if given), then put the instance back into routing; or say why the worker stays out.

        While the registration watchdog holds the worker out (an entry it cannot write), the instance stays
        withdrawn: the watchdog restores it with everything else once it can. A write refused here hands the worker
        to the watchdog the same way, instead of raising out of the watch that called this and ending the worker.
        """
        dynamo = self._dynamo
        assert dynamo is not None
        try:
            if card is not None:
                await dynamo.register(card)
            if not self._registration_lost:
                await dynamo.restore()
                return None
            problem = "an entry the registration watchdog cannot write yet"
        except ControlPlaneError:
            raise
        except Exception as exc:
            problem = " ".join(str(exc).split()) or type(exc).__name__
            self._registration_lost = True
            log.error(
                "our discovery registration cannot be published (%s): out of routing, retrying every %gs",
                problem,
                self.config.registration_check_interval_s,
            )
        return f"discovery registration lost and not restored ({problem})"

    # ------------------------------------------------------------------ supervision

    async def _watch_registration(self, dynamo: DynamoWorker) -> None:
        """File discovery never restores a lost entry by itself: every check puts back each one we published.

        What cannot be put back takes the worker out of serving (degraded, withdrawn from routing: one line) until a
        later check restores everything; after :data:`_REGISTRATION_GIVE_UP_CHECKS` failed checks in a row the worker
        exits 1 so that its supervisor starts a fresh one. A lost lease (etcd) ends it at once (ControlPlaneLost).
        """
        interval = self.config.registration_check_interval_s
        failed_checks = 0
        while True:
            await trio.sleep(interval)
            state = self.lifecycle.state
            if state != "serving" and not (state == "degraded" and self._registration_lost):
                continue
            report = await dynamo.republish(restore_instance=self._registration_lost)
            metrics.REGISTRATION_RESTORES.inc(len(report.restored))
            metrics.REGISTRATION_RESTORE_FAILURES.inc(len(report.failed))
            if not report.failed:
                failed_checks = 0
                if report.lost:
                    log.warning("%s", _restored_line(report))
                if self._registration_lost:
                    self._registration_lost = False
                    if self.lifecycle.state == "degraded":
                        self.lifecycle.fire("recover", reason="discovery registration restored")
                        self.lifecycle.fire("registered", reason="discovery registration restored")
                continue
            failed_checks += 1
            problem = "; ".join(f"{entry.what}: {why}" for entry, why in report.failed)
            if self.lifecycle.state == "serving":
                self._registration_lost = True
                self.lifecycle.fire("degrade", reason="discovery registration lost and not restored")
                log.error(
                    "our discovery registration disappeared and cannot be published again (%s): out of routing, "
                    "retrying every %gs, exiting after %d failed checks",
                    problem,
                    interval,
                    _REGISTRATION_GIVE_UP_CHECKS,
                )
                await _best_effort("withdrawal from routing", dynamo.withdraw(), self.config.grpc_rpc_timeout_s)
            if failed_checks >= _REGISTRATION_GIVE_UP_CHECKS:
                reason = f"discovery registration not restored in {failed_checks} checks ({problem})"
                self.lifecycle.fire("fail", reason=reason)
                log.error("%s: exiting so that a supervisor starts a fresh worker", reason)
                self._fatal.set()
                return

    async def _fail_fast(self, dynamo: DynamoWorker) -> None:
        """--exit-on-engine-loss or a refused engine: leave discovery, fail what is in flight, exit 1."""
        self.requests.attach(None)
        self.requests.cancel_all(EngineGone("engine lost: retry on another worker"))
        if self._lora is not None:
            self._lora.detach_all("failed")
        await _best_effort("deregistration", dynamo.unregister(), self.config.grpc_rpc_timeout_s, shield=True)
        with trio.move_on_after(_STRAGGLER_GRACE_S):
            await self.requests.wait_idle()

    # ------------------------------------------------------------------ drain

    async def _drain(self, dynamo: DynamoWorker, client: EngineClient) -> bool:
        """The hypercorn way: stop accepting, a deadline on in-flight requests, then confirm quiescence."""
        life = self.lifecycle
        config = self.config
        life.fire("drain", reason=f"{self.requests.in_flight} request(s) in flight")
        # Stop accepting first: a request that still arrives is sent elsewhere.
        self.requests.attach(None)
        if self._lora is not None:
            self._lora.detach_all("draining")
        await _best_effort("deregistration", dynamo.unregister(), config.grpc_rpc_timeout_s, shield=True)
        log.info("deregistered; waiting up to %gs for %d request(s)", config.drain_timeout_s, self.requests.in_flight)
        with trio.move_on_after(config.drain_timeout_s):
            async with trio.open_nursery() as wait:
                wait.start_soon(_cancel_on, self._force, wait.cancel_scope)
                await self.requests.wait_idle()
                wait.cancel_scope.cancel()
        cancelled = self.requests.cancel_all(WorkerDraining("drain deadline: retry on another worker"))
        if cancelled:
            log.warning("drain deadline: cancelled %d request(s); their engine requests are being aborted", cancelled)
        with trio.move_on_after(_STRAGGLER_GRACE_S):
            await self.requests.wait_idle()
        quiescent = await self._confirm_quiescence(client)
        await _best_effort("runtime shutdown", dynamo.shutdown(), config.grpc_rpc_timeout_s)
        return quiescent

    async def _confirm_quiescence(self, client: EngineClient) -> bool:
        """GetLoad must show nothing of ours left: running 0 (required), queued and KV sessions 0 when reported."""
        wait_s = self.config.abort_timeout_s + 1.0
        discovery = self.watch.discovery if self.watch is not None else None
        if discovery is not None and discovery.role == "prefill":
            # A prefill engine holds each handoff's KV blocks until a decode engine claims them: give the decode
            # legs already routed the drain budget to do so before calling the engine not quiescent.
            wait_s = max(wait_s, self.config.drain_timeout_s)
        deadline = trio.current_time() + wait_s
        last = "no answer"
        while True:
            try:
                load = await client.get_load(timeout_s=self.config.abort_timeout_s)
                figures = (load.running_requests, load.queued_requests, load.active_kv_sessions)
                last = "running={}, queued={}, kv_sessions={}".format(*figures)
                # A missing running count fails closed: an engine that cannot say it is idle is not idle.
                if load.running_requests == 0 and not load.queued_requests and not load.active_kv_sessions:
                    log.info("engine quiescent (%s)", last)
                    return True
            except EngineRpcError as exc:
                last = str(exc)
                if self.watch is not None and not await self.watch.listening():
                    # The engine runs beside this worker: nothing accepting on its address means no engine process,
                    # and nothing of ours left running on one.
                    log.info("engine quiescent: nothing listens at %s (%s)", self.config.grpc_endpoint, last)
                    return True
            if trio.current_time() >= deadline:
                log.error("drain could not confirm engine quiescence: %s", last)
                return False
            await trio.sleep(0.1)


def _restored_line(report: RestoreReport) -> str:
    lost, took = report.describe(report.lost), f"{report.seconds * 1000:.0f} ms"
    line = f"our discovery registration disappeared; publishing it again: restored {lost} in {took}"
    if report.recreated:
        line += (
            f"; the discovery directories {', '.join(report.recreated)} had been deleted: a Dynamo frontend running "
            "since before keeps watching the deleted ones and sees no worker until it is restarted"
        )
    return line


async def _best_effort(what: str, step: Awaitable[None], timeout_s: float, *, shield: bool = False) -> None:
    """A shutdown step that must not stop the ones after it: bounded, logged on failure, never raising."""
    with trio.CancelScope(shield=shield), trio.move_on_after(timeout_s) as bound:
        try:
            await step
        except Exception as exc:
            log.warning("%s failed: %s", what, exc)
    if bound.cancelled_caught:
        log.warning("%s did not finish within %gs", what, timeout_s)


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


async def _first_of(*events: trio.Event) -> None:
    async with trio.open_nursery() as nursery:
        for event in events:

            async def wait(event: trio.Event = event) -> None:
                await event.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(wait)


async def _cancel_on(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel(reason="signal")


# Dynamo binds its request plane to the first non-loopback address and its system server to 0.0.0.0 unless told
# otherwise. Every listener of ours is loopback unless the operator says so -- but for the planes other hosts must
# dial (REACHED_BY_PEERS) once discovery spans hosts: there a loopback address would be advertised to frontends in
# other pods, which cannot reach it.
LOOPBACK_DEFAULTS: Final = {
    "DYN_TCP_RPC_HOST": "127.0.0.1",
    "DYN_SYSTEM_HOST": "127.0.0.1",
    "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
}


#: The addresses Dynamo advertises in discovery for frontends and routers to dial: the request plane (TCP) and the
#: ZMQ event plane (KV events, load).
REACHED_BY_PEERS: Final = frozenset({"DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST"})
#: Discovery backends whose peers all run on this host (a file store, this process).
HOST_LOCAL_DISCOVERY: Final = frozenset({"file", "mem"})


def apply_loopback_defaults(environ: MutableMapping[str, str], discovery_backend: str = "file") -> list[str]:
    """Default Dynamo's listeners of this process to loopback; returns the variables it set. With discovery that
    spans hosts (etcd, kubernetes) the advertised planes keep Dynamo's own default, the host's address."""
    local = discovery_backend in HOST_LOCAL_DISCOVERY
    applied = [name for name in LOOPBACK_DEFAULTS if not environ.get(name) and (local or name not in REACHED_BY_PEERS)]
    for name in applied:
        environ[name] = LOOPBACK_DEFAULTS[name]
    return applied


def system_port(environ: Mapping[str, str]) -> int:
    """``DYN_SYSTEM_PORT`` as a number (0 when unset or 0: no system port the sidecar could serve before Dynamo)."""
    raw = environ.get("DYN_SYSTEM_PORT")
    return int(raw) if raw else 0


def disable_dynamo_canary(environ: MutableMapping[str, str]) -> bool:
    """``DYN_HEALTH_CHECK_ENABLED=true`` makes Dynamo 1.6.1 answer /health from its canary and endpoint registration,
    ignoring the worker's state; the sidecar polls the engine's Health itself. Returns whether it was turned off."""
    if environ.get("DYN_HEALTH_CHECK_ENABLED", "").strip().lower() in ("1", "true", "yes", "on"):
        environ["DYN_HEALTH_CHECK_ENABLED"] = "false"
        return True
    return False


def apply_cpu_scheduling(policy: str) -> str | None:
    """Give this thread -- and so every thread it starts later: the edge loop, trio's, Dynamo's runtime -- the
    scheduling policy ``policy``; returns why it could not, or None. Called before any of them exists."""
    if policy == "normal":
        return None
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError) as exc:  # not Linux, or a seccomp profile refusing it
        return f"SCHED_BATCH unavailable ({exc}); the worker's threads keep the default policy"
    return None


def run_worker(config: SidecarConfig) -> int:
    """Run the worker until it drains (0) or refuses/fails (1)."""
    scheduling_problem = apply_cpu_scheduling(config.cpu_scheduling)
    apply_loopback_defaults(os.environ, config.discovery_backend)
    canary_disabled = disable_dynamo_canary(os.environ)
    # The HTTP/2 layer's tunings of grpclib and hyperframe, process-wide: this process is the worker's alone
    # (docs/performance.md, "HTTP/2 layer tunings").
    apply_tunings()
    worker = Worker(config)
    logs.configure_logging(config.log_level, "json" if config.log_format == "json" else "text", worker.lifecycle)
    if scheduling_problem is not None:
        log.warning("%s", scheduling_problem)
    if canary_disabled:
        log.warning(
            "DYN_HEALTH_CHECK_ENABLED=true ignored: /health follows the worker state (the sidecar polls the engine's "
            "Health itself), and Dynamo's canary would override it"
        )
    # transitions logs every callback at INFO; the worker's own observer logs what an operator needs.
    logging.getLogger("transitions").setLevel(logging.WARNING)
    if _observe_worker not in WORKER.observers:
        WORKER.observers.append(_observe_worker)
    if observe_lora not in LORA.observers:
        LORA.observers.append(observe_lora)
    # Dynamo's bindings print each exception a request handler raised on sys.stderr, bare: made log lines too.
    logs.capture_stray_output()
    try:
        return trio.run(worker.run)
    finally:
        logs.release_stray_output()
