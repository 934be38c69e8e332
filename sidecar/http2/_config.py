"""Configuration of grpclib and h2 connections: grpclib's keepalive settings are its underscore-prefixed fields."""

from __future__ import annotations

import h2.config
from grpclib.config import Configuration

__all__ = ["grpclib_configuration", "h2_configuration"]

_MiB = 2**20


def grpclib_configuration(
    *,
    keepalive_s: float | None,
    keepalive_timeout_s: float = 20.0,
    keepalive_without_calls: bool = False,
    max_pings_without_data: int = 2,
    min_ping_interval_without_data_s: float = 300.0,
    stream_window_bytes: int = 4 * _MiB,
    connection_window_bytes: int = 4 * _MiB,
) -> Configuration:
    """grpclib's ``Configuration``; the defaults are grpclib's own (keepalive off when ``keepalive_s`` is None).

    :param keepalive_s: PING this often while the connection is idle (grpclib ``_keepalive_time``).
    :param keepalive_timeout_s: close the connection when a PING is not answered within this (``_keepalive_timeout``).
    :param keepalive_without_calls: PING also when no stream is open (``_keepalive_permit_without_calls``).
    :param max_pings_without_data: PINGs sent while *we* send no data before pinging stops; 0 = no limit
        (``_http2_max_pings_without_data``).
    :param min_ping_interval_without_data_s: the least time between such PINGs
        (``_http2_min_sent_ping_interval_without_data``).
    """
    return Configuration(
        _keepalive_time=keepalive_s,
        _keepalive_timeout=keepalive_timeout_s,
        _keepalive_permit_without_calls=keepalive_without_calls,
        _http2_max_pings_without_data=max_pings_without_data,
        _http2_min_sent_ping_interval_without_data=min_ping_interval_without_data_s,
        http2_stream_window_size=stream_window_bytes,
        http2_connection_window_size=connection_window_bytes,
    )


def h2_configuration(*, client_side: bool) -> h2.config.H2Configuration:
    """The h2 configuration grpclib gives its connections (its ``Channel`` and ``Server`` build the same one)."""
    return h2.config.H2Configuration(
        client_side=client_side,
        header_encoding="ascii",
        validate_inbound_headers=False,
        validate_outbound_headers=False,
        normalize_inbound_headers=False,
        normalize_outbound_headers=False,
    )
