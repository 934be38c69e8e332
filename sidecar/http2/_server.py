"""The server side, for ``openengine-mock``: grpclib's ``Server`` with what grpc-core (TensorRT-LLM's server) does and
grpclib's does not.

* ``MAX_CONCURRENT_STREAMS`` is the server's instead of h2's built-in 100 (grpcio sends no such setting: no limit).
  h2 puts 100 into the connection's first SETTINGS frame; a second SETTINGS frame right behind it (same write)
  replaces it before the client can open a stream, and h2 enforces the new value once the client acknowledges it,
  which the client does before opening any stream beyond the old limit.
* **Graceful stop**, as grpc-core's ``server.stop(grace)``: every connection gets a GOAWAY with last-stream-id
  2^31−1 and a PING, then -- once the PING is answered (or after a second) -- a second GOAWAY with the real last
  stream id. Both are written straight to the transport, so that h2 (which allows nothing but GOAWAY after sending
  one) keeps serving the open streams. A stream that arrives **between the two GOAWAYs** is answered as grpc-core
  answers it: trailers-only ``grpc-status 1 CANCELLED`` (``grpc-message: CANCELLED``), then ``RST_STREAM
  NO_ERROR``; its handler never runs. A stream above the second GOAWAY's last stream id is refused
  (``RST_STREAM REFUSED_STREAM``). :meth:`GrpcCoreServer.cut` ends what is left as grpc-core does when the grace runs
  out: trailers ``grpc-status 14`` ("Cancelling all calls"), then ``RST_STREAM NO_ERROR``.
* **Writes held for a step** (``hold_writes=True``): grpc-core writes what its streams queued in one pass, one write
  per connection, not one per message. :meth:`GrpcCoreServer.hold_writes` makes every connection keep what it
  writes; :meth:`GrpcCoreServer.release_writes` writes what each connection kept in one go (the mock's engine-wide
  decode step: a step's messages for all streams of one connection leave together). Without it every write goes
  straight to the transport, as grpclib's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any, Final, cast

from grpclib.protocol import H2Protocol
from grpclib.server import Server
from h2.errors import ErrorCodes
from h2.events import PingAckReceived, RequestReceived
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes
from hyperframe.frame import GoAwayFrame, RstStreamFrame

if TYPE_CHECKING:
    from grpclib.server import Stream

__all__ = ["NO_STREAM_LIMIT", "GrpcCoreServer", "drop_connection"]

log = logging.getLogger(__name__)

#: ``MAX_CONCURRENT_STREAMS`` advertised for "no limit" (what grpcio's missing setting means).
NO_STREAM_LIMIT: Final = 2**31 - 1
#: The first GOAWAY's last-stream-id: "every stream you may have opened" (grpc-core's graceful shutdown).
_MAX_STREAM_ID: Final = 2**31 - 1
#: Opaque data of the PING that follows the first GOAWAY; its ACK triggers the second GOAWAY.
_GOAWAY_PING: Final = b"oe-goawy"
#: The second GOAWAY is sent after this long even when the PING is never answered.
_GOAWAY_PING_TIMEOUT_S: Final = 1.0
#: grpc-core's answer to a stream that arrives between its two GOAWAYs (seen on the wire: TensorRT-LLM's server).
_CANCELLED_BETWEEN_GOAWAYS: Final = [
    (":status", "200"),
    ("content-type", "application/grpc"),
    ("grpc-status", "1"),
    ("grpc-message", "CANCELLED"),
]
#: The trailers grpc-core ends a call with when the stop grace runs out (``grpc_server_cancel_all_calls``).
_CUT_TRAILERS: Final = [("grpc-status", "14"), ("grpc-message", "Cancelling all calls")]
#: What a trailers-only response carries before them (a call cut before its first message).
_TRAILERS_ONLY: Final = [(":status", "200"), ("content-type", "application/grpc")]


class _WriteHold:
    """Whether the server's connections keep their writes now, and which of them kept some."""

    __slots__ = ("held", "pending")

    def __init__(self) -> None:
        self.held = False
        self.pending: dict[_HeldTransport, None] = {}

    def release(self) -> None:
        self.held = False
        pending = list(self.pending)
        self.pending.clear()
        for transport in pending:
            transport.flush()


class _HeldTransport:
    """A connection's transport as grpclib writes to it: while ``hold`` is held, writes are kept (in order) and
    written as one by :meth:`flush`; otherwise -- and for anything that closes the connection -- they go through."""

    __slots__ = ("_buffer", "_hold", "_transport")

    def __init__(self, transport: asyncio.Transport, hold: _WriteHold) -> None:
        self._transport = transport
        self._hold = hold
        self._buffer: list[bytes] = []

    def write(self, data: bytes) -> None:
        if self._hold.held and not self._transport.is_closing():
            if not self._buffer:
                self._hold.pending[self] = None
            self._buffer.append(bytes(data))
            return
        self.flush()
        self._transport.write(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        if self._buffer:
            data = b"".join(self._buffer)
            self._buffer.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._buffer.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _ServerProtocol(H2Protocol):
    """grpclib's server protocol plus the stream limit and the graceful stop of the module docstring."""

    def __init__(self, base: H2Protocol, server: GrpcCoreServer) -> None:
        super().__init__(base.handler, base.config, base.h2_config)
        self._owner = server
        #: Set by the first GOAWAY: streams above this id arrived after it.
        self._first_goaway_after: int | None = None
        #: Set by the second GOAWAY: streams above this id are refused.
        self._last_stream_id: int | None = None
        self._answered: set[int] = set()  # streams answered here, kept away from the handlers
        self._second_goaway: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        hold = self._owner.write_hold
        # grpclib's connection and streams write through what they are given here (duck-typed, not a subclass).
        super().connection_made(
            transport if hold is None else cast("asyncio.Transport", _HeldTransport(transport, hold))
        )
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
        # grpclib's data_received, with the streams answered here kept away from the handlers.
        try:
            events = self.connection.feed(data)
        except ProtocolError:
            log.debug("protocol error", exc_info=True)
            self.processor.close("Protocol error")
            return
        self.connection.flush()
        for event in events:
            stream_id = getattr(event, "stream_id", None)
            if isinstance(event, RequestReceived) and self._answer_new_stream(event.stream_id):
                continue
            if stream_id is not None and stream_id in self._answered:
                continue
            if isinstance(event, PingAckReceived) and event.ping_data == _GOAWAY_PING:
                self.send_final_goaway()
            self.processor.process(event)
        self.connection.flush()

    def _answer_new_stream(self, stream_id: int) -> bool:
        """True if the new stream ``stream_id`` is answered here (the server is stopping), not by a handler."""
        after = self._first_goaway_after
        if after is None or stream_id <= after:
            return False
        h2 = self.connection._connection
        self._answered.add(stream_id)
        last = self._last_stream_id
        if last is not None and stream_id > last:
            h2.reset_stream(stream_id, ErrorCodes.REFUSED_STREAM)
            return True
        log.info("stream %d arrived between the GOAWAYs: answered CANCELLED, as grpc-core does", stream_id)
        h2.send_headers(stream_id, _CANCELLED_BETWEEN_GOAWAYS, end_stream=True)
        self.connection.flush()
        # Written as it is: h2 may already count the stream as closed (the client's END_STREAM came in this read).
        self.connection._transport.write(RstStreamFrame(stream_id, error_code=ErrorCodes.NO_ERROR).serialize())
        return True

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
        if self._first_goaway_after is not None:
            return
        self._first_goaway_after = self.connection._connection.highest_inbound_stream_id
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


class GrpcCoreServer(Server):
    """A grpclib ``Server`` with grpcio's stream limit (none by default) and grpc-core's graceful stop."""

    def __init__(self, *args: Any, max_concurrent_streams: int = 0, hold_writes: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_concurrent_streams = max_concurrent_streams or NO_STREAM_LIMIT
        self.connections: set[_ServerProtocol] = set()
        #: ``hold_writes``: connections made from now on keep their writes while held (module docstring).
        self.write_hold = _WriteHold() if hold_writes else None

    def hold_writes(self) -> None:
        """Keep every connection's writes until :meth:`release_writes` (only with ``hold_writes=True``)."""
        if self.write_hold is not None:
            self.write_hold.held = True

    def release_writes(self) -> None:
        """Write what each connection kept since :meth:`hold_writes`, one write per connection."""
        if self.write_hold is not None:
            self.write_hold.release()

    def _protocol_factory(self) -> H2Protocol:
        return _ServerProtocol(super()._protocol_factory(), self)

    @property
    def listener(self) -> asyncio.AbstractServer:
        """The listening socket server (after ``start``)."""
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


def drop_connection(stream: Stream[Any, Any]) -> None:
    """Close the connection under a server ``stream`` at once, as a crashing engine would (no GOAWAY, no status)."""
    stream._stream._transport.close()
