"""The raw wire: channels to the engine, one ``Generate`` observed message by message, unary calls under deadlines.

The kit talks grpclib on asyncio directly (no sidecar client in between) because its checks are about the exact
message sequence: which messages arrived before the status, what came after the terminal event, when GOAWAY came.
Every call here is bounded; a failure becomes data (a status, a transport error, "no answer within N s"), never an
exception, so one misbehaving RPC fails one check and the run goes on.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

from google.protobuf.message import Message
from grpclib.client import Channel, Handler
from grpclib.const import Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.protocol import H2Protocol
from h2.errors import ErrorCodes
from h2.events import ConnectionTerminated
from hyperframe.frame import GoAwayFrame

from openengine.v1 import generation_pb2, openengine_grpc

__all__ = ["Call", "GoAway", "KitChannel", "Observation", "RawMessage", "Target", "call", "generate"]

_Resp = TypeVar("_Resp")


@dataclass(frozen=True, slots=True)
class Target:
    """Where an engine listens: TCP ``host:port`` or a Unix socket ``path``, optionally over TLS."""

    text: str
    host: str | None = None
    port: int | None = None
    path: str | None = None
    tls: ssl.SSLContext | None = None

    def channel(self, *, tolerate_goaway: bool = False) -> KitChannel:
        """A new channel (one HTTP/2 connection, opened on first use); the caller closes it."""
        if self.path is not None:
            return KitChannel(path=self.path, ssl=self.tls, tolerate_goaway=tolerate_goaway)
        return KitChannel(self.host, self.port, ssl=self.tls, tolerate_goaway=tolerate_goaway)


@dataclass(frozen=True, slots=True)
class RawMessage:
    """Request bytes sent as they are: a message no protobuf library would build (both members of a oneof)."""

    data: bytes


class _KitCodec(ProtoCodec):
    def encode(self, message: Any, message_type: Any) -> bytes:
        if isinstance(message, RawMessage):
            return message.data
        return super().encode(message, message_type)


@dataclass(frozen=True, slots=True)
class GoAway:
    """A GOAWAY frame the engine sent: when (monotonic), its error code and last stream id."""

    at: float
    error_code: int
    last_stream_id: int


class _RecordingProtocol(H2Protocol):
    """grpclib's client protocol, recording GOAWAY frames and, if asked, surviving them.

    grpclib closes the whole connection on any GOAWAY (trtllm §3), which would cut the very streams a graceful stop
    promises to finish; the graceful-stop check keeps reading them until the engine closes the connection itself.
    """

    def __init__(self, channel: KitChannel, base: H2Protocol) -> None:
        super().__init__(base.handler, base.config, base.h2_config)
        self._channel = channel

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        processors = self.processor.processors
        close_on_goaway = cast("Callable[[ConnectionTerminated], None]", processors[ConnectionTerminated])

        def on_goaway(event: ConnectionTerminated) -> None:
            self._channel.goaways.append(
                GoAway(time.monotonic(), int(event.error_code or 0), int(event.last_stream_id or 0))
            )
            if not self._channel.tolerate_goaway:
                close_on_goaway(event)

        processors[ConnectionTerminated] = on_goaway
        if self._channel.tolerate_goaway:
            # h2's own GOAWAY handler moves the whole connection to CLOSED, after which it refuses every later frame:
            # the DATA of the streams the GOAWAY lets finish, and the PING grpc-core sends in the same write as its
            # first GOAWAY (a ProtocolError that drops the connection before any handler could reopen it). This
            # channel opens no new stream after a GOAWAY, it only keeps reading (h2 4.x, pinned with grpclib 0.4.9).
            # The dispatch table holds bound methods, hence replaced per connection.
            self.connection._connection._frame_dispatch_table[GoAwayFrame] = _goaway_event


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


class KitChannel(Channel):
    """A grpclib channel with the kit's codec (raw requests) and GOAWAY recording."""

    def __init__(self, *args: Any, tolerate_goaway: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, codec=_KitCodec(), **kwargs)
        self.tolerate_goaway = tolerate_goaway
        self.goaways: list[GoAway] = []

    def _protocol_factory(self) -> H2Protocol:
        return _RecordingProtocol(self, H2Protocol(Handler(), self._config, self._h2_config))


@dataclass(slots=True)
class Observation:
    """Everything one ``Generate`` call produced, in order, with arrival times (seconds after the call started).

    ``status`` is the gRPC status (``None`` when the call ended without one: transport loss, cancellation, timeout);
    ``error`` says why in that case.
    """

    request_id: str
    n: int
    request: generation_pb2.GenerateRequest | None = None
    messages: list[generation_pb2.GenerateResponse] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    status: Status | None = None
    details: str | None = None
    error: str | None = None
    timed_out: bool = False
    seconds: float = 0.0
    first_message: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def accepted(self) -> bool:
        """The engine answered with at least one stream message (validation refusals have none)."""
        return bool(self.messages)

    def describe_end(self) -> str:
        if self.status is not None:
            text = f"status {self.status.name}"
            return f"{text} ({self.details})" if self.details else text
        return self.error or "no status"


async def generate(
    channel: Channel,
    request: generation_pb2.GenerateRequest | RawMessage,
    *,
    bound: float,
    request_id: str | None = None,
    n: int | None = None,
    metadata: Mapping[str, str] | None = None,
    observation: Observation | None = None,
) -> Observation:
    """Send one ``Generate`` and record every message until the status, the deadline or a transport loss.

    Cancelling the awaiting task cancels the RPC (RST_STREAM); the observation keeps what arrived until then.
    """
    if observation is None:
        if isinstance(request, RawMessage):
            assert request_id is not None, "a raw request needs its request_id stated"
            observation = Observation(request_id=request_id, n=n or 1)
        else:
            observation = Observation(
                request_id=request.request_id,
                n=request.sampling.num_sequences if request.sampling.HasField("num_sequences") else 1,
                request=request,
            )
    obs = observation
    loop = asyncio.get_running_loop()
    started = loop.time()
    stub = openengine_grpc.InferenceStub(channel)
    try:
        async with asyncio.timeout(bound):
            async with stub.Generate.open(metadata=dict(metadata or {}), timeout=bound + 1.0) as stream:
                await stream.send_message(cast("generation_pb2.GenerateRequest", request), end=True)
                async for message in stream:
                    obs.messages.append(message)
                    obs.times.append(loop.time() - started)
                    obs.first_message.set()
        obs.status = Status.OK
    except GRPCError as exc:
        obs.status, obs.details = exc.status, exc.message
    except TimeoutError:
        obs.timed_out = True
        obs.error = f"no answer within {bound:g} s"
    except (StreamTerminatedError, ConnectionError, OSError, ssl.SSLError) as exc:
        obs.error = f"transport: {exc!r}"
    except asyncio.CancelledError:
        obs.error = "cancelled by the kit"
        raise
    finally:
        obs.seconds = loop.time() - started
        obs.done.set()
    return obs


@dataclass(frozen=True, slots=True)
class Call(Generic[_Resp]):
    """The result of one unary call: a response, or a status, or a transport error / timeout."""

    response: _Resp | None
    status: Status | None
    details: str | None = None
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.response is not None

    def describe(self) -> str:
        if self.status is not None:
            text = self.status.name
            return f"{text} ({self.details})" if self.details else text
        return self.error or "no answer"

    def get(self) -> _Resp:
        assert self.response is not None
        return self.response


async def call(
    method: Callable[..., Awaitable[_Resp]],
    request: Message,
    *,
    bound: float,
) -> Call[_Resp]:
    """One unary RPC under a deadline; never raises for a status, a transport loss or the deadline."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        async with asyncio.timeout(bound):
            response = await method(request, timeout=bound + 1.0)
    except GRPCError as exc:
        return Call(None, exc.status, exc.message, seconds=loop.time() - started)
    except TimeoutError:
        return Call(None, None, error=f"no answer within {bound:g} s", seconds=loop.time() - started)
    except (StreamTerminatedError, ConnectionError, OSError, ssl.SSLError) as exc:
        return Call(None, None, error=f"transport: {exc!r}", seconds=loop.time() - started)
    return Call(response, Status.OK, seconds=loop.time() - started)
