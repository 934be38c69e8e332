"""The client side: grpclib channels whose connections drain on GOAWAY, and the HTTP/2 half of the direct receive path.

grpclib 0.4.9 closes the whole connection on the first GOAWAY (``EventsProcessor.process_connection_terminated``),
and h2 moves the connection to ``CLOSED`` on it, after which h2 refuses every frame of the streams still open. An
engine stopping like grpc-core (TensorRT-LLM: ``server.stop(grace=5)``) sends a GOAWAY with last-stream-id 2^31-1,
then the real one, and lets its open streams run until the grace ends. With :attr:`GoawayPolicy.DRAIN` a GOAWAY
only (a) takes the connection out of its channel, so the next call connects anew, (b) refuses new streams on it
(:class:`GoawayRefused`, raised before anything is sent, so the caller may retry on a fresh connection), (c) fails
the streams above the GOAWAY's last-stream-id (never processed by the engine), and (d) keeps delivering the others
until they end (the drained connection is then closed) or the engine closes the connection. With
:attr:`GoawayPolicy.CLOSE` the connection goes as grpclib's does. Either way the channel hears of every GOAWAY
(:meth:`Http2Channel.heard_goaway`: the conformance kit records them, the engine client tells its owner).

Everything here runs on the asyncio loop of the channel.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from grpclib.client import _H2_TO_GRPC_STATUS_MAP, Channel, Handler
from grpclib.const import Status
from grpclib.metadata import USER_AGENT, encode_metadata, encode_timeout
from grpclib.protocol import EventsProcessor, H2Protocol
from h2.connection import ConnectionState
from h2.errors import ErrorCodes
from h2.events import ConnectionTerminated, DataReceived
from h2.exceptions import ProtocolError, StreamClosedError, TooManyStreamsError
from h2.stream import StreamState
from hyperframe.frame import GoAwayFrame

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from grpclib.config import Configuration
    from grpclib.encoding.base import CodecBase
    from h2.connection import H2Connection

__all__ = [
    "ClientProtocol",
    "DirectSink",
    "Goaway",
    "GoawayPolicy",
    "GoawayRefused",
    "Http2Channel",
    "StreamLink",
    "grpc_request_headers",
    "grpc_status_of_http",
]

log = logging.getLogger(__name__)

#: The largest stream id; a GOAWAY without a last-stream-id lets every stream finish.
MAX_STREAM_ID: Final = (1 << 31) - 1
# An HTTP/2 frame header: 24-bit length (16 + 8 bits here), type, flags, stream id (RFC 9113 §4.1).
_FRAME_HEADER: Final = struct.Struct(">HBBBL")
_DATA_FRAME: Final = 0
_GRPC_CONTENT_TYPE: Final = "application/grpc"
# h2 stream states in which a DATA frame is received without a state change.
_RECEIVING: Final = frozenset({StreamState.OPEN, StreamState.HALF_CLOSED_LOCAL})


class GoawayRefused(ConnectionError):
    """A stream was about to open on a connection whose peer sent GOAWAY; nothing was sent, so retrying the call on a
    fresh connection is safe."""


class GoawayPolicy(enum.Enum):
    """What a connection does on the peer's GOAWAY."""

    #: Keep delivering the streams at or below its last-stream-id; open no new stream; close once they ended.
    DRAIN = "drain"
    #: grpclib's own: close the connection, failing every stream on it.
    CLOSE = "close"


@dataclass(frozen=True, slots=True)
class Goaway:
    """A GOAWAY frame the peer sent: when (``time.monotonic()``), its code, last stream id and debug data."""

    at: float
    error_code: int
    last_stream_id: int
    additional_data: bytes | None
    #: The connection's first GOAWAY (grpc-core sends two on a graceful stop).
    first: bool

    @property
    def code_name(self) -> str:
        """``NO_ERROR``, ``ENHANCE_YOUR_CALM``, ... (the number for a code h2 does not know)."""
        try:
            return ErrorCodes(self.error_code).name
        except ValueError:
            return str(self.error_code)


def _goaway_event(frame: GoAwayFrame) -> tuple[list[Any], list[Any]]:
    """A received GOAWAY as h2's event, without h2's move to ``CLOSED`` (no frames to send, one event)."""
    event = ConnectionTerminated()
    try:
        event.error_code = ErrorCodes(frame.error_code)
    except ValueError:
        event.error_code = frame.error_code
    event.last_stream_id = frame.last_stream_id
    event.additional_data = frame.additional_data or None
    return [], [event]


def _refuse_new_stream() -> int:
    raise GoawayRefused("the engine is closing this connection (GOAWAY); no new stream is opened on it")


class _ReleaseHook(asyncio.Event):
    """Stands in for a draining connection's ``stream_close_waiter``: grpclib sets it whenever a stream is released,
    which is the moment to see whether the connection has nothing left to deliver."""

    def __init__(self, on_set: Callable[[], None]) -> None:
        super().__init__()
        self._on_set = on_set

    def set(self) -> None:
        super().set()
        self._on_set()


class _Processor(EventsProcessor):
    """grpclib's events processor: GOAWAY as the protocol's policy says, and the first close reason kept."""

    def __init__(self, handler: Any, connection: Any, protocol: ClientProtocol) -> None:
        super().__init__(handler, connection)
        self._protocol = protocol
        #: The latest GOAWAY the peer sent, if any.
        self.goaway: Goaway | None = None
        self.closed_because: str | None = None

    def close(self, reason: str = "Connection closed") -> None:
        # The first reason is why the streams ended; the transport's own "connection lost" that follows must not
        # replace it (grpclib's stream raises the last reason it was given).
        if self.closed_because is None:
            self.closed_because = reason
        super().close(self.closed_because)

    def process_connection_terminated(self, event: ConnectionTerminated) -> None:
        first = self.goaway is None
        goaway = self.goaway = Goaway(
            time.monotonic(),
            int(event.error_code or 0),
            MAX_STREAM_ID if event.last_stream_id is None else event.last_stream_id,
            event.additional_data,
            first,
        )
        protocol = self._protocol
        if protocol.policy is GoawayPolicy.CLOSE:
            protocol.channel.heard_goaway(protocol, goaway)
            super().process_connection_terminated(event)
            return
        for stream_id, stream in list(self.streams.items()):
            if stream_id > goaway.last_stream_id:
                # Above the last-stream-id the peer never processed the stream: failing it is safe to retry.
                stream.__terminated__("refused by the engine's GOAWAY before it was processed; retry")
        if first:
            connection = self.connection
            # From now on grpclib's next-stream-id call refuses, before anything goes on the wire.
            connection._connection.get_next_available_stream_id = _refuse_new_stream  # type: ignore[method-assign]
            parked = connection.stream_close_waiter
            connection.stream_close_waiter = _ReleaseHook(self._close_if_idle)
            parked.set()  # streams waiting for a slot under MAX_CONCURRENT_STREAMS wake up and are refused
        protocol.channel.heard_goaway(protocol, goaway)
        self._close_if_idle()

    def _close_if_idle(self) -> None:
        if self.goaway is not None and not self.streams:
            asyncio.get_running_loop().call_soon(self._close_drained)

    def _close_drained(self) -> None:
        if not self.streams and not self.connection.is_closing():
            self.close("closed after the engine's GOAWAY, every stream ended")


class _DirectProcessor(_Processor):
    """Also hands the events of direct streams (:class:`DirectSink`) to them as they are."""

    def process_response_received(self, event: Any) -> None:
        stream: Any = self.streams.get(event.stream_id)
        if isinstance(stream, DirectSink):
            stream.on_headers(event.headers)
        else:
            super().process_response_received(event)

    def process_data_received(self, event: DataReceived) -> None:
        stream: Any = self.streams.get(event.stream_id)
        if isinstance(stream, DirectSink):
            stream.on_data(event.data, event.flow_controlled_length)
        else:
            super().process_data_received(event)

    def process_trailers_received(self, event: Any) -> None:
        stream: Any = self.streams.get(event.stream_id)
        if isinstance(stream, DirectSink):
            stream.on_trailers(event.headers)
        else:
            super().process_trailers_received(event)

    def process_stream_ended(self, event: Any) -> None:
        stream: Any = self.streams.get(event.stream_id)
        if isinstance(stream, DirectSink):
            self.connection.streams_succeeded += 1
            stream.on_end()
        else:
            super().process_stream_ended(event)

    def process_stream_reset(self, event: Any) -> None:
        stream: Any = self.streams.get(event.stream_id)
        if isinstance(stream, DirectSink):
            self.connection.streams_failed += 1
            if event.remote_reset:
                stream.on_reset(f"Stream reset by remote party, error_code: {event.error_code}")  # grpclib's words
            else:
                stream.on_reset("Protocol error")
        else:
            super().process_stream_reset(event)


class ClientProtocol(H2Protocol):
    """grpclib's client protocol with the GOAWAY policy of its channel, a look at the first bytes, and reasons."""

    processor: _Processor

    def __init__(self, channel: Http2Channel) -> None:
        super().__init__(Handler(), channel._config, channel._h2_config)
        self.channel = channel
        self.policy = channel.goaway_policy
        #: Something arrived from the peer (a close before that means HTTP/2 never began).
        self.received = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.processor = self._make_processor()
        if self.policy is GoawayPolicy.DRAIN:
            # h2's own GOAWAY handler moves the whole connection to CLOSED; every later frame of the streams still
            # open -- and the PING grpc-core sends in the same write as its first GOAWAY -- would then be a
            # ProtocolError. The dispatch table holds bound methods, hence replaced per connection.
            self.connection._connection._frame_dispatch_table[GoAwayFrame] = _goaway_event

    def _make_processor(self) -> _Processor:
        return _Processor(self.handler, self.connection, self)

    @property
    def goaway(self) -> Goaway | None:
        """The latest GOAWAY the peer sent on this connection, if any."""
        return self.processor.goaway

    @property
    def closing(self) -> bool:
        """The connection is closed or closing."""
        return bool(self.connection.is_closing())

    def close(self, reason: str) -> None:
        """Close the connection; its streams fail with ``reason``."""
        self.processor.close(reason)

    def data_received(self, data: bytes) -> None:
        if not self.received:
            self.received = True
            reason = self.channel.refuse_first_bytes(data)
            if reason is not None:
                self.processor.close(reason)
                return
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.processor.close(reason=self.channel.lost_reason(self, exc))
        self.channel.connection_closed(self)


class Http2Channel(Channel):
    """A grpclib channel whose connections follow ``goaway`` (see the module docstring); with ``direct=True`` its
    connections also carry direct streams (:class:`DirectSink`), which engages the frame splitter.

    Subclasses adapt it through the public hooks :meth:`open_connection`, :meth:`refuse_first_bytes`,
    :meth:`lost_reason`, :meth:`heard_goaway` and :meth:`connection_closed`, never grpclib's private names.
    """

    def __init__(
        self,
        host: str | None = None,
        port: int | None = None,
        *,
        path: str | None = None,
        codec: CodecBase | None = None,
        config: Configuration | None = None,
        ssl: Any = None,
        goaway: GoawayPolicy = GoawayPolicy.DRAIN,
        direct: bool = False,
    ) -> None:
        super().__init__(host, port, path=path, codec=codec, config=config, ssl=ssl)
        self.goaway_policy = goaway
        self.direct = direct
        #: How many connections of this channel heard their first GOAWAY: a call that saw it change heard one.
        self.goaways_heard = 0
        self._draining: set[ClientProtocol] = set()

    # -- grpclib's private hooks, adapted here and nowhere else -------------------------------------------------

    @property
    def _connected(self) -> bool:
        return self.connected

    def _protocol_factory(self) -> ClientProtocol:
        return SplittingProtocol(self) if self.direct else ClientProtocol(self)

    async def _create_connection(self) -> ClientProtocol:
        return await self.open_connection(self._protocol_factory)

    # -- views of grpclib's state -------------------------------------------------------------------------------

    @property
    def scheme(self) -> str:
        """``http`` or ``https``, as sent in ``:scheme``."""
        return str(self._scheme)

    @scheme.setter
    def scheme(self, value: str) -> None:
        self._scheme = value

    @property
    def authority(self) -> str:
        """What is sent as ``:authority``."""
        return str(self._authority)

    @authority.setter
    def authority(self, value: str) -> None:
        self._authority = value

    @property
    def config(self) -> Configuration:
        """grpclib's configuration of this channel."""
        return self._config

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop the channel was made on."""
        return self._loop

    @property
    def protocol(self) -> ClientProtocol | None:
        """The connection new calls go to, or None (not connected yet, or it heard a GOAWAY)."""
        protocol = self._protocol
        assert protocol is None or isinstance(protocol, ClientProtocol)  # our _protocol_factory made it
        return protocol

    @property
    def connected(self) -> bool:
        """grpclib's test plus "no GOAWAY": a connection that heard one before it was handed to the channel must not
        be reused for new calls either."""
        protocol = self._protocol
        return (
            protocol is not None
            and not getattr(protocol.handler, "connection_lost", False)
            and getattr(protocol.processor, "goaway", None) is None
        )

    def counters(self) -> tuple[int, int, int]:
        """grpclib's call counters: started, succeeded, failed."""
        return self._calls_started, self._calls_succeeded, self._calls_failed

    def stream_limit(self) -> tuple[int, int] | None:
        """``(open streams, the peer's MAX_CONCURRENT_STREAMS)`` of the current connection, None if there is none."""
        protocol = self._protocol
        if protocol is None:  # not connected yet: the peer's SETTINGS are unknown
            return None
        limit: int = protocol.connection._connection.remote_settings.max_concurrent_streams
        return len(protocol.processor.streams), limit

    @property
    def draining(self) -> int:
        """Connections of this channel that heard a GOAWAY and still deliver streams."""
        return len(self._draining)

    # -- hooks ---------------------------------------------------------------------------------------------------

    async def open_connection(self, factory: Callable[[], ClientProtocol]) -> ClientProtocol:
        """Make a connection with ``factory`` (grpclib's way by default: TCP or the Unix socket, TLS if given)."""
        protocol = await Channel._create_connection(self)  # calls self._protocol_factory, i.e. ``factory``
        assert isinstance(protocol, ClientProtocol)
        return protocol

    def refuse_first_bytes(self, data: bytes) -> str | None:
        """The reason to close a connection whose first received bytes are ``data``, or None to go on."""
        return None

    def lost_reason(self, protocol: ClientProtocol, exc: BaseException | None) -> str:
        """What the streams of a lost connection fail with."""
        return "Connection lost"  # grpclib's own words

    def heard_goaway(self, protocol: ClientProtocol, goaway: Goaway) -> None:
        """``protocol`` heard ``goaway``: new calls of this channel connect anew. Extend, calling this first."""
        if self._protocol is protocol:
            self._protocol = None
        if goaway.first:
            self.goaways_heard += 1
            if self.goaway_policy is GoawayPolicy.DRAIN and not protocol.closing:
                self._draining.add(protocol)

    def connection_closed(self, protocol: ClientProtocol) -> bool:
        """``protocol``'s connection is gone; True if it was draining. Extend, calling this first."""
        if protocol in self._draining:
            self._draining.discard(protocol)
            return True
        return False

    # -- closing -------------------------------------------------------------------------------------------------

    def close_draining(self, reason: str) -> None:
        """Close the connections that heard a GOAWAY (their streams fail with ``reason``)."""
        for protocol in list(self._draining):
            protocol.close(reason)

    #: What the streams of draining connections fail with when the channel is closed.
    closed_reason = "the channel is closed"

    def close(self) -> None:
        """Close the current connection and every draining one (their streams fail)."""
        self.close_draining(self.closed_reason)
        super().close()


# ---------------------------------------------------------------------------------------------- direct streams


class _NoWaiter:
    """``window_updated`` of a stream that is not waiting for send window (grpclib sets it on every stream)."""

    __slots__ = ()

    def set(self) -> None:
        pass


_NO_WAITER: Final = _NoWaiter()


class DirectSink:
    """A stream whose HTTP/2 events the processor hands over as they are, instead of to a grpclib ``Stream``.

    Registered in the processor's streams under its id like grpclib's streams (so that GOAWAY, a lost connection and
    the stream-limit count treat both alike), through :class:`StreamLink`. ``window_updated`` is what grpclib sets on
    every stream when the peer grants send window. Only connections of a ``direct=True`` channel carry them.
    """

    __slots__ = ("window_updated",)

    def __init__(self) -> None:
        self.window_updated: Any = _NO_WAITER

    def on_headers(self, headers: list[tuple[str, str]]) -> None:
        raise NotImplementedError

    def on_data(self, data: bytes, flow_controlled_length: int) -> None:
        raise NotImplementedError

    def on_trailers(self, headers: list[tuple[str, str]]) -> None:
        raise NotImplementedError

    def on_end(self) -> None:
        raise NotImplementedError

    def on_reset(self, reason: str) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """After the reads of one loop iteration: hand over what they brought (one post per stream)."""
        raise NotImplementedError

    def after_round(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the loop once the consumer has taken in what this stream handed over so far."""
        raise NotImplementedError

    def take_data_frame(self, length: int) -> bool:
        """Whether a plain DATA frame (no flags) of ``length`` bytes for this stream may skip h2 (then its payload goes
        to :meth:`on_data` next); :meth:`StreamLink.accept_data_frame` decides and accounts it."""
        raise NotImplementedError

    def __terminated__(self, reason: str) -> None:
        raise NotImplementedError


def grpc_request_headers(
    channel: Http2Channel, path: str, timeout_s: float | None, metadata: Sequence[tuple[str, str]]
) -> list[tuple[str, str]]:
    """The HEADERS of a gRPC call on ``channel``, as grpclib writes them (``grpc-timeout`` if ``timeout_s``)."""
    headers = [(":method", "POST"), (":scheme", channel.scheme), (":path", path), (":authority", channel.authority)]
    if timeout_s is not None:
        headers.append(("grpc-timeout", encode_timeout(timeout_s)))
    headers.extend((("te", "trailers"), ("content-type", _GRPC_CONTENT_TYPE), ("user-agent", USER_AGENT)))
    headers.extend(encode_metadata(list(metadata)))
    return headers


def grpc_status_of_http(status: str | None) -> Status:
    """The gRPC status a non-200 HTTP ``:status`` means, as grpclib maps it."""
    return _H2_TO_GRPC_STATUS_MAP.get(status, Status.UNKNOWN)  # type: ignore[arg-type]


class StreamLink:
    """The HTTP/2 stream of one :class:`DirectSink` on a channel's connection: opening it, sending the request,
    accounting and acknowledging what arrives, resetting and releasing it."""

    __slots__ = ("_connection", "_h2", "channel", "id", "protocol", "sink")

    def __init__(self, channel: Http2Channel, sink: DirectSink, protocol: ClientProtocol, stream_id: int) -> None:
        connection = protocol.processor.connection
        self.channel = channel
        self.sink = sink
        self.protocol: SplittingProtocol = protocol  # type: ignore[assignment]
        self.id = stream_id
        self._connection = connection
        self._h2: H2Connection = connection._connection
        protocol.processor.streams[stream_id] = sink  # type: ignore[assignment]
        channel._calls_started += 1
        connection.streams_started += 1
        connection.headers_send_process()

    @classmethod
    def open_now(
        cls,
        channel: Http2Channel,
        sink: DirectSink,
        headers: list[tuple[str, str]],
        before_open: Callable[[], None] | None = None,
    ) -> StreamLink | None:
        """Open the stream without waiting, if the channel is connected and has a slot and room to write; else None
        and nothing was done. The headers go out with the request (:meth:`send_now`) or the next :meth:`flush`.
        ``before_open()`` runs right before a slot is taken."""
        protocol = channel.protocol
        if protocol is None or not channel.connected:
            return None
        connection = protocol.processor.connection
        if not connection.write_ready.is_set():
            return None
        if before_open is not None:
            before_open()
        h2 = connection._connection
        try:
            stream_id = h2.get_next_available_stream_id()
            h2.send_headers(stream_id, headers, end_stream=False)
        except (TooManyStreamsError, GoawayRefused):
            return None
        return cls(channel, sink, protocol, stream_id)

    @classmethod
    async def open(
        cls,
        channel: Http2Channel,
        sink: DirectSink,
        headers: list[tuple[str, str]],
        before_open: Callable[[], None] | None = None,
    ) -> StreamLink:
        """Connect if need be, wait for a stream slot (at the peer's MAX_CONCURRENT_STREAMS: until a stream of the
        connection ends, grpclib's way) and send the headers. Raises :class:`GoawayRefused` (nothing sent) when the
        connection heard a GOAWAY meanwhile."""
        protocol: ClientProtocol = await channel.__connect__()  # type: ignore[assignment]
        connection = protocol.processor.connection
        h2 = connection._connection
        if before_open is not None:
            before_open()
        while True:
            await connection.write_ready.wait()
            stream_id = h2.get_next_available_stream_id()  # GoawayRefused once the peer sent GOAWAY
            try:
                h2.send_headers(stream_id, headers, end_stream=False)
            except TooManyStreamsError:
                connection.stream_close_waiter.clear()
                await connection.stream_close_waiter.wait()
                continue
            break
        link = cls(channel, sink, protocol, stream_id)
        connection.flush()
        return link

    @property
    def closing(self) -> bool:
        """The connection is closed or closing."""
        return bool(self._connection.is_closing())

    @property
    def heard_goaway(self) -> bool:
        """The connection heard the peer's GOAWAY."""
        return self.protocol.goaway is not None

    def send_now(self, data: bytes) -> bool:
        """Send ``data`` and end the stream if the send window and the frame size allow it at once; else False."""
        h2, stream_id = self._h2, self.id
        if h2.local_flow_control_window(stream_id) < len(data) or h2.max_outbound_frame_size < len(data):
            return False
        h2.send_data(stream_id, data, end_stream=True)
        self._connection.flush()
        self._connection.data_send_process()
        return True

    async def send(self, data: bytes, released: Callable[[], bool]) -> None:
        """Send ``data`` and end the stream, as send window allows; stops early once ``released()`` or once the peer
        ended the stream (an early error status: its events say how)."""
        connection, h2, stream_id, sink = self._connection, self._h2, self.id, self.sink
        position, total = 0, len(data)
        while not released():
            await connection.write_ready.wait()
            if released():  # released while waiting (reset, deadline, an early status)
                return
            try:
                window = h2.local_flow_control_window(stream_id)
                if window <= 0:
                    sink.window_updated = waiter = asyncio.Event()
                    try:
                        await waiter.wait()
                    finally:
                        sink.window_updated = _NO_WAITER
                    continue
                size = min(window, h2.max_outbound_frame_size, total - position)
                last = position + size == total
                h2.send_data(stream_id, data[position : position + size], end_stream=last)
            except StreamClosedError:
                return
            connection.flush()
            connection.data_send_process()
            position += size
            if last:
                return

    def wake_sender(self) -> None:
        """A send waiting for window wakes up (and sees the stream released)."""
        self.sink.window_updated.set()

    def accept_data_frame(self, length: int) -> bool:
        """Whether a plain DATA frame of ``length`` bytes may skip h2 (:func:`account_data_frame`: accounted if so)."""
        return account_data_frame(self._h2, self.id, length)

    def mark_dirty(self) -> None:
        """This stream got data in the current read: it is flushed once, after the reads of this loop iteration."""
        self.protocol.dirty.append(self.sink)

    def ack(self, size: int) -> None:
        """Acknowledge ``size`` received bytes: the connection's window always, the stream's while it is open (h2
        skips closed streams). The WINDOW_UPDATE frames it queues go out with the next flush."""
        self._h2.acknowledge_received_data(size, self.id)

    def flush(self) -> None:
        """Write what h2 has queued (unless the connection is closing)."""
        if not self._connection.is_closing():
            self._connection.flush()

    def reset(self) -> None:
        """RST_STREAM(CANCEL), unless the stream or the connection is already closed."""
        h2 = self._h2
        if self._connection.is_closing() or h2.state_machine.state is ConnectionState.CLOSED:
            return
        stream = h2.streams.get(self.id)
        if stream is None or stream.closed:
            return
        h2.reset_stream(self.id, error_code=ErrorCodes.CANCEL)
        if self._connection.write_ready.is_set():
            self._connection.flush()

    def release(self, unacknowledged: int, succeeded: bool) -> None:
        """Give the stream's slot back; its ``unacknowledged`` bytes go back to the connection window."""
        connection = self._connection
        self.protocol.processor.streams.pop(self.id, None)
        connection.stream_close_waiter.set()
        if not connection.is_closing():
            if unacknowledged:
                self.ack(unacknowledged)
            connection.flush()
        if succeeded:
            self.channel._calls_succeeded += 1
        else:
            self.channel._calls_failed += 1


def account_data_frame(h2: H2Connection, stream_id: int, length: int) -> bool:
    """Whether a plain DATA frame (no flags) of ``length`` bytes on ``stream_id`` may skip h2: only when h2 would do
    nothing but account its flow control and hand its payload on. If so, the accounting is done here, as h2's
    ``_receive_data_frame`` and ``H2Stream.receive_data`` would (``tests/http2`` compares the two)."""
    if h2.state_machine.state is not ConnectionState.CLIENT_OPEN or h2.incoming_buffer._headers_buffer:
        return False  # closing, or a header block awaits CONTINUATION (h2 must refuse the frame)
    stream = h2.streams.get(stream_id)
    if stream is None or stream.state_machine.state not in _RECEIVING or not stream.state_machine.headers_received:
        return False
    window = h2._inbound_flow_control_window_manager
    stream_window = stream._inbound_window_manager
    if (
        window.current_window_size < length
        or stream_window.current_window_size < length
        or stream._expected_content_length is not None
    ):
        return False  # h2 answers a flow-control breach (or a content-length) its own way
    window.current_window_size -= length
    stream_window.current_window_size -= length
    stream._actual_content_length += length
    return True


class SplittingProtocol(ClientProtocol):
    """:class:`ClientProtocol` for a channel with direct streams: DATA frames of direct streams skip h2 where h2
    would only account them, and what one loop iteration read is handed over once per stream."""

    def __init__(self, channel: Http2Channel) -> None:
        super().__init__(channel)
        #: Direct streams that got data during the current ``data_received`` (each flushes once at its end).
        self.dirty: list[DirectSink] = []
        self._rx = b""  # the start of a frame whose end has not arrived yet
        self._flush_due = False  # _flush_dirty is scheduled for the end of this loop iteration
        self._awaiting = False  # the last hand-over is not in the consumer's hands yet (see _flush_dirty)

    def _make_processor(self) -> _Processor:
        return _DirectProcessor(self.handler, self.connection, self)

    def data_received(self, data: bytes) -> None:
        if not self.received:
            self.received = True
            reason = self.channel.refuse_first_bytes(data)
            if reason is not None:
                self.processor.close(reason)
                return
        # grpclib's H2Protocol.data_received, with two changes for direct streams. (1) A plain DATA frame (no
        # END_STREAM, no padding) of a direct stream skips h2 when h2 would only have accounted its flow control and
        # handed its payload on (DirectSink.take_data_frame checks that and does the accounting): h2's per-frame
        # work was the largest cost per engine message left. Every other frame goes to h2 in order, in runs of
        # complete frames (a partial frame waits here, so h2's buffer never holds one). (2) What the reads of one
        # loop iteration brought for a direct stream is handed over once, after them (call_soon runs after every
        # read of the iteration): under load a stream's messages arrive in several reads, and one batch for them
        # means one wakeup of its consumer instead of one per read.
        if self._rx:
            data = self._rx + data
            self._rx = b""
        streams: dict[int, Any] = self.processor.streams  # grpclib's streams and DirectSinks
        size = len(data)
        position = slow = 0
        max_frame = self.connection._connection.max_inbound_frame_size
        try:
            while size - position >= 9:
                high, low, kind, flags, stream_id = _FRAME_HEADER.unpack_from(data, position)
                length = high << 8 | low
                if length > max_frame:
                    break  # h2 refuses it (FRAME_SIZE_ERROR): hand it over at once rather than buffer it
                end = position + 9 + length
                if end > size:
                    break
                if kind == _DATA_FRAME and flags == 0 and isinstance(streams.get(stream_id), DirectSink):
                    if slow < position:
                        if not self._receive(data[slow:position]):
                            return
                        slow = position
                    stream = streams.get(stream_id)
                    if isinstance(stream, DirectSink) and stream.take_data_frame(length):
                        stream.on_data(data[position + 9 : end], length)
                        slow = end
                position = end
            else:
                length = 0
            if length > max_frame:
                position = size
            if slow < position:
                self._receive(data[slow:position])
            if position < size:
                self._rx = data[position:]
        finally:
            if self.dirty and not self._flush_due and not self._awaiting:
                self._flush_due = True
                asyncio.get_running_loop().call_soon(self._flush_dirty)
            if not self.connection.is_closing():
                self.connection.flush()

    def _flush_dirty(self) -> None:
        self._flush_due = False
        dirty, self.dirty = self.dirty, []
        for sink in dirty:
            sink.flush()
        if not self.connection.is_closing():
            self.connection.flush()  # the WINDOW_UPDATEs of what was acknowledged
        if dirty:
            # The next hand-over waits until the consumer has taken this one in (its next round). Idle, that is at
            # once; busy, the reads in between add up, per stream, to one bigger batch: one wakeup of the consumer
            # and one chunk downstream (whose cost is per chunk) for several engine messages, with no timer.
            self._awaiting = True
            dirty[-1].after_round(self._caught_up)

    def _caught_up(self) -> None:
        self._awaiting = False
        if self.dirty and not self._flush_due:
            self._flush_dirty()

    def _receive(self, frames: bytes) -> bool:
        """Complete frames through h2 and the processor; False once the connection is closed."""
        connection = self.connection
        try:
            events = connection.feed(frames)
        except ProtocolError:
            log.debug("Protocol error", exc_info=True)
            self.processor.close("Protocol error")
            return False
        connection.flush()
        process = self.processor.process
        for event in events:
            process(event)
        return not connection.is_closing()
