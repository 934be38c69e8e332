"""Process lifecycle: listen (TCP or a Unix socket), write the port file, serve until a stop signal, stop like grpcio.

Stopping (``--stop-grace-secs``, TensorRT-LLM's ``server.stop(grace=5)`` on grpcio): the listener closes; every
connection gets a GOAWAY with last-stream-id 2^31−1 and a PING, then — once the PING is answered (or after a second) —
a second GOAWAY with the real last stream id. A stream that arrives between the two is answered trailers-only
``CANCELLED`` plus ``RST_STREAM NO_ERROR``, as grpc-core answers it; streams opened after the second are refused
(``RST_STREAM REFUSED_STREAM``); open streams keep running until they end or the grace ends; whatever remains then gets
grpc-core's trailers (``grpc-status 14``, "Cancelling all calls") and ``RST_STREAM NO_ERROR``, and the connections
are closed. Exit code 0. The HTTP/2 side of this is ``sidecar.http2``'s
(``GrpcCoreServer``).
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
from typing import TYPE_CHECKING

from sidecar.http2 import NO_STREAM_LIMIT, GrpcCoreServer, grpclib_configuration

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
#: The name other modules (and older tests) use for the server class: grpclib's ``Server`` with grpcio's stream limit
#: (none unless ``--max-concurrent-streams``) and grpc-core's graceful stop, from the owned HTTP/2 layer.
MockServer = GrpcCoreServer
StreamLimitServer = GrpcCoreServer


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
        hold_writes=engine.step_clock is not None,
        codec=LimitedProtoCodec(),
        config=grpclib_configuration(
            keepalive_s=30.0,
            keepalive_timeout_s=10.0,
            keepalive_without_calls=True,
            stream_window_bytes=_WINDOW_BYTES,
            connection_window_bytes=_WINDOW_BYTES,
        ),
    )
    if engine.step_clock is not None:  # a step's messages leave together, one write per connection
        engine.step_clock.hold_writes = server.hold_writes
        engine.step_clock.release_writes = server.release_writes
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
        if engine.step_clock is not None:
            engine.step_clock.close()
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
