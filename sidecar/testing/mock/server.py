"""Process lifecycle: listen (TCP or a Unix socket), write the port file, serve until a stop signal, stop like grpcio.

Stopping (``--stop-grace-secs``, TensorRT-LLM's ``server.stop(grace=5)`` on grpcio): the listener closes; every
connection gets a GOAWAY with last-stream-id 2^31−1 and a PING, then — once the PING is answered (or after a second) —
a second GOAWAY with the real last stream id. Streams opened after that are refused (``RST_STREAM REFUSED_STREAM``);
open streams keep running until they end or the grace ends; whatever remains then gets grpc-core's trailers
(``grpc-status 14``, "Cancelling all calls") and ``RST_STREAM NO_ERROR``, and the connections are closed. Exit code 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpclib.config import Configuration
from grpclib.protocol import H2Protocol
from grpclib.server import Server
from h2.errors import ErrorCodes
from h2.events import PingAckReceived, RequestReceived
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes
from hyperframe.frame import GoAwayFrame, RstStreamFrame

from .engine import Engine
from .service import ControlService, InferenceService, LimitedProtoCodec

if TYPE_CHECKING:
    from .config import MockConfig
    from .lmapi import LanguageModel

__all__ = [
    "NO_STREAM_LIMIT",
    "STOP_GRACE_S",
    "MockServer",
    "StreamLimitServer",
    "format_address",
    "serve",
    "write_port_file",
]

log = logging.getLogger("openengine_mock")

#: Default ``--stop-grace-secs`` (TensorRT-LLM: ``stop(grace=5)``).
STOP_GRACE_S = 5.0
#: Inbound HTTP/2 windows: bounded so one connection cannot queue megabytes ahead of the handlers (grpc-stack §4.2).
_WINDOW_BYTES = 1024 * 1024
_WILDCARDS = ("", "0.0.0.0", "::")
#: HTTP/2 ``MAX_CONCURRENT_STREAMS`` advertised for ``--max-concurrent-streams 0`` (the default): grpcio, which
#: TensorRT-LLM's server runs on, sends no such setting, i.e. no limit; h2 alone would enforce 100 per connection.
NO_STREAM_LIMIT = 2**31 - 1
#: The first GOAWAY's last-stream-id: "every stream you may have opened" (grpc-core's graceful shutdown).
_MAX_STREAM_ID = 2**31 - 1
#: Opaque data of the PING that follows the first GOAWAY; its ACK triggers the second GOAWAY.
_GOAWAY_PING = b"oe-goawy"
#: The second GOAWAY is sent after this long even when the PING is never answered.
_GOAWAY_PING_TIMEOUT_S = 1.0
#: The trailers grpc-core ends a call with when the stop grace runs out (``grpc_server_cancel_all_calls``).
_CUT_TRAILERS = [("grpc-status", "14"), ("grpc-message", "Cancelling all calls")]
#: What a trailers-only response carries before them (a call cut before its first message).
_TRAILERS_ONLY = [(":status", "200"), ("content-type", "application/grpc")]


class _MockProtocol(H2Protocol):
    """grpclib's HTTP/2 protocol plus what grpcio's server does and grpclib's does not.

    * ``MAX_CONCURRENT_STREAMS`` is ours instead of h2's built-in 100: h2 puts 100 into the connection's first
      SETTINGS frame; a second SETTINGS frame right behind it (same write) replaces it before the client can open a
      stream, and h2 enforces the new value once the client acknowledges it, which the client does before opening
      any stream beyond the old limit.
    * Graceful stop: two GOAWAY frames, written straight to the transport so that h2 (which allows nothing but
      GOAWAY after sending one) keeps serving the open streams; streams opened after the second one are refused.
    """

    def __init__(self, base: H2Protocol, server: MockServer) -> None:
        super().__init__(base.handler, base.config, base.h2_config)
        self._owner = server
        #: Set by the second GOAWAY: streams above this id are refused.
        self._last_stream_id: int | None = None
        self._refused: set[int] = set()
        self._second_goaway: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        limit = self._owner.max_concurrent_streams
        self.connection._connection.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: limit})
        self.connection.flush()
        self._owner.connections.add(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._owner.connections.discard(self)
        if self._second_goaway is not None:
            self._second_goaway.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # grpclib's data_received, with refused streams kept away from the handlers.
        try:
            events = self.connection.feed(data)
        except ProtocolError:
            log.debug("protocol error", exc_info=True)
            self.processor.close("Protocol error")
            return
        self.connection.flush()
        for event in events:
            stream_id = getattr(event, "stream_id", None)
            last = self._last_stream_id
            if isinstance(event, RequestReceived) and last is not None and event.stream_id > last:
                self.connection._connection.reset_stream(event.stream_id, ErrorCodes.REFUSED_STREAM)
                self._refused.add(event.stream_id)
                continue
            if stream_id is not None and stream_id in self._refused:
                continue
            if isinstance(event, PingAckReceived) and event.ping_data == _GOAWAY_PING:
                self.send_final_goaway()
            self.processor.process(event)
        self.connection.flush()

    @property
    def open_streams(self) -> int:
        return len(self.processor.streams)

    def _write_goaway(self, last_stream_id: int) -> bool:
        if self.connection.is_closing():
            return False
        self.connection.flush()  # whatever h2 has queued goes first: frames stay whole and in order
        self.connection._transport.write(GoAwayFrame(0, last_stream_id=last_stream_id, error_code=0).serialize())
        return True

    def send_first_goaway(self) -> None:
        """GOAWAY(2^31−1) and a PING: open no more streams, those in flight still count."""
        if not self._write_goaway(_MAX_STREAM_ID):
            return
        self.connection._connection.ping(_GOAWAY_PING)
        self.connection.flush()
        self._second_goaway = asyncio.get_running_loop().call_later(_GOAWAY_PING_TIMEOUT_S, self.send_final_goaway)

    def send_final_goaway(self) -> None:
        """GOAWAY(last stream id): one round trip after the first, every stream the client opened has arrived."""
        if self._last_stream_id is not None:
            return
        if self._second_goaway is not None:
            self._second_goaway.cancel()
        self._last_stream_id = self.connection._connection.highest_inbound_stream_id
        self._write_goaway(self._last_stream_id)

    def cut(self) -> None:
        """The grace is over: end every open stream as grpc-core does — trailers ``grpc-status 14`` ("Cancelling all
        calls"; a trailers-only response where no headers went out yet), then ``RST_STREAM NO_ERROR`` — and close
        the connection."""
        if self.connection.is_closing():
            return
        h2 = self.connection._connection
        ended: list[int] = []
        for stream_id in list(self.processor.streams):
            stream = h2.streams.get(stream_id)
            if stream is None:
                continue
            headers = _CUT_TRAILERS if stream.state_machine.headers_sent else [*_TRAILERS_ONLY, *_CUT_TRAILERS]
            with contextlib.suppress(Exception):  # a stream h2 already closed
                h2.send_headers(stream_id, headers, end_stream=True)
                ended.append(stream_id)
        self.connection.flush()
        # h2 considers a stream closed once both sides ended it; grpc-core resets it anyway (NO_ERROR).
        for stream_id in ended:
            self.connection._transport.write(RstStreamFrame(stream_id, error_code=ErrorCodes.NO_ERROR).serialize())
        self.connection.close()


class MockServer(Server):
    """A grpclib ``Server`` with grpcio's stream limit (none by default) and grpc-core's graceful stop."""

    def __init__(self, *args: Any, max_concurrent_streams: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_concurrent_streams = max_concurrent_streams or NO_STREAM_LIMIT
        self.connections: set[_MockProtocol] = set()

    def _protocol_factory(self) -> H2Protocol:
        return _MockProtocol(super()._protocol_factory(), self)

    @property
    def listener(self) -> asyncio.AbstractServer:
        assert self._server is not None
        return self._server

    def goaway(self) -> None:
        """Stop accepting connections and send every connection its first GOAWAY."""
        self.listener.close()
        for protocol in list(self.connections):
            protocol.send_first_goaway()

    def handler_tasks(self) -> set[asyncio.Task[None]]:
        """The request handlers still running (grpclib's, one task per stream)."""
        return {task for handler in self._handlers for task in handler._tasks.values() if not task.done()}

    def cut(self) -> None:
        """Reset what is still open, close every connection, cancel the handlers."""
        for protocol in list(self.connections):
            protocol.cut()
        self.close()


#: The name other modules (and older tests) use for the server class.
StreamLimitServer = MockServer


def format_address(host: str, port: int) -> str:
    """``host:port``, with IPv6 literals bracketed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def write_port_file(path: Path, address: str) -> None:
    """Write ``address`` to ``path`` atomically (a temp file in the same directory, then rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(address + "\n")
    os.replace(tmp, path)


def _load_model(config: MockConfig) -> LanguageModel:
    from .lm import TinyLM

    return TinyLM.load(config.model_dir)


async def serve(config: MockConfig, lm: LanguageModel | None = None) -> int:
    """Run the mock until a stop signal; returns the process exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        return await _serve(config, lm, stop)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            loop.remove_signal_handler(sig)


def _refuse(message: str) -> int:
    """One line on stderr and exit status 2, as for a bad flag (a problem found only when listening)."""
    print(f"openengine-mock: error: {message}", file=sys.stderr, flush=True)
    return 2


async def _serve(config: MockConfig, lm: LanguageModel | None, stop: asyncio.Event) -> int:
    try:
        tls = _tls_context(config)
    except (OSError, ssl.SSLError) as exc:
        return _refuse(f"TLS: cannot load the certificate, key or client CA: {exc}")
    if lm is None:
        lm = _load_model(config)
    engine = Engine(config, lm)
    if config.engine.port_closed_while_loading and config.startup_delay > 0:
        # TensorRT-LLM opens its port only once the model is loaded (no STARTING state): the delay is spent closed.
        log.info("loading for %g s before listening (--startup-delay)", config.startup_delay)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), config.startup_delay)
        if stop.is_set():
            return 0
        engine.ready = True
    server = MockServer(
        [InferenceService(engine), ControlService(engine)],
        max_concurrent_streams=config.max_concurrent_streams,
        codec=LimitedProtoCodec(),
        config=Configuration(
            http2_connection_window_size=_WINDOW_BYTES,
            http2_stream_window_size=_WINDOW_BYTES,
            _keepalive_time=30.0,
            _keepalive_timeout=10.0,
            _keepalive_permit_without_calls=True,
        ),
    )
    try:
        if config.uds is not None:
            with contextlib.suppress(FileNotFoundError):
                config.uds.unlink()  # a stale socket of an earlier run (config.py refused anything else)
            await server.start(path=str(config.uds), ssl=tls)
            host = "127.0.0.1"  # the KV transfer channel stays on loopback TCP
            engine.listen_host, engine.listen_port = host, 0
            address = f"unix://{config.uds.absolute()}"
        else:
            await server.start(config.host, config.port, ssl=tls)
            sockets: Sequence[socket.socket] = getattr(server.listener, "sockets", ())  # asyncio's and uvloop's
            bound = sockets[0].getsockname()
            host = config.host if config.host not in _WILDCARDS else "127.0.0.1"
            engine.listen_host, engine.listen_port = host, int(bound[1])
            address = format_address(host, engine.listen_port)
    except OSError as exc:
        uds = config.uds
        where = f"unix socket {str(uds)!r}" if uds is not None else format_address(config.host, config.port)
        return _refuse(f"cannot listen on {where}: {exc.strerror or exc}")
    await engine.kv_sessions.start(host)  # the KV transfer channel of disaggregated legs (kvsessions.py)
    if config.port_file is not None:
        write_port_file(config.port_file, address)
    print(f"openengine-mock listening on {address}", flush=True)
    log.info(
        "serving %r (profile %s, role %s, instance %s, speedup %g)",
        config.served_model_name,
        config.profile,
        config.role,
        config.instance_id,
        config.speedup,
    )
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, _toggle_health, engine)
    startup = asyncio.create_task(engine.run_startup())
    try:
        await stop.wait()
        await _stop(server, engine, config.stop_grace_secs)
    finally:
        startup.cancel()
        await engine.kv_sessions.close()
        if config.uds is not None:
            with contextlib.suppress(OSError):
                config.uds.unlink()
    log.info("stopped")
    return 0


async def _stop(server: MockServer, engine: Engine, grace: float) -> None:
    """grpc-core's ``stop(grace)``: GOAWAY, open streams run out the grace, the rest is cut."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    log.info("stop signal: GOAWAY sent; %d open request(s), %.0f s grace", len(engine.live), grace)
    engine.draining = True
    server.goaway()
    drained = await engine.wait_idle(grace)
    if drained:
        # Let the handlers write their trailers (endless KV event subscriptions excepted: cut below).
        pending = server.handler_tasks() - engine.endless_tasks
        remaining = deadline - loop.time()
        if pending and remaining > 0:
            await asyncio.wait(pending, timeout=remaining)
    else:
        log.warning("grace period over: cutting %d open stream(s)", len(engine.live))
    server.cut()
    try:
        await asyncio.wait_for(server.wait_closed(), STOP_GRACE_S)
    except TimeoutError:
        log.warning("handlers did not finish after cancellation")


def _toggle_health(engine: Engine) -> None:
    engine.health_override = None if engine.health_override else "not_ready"
    log.info("SIGUSR1: health now %s", engine.health_override or "as configured")


def _tls_context(config: MockConfig) -> ssl.SSLContext | None:
    """TLS (and, with a client CA, mutual TLS) for tests of the sidecar's TLS option; plaintext h2c otherwise."""
    if config.tls_cert is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(config.tls_cert), str(config.tls_key))
    context.set_alpn_protocols(["h2"])
    if config.tls_client_ca is not None:
        context.load_verify_locations(cafile=str(config.tls_client_ca))
        context.verify_mode = ssl.CERT_REQUIRED
    return context
