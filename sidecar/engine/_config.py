"""One frozen configuration for the engine client; every limit has a reason next to it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sidecar.contract import Endpoint

__all__ = ["MIN_KEEPALIVE_INTERVAL_S", "EngineClientConfig"]

_MiB: Final = 1 << 20
# gRPC core servers (TensorRT-LLM sets min_ping_interval_without_data = 10 s) answer faster pings with
# GOAWAY(too_many_pings), which would tear down every stream on the connection.
MIN_KEEPALIVE_INTERVAL_S: Final = 10.0
# HTTP/2 allows windows from 64 KiB - 1 to 2 GiB - 1 (RFC 9113 §6.9.1, §6.5.2).
_MIN_WINDOW: Final = (1 << 16) - 1
_MAX_WINDOW: Final = (1 << 31) - 1


@dataclass(frozen=True, slots=True)
class EngineClientConfig:
    """How the sidecar talks to one OpenEngine server.

    :param endpoint: where the engine listens (see :func:`sidecar.engine.parse_endpoint`).
    :param connections: size of the HTTP/2 connection pool; ``Generate`` streams are spread round-robin because
        TensorRT-LLM spreads load over its serve frontends only per connection.
    :param max_message_bytes: largest message sent or accepted (TensorRT-LLM's own limit; long prompt-logprob
        replies exceed gRPC's 4 MiB default).
    :param keepalive_interval_s: HTTP/2 PING interval while streams are open; at least 10 s.
    :param keepalive_timeout_s: a PING unanswered this long closes the connection (its streams fail UNAVAILABLE).
    :param rpc_timeout_s: deadline of every unary RPC (sent to the engine as ``grpc-timeout``).
    :param connect_attempt_timeout_s: bound of one connection attempt in :meth:`EngineClient.wait_connected`.
    :param retry_interval_s: fixed pause between connection attempts (no backoff: the engine is local and the
        first success should be seen promptly).
    :param startup_deadline_s: default bound of :meth:`EngineClient.wait_connected` (model loading can be slow).
    :param stream_window_bytes: per-stream HTTP/2 receive window. grpclib's ``recv_message`` returns without
        yielding while data is buffered, so the window bounds how long one fast stream can monopolise the edge loop.
    :param connection_window_bytes: per-connection HTTP/2 receive window (shared by that connection's streams).
    """

    endpoint: Endpoint
    connections: int = 8
    max_message_bytes: int = 64 * _MiB
    keepalive_interval_s: float = 30.0
    keepalive_timeout_s: float = 20.0
    rpc_timeout_s: float = 30.0
    connect_attempt_timeout_s: float = 30.0
    retry_interval_s: float = 1.0
    startup_deadline_s: float = 1800.0
    stream_window_bytes: int = 1 * _MiB
    connection_window_bytes: int = 2 * _MiB
    #: TLS towards an engine on another host (``endpoint.tls``): CA bundle, and a client pair for mutual TLS (with
    #: the file holding the key's passphrase, if it is encrypted). Read again on a connection attempt whenever one of
    #: them changed on disk, so rotated certificates are used without a restart.
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_key_password_file: Path | None = None
    #: Receive ``Generate`` straight from the HTTP/2 events (``_direct.py``) instead of through grpclib's streams (a
    #: ``Stream``, a buffer and a task per stream, woken per message): on the loop-resident data path ~30 % less CPU
    #: per engine message (docs/architecture.md, *The data path*). ``--grpc-receive grpclib`` turns it off.
    direct_receive: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.endpoint, Endpoint):
            raise TypeError(f"endpoint must be an Endpoint (use parse_endpoint), not {type(self.endpoint).__name__}")
        if self.endpoint.tls and self.tls_ca is None:
            raise ValueError("a TLS endpoint needs tls_ca (the CA that signed the engine's certificate)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together (mutual TLS)")
        if not 1 <= self.connections <= 256:
            raise ValueError(f"connections must be in 1..256, got {self.connections}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be at least 1024, got {self.max_message_bytes}")
        if not self.keepalive_interval_s >= MIN_KEEPALIVE_INTERVAL_S:
            raise ValueError(
                f"keepalive_interval_s must be at least {MIN_KEEPALIVE_INTERVAL_S:g} s (gRPC servers answer faster"
                f" pings with GOAWAY too_many_pings), got {self.keepalive_interval_s}"
            )
        for name in (
            "keepalive_timeout_s",
            "rpc_timeout_s",
            "connect_attempt_timeout_s",
            "retry_interval_s",
            "startup_deadline_s",
        ):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be positive and finite, got {value}")
        for name in ("stream_window_bytes", "connection_window_bytes"):
            value = getattr(self, name)
            if not _MIN_WINDOW <= value <= _MAX_WINDOW:
                raise ValueError(f"{name} must be in {_MIN_WINDOW}..{_MAX_WINDOW}, got {value}")
