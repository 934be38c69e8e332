"""A minimal ZeroMQ PUB socket on asyncio (ZMTP 3.0, NULL mechanism), so the mock can publish KV events the way
vLLM and TensorRT-LLM do without pyzmq.

Only what a PUB needs (RFC 23/ZMTP): the 64-byte greeting, the ``READY`` command with ``Socket-Type: PUB``,
subscriptions from SUB/XSUB peers (ZMTP 3.0 messages ``\\x01topic`` / ``\\x00topic``, and 3.1's ``SUBSCRIBE`` /
``CANCEL`` commands), ``PING`` → ``PONG``, and multipart messages delivered to every peer with a subscription that
is a prefix of the first frame. Like a real PUB it never blocks the publisher: a peer that cannot keep up (more than
:data:`HIGH_WATER` bytes buffered) has messages dropped, and a message published before a peer subscribed is never
seen by it (ZeroMQ's "slow joiner").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

__all__ = ["HIGH_WATER", "ZmtpPublisher"]

log = logging.getLogger("openengine_mock")

HIGH_WATER = 16 * 1024 * 1024
_SIGNATURE = b"\xff" + bytes(8) + b"\x7f"
_GREETING = _SIGNATURE + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
_FLAG_MORE = 0x01
_FLAG_LONG = 0x02
_FLAG_COMMAND = 0x04


def _frame(body: bytes, flags: int) -> bytes:
    if len(body) > 255:
        return bytes([flags | _FLAG_LONG]) + len(body).to_bytes(8, "big") + body
    return bytes([flags, len(body)]) + body


def _command(name: bytes, data: bytes = b"") -> bytes:
    return _frame(bytes([len(name)]) + name + data, _FLAG_COMMAND)


def _ready() -> bytes:
    prop = b"Socket-Type"
    return _command(b"READY", bytes([len(prop)]) + prop + (3).to_bytes(4, "big") + b"PUB")


class _Peer:
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.subscriptions: list[bytes] = []
        self.ready = False

    def wants(self, topic: bytes) -> bool:
        return self.ready and any(topic.startswith(prefix) for prefix in self.subscriptions)


class ZmtpPublisher:
    """``await start(host, port)``, then ``publish([topic, *frames])`` from the event loop; ``await close()``."""

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._peers: set[_Peer] = set()
        self.host = ""
        self.port = 0
        self.dropped = 0

    @property
    def subscribers(self) -> int:
        """Peers that completed the handshake and subscribed to something."""
        return sum(1 for peer in self._peers if peer.ready and peer.subscriptions)

    async def start(self, host: str, port: int = 0) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._serve, host, port)
        bound = self._server.sockets[0].getsockname()
        self.host, self.port = host, int(bound[1])
        log.info("KV events: ZMQ PUB listening on tcp://%s:%d", host, self.port)
        return self.host, self.port

    def publish(self, frames: Sequence[bytes]) -> None:
        """Send one multipart message to every peer subscribed to a prefix of ``frames[0]``."""
        data = b"".join(_frame(f, _FLAG_MORE if i < len(frames) - 1 else 0) for i, f in enumerate(frames))
        for peer in tuple(self._peers):
            if not peer.wants(frames[0]):
                continue
            if peer.writer.transport.get_write_buffer_size() > HIGH_WATER:
                self.dropped += 1
                continue
            peer.writer.write(data)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for peer in tuple(self._peers):
            peer.writer.close()
        self._peers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _Peer(writer)
        self._peers.add(peer)
        try:
            writer.write(_GREETING)
            greeting = await reader.readexactly(64)
            if greeting[0] != 0xFF or greeting[9] != 0x7F or greeting[10] < 3:
                raise ValueError(f"not a ZMTP 3 peer: {greeting[:12]!r}")
            writer.write(_ready())
            while True:
                flags = (await reader.readexactly(1))[0]
                size_bytes = await reader.readexactly(8 if flags & _FLAG_LONG else 1)
                body = await reader.readexactly(int.from_bytes(size_bytes, "big"))
                if flags & _FLAG_COMMAND:
                    self._on_command(peer, body)
                elif body[:1] == b"\x01":
                    peer.subscriptions.append(body[1:])
                elif body[:1] == b"\x00" and body[1:] in peer.subscriptions:
                    peer.subscriptions.remove(body[1:])
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception as exc:
            log.warning("KV events: ZMQ peer dropped: %r", exc)
        finally:
            self._peers.discard(peer)
            with contextlib.suppress(Exception):
                writer.close()

    def _on_command(self, peer: _Peer, body: bytes) -> None:
        name = body[1 : 1 + body[0]]
        data = body[1 + body[0] :]
        if name == b"READY":
            peer.ready = True
        elif name == b"SUBSCRIBE":
            peer.subscriptions.append(data)
        elif name == b"CANCEL" and data in peer.subscriptions:
            peer.subscriptions.remove(data)
        elif name == b"PING":
            # PING: TTL (2 bytes) then context; PONG echoes the context.
            peer.writer.write(_command(b"PONG", data[2:]))
