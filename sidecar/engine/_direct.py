"""``Generate`` streams received straight from the HTTP/2 events: no grpclib stream, buffer or task per message.

The default receive path (``EngineClientConfig.direct_receive``, ``--grpc-receive direct``): on the loop-resident
data path it costs about a third less CPU per engine message than grpclib's streams (docs/architecture.md, *The data
path*).

grpclib still owns the connection (``PooledChannel`` made with ``direct=True``: connecting, TLS, keepalive, GOAWAY,
h2); what it no longer does for these streams is the per-message part. There, grpclib queued every DATA frame in
the stream's ``Buffer``, and a task per stream woke for every message to read its 5-byte prefix and body, and our
pump task forwarded each to trio -- about a third of the sidecar's CPU per engine message (docs/performance.md).
Here the processor hands a stream's events to its :class:`DirectStream` (a ``sidecar.http2.DirectSink``), which cuts
the gRPC messages out of the DATA as it arrives, decodes them (upb), and at the end of the read hands everything that
reads of one loop iteration brought for the stream to its consumer in one ``push`` (:class:`._sink.GenerateSink`:
the request's data path on the loop, or ``Edge.open_feed`` towards trio). Everything it does to the HTTP/2 stream
goes through its ``sidecar.http2.StreamLink``: this module touches no grpclib or h2 internals.

What grpclib did and this keeps, each tested in ``tests/engine/test_direct.py``:

* **flow control and backpressure**: received bytes are acknowledged (HTTP/2 window) once they are handed over,
  while trio holds fewer than ``high_water`` messages not taken; past that, acknowledgement waits until trio takes
  some (``Feed.hold``), so a slow consumer stops the engine at the stream window and memory stays bounded;
* **messages split across DATA frames, many in one frame**, and the **message-size limit** (checked on the 5-byte
  prefix, before any of the body is kept: a stream announcing more than the limit fails RESOURCE_EXHAUSTED);
* **status**: ``:status``, content type, trailers-only responses and trailers map to the same errors as grpclib's
  (``_status.to_engine_rpc_error``), raised in trio after every message received before them;
* **cancellation**: trio leaving the stream resets it (RST_STREAM CANCEL) in the loop callback it posts, releases the
  stream slot and returns its unacknowledged bytes to the connection window;
* **deadlines** (``grpc-timeout`` sent, and enforced locally: DEADLINE_EXCEEDED, stream reset);
* **GOAWAY and a lost connection**: the processor terminates the stream as it would a grpclib stream; the messages
  received before still come first.

Everything here runs on the edge loop's thread.
"""

from __future__ import annotations

import asyncio
import struct
from typing import TYPE_CHECKING, Any, Final, TypeVarTuple

from grpclib.const import Status
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.metadata import decode_grpc_message

from sidecar.errors import EngineRpcError, GrpcCode
from sidecar.http2 import DirectSink, GoawayRefused, StreamLink, grpc_request_headers, grpc_status_of_http

from ._status import to_engine_rpc_error

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from ._sink import GenerateSink
    from ._transport import PooledChannel

__all__ = ["DirectStream", "start_direct_stream"]

_PREFIX: Final = struct.Struct(">BI")  # gRPC message prefix: compressed flag, length
_GRPC_CONTENT_TYPE: Final = "application/grpc"


Ts = TypeVarTuple("Ts")


def start_direct_stream(
    feed: GenerateSink,
    rpc: str,
    channel: PooledChannel,
    path: str,
    request: Any,
    response_type: type[Any],
    metadata: Sequence[tuple[str, str]],
    timeout_s: float | None,
    max_bytes: int,
    before_open: Callable[[str, PooledChannel], None] | None = None,
) -> None:
    """``Edge.open_feed``'s start function: open a server stream for ``request`` on ``channel`` and feed its decoded
    messages to trio. ``before_open(rpc, channel)`` runs right before a stream slot is taken (the stream-limit log).

    On a connected channel with room the request goes out here and now; otherwise a task connects, waits for a
    stream slot or for send window, and sends it.
    """
    stream = DirectStream(feed, rpc, channel, response_type, max_bytes)
    try:
        body = request.SerializeToString()
        if len(body) > max_bytes:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED, f"request of {len(body)} bytes exceeds the {max_bytes}-byte limit"
            )
        headers = grpc_request_headers(channel, path, timeout_s, metadata)
    except Exception as exc:
        stream._fail(exc)
        return
    data = b"\x00" + len(body).to_bytes(4, "big") + body
    loop = asyncio.get_running_loop()
    if timeout_s is not None:
        stream.deadline = loop.call_later(timeout_s, stream.deadline_passed)
    if stream.open_now(headers, data, before_open):
        return
    task = stream.opening = loop.create_task(stream.open(headers, data, before_open), name=f"sidecar.engine {rpc}")
    feed.on_cancel = task.cancel


class DirectStream(DirectSink):
    """One server stream, from the request it sends to the status it ends with (see the module docstring)."""

    __slots__ = ("_acks_held", "_decode", "_dirty", "_feed", "_headers_seen", "_max_bytes", "_need", "_partial",
                 "_pending", "_status", "_to_ack", "channel", "deadline", "link", "opening", "released",
                 "rpc")  # fmt: skip

    def __init__(
        self, feed: GenerateSink, rpc: str, channel: PooledChannel, response_type: type[Any], max_bytes: int
    ) -> None:
        super().__init__()
        self._feed: Final = feed
        self.rpc: Final = rpc
        self.channel: Final = channel
        self._decode: Final[Callable[[bytes], Any]] = response_type.FromString
        self._max_bytes: Final = max_bytes
        self.link: StreamLink | None = None  # the HTTP/2 stream, once opened
        self.deadline: asyncio.TimerHandle | None = None
        self.opening: asyncio.Task[None] | None = None  # until the request is sent
        self.released = False
        self._pending: list[Any] = []  # decoded, not handed over yet
        self._partial: bytearray | None = None  # the start of a message whose end has not arrived
        self._need = 0  # bytes _partial must reach before the next step of parsing
        self._to_ack = 0  # received flow-controlled bytes not acknowledged yet
        self._acks_held = False  # acknowledgement waits for the consumer (Feed.hold)
        self._dirty = False
        self._headers_seen = False
        # None: no status yet; False: OK; an exception: the stream's error.
        self._status: BaseException | bool | None = None

    # ---------------------------------------------------------------------------------------------- opening

    def open_now(
        self, headers: list[tuple[str, str]], data: bytes, before_open: Callable[[str, PooledChannel], None] | None
    ) -> bool:
        """Open the stream without waiting, if the channel is connected and has a slot and room to write; send the
        request too if the window allows. False: nothing was done (:meth:`open` does it all)."""
        link = StreamLink.open_now(self.channel, self, headers, self._before(before_open))
        if link is None:
            return False
        self.link = link
        self._feed.on_cancel = self.cancel
        if not link.send_now(data):
            link.flush()  # the headers; the request follows as the window allows
            self.opening = asyncio.get_running_loop().create_task(self._as_opening(self._send_message, data))
        return True

    def _before(self, before_open: Callable[[str, PooledChannel], None] | None) -> Callable[[], None] | None:
        if before_open is None:
            return None
        rpc, channel = self.rpc, self.channel
        return lambda: before_open(rpc, channel)

    async def open(
        self, headers: list[tuple[str, str]], data: bytes, before_open: Callable[[str, PooledChannel], None] | None
    ) -> None:
        """Connect if need be, wait for a stream slot, send the headers and the request; from then on the processor
        feeds this stream."""
        await self._as_opening(self._open, headers, data, before_open)

    async def _open(
        self, headers: list[tuple[str, str]], data: bytes, before_open: Callable[[str, PooledChannel], None] | None
    ) -> None:
        retry = True
        while True:
            try:
                await self._send_headers(headers, before_open)
                break
            except GoawayRefused:
                # Raised before anything was sent: retry once on the fresh connection the channel makes now.
                if not retry:
                    raise
                retry = False
        self._feed.on_cancel = self.cancel
        await self._send_message(data)

    async def _as_opening(self, step: Callable[[*Ts], Awaitable[None]], *args: *Ts) -> None:
        """Run ``step`` as the :attr:`opening` task: a failure fails the stream; a cancellation -- trio left while the
        stream was opening (the feed has already reported its end), its deadline passed, or the loop is shutting down
        (then the feed still waits: tell it) -- ends the feed and the stream."""
        try:
            await step(*args)
        except asyncio.CancelledError:
            self._feed.fail_cancelled()
            self.cancel()
            raise
        except Exception as exc:
            self._fail(exc)
        finally:
            self.opening = None

    async def _send_headers(
        self, headers: list[tuple[str, str]], before_open: Callable[[str, PooledChannel], None] | None
    ) -> None:
        self.link = await StreamLink.open(self.channel, self, headers, self._before(before_open))

    async def _send_message(self, data: bytes) -> None:
        assert self.link is not None
        await self.link.send(data, self._gone)

    def _gone(self) -> bool:
        return self.released

    # ---------------------------------------------------------------------------------------------- HTTP/2 events

    def on_headers(self, headers: list[tuple[str, str]]) -> None:
        self._headers_seen = True
        fields = dict(headers)
        status = fields.get(":status")
        if status != "200":
            self._fail(GRPCError(grpc_status_of_http(status), f"Received :status = {status!r}"), reset=True)
            return
        content_type = fields.get("content-type")
        if content_type is None:
            self._fail(GRPCError(Status.UNKNOWN, "Missing content-type header"), reset=True)
            return
        base, _, subtype = content_type.partition("+")
        if base != _GRPC_CONTENT_TYPE or (subtype or "proto") != "proto":
            self._fail(GRPCError(Status.UNKNOWN, f"Invalid content-type: {content_type!r}"), reset=True)
            return
        if "grpc-status" in fields:  # trailers-only: the status comes with the headers, the end follows
            self._status = _grpc_status(fields)

    def on_data(self, data: bytes, flow_controlled_length: int) -> None:
        self._to_ack += flow_controlled_length
        if not self._dirty:
            self._dirty = True
            self.link.mark_dirty()  # type: ignore[union-attr]
        partial = self._partial
        if partial is not None:
            partial += data
            if len(partial) < self._need:
                return
            data = bytes(partial)
            self._partial = None
        size = len(data)
        position = 0
        pending = self._pending
        decode = self._decode
        try:
            while size - position >= 5:
                compressed, length = _PREFIX.unpack_from(data, position)
                if compressed:
                    raise EngineRpcError(self.rpc, GrpcCode.INTERNAL, "compressed message, but none was negotiated")
                if length > self._max_bytes:
                    raise GRPCError(
                        Status.RESOURCE_EXHAUSTED,
                        f"response of {length} bytes exceeds the {self._max_bytes}-byte limit",
                    )
                end = position + 5 + length
                if end > size:
                    self._need = end - position
                    break
                pending.append(decode(data[position + 5 : end]))
                position = end
            else:
                self._need = 5
            if position < size:
                self._partial = bytearray(data[position:] if position else data)
        except Exception as exc:
            self._fail(exc, reset=True)

    def after_round(self, callback: Callable[[], None]) -> None:
        self._feed.after_round(callback)

    def take_data_frame(self, length: int) -> bool:
        if not self._headers_seen or self.released:
            return False
        return self.link.accept_data_frame(length)  # type: ignore[union-attr]

    def on_trailers(self, headers: list[tuple[str, str]]) -> None:
        self._status = _grpc_status(dict(headers))

    def on_end(self) -> None:
        status = self._status
        if self._partial is not None:
            got = len(self._partial)
            self._fail(EngineRpcError(self.rpc, GrpcCode.INTERNAL, f"stream ended inside a message ({got} bytes)"))
        elif status is None:
            what = "trailers" if self._headers_seen else "headers"
            self._fail(GRPCError(Status.UNKNOWN, f"Missing grpc-status header (stream ended without {what})"))
        elif status is False:
            self._finish(None)
            self._release(succeeded=True)
        else:
            self._fail(status)  # type: ignore[arg-type]

    def on_reset(self, reason: str) -> None:
        self._fail(StreamTerminatedError(reason))

    def __terminated__(self, reason: str) -> None:
        # Called while the processor iterates its streams (a lost connection): the slot is given back afterwards.
        self._fail(StreamTerminatedError(reason), release_later=True)

    def flush(self) -> None:
        self._dirty = False
        if self.released:
            return
        feed = self._feed
        if self._pending:
            items, self._pending = self._pending, []
            room = feed.push(items)
        else:
            room = feed.has_room
        if self._to_ack and not self._acks_held:
            if room:
                self._ack()
            else:
                self._acks_held = True
                feed.hold(self._room)

    # ---------------------------------------------------------------------------------------------- internals

    def _room(self) -> None:
        # The consumer took messages after a hold: acknowledge what was held back (the engine may send again).
        self._acks_held = False
        if not self.released and self._to_ack:
            self._ack()
            self.link.flush()  # type: ignore[union-attr]

    def _ack(self) -> None:
        # h2 queues a WINDOW_UPDATE only once half a window is consumed; it goes out with the protocol's flush.
        size, self._to_ack = self._to_ack, 0
        self.link.ack(size)  # type: ignore[union-attr]

    def deadline_passed(self) -> None:
        """The stream's deadline (``timeout_s``) passed: DEADLINE_EXCEEDED, as grpclib's deadline raises it."""
        self.deadline = None
        self._fail(TimeoutError(), reset=True)

    def cancel(self) -> None:
        """Trio left the stream: reset it (the engine aborts the request) and give its slot back."""
        if self.released:
            return
        self._reset()
        self._release(succeeded=False)

    def _finish(self, error: BaseException | None) -> None:
        feed = self._feed
        if self._pending:
            items, self._pending = self._pending, []
            feed.push(items)
        if error is None:
            feed.end()
        else:
            feed.fail(error)

    def _fail(self, error: BaseException, *, reset: bool = False, release_later: bool = False) -> None:
        if self.released:
            return
        link = self.link
        mapped = to_engine_rpc_error(self.rpc, error, after_goaway=link is not None and link.heard_goaway)
        self._finish(mapped if mapped is not None else error)
        if reset:
            self._reset()
        if release_later:
            self.released = True
            asyncio.get_running_loop().call_soon(self._release, False, True)
        else:
            self._release(succeeded=False)

    def _reset(self) -> None:
        if self.link is not None:
            self.link.reset()

    def _release(self, succeeded: bool = True, again: bool = False) -> None:
        if self.released and not again:
            return
        self.released = True
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        opening = self.opening
        if opening is not None and opening is not asyncio.current_task():
            opening.cancel()  # released before the request went out (deadline, an early error status)
        link = self.link
        if link is None:
            return  # never opened
        link.wake_sender()  # a send waiting for window wakes up and sees the stream released
        # The stream is gone; the connection's window must not shrink by its unread bytes.
        unacknowledged, self._to_ack = self._to_ack, 0
        link.release(unacknowledged, succeeded)


def _grpc_status(fields: dict[str, str]) -> BaseException | bool:
    """False for an OK ``grpc-status``, else the error (grpclib's words)."""
    raw = fields.get("grpc-status")
    if raw is None:
        return GRPCError(Status.UNKNOWN, "Missing grpc-status header")
    try:
        status = Status(int(raw))
    except ValueError:
        return GRPCError(Status.UNKNOWN, f"Invalid grpc-status: {raw!r}")
    if status is Status.OK:
        return False
    message = fields.get("grpc-message")
    return GRPCError(status, decode_grpc_message(message) if message is not None else None)
