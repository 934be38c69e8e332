"""A recording in-process OpenEngine fake, for what the mock process cannot show: exact metadata on every RPC,
the peer port of each call (which pooled connection carried it) and the server-side cancellation instant.

It is a grpclib server started **on the edge loop** (so it needs no thread of its own). Behaviour of ``Generate`` is
chosen by ``request_id``: ``hang…`` sends one token then waits forever, ``big…`` sends one ``size``-byte message
(``stopping.max_tokens`` bytes), anything else sends ``stopping.max_tokens`` tokens (default 3) then finishes.
Control RPCs answer a minimal message; ``GetLoad`` with ``include_per_rank`` hangs (for deadline tests).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.protocol import H2Protocol
from grpclib.server import Stream

from openengine.v1 import generation_pb2, kv_pb2, lifecycle_pb2, lora_pb2, model_pb2, openengine_grpc, server_pb2
from sidecar.engine import PINNED_SCHEMA_RELEASE, Endpoint
from sidecar.testing.mock.server import StreamLimitServer

if TYPE_CHECKING:
    from sidecar.edge import Edge


@dataclass(frozen=True, slots=True)
class Call:
    """One RPC as the fake saw it."""

    method: str
    metadata: dict[str, str]
    peer_port: int


@dataclass
class Recorder:
    """What the fake saw; appended on the edge loop, read by trio after the RPCs it cares about completed."""

    calls: list[Call] = field(default_factory=list)
    cancelled_at: dict[str, float] = field(default_factory=dict)

    def record(self, method: str, stream: Stream[Any, Any]) -> None:
        metadata = {k: v for k, v in stream.metadata.items() if isinstance(v, str)} if stream.metadata else {}
        peer = stream.peer.addr() if stream.peer is not None else None
        self.calls.append(Call(method, metadata, peer[1] if peer else 0))


class _Inference(openengine_grpc.InferenceBase):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    async def Generate(self, stream: Stream[Any, Any]) -> None:
        self.recorder.record("Generate", stream)
        request = await stream.recv_message()
        assert request is not None
        rid = request.request_id
        token = generation_pb2.GenerateResponse(request_id=rid)
        token.token.output_index = 0
        token.token.text = " hi"
        token.token.tokens.add(token_id=7, token=" hi")
        try:
            if rid.startswith("hang"):
                await stream.send_message(token)
                await asyncio.Event().wait()
            if rid.startswith("big"):
                big = generation_pb2.GenerateResponse(request_id=rid)
                big.token.output_index = 0
                big.token.text = "x" * request.stopping.max_tokens
                await stream.send_message(big)
                return
            for _ in range(request.stopping.max_tokens or 3):
                await stream.send_message(token)
                await asyncio.sleep(0)
            done = generation_pb2.GenerateResponse(request_id=rid)
            done.finished.output_index = 0
            done.finished.reason = generation_pb2.FINISH_REASON_LENGTH
            done.usage.prompt_tokens = 1
            await stream.send_message(done)
        except asyncio.CancelledError:
            self.recorder.cancelled_at[rid] = time.monotonic()
            raise


class _Control(openengine_grpc.ControlBase):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    async def _unary(self, name: str, stream: Stream[Any, Any], reply: Any) -> None:
        self.recorder.record(name, stream)
        await stream.recv_message()
        await stream.send_message(reply)

    async def GetServerInfo(self, stream: Stream[Any, Any]) -> None:
        info = server_pb2.ServerInfo(
            engine_name="fake", schema_revision=1, minimum_client_revision=1, schema_release=PINNED_SCHEMA_RELEASE
        )
        await self._unary("GetServerInfo", stream, info)

    async def GetModelInfo(self, stream: Stream[Any, Any]) -> None:
        await self._unary("GetModelInfo", stream, model_pb2.ModelInfo(model_id="fake"))

    async def GetLoad(self, stream: Stream[Any, Any]) -> None:
        self.recorder.record("GetLoad", stream)
        request = await stream.recv_message()
        assert request is not None
        if request.include_per_rank:
            await asyncio.Event().wait()
        await stream.send_message(server_pb2.LoadInfo(running_requests=0))

    async def Health(self, stream: Stream[Any, Any]) -> None:
        await self._unary("Health", stream, lifecycle_pb2.HealthResponse(state=lifecycle_pb2.HEALTH_STATE_READY))

    async def Abort(self, stream: Stream[Any, Any]) -> None:
        # Recorded once the request message has arrived, as an engine acts on it: a client that gives up before
        # sending it has not aborted anything.
        request = await stream.recv_message()
        assert request is not None
        self.recorder.record("Abort", stream)
        await stream.send_message(lifecycle_pb2.AbortResponse(status=lifecycle_pb2.ABORT_STATUS_ALREADY_FINISHED))

    async def LoadLora(self, stream: Stream[Any, Any]) -> None:
        await self._unary("LoadLora", stream, lora_pb2.LoadLoraResponse())

    async def UnloadLora(self, stream: Stream[Any, Any]) -> None:
        await self._unary("UnloadLora", stream, lora_pb2.UnloadLoraResponse())

    async def ListLoras(self, stream: Stream[Any, Any]) -> None:
        await self._unary("ListLoras", stream, lora_pb2.ListLorasResponse())

    async def GetKvEventSources(self, stream: Stream[Any, Any]) -> None:
        await self._unary("GetKvEventSources", stream, kv_pb2.GetKvEventSourcesResponse())

    async def SubscribeKvEvents(self, stream: Stream[Any, Any]) -> None:
        self.recorder.record("SubscribeKvEvents", stream)
        await stream.recv_message()
        batch = kv_pb2.SubscribeKvEventsResponse()
        batch.batch.sequence_number = 1
        await stream.send_message(batch)
        raise GRPCError(Status.DATA_LOSS, "fake subscription ends badly")


class _FakeServer(StreamLimitServer):
    """The mock's server class, remembering its connections: a stopped fake drops them, like a stopped process
    (grpclib's ``Server.close`` leaves idle connections open)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.protocols: list[H2Protocol] = []

    def _protocol_factory(self) -> H2Protocol:
        protocol = super()._protocol_factory()
        self.protocols.append(protocol)
        return protocol


async def _start(
    recorder: Recorder, max_concurrent_streams: int, context: ssl.SSLContext | None, path: str | None, port: int
) -> tuple[_FakeServer, int]:
    # The mock's server class: its HTTP/2 stream limit per connection is ours to set (0 = none, as grpcio).
    server = _FakeServer([_Inference(recorder), _Control(recorder)], max_concurrent_streams=max_concurrent_streams)
    if path is not None:
        await server.start(path=path)
        return server, 0
    await server.start("127.0.0.1", port, ssl=context)
    # uvloop's server is not an asyncio.Server, but has the same `sockets`.
    listener: Any = server._server
    bound: int = listener.sockets[0].getsockname()[1]
    return server, bound


async def _stop(server: _FakeServer) -> None:
    server.close()
    for protocol in server.protocols:
        if hasattr(protocol, "connection"):  # not for a connection whose TLS handshake failed
            protocol.connection.close()
    await asyncio.wait_for(server.wait_closed(), 5)


@asynccontextmanager
async def fake_engine(
    edge: Edge,
    *,
    max_concurrent_streams: int = 0,
    tls: ssl.SSLContext | None = None,
    path: str | None = None,
    port: int = 0,
) -> AsyncIterator[tuple[Endpoint, Recorder]]:
    """Serve the fake on ``edge``'s loop; yield its endpoint and recorder. ``max_concurrent_streams``: the HTTP/2
    limit per connection (0 = none); ``tls``: a server context (the endpoint then says TLS); ``path``: serve on
    that Unix socket instead of loopback TCP; ``port``: a fixed port (0 = the OS picks)."""
    recorder = Recorder()
    server, bound = await edge.run(_start, recorder, max_concurrent_streams, tls, path, port)
    try:
        endpoint = Endpoint.unix(path) if path is not None else Endpoint("127.0.0.1", bound, tls=tls is not None)
        yield endpoint, recorder
    finally:
        await edge.run(_stop, server)
