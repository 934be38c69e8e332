"""Process lifecycle: listen, write the port file, serve until SIGTERM/SIGINT, drain with a 5 s grace, exit 0."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpclib.config import Configuration
from grpclib.protocol import H2Protocol
from grpclib.server import Server
from h2.settings import SettingCodes

from .engine import Engine
from .service import ControlService, InferenceService, LimitedProtoCodec

if TYPE_CHECKING:
    from .config import MockConfig
    from .lmapi import LanguageModel

__all__ = ["NO_STREAM_LIMIT", "STOP_GRACE_S", "StreamLimitServer", "format_address", "serve", "write_port_file"]

log = logging.getLogger("openengine_mock")

#: Open streams get this long to finish after SIGTERM/SIGINT before they are cut (TensorRT-LLM: ``stop(grace=5)``).
STOP_GRACE_S = 5.0
#: Inbound HTTP/2 windows: bounded so one connection cannot queue megabytes ahead of the handlers (grpc-stack §4.2).
_WINDOW_BYTES = 1024 * 1024
_WILDCARDS = ("", "0.0.0.0", "::")
#: HTTP/2 ``MAX_CONCURRENT_STREAMS`` advertised for ``--max-concurrent-streams 0`` (the default): grpcio, which
#: TensorRT-LLM's server runs on, sends no such setting, i.e. no limit; h2 alone would enforce 100 per connection.
NO_STREAM_LIMIT = 2**31 - 1


class _StreamLimitProtocol(H2Protocol):
    """grpclib's HTTP/2 protocol with our ``MAX_CONCURRENT_STREAMS`` instead of h2's built-in 100.

    h2 puts 100 into the connection's first SETTINGS frame; a second SETTINGS frame right behind it (same write)
    replaces it before the client can open a stream, and h2 enforces the new value once the client acknowledges it,
    which the client does before opening any stream beyond the old limit.
    """

    def __init__(self, base: H2Protocol, max_concurrent_streams: int) -> None:
        super().__init__(base.handler, base.config, base.h2_config)
        self._max_concurrent_streams = max_concurrent_streams

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.connection._connection.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: self._max_concurrent_streams})
        self.connection.flush()


class StreamLimitServer(Server):
    """A grpclib ``Server`` whose connections accept ``max_concurrent_streams`` streams (0: no limit, as grpcio)."""

    def __init__(self, *args: Any, max_concurrent_streams: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._max_concurrent_streams = max_concurrent_streams or NO_STREAM_LIMIT

    def _protocol_factory(self) -> H2Protocol:
        return _StreamLimitProtocol(super()._protocol_factory(), self._max_concurrent_streams)


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
    if lm is None:
        lm = _load_model(config)
    engine = Engine(config, lm)
    server = StreamLimitServer(
        [InferenceService(engine), ControlService(engine)],
        # --max-concurrent-streams; read with a default so that a MockConfig without the field serves grpcio's "no
        # limit" (the flag lives in config.py).
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
    await server.start(config.host, config.port, ssl=_tls_context(config))
    listener = server._server
    assert listener is not None
    sockets: Sequence[socket.socket] = getattr(listener, "sockets", ())  # asyncio's and uvloop's servers have it
    bound = sockets[0].getsockname()
    host = config.host if config.host not in _WILDCARDS else "127.0.0.1"
    engine.listen_host, engine.listen_port = host, int(bound[1])
    await engine.kv_sessions.start(host)  # the KV transfer channel of disaggregated legs (kvsessions.py)
    address = format_address(host, engine.listen_port)
    if config.port_file is not None:
        write_port_file(config.port_file, address)
    print(f"openengine-mock listening on {address}", flush=True)
    log.info(
        "serving %r (role %s, instance %s, speedup %g)",
        config.served_model_name,
        config.role,
        config.instance_id,
        config.speedup,
    )

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, _toggle_health, engine)
    startup = asyncio.create_task(engine.run_startup())
    try:
        await stop.wait()
        log.info("stop signal: no new requests; %d open, %.0f s grace", len(engine.live), STOP_GRACE_S)
        engine.draining = True
        listener.close()  # stop accepting connections; open connections keep being served
        if not await engine.wait_idle(STOP_GRACE_S):
            log.warning("grace period over: cutting %d open stream(s)", len(engine.live))
        server.close()  # cancels the remaining handlers
        try:
            await asyncio.wait_for(server.wait_closed(), STOP_GRACE_S)
        except TimeoutError:
            log.warning("handlers did not finish after cancellation")
    finally:
        startup.cancel()
        await engine.kv_sessions.close()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            loop.remove_signal_handler(sig)
    log.info("stopped")
    return 0


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
