"""Serve frontends: ``--frontends N`` runs N server processes on one port around one engine, as TensorRT-LLM's
``trtllm-serve --grpc --grpc-protocol openengine --num_serve_frontends N`` does.

Theory of operation
-------------------
TensorRT-LLM's launcher process owns the executor and a private coordinator; the other frontend processes attach to
that executor. Every frontend binds the same fixed port with ``SO_REUSEPORT``, so the kernel hands each new TCP
connection to one of them (by a hash of the connection: not evenly, and never per RPC). The coordinator reserves
request ids across all frontends, routes ``Abort`` to the frontend that owns the request and counts every reservation
for ``GetLoad``; all frontends report the same instance id.

The mock keeps that shape with one engine:

* The **launcher** (frontend 0, the process started from the command line) runs the :class:`~.engine.Engine` and
  serves it on the public port itself, and on a private Unix socket in a mode-0700 directory of its own.
* Each **attached frontend** (1 … N−1) is a process started by the launcher with the same command line and
  :data:`FRONTEND_ENV` set. It loads no model: it listens on the public port and forwards every RPC to the engine
  over the private socket (:class:`FrontendProxy`), with three private metadata keys saying which frontend, which
  process and which client connection it came from. So requests from all frontends reach one engine: ids are unique
  engine-wide, an ``Abort`` arriving on any connection reaches its request, ``GetLoad`` counts every frontend's
  requests, and every fault, counter and KV block is the engine's.
* :class:`RequestLedger` records where each request came from (``ServerInfo.extra.mock_stats.frontends``): per
  frontend its process id and, per client connection, the ``Generate`` streams and control calls it carried.
* The group stands and falls together, as TensorRT-LLM's: the launcher publishes its port file only once every
  frontend listens; a frontend that exits stops the group (exit status 1); an attached frontend whose launcher is
  gone (its life pipe reads EOF) cuts its connections and exits. A stop signal sent to the launcher marks the engine
  stopping (a new ``Generate`` on a frontend that has not stopped yet is refused ``UNAVAILABLE``, as TensorRT-LLM's
  coordinator refuses a reservation once the group is stopping) and stops every frontend the grpc-core way
  (``server.py``).
* A fault that drops the client's connection (``drop_after_tokens``) reaches the attached frontend as a private
  trailer (:data:`DROP_KEY`): it closes the client's connection, not its own connection to the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, Final

from grpclib.client import Channel
from grpclib.const import Handler, Status
from grpclib.exceptions import GRPCError, StreamTerminatedError

from openengine.v1 import lifecycle_pb2, openengine_grpc
from sidecar.http2 import GrpcCoreServer, drop_connection, grpclib_configuration

from .ledger import DROP_KEY, FRONTEND_KEY, PEER_KEY, PID_KEY, RequestLedger, peer_of
from .service import LimitedProtoCodec, recv_request

if TYPE_CHECKING:
    import ssl
    from collections.abc import Callable, Mapping

    from grpclib.config import Configuration
    from grpclib.server import Stream

    from .config import MockConfig

__all__ = [
    "FRONTEND_ENV",
    "FrontendGroup",
    "FrontendProxy",
    "FrontendWiring",
    "frontend_wiring",
    "serve_attached_frontend",
    "server_config",
]

log = logging.getLogger("openengine_mock")

#: Set in an attached frontend's environment: ``INDEX:READY_FD:LIFE_FD:ENGINE_SOCKET``.
FRONTEND_ENV: Final = "OPENENGINE_MOCK_FRONTEND"
#: Bound on the attached frontends' start (they load no model: a second is plenty on a quiet machine).
_READY_TIMEOUT_S: Final = 60.0
#: After their grace, the attached frontends get this long to exit before they are killed.
_EXIT_MARGIN_S: Final = 5.0
#: Inbound HTTP/2 windows: bounded so one connection cannot queue megabytes ahead of the handlers (grpc-stack §4.2).
#: The private connection's own window is unbounded so that one stalled client stream (whose data waits in its stream
#: window) never holds back the other streams sharing it.
_WINDOW_BYTES: Final = 1024 * 1024
_UNBOUNDED_WINDOW: Final = 2**31 - 1


# -- the attached frontends' side ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class FrontendWiring:
    """What an attached frontend is told by its launcher (:data:`FRONTEND_ENV`)."""

    index: int
    engine_socket: str
    ready_fd: int
    life_fd: int


def frontend_wiring() -> FrontendWiring | None:
    """This process's :class:`FrontendWiring` when it is an attached frontend, else None."""
    raw = os.environ.get(FRONTEND_ENV)
    if not raw:
        return None
    index, ready, life, socket_path = raw.split(":", 3)
    return FrontendWiring(int(index), socket_path, int(ready), int(life))


class _Names:
    """Stands in for a servicer when reading a generated ``__mapping__`` (only the handler types are kept)."""

    def __getattr__(self, name: str) -> None:
        return None


class FrontendProxy:
    """Every ``Inference`` and ``Control`` RPC, forwarded to the engine over the private socket, with its origin.

    Messages go both ways one at a time (the next engine message is read once the client took the previous one), so
    a client that stops reading holds back its own stream only, and the engine's stall watchdog still sees it.
    """

    def __init__(self, index: int, channel: Channel) -> None:
        self._index = index
        self._channel = channel
        self._pid = os.getpid()

    def __mapping__(self) -> dict[str, Handler]:
        names = _Names()
        mapping: dict[str, Handler] = {}
        for base in (openengine_grpc.InferenceBase, openengine_grpc.ControlBase):
            for path, spec in base.__mapping__(names).items():  # type: ignore[arg-type]

                async def forward(stream: Stream[Any, Any], path: str = path, spec: Handler = spec) -> None:
                    await self._forward(path, spec, stream)

                mapping[path] = Handler(forward, spec.cardinality, spec.request_type, spec.reply_type)
        return mapping

    async def _forward(self, path: str, spec: Handler, stream: Stream[Any, Any]) -> None:
        request = await recv_request(stream, path.rsplit("/", 1)[-1])
        metadata: list[tuple[str, str | bytes]] = [
            (k, v) for k, v in (stream.metadata or {}).items() if not k.startswith("x-openengine-mock-")
        ]
        metadata += [(FRONTEND_KEY, str(self._index)), (PID_KEY, str(self._pid)), (PEER_KEY, peer_of(stream))]
        upstream = self._channel.request(
            path, spec.cardinality, spec.request_type, spec.reply_type, metadata=metadata, deadline=stream.deadline
        )
        async with upstream as up:
            await up.send_message(request, end=True)
            try:
                while (reply := await up.recv_message()) is not None:
                    await stream.send_message(reply)
                await up.recv_trailing_metadata()
            except GRPCError as exc:
                raise GRPCError(exc.status, exc.message, exc.details) from None
            except (StreamTerminatedError, ConnectionError, OSError) as exc:
                # The engine's process went away under this stream: what grpc-core answers for a lost backend.
                raise GRPCError(Status.UNAVAILABLE, f"OpenEngine coordinator unavailable: {exc}") from None
        if up.trailing_metadata is not None and DROP_KEY in up.trailing_metadata:
            drop_connection(stream)


def _client_config() -> Configuration:
    return grpclib_configuration(
        keepalive_s=None, stream_window_bytes=_WINDOW_BYTES, connection_window_bytes=_UNBOUNDED_WINDOW
    )


def server_config() -> Configuration:
    """The public listeners' grpclib configuration (TensorRT-LLM's keepalive; bounded inbound windows)."""
    return grpclib_configuration(
        keepalive_s=30.0,
        keepalive_timeout_s=10.0,
        keepalive_without_calls=True,
        stream_window_bytes=_WINDOW_BYTES,
        connection_window_bytes=_WINDOW_BYTES,
    )


async def serve_attached_frontend(config: MockConfig, wiring: FrontendWiring, tls: ssl.SSLContext | None) -> int:
    """Run attached frontend ``wiring.index`` until its launcher stops it (SIGTERM) or goes away; the exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    orphaned = False

    def launcher_gone() -> None:
        nonlocal orphaned
        orphaned = True
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_reader(wiring.life_fd, launcher_gone)  # the launcher never writes: readable means EOF
    channel = Channel(path=wiring.engine_socket, codec=LimitedProtoCodec(), config=_client_config())
    server = GrpcCoreServer(
        [FrontendProxy(wiring.index, channel)],
        max_concurrent_streams=config.max_concurrent_streams,
        codec=LimitedProtoCodec(),
        config=server_config(),
    )
    try:
        # Connect to the engine before listening: the launcher removes the private socket's file once every frontend
        # is connected (nothing is left on disk, even when the launcher is killed). Not counted as a client's call.
        health = openengine_grpc.ControlStub(channel).Health
        await health(
            lifecycle_pb2.HealthRequest(), metadata=[(FRONTEND_KEY, str(wiring.index))], timeout=_READY_TIMEOUT_S
        )
        await server.start(config.host, config.port, ssl=tls, reuse_port=True)
        os.write(wiring.ready_fd, b"R")
        os.close(wiring.ready_fd)
        log.info("frontend %d (pid %d) listening on port %d", wiring.index, os.getpid(), config.port)
        await stop.wait()
        if orphaned:
            log.error("frontend %d: the launcher is gone; cutting every connection", wiring.index)
        else:
            server.goaway()
            pending = server.handler_tasks()
            if pending:
                await asyncio.wait(pending, timeout=config.stop_grace_secs)
        server.cut()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), _EXIT_MARGIN_S)
    finally:
        loop.remove_reader(wiring.life_fd)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        channel.close()
    log.info("frontend %d stopped", wiring.index)
    return 1 if orphaned else 0


# -- the launcher's side -------------------------------------------------------------------------------------------


class FrontendGroup:
    """The launcher's attached frontends: started with its own command line, watched, stopped."""

    def __init__(self, config: MockConfig, engine_socket: str, ledger: RequestLedger) -> None:
        self._config = config
        self._socket = engine_socket
        self._ledger = ledger
        self._life_r, self._life_w = os.pipe()
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self.stopping = False

    async def start(self) -> None:
        """Start frontends 1 … N−1 and wait until each listens; raises ``RuntimeError`` naming one that did not."""
        loop = asyncio.get_running_loop()
        waits: list[tuple[int, asyncio.Future[bytes], int]] = []
        for index in range(1, self._config.frontends):
            ready_r, ready_w = os.pipe()
            env = {**os.environ, FRONTEND_ENV: f"{index}:{ready_w}:{self._life_r}:{self._socket}"}
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "sidecar.testing.mock",
                *self._config.argv,
                env=env,
                pass_fds=(ready_w, self._life_r),
                stdin=asyncio.subprocess.DEVNULL,
            )
            os.close(ready_w)
            self._procs[index] = proc
            self._ledger.note_pid(index, proc.pid)
            future: asyncio.Future[bytes] = loop.create_future()

            def readable(fd: int = ready_r, future: asyncio.Future[bytes] = future) -> None:
                loop.remove_reader(fd)
                if not future.done():
                    future.set_result(os.read(fd, 1))

            loop.add_reader(ready_r, readable)
            waits.append((index, future, ready_r))
        try:
            for index, future, _ in waits:
                try:
                    answer = await asyncio.wait_for(future, _READY_TIMEOUT_S)
                except TimeoutError:
                    raise RuntimeError(f"frontend {index} did not listen within {_READY_TIMEOUT_S:g} s") from None
                if answer != b"R":
                    code = await self._procs[index].wait()
                    raise RuntimeError(f"frontend {index} exited with status {code} before it listened")
        finally:
            for _, future, fd in waits:
                loop.remove_reader(fd)
                future.cancel()
                os.close(fd)

    async def watch(self, on_failure: Callable[[str], None]) -> None:
        """Return when a frontend exits; unless the group is stopping, call ``on_failure`` with why."""
        if not self._procs:
            await asyncio.Event().wait()
        waits = {asyncio.ensure_future(proc.wait()): index for index, proc in self._procs.items()}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        if not self.stopping:
            task = next(iter(done))
            on_failure(f"frontend {waits[task]} exited with status {task.result()}; stopping the serving group")

    def signal_stop(self) -> None:
        """Tell every attached frontend to stop (its own GOAWAY and grace)."""
        self.stopping = True
        for proc in self._procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)

    async def wait_stopped(self) -> None:
        """Wait (bounded: their grace and a margin) for every attached frontend to exit; kill what is left."""
        procs = [p for p in self._procs.values() if p.returncode is None]
        if procs:
            bound = self._config.stop_grace_secs + _EXIT_MARGIN_S
            _, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=bound)
            for task in pending:
                task.cancel()
        for proc in self._procs.values():
            if proc.returncode is None:
                log.warning("frontend (pid %d) did not stop in time: killed", proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()

    def close(self) -> None:
        """Close the life pipe (an attached frontend still running reads EOF and exits)."""
        for fd in (self._life_r, self._life_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    @property
    def pids(self) -> Mapping[int, int]:
        """The attached frontends' process ids by index."""
        return {index: proc.pid for index, proc in self._procs.items()}
