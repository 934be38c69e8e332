"""Two h2 connections talking to each other in memory, configured as grpclib configures them
(``sidecar.http2.h2_configuration``): for measuring and testing what h2 does per received frame without sockets or an
event loop."""

from __future__ import annotations

import h2.connection
import h2.settings

from sidecar.http2 import h2_configuration

__all__ = ["connected_pair"]

_WINDOW_MAX = 2**31 - 1
_DEFAULT_WINDOW = 65535


def connected_pair(*, open_window: bool = False) -> tuple[h2.connection.H2Connection, h2.connection.H2Connection, int]:
    """A client and a server connection with one stream open (headers exchanged): ``(client, server, stream_id)``.

    ``open_window`` raises the client's receive windows to the maximum, so the server can send many frames without
    waiting for WINDOW_UPDATEs.
    """
    client = h2.connection.H2Connection(h2_configuration(client_side=True))
    server = h2.connection.H2Connection(h2_configuration(client_side=False))
    client.initiate_connection()
    if open_window:
        client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _WINDOW_MAX})
        client.increment_flow_control_window(_WINDOW_MAX - _DEFAULT_WINDOW)
    server.receive_data(client.data_to_send())
    server.initiate_connection()
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, [(":method", "POST"), (":path", "/x"), (":scheme", "http"), (":authority", "a")])
    server.receive_data(client.data_to_send())
    server.send_headers(stream_id, [(":status", "200")])
    client.receive_data(server.data_to_send())
    return client, server, stream_id
