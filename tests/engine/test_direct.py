"""The direct receive path of ``Generate`` (``sidecar/engine/_direct.py``, ``direct_receive=True``) against a server
that writes every frame itself (``raw_h2``): framing, flow control, statuses, cancellation and deadlines, as grpclib's
path handled them.

Each stream's answer is a script; the client is the real one (``open_engine_client``) on the real edge.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from openengine.v1 import generation_pb2
from sidecar.edge import Edge
from sidecar.engine import Endpoint, EngineClient, EngineClientConfig, open_engine_client
from sidecar.errors import EngineRpcError, GrpcCode
from tests.engine.raw_h2 import RID, Responder, message, raw_engine, token
from tests.helpers.waits import wait_until

TEST_BOUND = 20.0


def request(max_tokens: int = 16) -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest(request_id=RID, model="raw")
    req.token_ids.ids.extend([1, 2, 3])
    req.stopping.max_tokens = max_tokens
    return req


@asynccontextmanager
async def client_for(edge: Edge, endpoint: Endpoint, **config: Any) -> AsyncIterator[EngineClient]:
    settings: dict[str, Any] = {"connections": 1, "retry_interval_s": 0.1, "direct_receive": True}
    settings.update(config)
    async with open_engine_client(edge, EngineClientConfig(endpoint, **settings)) as client:
        yield client


async def read_all(client: EngineClient, **kw: Any) -> tuple[list[int], EngineRpcError | None]:
    """Token ids of every message, in order, and the error the stream ended with (None: a clean end)."""
    ids: list[int] = []
    try:
        async with client.generate(request(), **kw) as batches:
            async for batch in batches:
                ids.extend(r.token.tokens[0].token_id for r in batch)
    except EngineRpcError as exc:
        return ids, exc
    return ids, None


async def test_messages_are_cut_out_of_any_framing_in_order(edge: Edge) -> None:
    async def script(r: Responder) -> None:
        r.headers()
        await r.data(token(1) + token(2) + token(3))  # three messages in one frame
        whole = token(4)
        await r.data(whole[:3])  # a message split across frames, inside its 5-byte prefix ...
        await r.data(whole[3:9])  # ... and inside its body
        await r.data(whole[9:])
        frame = r.frame_bytes(token(5) + token(6)[:4])  # one frame written in three pieces, a message split on
        for part in (frame[:4], frame[4:13], frame[13:]):  # the frame header, and the rest of 6 in the next frame
            r.raw(part)
            # Not a synchronisation: the pieces are written apart so that the client reads them apart.
            await asyncio.sleep(0.02)
        await r.data(token(6)[4:])
        await r.data(token(7), pad=9)  # a padded frame (through h2)
        await r.data(token(8) + token(9)[:2])
        await r.data(token(9)[2:], end=False)
        r.trailers(0)

    with trio.fail_after(TEST_BOUND):
        async with raw_engine(edge, script) as (endpoint, seen), client_for(edge, endpoint) as client:
            for _ in range(2):  # the first stream connects (opened in a task), the second opens at once
                ids, error = await read_all(client)
                assert error is None
                assert ids == list(range(1, 10))
    assert not seen.script_errors
    assert len(seen.requests) == 2
    sent = generation_pb2.GenerateRequest.FromString(seen.requests[0][5:])
    assert sent.request_id == RID


async def test_more_than_the_windows_in_plain_frames_keeps_flowing(edge: Edge) -> None:
    """Plain DATA frames skip h2; their flow control must still be accounted, or the engine stalls at the window."""
    count = 3000  # ~3 MiB: more than the 1 MiB stream window and the 2 MiB connection window

    async def script(r: Responder) -> None:
        r.headers()
        for i in range(count):
            response = generation_pb2.GenerateResponse(request_id=RID)
            response.token.output_index = 0
            response.token.tokens.add(token_id=i, token="x" * 1000)
            await r.data(message(response))
        r.trailers(0)

    with trio.fail_after(TEST_BOUND):
        async with raw_engine(edge, script) as (endpoint, seen), client_for(edge, endpoint) as client:
            ids, error = await read_all(client)
    assert error is None
    assert ids == list(range(count))
    assert seen.stream_window_updates > 0


async def test_a_consumer_that_stops_reading_stops_the_engine_at_the_window(edge: Edge) -> None:
    count = 4000

    def big(i: int) -> bytes:
        response = generation_pb2.GenerateResponse(request_id=RID)
        response.token.output_index = 0
        response.token.tokens.add(token_id=i, token="y" * 1000)
        return message(response)

    size = len(big(count))

    async def script(r: Responder) -> None:
        r.headers()
        for i in range(count):
            await r.data(big(i))
        r.trailers(0)

    window = 65535
    with trio.fail_after(TEST_BOUND):
        async with (
            raw_engine(edge, script) as (endpoint, seen),
            client_for(edge, endpoint, stream_window_bytes=window) as client,
            client.generate(request()) as batches,
        ):
            first = await batches.__anext__()
            # Not reading: the engine fills what the client buffers, then the window, and stops.
            stalled = await _settled(lambda: sum(seen.sent.values()), quiet=0.3)
            await trio.sleep(0.5)  # not a synchronisation: a negative check, time for a send past the window to show
            assert sum(seen.sent.values()) == stalled, "the engine kept sending to a consumer that does not read"
            # At most what was taken, the bridge's bound (1,024 messages not taken) and one stream window.
            assert stalled <= (len(first) + 1024) * size + window
            assert stalled < count * size
            ids = [r.token.tokens[0].token_id for r in first]
            async for batch in batches:
                ids.extend(r.token.tokens[0].token_id for r in batch)
    assert ids == list(range(count))


async def test_a_trailers_only_error_is_raised_with_its_status(edge: Edge) -> None:
    async def script(r: Responder) -> None:
        fields = [(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "8"),
                  ("grpc-message", "queue%20full")]  # fmt: skip
        r.headers(fields, end=True)

    with trio.fail_after(TEST_BOUND):
        async with raw_engine(edge, script) as (endpoint, _), client_for(edge, endpoint) as client:
            ids, error = await read_all(client)
    assert ids == []
    assert error is not None
    assert error.code is GrpcCode.RESOURCE_EXHAUSTED
    assert "queue full" in str(error)


@pytest.mark.parametrize(
    ("fields", "code", "text"),
    [
        ([(":status", "503")], GrpcCode.UNAVAILABLE, ":status = '503'"),
        ([(":status", "200"), ("content-type", "text/html")], GrpcCode.UNKNOWN, "Invalid content-type"),
        ([(":status", "200")], GrpcCode.UNKNOWN, "Missing content-type"),
    ],
)
async def test_bad_response_headers_fail_the_stream_as_grpclib_did(
    edge: Edge, fields: list[tuple[str, str]], code: GrpcCode, text: str
) -> None:
    async def script(r: Responder) -> None:
        r.headers(fields)
        # Not a synchronisation: an engine that goes silent.
        await asyncio.sleep(30)

    with trio.fail_after(TEST_BOUND):
        async with raw_engine(edge, script) as (endpoint, seen), client_for(edge, endpoint) as client:
            ids, error = await read_all(client)
            await wait_until(lambda: seen.resets)
    assert ids == []
    assert error is not None
    assert error.code is code
    assert text in str(error)


async def test_an_error_status_follows_every_message_before_it(edge: Edge) -> None:
    async def script(r: Responder) -> None:
        r.headers()
        await r.data(token(1) + token(2))
        r.trailers(13, "engine%20broke")

    with trio.fail_after(TEST_BOUND):
        async with raw_engine(edge, script) as (endpoint, _), client_for(edge, endpoint) as client:
            ids, error = await read_all(client)
    assert ids == [1, 2]
    assert error is not None
    assert error.code is GrpcCode.INTERNAL
    assert "engine broke" in str(error)


async def test_a_reset_in_the_middle_of_a_message_keeps_the_whole_ones(edge: Edge) -> None:
    async def script(r: Responder) -> None:
        r.headers()
        await r.data(token(1) + token(2)[:7])
        # Not a synchronisation: the whole messages reach the client before the reset.
        await asyncio.sleep(0.05)
        r.reset(2)  # INTERNAL_ERROR

    with trio.fail_after(TEST_BOUND):
        async with raw_engine(edge, script) as (endpoint, _), client_for(edge, endpoint) as client:
            ids, error = await read_all(client)
    assert ids == [1]
    assert error is not None
    assert error.code is GrpcCode.UNAVAILABLE
    assert "reset by remote party" in str(error)


@pytest.mark.parametrize("trailers", [True, False])
async def test_a_stream_that_ends_without_a_status_or_inside_a_message_fails(edge: Edge, trailers: bool) -> None:
    async def script(r: Responder) -> None:
        r.headers()
        if trailers:
            await r.data(token(1) + token(2)[:6])
            r.trailers(0)
        else:
            await r.data(token(1), end=True)

    with trio.fail_after(TEST_BOUND):
        async with raw_engine(edge, script) as (endpoint, _), client_for(edge, endpoint) as client:
            ids, error = await read_all(client)
    assert ids == [1]
    assert error is not None
    if trailers:
        assert error.code is GrpcCode.INTERNAL
        assert "inside a message" in str(error)
    else:
        assert error.code is GrpcCode.UNKNOWN
        assert "grpc-status" in str(error)


async def test_a_message_over_the_limit_fails_before_its_body_arrives(edge: Edge) -> None:
    limit = 4096

    async def script(r: Responder) -> None:
        r.headers()
        await r.data(token(1))
        await r.data(b"\x00" + (10 * limit).to_bytes(4, "big") + b"\x01" * 100)  # announces 40 KiB, sends 100 bytes
        # Not a synchronisation: an engine that goes silent.
        await asyncio.sleep(30)

    with trio.fail_after(TEST_BOUND):
        async with (
            raw_engine(edge, script) as (endpoint, seen),
            client_for(edge, endpoint, max_message_bytes=limit) as client,
        ):
            ids, error = await read_all(client)
            await wait_until(lambda: seen.resets)
    assert ids == [1]
    assert error is not None
    assert error.code is GrpcCode.RESOURCE_EXHAUSTED
    assert f"exceeds the {limit}-byte limit" in str(error)
    assert seen.resets[0][1] == 8  # CANCEL


async def _one_token_then_silence(r: Responder) -> None:
    r.headers()
    await r.data(token(1))
    # Not a synchronisation: an engine that goes silent.
    await asyncio.sleep(30)


async def test_leaving_the_stream_resets_it_at_once(edge: Edge) -> None:
    with trio.fail_after(TEST_BOUND):
        async with raw_engine(edge, _one_token_then_silence) as (endpoint, seen), client_for(edge, endpoint) as client:
            for attempt in range(2):
                async with client.generate(request()) as batches:
                    assert [r.token.tokens[0].token_id for r in await batches.__anext__()] == [1]
                    left = time.monotonic()
                # The reset is written by the loop callback that leaving posts, before leaving returns.
                await wait_until(lambda: len(seen.resets) > attempt, timeout=1)  # noqa: B023
                assert len(seen.resets) == attempt + 1
                _, code, at = seen.resets[-1]
                assert code == 8  # CANCEL
                assert at - left < 1.0
            stats = await client.channel_stats()
    assert stats[0].calls_started == 2
    assert stats[0].calls_failed == 2


async def test_a_deadline_ends_the_stream_deadline_exceeded(edge: Edge) -> None:
    with trio.fail_after(TEST_BOUND):
        async with raw_engine(edge, _one_token_then_silence) as (endpoint, seen), client_for(edge, endpoint) as client:
            ids, error = await read_all(client, timeout_s=0.3)
            await wait_until(lambda: seen.resets)
    assert ids == [1]
    assert error is not None
    assert error.code is GrpcCode.DEADLINE_EXCEEDED


async def test_a_connection_that_cannot_be_made_fails_unavailable(edge: Edge) -> None:
    async with client_for(edge, Endpoint("127.0.0.1", 1)) as client:
        with trio.fail_after(TEST_BOUND):
            ids, error = await read_all(client)
    assert ids == []
    assert error is not None
    assert error.code is GrpcCode.UNAVAILABLE


async def _settled(read: Callable[[], int], quiet: float) -> int:
    """``read()`` once it has not changed for ``quiet`` seconds (a sender that stopped)."""
    last, since = read(), trio.current_time()

    def still() -> bool:
        nonlocal last, since
        now = read()
        if now != last:
            last, since = now, trio.current_time()
        return trio.current_time() - since >= quiet

    await wait_until(still, timeout=20)
    return last
