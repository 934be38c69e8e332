"""The engine client against a recording in-process fake (``fake_engine``): exact metadata on every RPC, which
connection carried each call, server-side cancellation latency, deadlines, message-size limit, stream errors.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import pytest
import trio

from openengine.v1 import generation_pb2
from openengine_bp.openengine.v1 import KvSessionRef, SubscribeKvEventsRequest
from sidecar.edge import Edge, open_edge
from sidecar.engine import Endpoint, EngineClient, EngineClientConfig, RequestMetadata, TraceContext, open_engine_client
from sidecar.engine import _client as engine_client
from sidecar.errors import EngineRpcError, GrpcCode
from tests.helpers.waits import wait_until

from .conftest import connected_client
from .fake_engine import fake_engine

TEST_BOUND = 20.0
TRACE = TraceContext("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "vendor=opaque")
#: Server-side cancellation must follow the consumer leaving within this (architecture: "within 10 ms"; the bound
#: leaves room for a loaded 2-core CI box, the median is checked tighter).
CANCEL_MAX_S = 0.1
CANCEL_MEDIAN_S = 0.02


def request(rid: str, max_tokens: int = 3) -> Any:
    message = generation_pb2.GenerateRequest(request_id=rid, model="fake")
    message.stopping.max_tokens = max_tokens
    return message


async def drain(stream: Any) -> list[Any]:
    return [m async for batch in stream for m in batch]


async def subscribe_into(client: EngineClient, into: list[Any]) -> None:
    async with client.subscribe_kv_events(SubscribeKvEventsRequest()) as batches:
        async for batch in batches:
            into.extend(batch)


async def test_trace_context_on_every_rpc(edge: Edge) -> None:
    with trio.fail_after(TEST_BOUND):
        async with fake_engine(edge) as (endpoint, seen), connected_client(edge, endpoint) as client:
            seen.calls.clear()
            await client.get_server_info(trace=TRACE)
            await client.get_model_info("fake", trace=TRACE)
            await client.get_load(trace=TRACE)
            await client.health(trace=TRACE)
            await client.abort("r", trace=TRACE)
            await client.abort(kv_session=KvSessionRef(session_id="s"), trace=TRACE)
            await client.load_lora("a", "/a", 1, trace=TRACE)
            await client.unload_lora("a", trace=TRACE)
            await client.list_loras(trace=TRACE)
            await client.get_kv_event_sources([0, 1], trace=TRACE)
            with pytest.raises(EngineRpcError):
                async with client.subscribe_kv_events(SubscribeKvEventsRequest(), trace=TRACE) as batches:
                    await drain(batches)
            async with client.generate(request("g"), trace=TRACE) as stream:
                await drain(stream)
    methods = [call.method for call in seen.calls]
    assert sorted(set(methods)) == sorted(
        {
            "GetServerInfo",
            "GetModelInfo",
            "GetLoad",
            "Health",
            "Abort",
            "LoadLora",
            "UnloadLora",
            "ListLoras",
            "GetKvEventSources",
            "SubscribeKvEvents",
            "Generate",
        }
    )
    for call in seen.calls:
        assert call.metadata.get("traceparent") == TRACE.traceparent, call.method
        assert call.metadata.get("tracestate") == TRACE.tracestate, call.method


async def test_request_metadata_exact_keys(edge: Edge) -> None:
    metadata = RequestMetadata(
        routing_key="tenant-1", target_dp_rank=2, priority=5, traceparent=TRACE.traceparent, extra=(("x-app", "v"),)
    )
    with trio.fail_after(TEST_BOUND):
        async with (
            fake_engine(edge) as (endpoint, seen),
            connected_client(edge, endpoint) as client,
            client.generate(request("m"), metadata=metadata.pairs()) as stream,
        ):
            await drain(stream)
    (call,) = [c for c in seen.calls if c.method == "Generate"]
    assert {k: v for k, v in call.metadata.items() if k != "user-agent"} == {
        "openengine-routing-key": "tenant-1",
        "openengine-target-dp-rank": "2",
        "openengine-priority": "5",
        "traceparent": TRACE.traceparent,
        "x-app": "v",
    }


async def test_cancellation_reaches_the_server_fast(edge: Edge) -> None:
    """Leaving generate() early resets the stream; the server handler sees CancelledError within milliseconds."""
    delays: list[float] = []
    with trio.fail_after(TEST_BOUND):
        async with fake_engine(edge) as (endpoint, seen), connected_client(edge, endpoint) as client:
            for i in range(20):
                rid = f"hang-{i}"
                async with client.generate(request(rid)) as stream:
                    async for _ in stream:
                        left = time.monotonic()
                        break
                await wait_until(lambda: rid in seen.cancelled_at, timeout=2, interval=0.0005)  # noqa: B023
                delays.append(seen.cancelled_at[rid] - left)
    print(f"server-side cancel delay: median {1e3 * statistics.median(delays):.2f} ms, max {1e3 * max(delays):.2f} ms")
    assert max(delays) < CANCEL_MAX_S
    assert statistics.median(delays) < CANCEL_MEDIAN_S


async def test_trio_cancel_scope_cancels_the_stream(edge: Edge) -> None:
    with trio.fail_after(TEST_BOUND):
        async with fake_engine(edge) as (endpoint, seen), connected_client(edge, endpoint) as client:
            with trio.move_on_after(0.2) as scope:
                async with client.generate(request("hang-scope")) as stream:
                    await drain(stream)
            assert scope.cancelled_caught
            left = scope.deadline  # trio's clock is time.monotonic() (no mock clock here)
            await wait_until(lambda: "hang-scope" in seen.cancelled_at, timeout=2, interval=0.0005)
            assert seen.cancelled_at["hang-scope"] - left < CANCEL_MAX_S


async def test_unary_deadline(edge: Edge) -> None:
    with trio.fail_after(TEST_BOUND):
        async with fake_engine(edge) as (endpoint, _), connected_client(edge, endpoint) as client:
            start = trio.current_time()
            with pytest.raises(EngineRpcError) as caught:
                await client.get_load(include_per_rank=True, timeout_s=0.2)  # the fake hangs on this one
            took = trio.current_time() - start
            assert caught.value.code is GrpcCode.DEADLINE_EXCEEDED
            assert 0.15 < took < 1.5
            # The connection is still good afterwards.
            await client.get_load()


async def test_oversized_response_is_resource_exhausted(edge: Edge) -> None:
    with trio.fail_after(TEST_BOUND):
        async with fake_engine(edge) as (endpoint, _), connected_client(edge, endpoint, max_message_bytes=4096) as c:
            with pytest.raises(EngineRpcError) as caught:
                async with c.generate(request("big", max_tokens=10_000)) as stream:
                    await drain(stream)
            assert caught.value.code is GrpcCode.RESOURCE_EXHAUSTED
            async with c.generate(request("big-ok", max_tokens=1000)) as stream:
                assert len(await drain(stream)) == 1


async def test_stream_error_after_data(edge: Edge) -> None:
    """SubscribeKvEvents on the fake: one batch, then DATA_LOSS — raised after the batch."""
    received: list[Any] = []
    with trio.fail_after(TEST_BOUND):
        async with fake_engine(edge) as (endpoint, _), connected_client(edge, endpoint) as client:
            with pytest.raises(EngineRpcError) as caught:
                await subscribe_into(client, received)
    assert [m.batch.sequence_number for m in received] == [1]
    assert caught.value.code is GrpcCode.DATA_LOSS
    assert caught.value.details == "fake subscription ends badly"


async def test_round_robin_over_distinct_connections(edge: Edge) -> None:
    with trio.fail_after(TEST_BOUND):
        async with fake_engine(edge) as (endpoint, seen), connected_client(edge, endpoint, connections=3) as client:
            seen.calls.clear()
            async with trio.open_nursery() as nursery:
                for i in range(9):

                    async def one(i: int = i) -> None:
                        async with client.generate(request(f"rr-{i}")) as stream:
                            await drain(stream)

                    nursery.start_soon(one)
    ports = [call.peer_port for call in seen.calls if call.method == "Generate"]
    assert len(ports) == 9
    assert len(set(ports)) == 3
    assert sorted(ports.count(p) for p in set(ports)) == [3, 3, 3]


async def test_many_concurrent_streams(edge: Edge) -> None:
    with trio.fail_after(TEST_BOUND):
        async with fake_engine(edge) as (endpoint, _), connected_client(edge, endpoint, connections=4) as client:
            counts: list[int] = []

            async def one(i: int) -> None:
                async with client.generate(request(f"c-{i}", max_tokens=100)) as stream:
                    counts.append(len(await drain(stream)))

            async with trio.open_nursery() as nursery:
                for i in range(64):
                    nursery.start_soon(one, i)
    assert counts == [101] * 64


async def test_close_fails_open_streams_with_unavailable(edge: Edge) -> None:
    with trio.fail_after(TEST_BOUND):
        async with fake_engine(edge) as (endpoint, _), connected_client(edge, endpoint) as client:
            received: list[Any] = []
            errors: list[EngineRpcError] = []

            async def consume() -> None:
                try:
                    async with client.generate(request("hang-close")) as stream:
                        async for batch in stream:
                            received.extend(batch)
                except EngineRpcError as exc:
                    errors.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume)
                await wait_until(lambda: received, interval=0.001)
                await client.aclose()
    (error,) = errors
    assert error.code is GrpcCode.UNAVAILABLE


async def test_channel_configuration(edge: Edge) -> None:
    """Keepalive no faster than configured (grpclib's 300 s floor lifted), bounded windows, one channel each."""
    config = EngineClientConfig(
        Endpoint("127.0.0.1", 1), connections=3, keepalive_interval_s=12.0, stream_window_bytes=256 * 1024
    )
    async with open_engine_client(edge, config) as client:
        channels = client._channels
        assert len({id(c) for c in channels}) == 3
        grpc_config = channels[0]._config
        assert grpc_config._keepalive_time == 12.0
        assert grpc_config._http2_min_sent_ping_interval_without_data == 12.0
        assert grpc_config._http2_max_pings_without_data == 0
        assert grpc_config.http2_stream_window_size == 256 * 1024
        assert grpc_config.http2_connection_window_size == 2 * 2**20


async def test_client_outliving_its_edge_closes_quietly() -> None:
    config = EngineClientConfig(Endpoint("127.0.0.1", 1), connections=1)
    with trio.fail_after(TEST_BOUND):
        async with open_edge() as own_edge:
            manager = open_engine_client(own_edge, config)
            client = await manager.__aenter__()
        with pytest.raises(EngineRpcError) as caught:
            await client.get_load()
        assert caught.value.code is GrpcCode.UNAVAILABLE
        await manager.__aexit__(None, None, None)
        assert client.closed


async def test_control_rpcs_answer_promptly_while_every_generate_slot_is_taken(
    edge: Edge, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two slots per connection, two Generate connections, five hanging streams: four hold every slot and the fifth
    waits for one (logged). Control RPCs have their own connection, so they do not wait behind them."""
    monkeypatch.setattr(engine_client, "_stream_limit_logged_at", -math.inf)  # the rate limit is process-wide
    with trio.fail_after(TEST_BOUND):
        async with (
            fake_engine(edge, max_concurrent_streams=2) as (endpoint, seen),
            connected_client(edge, endpoint, connections=2) as client,
            trio.open_nursery() as nursery,
        ):
            streaming = 0

            async def hang(i: int) -> None:
                nonlocal streaming
                async with client.generate(request(f"hang-slot-{i}")) as stream:
                    async for _ in stream:
                        streaming += 1

            for i in range(5):
                nursery.start_soon(hang, i)
            await wait_until(lambda: streaming >= 4)
            # The fifth stream has asked for a slot: the client logged that it waits (the log's timestamp is set).
            await wait_until(lambda: engine_client._stream_limit_logged_at > -math.inf, what="the fifth stream waits")
            assert streaming == 4
            generate_ports = {call.peer_port for call in seen.calls if call.method == "Generate"}
            seen.calls.clear()
            start = time.monotonic()
            for _ in range(3):
                await client.health(timeout_s=2.0)
                await client.get_load(timeout_s=2.0)
                await client.abort("r", timeout_s=2.0)
                await client.get_model_info("fake", timeout_s=2.0)
            elapsed = time.monotonic() - start
            nursery.cancel_scope.cancel()
    assert elapsed < 1.0, f"12 Control RPCs took {elapsed:.2f}s"
    control_ports = {call.peer_port for call in seen.calls}
    assert len(generate_ports) == 2
    assert len(control_ports) == 1
    assert not control_ports & generate_ports
    limit_lines = [r for r in caplog.records if "concurrent streams" in r.getMessage()]
    assert len(limit_lines) == 1, "hitting the limit is logged, once"
    assert "limit of 2 concurrent streams" in limit_lines[0].getMessage()
