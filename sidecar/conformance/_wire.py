"""The raw wire: channels to the engine, one ``Generate`` observed message by message, unary calls under deadlines.

The kit talks grpclib on asyncio directly (no sidecar client in between) because its checks are about the exact
message sequence: which messages arrived before the status, what came after the terminal event, when GOAWAY came.
Every call here is bounded; a failure becomes data (a status, a transport error, "no answer within N s"), never an
exception, so one misbehaving RPC fails one check and the run goes on.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

from google.protobuf.message import Message
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError, StreamTerminatedError

from openengine.v1 import generation_pb2, openengine_grpc
from sidecar.http2 import ClientProtocol, Goaway, GoawayPolicy, Http2Channel

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


class KitChannel(Http2Channel):
    """A grpclib channel (through ``sidecar.http2``) with the kit's codec (raw requests) that records every GOAWAY.

    By default a GOAWAY closes the connection as stock grpclib does (trtllm §3: every open stream fails). With
    ``tolerate_goaway`` the connection drains instead -- the open streams are read to their end, no new stream opens
    on it -- which the graceful-stop check needs: grpc-core's stop promises to finish them.
    """

    def __init__(self, *args: Any, tolerate_goaway: bool = False, **kwargs: Any) -> None:
        policy = GoawayPolicy.DRAIN if tolerate_goaway else GoawayPolicy.CLOSE
        super().__init__(*args, codec=_KitCodec(), goaway=policy, **kwargs)
        self.tolerate_goaway = tolerate_goaway
        self.goaways: list[GoAway] = []

    def heard_goaway(self, protocol: ClientProtocol, goaway: Goaway) -> None:
        self.goaways.append(GoAway(goaway.at, goaway.error_code, goaway.last_stream_id))
        super().heard_goaway(protocol, goaway)


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
