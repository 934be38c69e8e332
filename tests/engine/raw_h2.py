"""A scripted HTTP/2 server on the edge loop: every frame of a ``Generate`` answer chosen by the test.

For the receive path's edge cases that a gRPC server library never produces on purpose: a message split across DATA
frames (and across TCP writes), many messages in one frame, padded frames, trailers-only answers, RST_STREAM in the
middle of a message, a message above the size limit, and a server that fills the stream window of a consumer that
does not read. Each stream runs ``script(responder)`` once its request has arrived; the responder writes frames.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions

from openengine.v1 import generation_pb2
from sidecar.engine import Endpoint

if TYPE_CHECKING:
    from sidecar.edge import Edge

RID = "raw-1"


def message(response: generation_pb2.GenerateResponse) -> bytes:
    """One gRPC length-prefixed message."""
    body: bytes = response.SerializeToString()
    return b"\x00" + struct.pack(">I", len(body)) + body


def token(token_id: int, request_id: str = RID) -> bytes:
    response = generation_pb2.GenerateResponse(request_id=request_id)
    response.token.output_index = 0
    response.token.tokens.add(token_id=token_id)
    return message(response)


@dataclass
class Seen:
    """What the server saw, appended on the edge loop."""

    requests: list[bytes] = field(default_factory=list)
    #: (stream id, error code, monotonic time) of every RST_STREAM from the client.
    resets: list[tuple[int, int, float]] = field(default_factory=list)
    #: Stream window increments the client granted (WINDOW_UPDATE on a stream).
    stream_window_updates: int = 0
    #: DATA bytes (flow-controlled) the server has sent, per stream.
    sent: dict[int, int] = field(default_factory=dict)
    script_errors: list[BaseException] = field(default_factory=list)


class Responder:
    """The frames of one stream's answer."""

    def __init__(self, server: _Server, stream_id: int) -> None:
        self._server = server
        self.stream_id = stream_id

    @property
    def _conn(self) -> h2.connection.H2Connection:
        return self._server.conn

    def _flush(self) -> None:
        self._server.transport.write(self._conn.data_to_send())

    def headers(self, fields: list[tuple[str, str]] | None = None, *, end: bool = False) -> None:
        self._conn.send_headers(self.stream_id, fields or [(":status", "200"), ("content-type", "application/grpc")],
                                end_stream=end)  # fmt: skip
        self._flush()

    async def data(self, payload: bytes, *, end: bool = False, pad: int | None = None) -> None:
        """One DATA frame (waits for window: a client that does not acknowledge stalls the script here)."""
        while self._conn.local_flow_control_window(self.stream_id) < len(payload) + (pad or 0) + (1 if pad else 0):
            # Not a synchronisation: the fake engine's pace.
            await asyncio.sleep(0.005)
        self._conn.send_data(self.stream_id, payload, end_stream=end, pad_length=pad)
        self._server.seen.sent[self.stream_id] = self._server.seen.sent.get(self.stream_id, 0) + len(payload)
        self._flush()

    def raw(self, data: bytes) -> None:
        """Bytes on the wire as they are (part of a frame, say): h2's own state is not told."""
        self._server.transport.write(data)

    def frame_bytes(self, payload: bytes, *, end: bool = False) -> bytes:
        """A DATA frame for this stream, accounted in h2's flow control, returned instead of written."""
        self._conn.send_data(self.stream_id, payload, end_stream=end)
        self._server.seen.sent[self.stream_id] = self._server.seen.sent.get(self.stream_id, 0) + len(payload)
        return self._conn.data_to_send()

    def trailers(self, status: int = 0, text: str | None = None) -> None:
        fields = [("grpc-status", str(status))]
        if text is not None:
            fields.append(("grpc-message", text))
        self._conn.send_headers(self.stream_id, fields, end_stream=True)
        self._flush()

    def reset(self, code: int = 2) -> None:
        self._conn.reset_stream(self.stream_id, error_code=code)
        self._flush()


Script = Callable[[Responder], Awaitable[None]]


class _Server(asyncio.Protocol):
    def __init__(self, script: Script, seen: Seen) -> None:
        self.script = script
        self.seen = seen
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding="utf-8", validate_inbound_headers=False)
        )
        self.transport: Any = None
        self.bodies: dict[int, bytes] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.conn.initiate_connection()
        transport.write(self.conn.data_to_send())  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                self.bodies[event.stream_id] = self.bodies.get(event.stream_id, b"") + event.data
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded) and event.stream_id in self.bodies:
                self.seen.requests.append(self.bodies.pop(event.stream_id))
                task = asyncio.get_running_loop().create_task(self._run(event.stream_id))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            elif isinstance(event, h2.events.StreamReset):
                self.seen.resets.append((event.stream_id, int(event.error_code or 0), time.monotonic()))
            elif isinstance(event, h2.events.WindowUpdated) and event.stream_id:
                self.seen.stream_window_updates += 1
        self.transport.write(self.conn.data_to_send())

    async def _run(self, stream_id: int) -> None:
        try:
            await self.script(Responder(self, stream_id))
        except h2.exceptions.StreamClosedError:
            pass  # the client reset the stream first
        except Exception as exc:
            self.seen.script_errors.append(exc)

    def connection_lost(self, exc: BaseException | None) -> None:
        for task in self.tasks:
            task.cancel()


async def _start(script: Script, seen: Seen) -> tuple[asyncio.Server, int]:
    server = await asyncio.get_running_loop().create_server(lambda: _Server(script, seen), "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _stop(server: asyncio.Server) -> None:
    server.close()
    await asyncio.wait_for(server.wait_closed(), 5)


@asynccontextmanager
async def raw_engine(edge: Edge, script: Script) -> AsyncIterator[tuple[Endpoint, Seen]]:
    """Serve ``script`` for every stream on ``edge``'s loop; yield the endpoint and what the server saw."""
    seen = Seen()
    server, port = await edge.run(_start, script, seen)
    try:
        yield Endpoint("127.0.0.1", port), seen
    finally:
        await edge.run(_stop, server)
