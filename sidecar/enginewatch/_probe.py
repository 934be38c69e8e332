"""Does anything accept connections on the engine's address? A TCP (or Unix-socket) connect, nothing more.

The cheap half of the way back (``EngineWatch``): while the engine's port refuses, a refused connect costs the engine
nothing (its kernel answers) and the worker a few microseconds, so it is tried often; the expensive half -- a gRPC
call, an HTTP/2 connection, the engine's own work -- waits until the port accepts, and backs off while it fails.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Final

import trio

if TYPE_CHECKING:
    from sidecar.engine import Endpoint

#: A host name is resolved again at most this often while probing (a restarted engine may come back elsewhere).
_RESOLVE_EVERY_S: Final = 1.0


class PortProbe:
    """Connect-only probes of one endpoint: :meth:`accepts` says True (a connection was accepted), False (refused, or
    nothing there to connect to) or None (no answer within the bound: a host that drops packets says nothing)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._addresses: list[tuple[int, tuple[object, ...]]] = []
        self._resolved_at = -float("inf")

    async def accepts(self, timeout_s: float) -> bool | None:
        with trio.move_on_after(timeout_s):
            return await self._connect()
        return None

    async def _connect(self) -> bool:
        path = self.endpoint.path
        if path is not None:
            try:
                stream = await trio.open_unix_socket(path)
            except OSError:  # no socket file, nobody listening on it, no permission: not accepting
                return False
            await stream.aclose()
            return True
        for family, address in await self._resolve():
            sock = trio.socket.socket(family, socket.SOCK_STREAM)
            try:
                await sock.connect(address)
            except OSError:
                continue
            finally:
                sock.close()
            return True
        return False

    async def _resolve(self) -> list[tuple[int, tuple[object, ...]]]:
        now = trio.current_time()
        if now - self._resolved_at >= _RESOLVE_EVERY_S:
            try:
                found = await trio.socket.getaddrinfo(self.endpoint.host, self.endpoint.port, type=socket.SOCK_STREAM)
            except OSError:
                found = []  # the name does not resolve (yet): nothing to connect to
            self._addresses = [(family, address) for family, _, _, _, address in found]
            self._resolved_at = now
        return self._addresses
