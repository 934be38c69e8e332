"""Readiness and liveness of the worker, on the system port for the worker's whole life.

The system port (``DYN_SYSTEM_HOST``:``DYN_SYSTEM_PORT``) is the sidecar's from the first second to the last
(:class:`SystemPort`). It answers readiness and liveness itself, with the worker's state and why:

    GET /health        200 {"status": "ready", "state": "serving", "reason": ...} exactly while the worker is serving;
                       503 {"status": "notready", "state": "reconnecting", "reason": "...", "detail": "..."} otherwise
    GET /live          200 {"status": "live", "state": ..., "reason": ..., "ready": false} while the process answers
    GET /engine/live   the same as /live (the path the manifests used while Dynamo answered /live, kept)

Everything else is Dynamo's. Its runtime serves ``/metrics`` (its ``dynamo_component_*`` families and ours),
``/engine/<control>`` (the LoRA controls), the self-hosted model-card files and whatever else it has on a second
port on the same host, handed to it through ``DYN_SYSTEM_PORT`` when the runtime is created:

* by default ``0``: the OS picks a free port from its ephemeral range when Dynamo binds (Dynamo 1.6.1 reads
  ``DYN_SYSTEM_PORT`` as a signed 16-bit number, but the value it reads is 0, so the bound port may be above 32767),
  and the worker asks the runtime which one (``DistributedRuntime.system_status_server_url``). Nothing is reserved
  beforehand, so nothing can race for it, and no port another service of the host expects is taken (the sidecar used
  to draw one at random from 20000-32767: a fixed port of some other service, a NodePort, could be it);
* ``--dynamo-system-port N`` (``DYN_SIDECAR_DYNAMO_SYSTEM_PORT``), for a firewall or NetworkPolicy that must name it:
  bound here at start (a port in use is a one-line refusal before the engine is contacted) and held until right
  before the runtime is created.

Once the runtime exists the sidecar relays every other request there (``sidecar.ops.forward``: method, path, query,
headers, body; the answer streamed back; 502/504 in one line when Dynamo's server does not answer). Before the
runtime exists (the engine is being connected, discovered, awaited -- minutes while weights load, or up to the
start-up deadline while the worker retries a bad certificate) and after it has shut down, ``/metrics`` is the
sidecar's families alone and other paths are 503 with the state.

Why not Dynamo's own ``/health`` and ``/live``: Dynamo 1.6.1's body has no room for the state and reason
(``{"status": "notready", "uptime": ..., "endpoints": ...}``), it answers ``/live`` exactly like ``/health`` (one
handler for both paths: a liveness probe there restarts a worker that is only waiting for its engine), and
``DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS`` or a canary makes it ignore the worker's state. The worker still pushes its
readiness to Dynamo (``DistributedRuntime.set_health_status``) so Dynamo's own port tells the same story.

What Dynamo advertises: the self-hosted model-card URLs (``http://<host>:<port>/v1/metadata/...``, fetched by the
frontends when they add the model) carry the port Dynamo bound, the second one. It is on the same host as the system
port (loopback when that is loopback), so wherever the frontends reached the system port they reach it too; the
manifests set no NetworkPolicy. Kubernetes discovery keeps its metadata in ``DynamoWorkerMetadata`` resources and
pod readiness (our ``/health``), not behind the port.
"""

from __future__ import annotations

import json
import logging
import socket
from typing import TYPE_CHECKING, Any, Final

import trio

from . import metrics
from .forward import forward
from .logs import latest_line
from .server import HEAD_TIMEOUT_S, read_request, respond

if TYPE_CHECKING:
    from statemachines import WorkerLifecycle

__all__ = ["LIVE_ROUTE", "SystemPort", "liveness", "readiness"]

log: Final = logging.getLogger("sidecar.ops")

#: ``/engine/<name>`` answered by the sidecar like ``/live``, in every phase.
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


class SystemPort:
    """The system port, served by the sidecar for the worker's whole life; Dynamo's server sits behind it.

    Use: ``await nursery.start(port.run)`` (binds the port, and Dynamo's when ``dynamo_port`` names one;
    :class:`OSError` with one line when either cannot be had), put :meth:`dynamo_environment` into ``os.environ``
    before Dynamo's runtime is created, :meth:`release_dynamo_port` right before creating it,
    :meth:`forward_to_dynamo` with the port the runtime bound once it exists and :meth:`answer_alone` once it has
    shut down.
    """

    def __init__(
        self,
        worker: WorkerLifecycle,
        host: str,
        port: int,
        *,
        control_timeout_s: float = 60.0,
        dynamo_port: int = 0,
    ) -> None:
        self._worker: Final = worker
        self.host: Final = host
        self.port: Final = port
        #: How long an ``/engine/<control>`` may take to answer (a LoRA load fetches and loads the adapter).
        self.control_timeout_s: Final = control_timeout_s
        #: The port asked for Dynamo's server (``--dynamo-system-port``); 0: the OS picks when Dynamo binds.
        self.dynamo_port_asked: Final = dynamo_port
        #: The port Dynamo's server listens on, once known (:meth:`forward_to_dynamo`); 0 before.
        self.dynamo_port = 0
        self._reservation: socket.socket | None = None
        self._forwarding = False

    async def run(self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            listeners = await trio.open_tcp_listeners(self.port, host=self.host)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise OSError(exc.errno, f"DYN_SYSTEM_PORT {self.port} on {self.host}: {reason}") from None
        try:
            if self.dynamo_port_asked:
                self._reservation = _reserve_port(self.host, self.dynamo_port_asked)
            bound = listeners[0].socket.getsockname()
            behind = (
                f"on {self.host}:{self.dynamo_port_asked} (--dynamo-system-port)"
                if self.dynamo_port_asked
                else f"on {self.host}, on a port the OS picks"
            )
            log.info(
                "system port %s:%s: /health and /live answered by the sidecar; Dynamo's system server will listen "
                "behind it %s once its runtime runs",
                self.host,
                bound[1],
                behind,
            )
            task_status.started((str(bound[0]), int(bound[1])))
            await trio.serve_listeners(self._handle, listeners)
        finally:
            self.release_dynamo_port()
            for listener in listeners:
                await trio.aclose_forcefully(listener)

    def dynamo_environment(self) -> dict[str, str]:
        """What Dynamo's runtime reads to bind its own system server: the port asked for, or 0 (the OS picks)."""
        return {"DYN_SYSTEM_HOST": self.host, "DYN_SYSTEM_PORT": str(self.dynamo_port_asked)}

    def release_dynamo_port(self) -> None:
        """Free the reserved port for Dynamo's runtime, which binds it when it is created (idempotent)."""
        if self._reservation is not None:
            self._reservation.close()
            self._reservation = None

    def forward_to_dynamo(self, bound: int | None) -> None:
        """Dynamo's server listens on ``bound`` (what its runtime reports; ``None``: it reports none): relay
        everything but readiness and liveness to it. Without a port to relay to, the sidecar keeps answering alone
        (``/metrics`` with its own families; a warning says why)."""
        port = bound or self.dynamo_port_asked
        if not port:
            log.warning(
                "system port %s:%s: Dynamo's runtime reports no system server of its own; /metrics keeps the "
                "sidecar's families alone and Dynamo's routes (/engine/<control>) are not served",
                self.host,
                self.port,
            )
            return
        if self.dynamo_port_asked and bound and bound != self.dynamo_port_asked:
            log.warning(
                "Dynamo's system server listens on %s, not on the --dynamo-system-port %s asked",
                bound,
                self.dynamo_port_asked,
            )
        self.dynamo_port = port
        log.info(
            "system port %s:%s: /health and /live answered by the sidecar, everything else relayed to Dynamo's "
            "system server on %s:%s",
            self.host,
            self.port,
            self.host,
            port,
        )
        self._forwarding = True

    def answer_alone(self) -> None:
        """Dynamo's server is gone (or not there yet): answer ``/metrics`` with the sidecar's families, 503 the rest."""
        self._forwarding = False

    @property
    def _upstream(self) -> tuple[str, int]:
        # A wildcard bind listens on loopback too; connecting to the wildcard address itself is not portable.
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        return host, self.dynamo_port

    async def _handle(self, stream: trio.SocketStream) -> None:
        try:
            received = None
            with trio.move_on_after(HEAD_TIMEOUT_S):
                received = await read_request(stream)
            if received is None:
                return
            conn, request, _ = received
            path = request.target.decode("latin-1").split("?", 1)[0]
            if path in _OWN_PATHS:
                status, content_type, body = self._own(request.method, path)
                await respond(stream, conn, status, content_type, body, *_allow(status))
            elif self._forwarding:
                timeout = self.control_timeout_s if path.startswith("/engine/") else _ANSWER_TIMEOUT_S
                await forward(stream, conn, request, self._upstream, answer_timeout_s=timeout)
            else:
                status, content_type, body = self._without_dynamo(request.method, path)
                await respond(stream, conn, status, content_type, body, *_allow(status))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    def _own(self, method: bytes, path: str) -> tuple[int, str, bytes]:
        if method != b"GET":
            return 405, "text/plain", f"{path}: GET only\n".encode()
        if path == "/health":
            status, body = readiness(self._worker)
            return status, "application/json", json.dumps(body).encode()
        return 200, "application/json", json.dumps(liveness(self._worker)).encode()

    def _without_dynamo(self, method: bytes, path: str) -> tuple[int, str, bytes]:
        if path == "/metrics" and method == b"GET":
            return 200, "text/plain; version=0.0.4; charset=utf-8", metrics.exposition().encode()
        # Dynamo's routes (/engine/<control>, /v1/metadata/..., its own families on /metrics) exist while its runtime
        # does.
        _, body = readiness(self._worker)
        body["message"] = f"{path} is served while the worker's Dynamo runtime runs"
        return 503, "application/json", json.dumps(body).encode()


#: Answered by the sidecar in every phase; everything else is Dynamo's.
_OWN_PATHS: Final = frozenset({"/health", "/live", f"/engine/{LIVE_ROUTE}"})
#: How long Dynamo's server may take to start answering anything but an ``/engine/`` control (``/metrics``, ...).
_ANSWER_TIMEOUT_S: Final = 30.0


def _allow(status: int) -> tuple[tuple[str, str], ...]:
    return (("allow", "GET"),) if status == 405 else ()


def _reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound (not listening) to ``port`` on ``host``: nothing listening and no socket without
    SO_REUSEADDR can bind it until it is closed, then Dynamo's runtime does. SO_REUSEADDR, as every server's
    listener: a restarted worker finds the port in TIME_WAIT from its last run (Dynamo's server there closed its
    connections first) and must not refuse to start for it. One line naming the flag when it is taken."""
    family = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise OSError(exc.errno, f"--dynamo-system-port {port} on {host}: {reason}") from None
    return sock
