"""``EngineClient.start_generate``: a ``Generate`` stream consumed on the edge loop itself (a request's data path),
with both receive paths (``direct_receive``: straight from the HTTP/2 events, or through grpclib's streams).

The sink is a recording :class:`~sidecar.engine._sink.GenerateSink` on the loop; the server writes every frame itself
(``raw_h2``). What the data path relies on: every message in order then the end, an error status after the messages
before it, ``on_cancel`` resetting the stream, and a sink without room stopping the flow until it has room again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from openengine.v1 import generation_pb2
from sidecar.edge import Edge
from sidecar.engine import EngineClient, EngineClientConfig, open_engine_client
from sidecar.errors import EngineRpcError, GrpcCode
from tests.engine.raw_h2 import RID, Responder, message, raw_engine, token

TEST_BOUND = 20.0
RECEIVE = pytest.mark.parametrize("direct", [True, False], ids=["direct", "grpclib"])


class RecordingSink:
    """A GenerateSink on the edge loop: records what it is handed; ``done`` is set (in trio) once the stream is over."""

    def __init__(self, edge: Edge, *, room: bool = True) -> None:
        self.edge = edge
        self.ids: list[int] = []
        self.pushes = 0
        self.error: BaseException | None = None
        self.ended = False
        self.done = trio.Event()
        self.on_cancel: Callable[[], object] | None = None
        self._room = room
        self._on_room: Callable[[], None] | None = None

    @property
    def has_room(self) -> bool:
        return self._room

    def push(self, items: list[generation_pb2.GenerateResponse]) -> bool:
        self.pushes += 1
        self.ids.extend(r.token.tokens[0].token_id for r in items)
        return self._room

    def hold(self, on_room: Callable[[], None]) -> None:
        self._on_room = on_room

    def end(self) -> None:
        self.ended = True
        self.edge.to_trio(self.done.set)

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.edge.to_trio(self.done.set)

    def fail_cancelled(self) -> None:
        self.fail(RuntimeError("cancelled by someone else"))

    def after_round(self, callback: Callable[[], None]) -> None:
        callback()

    def give_room(self) -> None:
        """Loop: the consumer took what it had; the producer may go on."""
        self._room = True
        on_room, self._on_room = self._on_room, None
        if on_room is not None:
            on_room()


def request() -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest(request_id=RID, model="raw")
    req.token_ids.ids.extend([1, 2, 3])
    req.stopping.max_tokens = 16
    return req


@asynccontextmanager
async def client_for(edge: Edge, endpoint: Any, direct: bool) -> AsyncIterator[EngineClient]:
    config = EngineClientConfig(endpoint, connections=1, retry_interval_s=0.1, direct_receive=direct)
    async with open_engine_client(edge, config) as client:
        yield client


async def start(edge: Edge, client: EngineClient, sink: RecordingSink) -> None:
    await edge.run(_start, client, sink)


async def _start(client: EngineClient, sink: RecordingSink) -> None:
    client.start_generate(request(), sink, metadata=[("openengine-routing-key", "k")])


@RECEIVE
async def test_every_message_arrives_in_order_then_the_end(edge: Edge, direct: bool) -> None:
    async def script(r: Responder) -> None:
        r.headers()
        for i in range(1, 40):
            await r.data(token(i))
        r.trailers(0)

    with trio.fail_after(TEST_BOUND):
        async with raw_engine(edge, script) as (endpoint, seen), client_for(edge, endpoint, direct) as client:
            sink = RecordingSink(edge)
            await start(edge, client, sink)
            await sink.done.wait()
    assert sink.ended
    assert sink.error is None
    assert sink.ids == list(range(1, 40))
    assert not seen.script_errors


@RECEIVE
async def test_an_error_status_follows_the_messages_before_it(edge: Edge, direct: bool) -> None:
    async def script(r: Responder) -> None:
        r.headers()
        await r.data(token(1) + token(2))
        r.trailers(14, "engine going away")

    with trio.fail_after(TEST_BOUND):
        async with raw_engine(edge, script) as (endpoint, _), client_for(edge, endpoint, direct) as client:
            sink = RecordingSink(edge)
            await start(edge, client, sink)
            await sink.done.wait()
    assert sink.ids == [1, 2]
    assert isinstance(sink.error, EngineRpcError)
    assert sink.error.code is GrpcCode.UNAVAILABLE


@RECEIVE
async def test_on_cancel_resets_the_stream(edge: Edge, direct: bool) -> None:
    async def script(r: Responder) -> None:
        r.headers()
        await r.data(token(1))
        await asyncio.sleep(30)

    with trio.fail_after(TEST_BOUND):
        async with raw_engine(edge, script) as (endpoint, seen), client_for(edge, endpoint, direct) as client:
            sink = RecordingSink(edge)
            await start(edge, client, sink)
            while not sink.ids:
                await trio.sleep(0.01)
            assert sink.on_cancel is not None
            edge.to_loop(sink.on_cancel)
            while not seen.resets:
                await trio.sleep(0.01)
    assert sink.ids == [1]
    assert not sink.ended


@RECEIVE
async def test_a_sink_without_room_holds_the_engine_back_until_it_has_room(edge: Edge, direct: bool) -> None:
    """The producer stops acknowledging (direct) or reading (grpclib) while the sink has no room: the engine stops at
    the HTTP/2 window, and everything flows once the sink has room again."""
    count = 3000  # ~3 MiB: more than the stream and connection windows

    def big(i: int) -> bytes:
        response = generation_pb2.GenerateResponse(request_id=RID)
        response.token.output_index = 0
        response.token.tokens.add(token_id=i, token="z" * 1000)
        return message(response)

    async def script(r: Responder) -> None:
        r.headers()
        for i in range(count):
            await r.data(big(i))
        r.trailers(0)

    with trio.fail_after(TEST_BOUND):
        async with raw_engine(edge, script) as (endpoint, _), client_for(edge, endpoint, direct) as client:
            sink = RecordingSink(edge, room=False)
            await start(edge, client, sink)
            await trio.sleep(1.0)
            held = len(sink.ids)
            assert 0 < held < count, "the engine is stopped by the window while the sink has no room"
            await edge.run(_give_room, sink)
            await sink.done.wait()
    assert sink.ended
    assert sink.ids == list(range(count))


async def _give_room(sink: RecordingSink) -> None:
    sink.give_room()
