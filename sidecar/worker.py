"""The worker: its nursery tree, its lifecycle machine, start-up and drain.

Nursery tree (hypercorn's shape)::

    run_worker
    └── signals ⊃ edge thread ⊃ engine client ⊃ Dynamo runtime
        └── request nursery: one task per request (sidecar.requests), the Dynamo serve task

Drain on SIGTERM/SIGINT: stop accepting (new requests get a migratable error, the model card and instance are
withdrawn from discovery first), let in-flight requests finish until ``--drain-timeout-secs``, then cancel the
stragglers with reason "drain deadline" (each aborted on the engine, each client told to retry elsewhere), shut the
runtime down and exit 0. A second signal skips the wait. Every step is a worker-machine transition and a log line.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import TYPE_CHECKING, Final

import trio

from sidecar.dynamo import DynamoSettings, open_dynamo
from sidecar.edge import open_edge
from sidecar.engine import EngineClientConfig, SchemaIncompatible, open_engine_client, parse_endpoint
from sidecar.errors import EngineRpcError, WorkerDraining
from sidecar.ops import metrics
from sidecar.requests import CANARY_PAYLOAD, RequestServer, ServingContext
from sidecar.startup import StartupRefused, check_unchanged, discover, registration_for, wait_ready
from statemachines import WORKER, WorkerLifecycle

if TYPE_CHECKING:
    from sidecar.cli import SidecarConfig
    from sidecar.dynamo import DynamoWorker
    from statemachines import WorkerEvent, WorkerState

log: Final = logging.getLogger("sidecar.worker")

# After the drain deadline has cancelled the stragglers, how long their aborts may take before teardown.
_STRAGGLER_GRACE_S: Final = 5.0


def _observe_worker(model: WorkerLifecycle, event: WorkerEvent, source: WorkerState, dest: WorkerState) -> None:
    reason = f": {model.reason}" if model.reason else ""
    log.info("worker %s -> %s (%s)%s", source, dest, event, reason)
    metrics.WORKER_STATE.labels(state=source).set(0)
    metrics.WORKER_STATE.labels(state=dest).set(1)


def _client_config(config: SidecarConfig) -> EngineClientConfig:
    return EngineClientConfig(
        endpoint=parse_endpoint(config.grpc_endpoint),
        connections=config.grpc_connections,
        rpc_timeout_s=config.grpc_rpc_timeout_s,
        connect_attempt_timeout_s=config.grpc_connect_attempt_timeout_s,
        retry_interval_s=config.grpc_retry_interval_s,
        startup_deadline_s=config.grpc_startup_deadline_s,
    )


def _dynamo_settings(config: SidecarConfig, role: str) -> DynamoSettings:
    component = config.component or ("prefill" if role == "prefill" else "backend")
    return DynamoSettings(
        discovery_backend=config.discovery_backend,  # type: ignore[arg-type]
        request_plane=config.request_plane,  # type: ignore[arg-type]
        event_plane=config.event_plane,  # type: ignore[arg-type]
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
        async with trio.open_nursery() as top:
            top.start_soon(self.watch_signals)
            try:
                status = await self._run()
            finally:
                top.cancel_scope.cancel(reason="worker finished")
        return status

    async def _run(self) -> int:
        config = self.config
        life = self.lifecycle
        async with open_edge() as edge, open_engine_client(edge, _client_config(config)) as client:
            first = None
            with trio.CancelScope() as startup:
                # A signal during start-up ends it: nothing is registered yet, so nothing needs draining.
                async with trio.open_nursery() as guard:
                    guard.start_soon(_cancel_on, self._stop, startup)
                    try:
                        deadline = trio.current_time() + config.grpc_startup_deadline_s
                        life.fire("connect", reason=config.grpc_endpoint)
                        await client.wait_connected(deadline)
                        life.fire("connected")
                        first = await discover(client, config)
                        life.fire("discovered", reason=f"{first.caps.engine_name}, model {first.model!r}")
                        await wait_ready(client, deadline=deadline, retry_interval_s=config.grpc_retry_interval_s)
                        again = await discover(client, config)
                        check_unchanged(first, again)
                        life.fire("ready")
                    except (StartupRefused, SchemaIncompatible, EngineRpcError) as exc:
                        life.fire("fail", reason=str(exc))
                        log.error("refusing to start: %s", exc)
                        return 1
                    finally:
                        guard.cancel_scope.cancel()
            if startup.cancelled_caught or first is None:
                life.fire("stop", reason="shutdown requested during start-up")
                return 0

            registration = registration_for(first, config)
            serving = ServingContext(
                client=client,
                caps=first.caps,
                model=first.model,
                context_length=first.context_length,
                abort_timeout_s=config.abort_timeout_s,
                inactivity_timeout_s=config.request_inactivity_timeout_s,
            )
            settings = _dynamo_settings(config, first.role)
            async with open_dynamo(edge, settings) as dynamo, trio.open_nursery() as request_nursery:
                self.requests.attach(serving)
                await dynamo.register(registration)
                await dynamo.serve(request_nursery, self.requests.handle, health_check_payload=CANARY_PAYLOAD)
                life.fire("registered", reason=f"model {registration.served_model_name!r}")
                await self._stop.wait()
                await self._drain(dynamo)
                request_nursery.cancel_scope.cancel(reason="worker drained")
            life.fire("drained")
        return 0

    async def _drain(self, dynamo: DynamoWorker) -> None:
        life = self.lifecycle
        config = self.config
        life.fire("drain", reason=f"{self.requests.in_flight} request(s) in flight")
        # Stop accepting first: a request that still arrives is sent elsewhere.
        self.requests.attach(None)
        with trio.CancelScope(shield=True), trio.move_on_after(config.grpc_rpc_timeout_s):
            await dynamo.unregister()
        log.info("deregistered; waiting up to %gs for %d request(s)", config.drain_timeout_s, self.requests.in_flight)
        with trio.move_on_after(config.drain_timeout_s):
            async with trio.open_nursery() as wait:
                wait.start_soon(_cancel_on, self._force, wait.cancel_scope)
                await self.requests.wait_idle()
                wait.cancel_scope.cancel()
        cancelled = self.requests.cancel_all(WorkerDraining("drain deadline: retry on another worker"))
        if cancelled:
            log.warning("drain deadline: cancelled %d request(s)", cancelled)
        with trio.move_on_after(_STRAGGLER_GRACE_S):
            await self.requests.wait_idle()
        with trio.move_on_after(config.grpc_rpc_timeout_s):
            await dynamo.shutdown()


async def _cancel_on(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel(reason="signal")


def run_worker(config: SidecarConfig) -> int:
    """Run the worker until it drains (0) or refuses/fails (1)."""
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # transitions logs every callback at INFO; the worker's own observer logs what an operator needs.
    logging.getLogger("transitions").setLevel(logging.WARNING)
    if _observe_worker not in WORKER.observers:
        WORKER.observers.append(_observe_worker)
    worker = Worker(config)
    return trio.run(worker.run)
