"""Readiness and liveness of the worker, and the system port while Dynamo's runtime does not exist yet.

The system port (``DYN_SYSTEM_HOST``:``DYN_SYSTEM_PORT``) is Dynamo's: its runtime serves ``/health``, ``/live``,
``/metrics`` and ``/engine/<route>`` there, and advertises it (self-hosted model cards, Kubernetes metadata). That
runtime is created only once the engine has been connected, discovered and found READY -- minutes, or up to the
start-up deadline while it retries a bad certificate. Until then the sidecar serves the port itself
(:class:`StartupPort`), so probes and scrapes see the truth from the first second:

    GET /health        503 {"status": "notready", "state": "connecting", "reason": "127.0.0.1:50051"}
    GET /live          200 {"status": "live", "state": ..., "reason": ..., "ready": false}
    GET /engine/live   the same as /live (the path that keeps answering after the hand-over, see below)
    GET /metrics       the sidecar's families (``sidecar.ops.metrics.exposition``)

Right before the runtime is created the sidecar closes its listener (:meth:`StartupPort.release`) and Dynamo binds
the port. From then on:

* ``/health`` is Dynamo's, driven by the worker: 200 exactly while the worker is ``serving``, 503 in every other state
  (``DistributedRuntime.set_health_status``, pushed on every worker transition). Dynamo 1.6.1's body has no room for
  the state and reason (``{"status": "notready", "uptime": ..., "endpoints": ...}``); ``/engine/live`` has them.
* ``/live`` is Dynamo's too, and Dynamo 1.6.1 answers it exactly like ``/health`` (one handler for both paths): a
  liveness probe on it would restart a worker that is only waiting for its engine. ``/engine/live`` (our route,
  :func:`liveness`) answers 200 while the process answers at all, with the state and reason: use it for liveness and
  start-up probes.
"""

from __future__ import annotations

import json
import logging
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import trio

from . import metrics
from .logs import latest_line
from .server import HEAD_TIMEOUT_S, read_request, respond

if TYPE_CHECKING:
    from statemachines import WorkerLifecycle

__all__ = ["LIVE_ROUTE", "StartupPort", "liveness", "readiness"]

log: Final = logging.getLogger("sidecar.ops")

#: The route (``/engine/<name>`` on the system port) that answers liveness in every phase.
LIVE_ROUTE: Final = "live"


def _state(worker: WorkerLifecycle) -> dict[str, Any]:
    state = worker.state
    # The state's reason says why it was entered (the endpoint, for connecting); the latest log line of that state
    # says what is happening now (the last attempt's error, while the worker retries a bad certificate).
    out: dict[str, Any] = {"state": state, "reason": worker.reason}
    if (detail := latest_line(state)) is not None:
        out["detail"] = detail
    return out


def readiness(worker: WorkerLifecycle) -> tuple[int, dict[str, Any]]:
    """``/health``: 200 ``ready`` while the worker is ``serving``, otherwise 503 ``notready``; with state and reason
    (and ``detail``, the latest log line of the state, when there is one)."""
    ready = worker.state == "serving"
    return (200 if ready else 503), {"status": "ready" if ready else "notready", **_state(worker)}


def liveness(worker: WorkerLifecycle) -> dict[str, Any]:
    """``/live`` and ``/engine/live``: the process answers; what it is doing and whether it is ready."""
    return {"status": "live", **_state(worker), "ready": worker.state == "serving"}


class StartupPort:
    """The system port, served by the sidecar until :meth:`release` hands it to Dynamo's runtime.

    Use: ``await nursery.start(port.run)`` (raises :class:`OSError` with one line when the port cannot be bound),
    later ``await port.release()`` (returns once the listener is closed; idempotent, also before ``run``).
    """

    def __init__(self, worker: WorkerLifecycle, host: str, port: int) -> None:
        self._worker: Final = worker
        self.host: Final = host
        self.port: Final = port
        self._scope: Final = trio.CancelScope()
        self._released: Final = trio.Event()
        self._running = False

    async def run(self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
        self._running = True
        try:
            with self._scope:
                try:
                    listeners = await trio.open_tcp_listeners(self.port, host=self.host)
                except OSError as exc:
                    reason = exc.strerror or str(exc)
                    raise OSError(exc.errno, f"DYN_SYSTEM_PORT {self.port} on {self.host}: {reason}") from None
                bound = listeners[0].socket.getsockname()
                task_status.started((str(bound[0]), int(bound[1])))
                log.info(
                    "system port %s:%s: /health, /live and /metrics served by the sidecar until Dynamo's runtime "
                    "starts",
                    self.host,
                    bound[1],
                )
                # serve_listeners closes the listeners when cancelled: the port is free once this scope has exited.
                await trio.serve_listeners(partial(_handle, self._worker), listeners)
        finally:
            self._released.set()

    async def release(self) -> None:
        """Close the listener (connections in progress are cut) and return once the port is free."""
        self._scope.cancel(reason="handing the system port to Dynamo's runtime")
        if self._running:
            with trio.CancelScope(shield=True):
                await self._released.wait()


async def _handle(worker: WorkerLifecycle, stream: trio.SocketStream) -> None:
    try:
        with trio.move_on_after(HEAD_TIMEOUT_S):
            received = await read_request(stream)
            if received is None:
                return
            conn, request, _ = received
            path = request.target.decode("latin-1").split("?", 1)[0]
            status, content_type, body = _answer(worker, request.method, path)
            await respond(stream, conn, status, content_type, body)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await trio.aclose_forcefully(stream)


def _answer(worker: WorkerLifecycle, method: bytes, path: str) -> tuple[int, str, bytes]:
    if method != b"GET":
        return 405, "text/plain", b"GET only while the worker starts\n"
    if path == "/health":
        status, body = readiness(worker)
        return status, "application/json", json.dumps(body).encode()
    if path in ("/live", f"/engine/{LIVE_ROUTE}"):
        return 200, "application/json", json.dumps(liveness(worker)).encode()
    if path == "/metrics":
        return 200, "text/plain; version=0.0.4; charset=utf-8", metrics.exposition().encode()
    # Dynamo's other routes (/engine/<control>, /metadata, ...) exist once its runtime does.
    status, body = readiness(worker)
    body["message"] = f"{path} is served once the worker's Dynamo runtime has started"
    return 503, "application/json", json.dumps(body).encode()
