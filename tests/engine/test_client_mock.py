"""The engine client against a real ``openengine-mock`` process: every RPC, metadata, every fault mode, connect,
cancellation, the pool and close. Every test runs under an absolute bound so that a hang fails instead of blocking.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
from google.protobuf import json_format  # type: ignore[import-untyped,unused-ignore]

from openengine.v1 import generation_pb2
from openengine_bp.openengine.v1 import (
    AbortStatus,
    HealthState,
    KvSessionRef,
    SubscribeKvEventsRequest,
)
from sidecar.edge import Edge
from sidecar.engine import (
    Endpoint,
    EngineClient,
    EngineClientConfig,
    MetadataError,
    RequestMetadata,
    check_server_compat,
    open_engine_client,
)
from sidecar.errors import EngineRpcError, GrpcCode
from tests.helpers.waits import wait_until

from .conftest import MockEngine, SharedMock, connected_client, free_port, start_mock

#: Absolute bound of any one test doing I/O against the mock.
TEST_BOUND = 30.0
#: How long the engine may take to notice a cancelled stream and drop the request (GetLoad polled).
CANCEL_VISIBLE_WITHIN = 1.0

pytestmark = pytest.mark.e2e


def make_request(max_tokens: int = 8, mock: dict[str, Any] | None = None, **extra: Any) -> Any:
    """A greedy token-ids request for the mock's tiny model; ``mock`` = fault keys for ``extra["mock"]``."""
    request = generation_pb2.GenerateRequest(request_id=f"t-{uuid.uuid4()}", model="tiny-oe")
    request.token_ids.ids.extend([5, 6, 7, 8])
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = max_tokens
    request.stopping.ignore_eos = True
    if mock is not None or extra:
        payload = dict(extra)
        if mock is not None:
            payload["mock"] = mock
        json_format.ParseDict(payload, request.extra)
    return request


async def collect(
    client: EngineClient,
    request: Any,
    metadata: Sequence[tuple[str, str]] = (),
    *,
    into: list[list[Any]] | None = None,
    timeout_s: float | None = None,
) -> list[list[generation_pb2.GenerateResponse]]:
    """Every batch of one Generate stream (also appended to ``into`` as they come, for streams that fail)."""
    batches = [] if into is None else into
    async with client.generate(request, metadata=metadata, timeout_s=timeout_s) as stream:
        async for batch in stream:
            assert batch, "batches are never empty"
            batches.append(batch)
    return batches


async def subscribe(client: EngineClient) -> None:
    """Open a KV-event subscription and expect no batch."""
    async with client.subscribe_kv_events(SubscribeKvEventsRequest(include_snapshot=True)) as batches:
        async for _ in batches:
            pytest.fail("no batch expected")


def flat(batches: list[list[Any]]) -> list[Any]:
    """The messages of all batches, in order."""
    return [message for batch in batches for message in batch]


async def wait_idle(client: EngineClient, within: float = CANCEL_VISIBLE_WITHIN) -> float:
    """Poll GetLoad until running_requests is 0; return how long it took (fails after ``within``)."""
    start = trio.current_time()

    async def idle() -> bool:
        return not (await client.get_load()).running_requests

    await wait_until(idle, timeout=within, interval=0.005, what="the engine idle")
    return trio.current_time() - start


# ---------------------------------------------------------------------------------------------- Control RPCs


async def test_every_control_rpc(client: EngineClient) -> None:
    with trio.fail_after(TEST_BOUND):
        info = await client.get_server_info()
        assert info.engine_name == "tensorrt_llm"  # the mock's default profile is TensorRT-LLM's server
        assert check_server_compat(info) == []
        assert "tiny-oe" in info.supported_models

        model = await client.get_model_info("tiny-oe")
        assert model.served_model_name == "tiny-oe"
        # A single-model TensorRT-LLM server resolves any name to its model (never NOT_FOUND).
        assert (await client.get_model_info("no-such-model")).served_model_name == "tiny-oe"

        load = await client.get_load()
        assert not load.running_requests
        await client.get_load(include_per_rank=True)

        health = await client.health()
        assert health.state is HealthState.READY
        probed = await client.health(include_inference_probe=True, model="tiny-oe")
        assert probed.state is HealthState.READY

        aborted = await client.abort("never-seen")
        assert aborted.status is AbortStatus.ALREADY_FINISHED
        assert (await client.abort(all_requests=True)).status is AbortStatus.ALREADY_FINISHED
        with pytest.raises(EngineRpcError) as caught:
            await client.abort(kv_session=KvSessionRef(session_id="s"))
        assert caught.value.code is GrpcCode.UNIMPLEMENTED
        with pytest.raises(ValueError, match="exactly one target"):
            await client.abort()
        with pytest.raises(ValueError, match="exactly one target"):
            await client.abort("a", all_requests=True)


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.list_loras(),
        lambda c: c.load_lora("a", "/tmp/a", 1),
        lambda c: c.unload_lora("a"),
    ],
    ids=["ListLoras", "LoadLora", "UnloadLora"],
)
async def test_unsupported_rpcs_are_unimplemented(client: EngineClient, call: Any) -> None:
    with trio.fail_after(TEST_BOUND), pytest.raises(EngineRpcError) as caught:
        await call(client)
    assert caught.value.code is GrpcCode.UNIMPLEMENTED


async def test_kv_event_rpcs_unimplemented_as_trt_baseline(edge: Edge) -> None:
    """``--kv-events unimplemented``: both KV-event RPCs answer UNIMPLEMENTED (the default mock streams events)."""
    with trio.fail_after(TEST_BOUND):
        async with (
            start_mock("--kv-events", "unimplemented") as mock,
            connected_client(edge, mock.endpoint) as client,
        ):
            with pytest.raises(EngineRpcError) as sources:
                await client.get_kv_event_sources([0])
            assert sources.value.code is GrpcCode.UNIMPLEMENTED
            with pytest.raises(EngineRpcError) as caught:
                await subscribe(client)
            assert caught.value.code is GrpcCode.UNIMPLEMENTED
            assert caught.value.rpc == "SubscribeKvEvents"


async def test_lora_rpcs_with_capability(edge: Edge, tmp_path: Path) -> None:
    style = str(tmp_path)
    with trio.fail_after(TEST_BOUND):
        async with start_mock("--capability", "lora=true") as mock, connected_client(edge, mock.endpoint) as client:
            loaded = await client.load_lora("style", style, 7)
            assert not loaded.already_loaded
            assert (await client.load_lora("style", style, 7)).already_loaded
            listed = await client.list_loras()
            assert [a.lora_name for a in listed.adapters] == ["style"]
            with pytest.raises(EngineRpcError) as caught:
                await client.load_lora("other", style, 8)
            assert caught.value.code is GrpcCode.ALREADY_EXISTS
            assert (await client.unload_lora("style")).adapter is not None
            with pytest.raises(EngineRpcError) as caught:
                await client.unload_lora("style")
            assert caught.value.code is GrpcCode.NOT_FOUND


# ---------------------------------------------------------------------------------------------- Generate


async def test_generate_streams_tokens_then_finish(client: EngineClient) -> None:
    with trio.fail_after(TEST_BOUND):
        messages = flat(await collect(client, make_request(max_tokens=16)))
    events = [m.WhichOneof("event") for m in messages]
    assert events.count("finished") == 1
    assert events[-1] == "finished"
    assert sum(len(m.token.tokens) for m in messages if m.HasField("token")) == 16
    assert messages[-1].HasField("usage")
    assert messages[-1].usage.completion_tokens == 16


async def test_generate_rejected_request_is_an_rpc_error_with_no_batches(client: EngineClient) -> None:
    request = make_request()
    request.lora_name = "no-such-adapter"  # TensorRT-LLM: lora_name is UNIMPLEMENTED
    batches: list[Any] = []
    with trio.fail_after(TEST_BOUND), pytest.raises(EngineRpcError) as caught:
        await collect(client, request, into=batches)
    assert batches == []
    assert caught.value.rpc == "Generate"
    assert caught.value.code is GrpcCode.UNIMPLEMENTED


async def test_metadata_reaches_the_engine(client: EngineClient) -> None:
    with trio.fail_after(TEST_BOUND):
        # Accepted keys.
        await collect(client, make_request(), RequestMetadata(routing_key="tenant-7").pairs())
        # Priority is refused when the model does not advertise it (TensorRT-LLM's behaviour) ...
        with pytest.raises(EngineRpcError) as caught:
            await collect(client, make_request(), RequestMetadata(priority=3).pairs())
        assert caught.value.code is GrpcCode.UNIMPLEMENTED
        assert "priority" in caught.value.details
        with pytest.raises(EngineRpcError) as caught:
            await collect(client, make_request(), RequestMetadata(target_dp_rank=0).pairs())
        assert caught.value.code is GrpcCode.UNIMPLEMENTED
        # ... and repeated reserved keys never leave the client.
        with pytest.raises(MetadataError, match="repeated"):
            await collect(client, make_request(), [("openengine-routing-key", "a"), ("openengine-routing-key", "b")])


async def test_priority_when_advertised(edge: Edge) -> None:
    with trio.fail_after(TEST_BOUND):
        async with start_mock("--capability", "priority=true") as mock, connected_client(edge, mock.endpoint) as client:
            await collect(client, make_request(), RequestMetadata(priority=-2).pairs())
            # A malformed value (bypassing RequestMetadata's validation) is the engine's INVALID_ARGUMENT.
            with pytest.raises(EngineRpcError) as caught:
                await collect(client, make_request(), [("openengine-priority", "high")])
            assert caught.value.code is GrpcCode.INVALID_ARGUMENT


# ---------------------------------------------------------------------------------------------- fault modes


@pytest.mark.parametrize(
    "status",
    [
        GrpcCode.INVALID_ARGUMENT,
        GrpcCode.UNIMPLEMENTED,
        GrpcCode.ALREADY_EXISTS,
        GrpcCode.RESOURCE_EXHAUSTED,
        GrpcCode.UNAVAILABLE,
        GrpcCode.INTERNAL,
        GrpcCode.FAILED_PRECONDITION,
        GrpcCode.PERMISSION_DENIED,
    ],
    ids=lambda c: c.name,
)
async def test_reject_status(client: EngineClient, status: GrpcCode) -> None:
    request = make_request(mock={"reject_status": status.name, "reject_message": f"no: {status.name}"})
    batches: list[Any] = []
    with trio.fail_after(TEST_BOUND), pytest.raises(EngineRpcError) as caught:
        await collect(client, request, into=batches)
    assert batches == []
    assert caught.value.code is status
    assert caught.value.details == f"no: {status.name}"


async def test_error_after_tokens_is_data(client: EngineClient) -> None:
    request = make_request(
        max_tokens=50, mock={"error_after_tokens": 5, "error_code": "OVERLOADED", "error_retryable": True}
    )
    with trio.fail_after(TEST_BOUND):
        messages = flat(await collect(client, request))
    assert sum(len(m.token.tokens) for m in messages if m.HasField("token")) == 5
    terminal = messages[-1]
    assert terminal.WhichOneof("event") == "error"
    assert terminal.error.retryable
    assert terminal.HasField("usage")


async def test_drop_after_tokens_is_unavailable_after_the_tokens(client: EngineClient) -> None:
    request = make_request(max_tokens=50, mock={"drop_after_tokens": 4})
    batches: list[Any] = []
    with trio.fail_after(TEST_BOUND), pytest.raises(EngineRpcError) as caught:
        await collect(client, request, into=batches)
    assert caught.value.code is GrpcCode.UNAVAILABLE
    assert caught.value.migratable
    assert sum(len(m.token.tokens) for m in flat(batches) if m.HasField("token")) <= 4
    # The pool heals: the next request on the same connections succeeds.
    with trio.fail_after(TEST_BOUND):
        for _ in range(3):
            await collect(client, make_request())


async def test_hang_is_bounded_then_cancelled_cleanly(client: EngineClient) -> None:
    request = make_request(max_tokens=50, mock={"hang_after_tokens": 3})
    received = 0
    with trio.fail_after(TEST_BOUND):
        with trio.move_on_after(0.5) as bound:
            async with client.generate(request) as stream:
                async for batch in stream:
                    received += len(batch)
        assert bound.cancelled_caught
        assert received == 3
        await wait_idle(client)


async def test_hang_before_first_message_and_stream_deadline(client: EngineClient) -> None:
    request = make_request(mock={"hang_after_tokens": 0})
    with trio.fail_after(TEST_BOUND):
        start = time.monotonic()
        batches: list[Any] = []
        with pytest.raises(EngineRpcError) as caught:
            await collect(client, request, into=batches, timeout_s=0.3)
        assert batches == []
        assert caught.value.code is GrpcCode.DEADLINE_EXCEEDED
        assert time.monotonic() - start < 5
        await wait_idle(client)


@pytest.mark.parametrize(
    "violation",
    [
        "wrong_request_id",
        "event_after_terminal",
        "missing_output_index",
        "usage_on_non_final",
        "eof_before_terminal",
        "unspecified_finish",
    ],
)
async def test_violations_pass_through_as_data(client: EngineClient, violation: str) -> None:
    with trio.fail_after(TEST_BOUND):
        messages = flat(await collect(client, make_request(mock={"violation": violation})))
    if violation == "eof_before_terminal":
        assert all(m.WhichOneof("event") == "token" for m in messages)
    else:
        assert messages


async def test_scripted_tokens(client: EngineClient) -> None:
    with trio.fail_after(TEST_BOUND):
        messages = flat(await collect(client, make_request(max_tokens=10, mock={"tokens": [11, 12, 13]})))
    ids = [t.token_id for m in messages if m.HasField("token") for t in m.token.tokens]
    assert ids[:3] == [11, 12, 13]


# ---------------------------------------------------------------------------------------------- cancellation


async def test_trio_cancel_frees_the_engine_request(client: EngineClient) -> None:
    """A long stream cancelled from trio: the engine drops the request (GetLoad back to 0) promptly."""
    with trio.fail_after(TEST_BOUND):
        received = 0
        async with trio.open_nursery() as nursery:

            async def consume() -> None:
                nonlocal received
                async with client.generate(make_request(max_tokens=2000, mock={"hang_after_tokens": 1000})) as s:
                    async for batch in s:
                        received += len(batch)

            nursery.start_soon(consume)
            await wait_until(lambda: received >= 100, interval=0.001)
            assert (await client.get_load()).running_requests == 1
            cancelled_at = trio.current_time()
            nursery.cancel_scope.cancel(reason="test cancels the request")
        await wait_idle(client)
        took = trio.current_time() - cancelled_at
    print(f"engine request gone within {1e3 * took:.1f} ms of the trio cancel (GetLoad polled every 5 ms)")
    assert took < CANCEL_VISIBLE_WITHIN


async def test_leaving_early_frees_the_engine_request(client: EngineClient) -> None:
    with trio.fail_after(TEST_BOUND):
        async with client.generate(make_request(max_tokens=2000, mock={"hang_after_tokens": 1000})) as stream:
            async for _ in stream:
                break
        await wait_idle(client)


# ---------------------------------------------------------------------------------------------- connection


async def test_wait_connected_retries_until_a_late_engine_listens(edge: Edge) -> None:
    port = free_port()
    with trio.fail_after(TEST_BOUND):
        config = EngineClientConfig(
            Endpoint("127.0.0.1", port), connections=2, retry_interval_s=0.1, connect_attempt_timeout_s=2.0
        )
        async with open_engine_client(edge, config) as client, trio.open_nursery() as nursery:
            result: list[Any] = []

            async def connect() -> None:
                result.append(await client.wait_connected(trio.current_time() + 25))

            nursery.start_soon(connect)
            await trio.sleep(1.0)  # not a synchronisation: a negative check, no engine for a while
            assert not result
            async with start_mock(port=port):
                await wait_until(lambda: result, timeout=20, interval=0.05)
            assert result[0].engine_name == "tensorrt_llm"


async def test_wait_connected_fails_with_one_clear_error(edge: Edge, caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    config = EngineClientConfig(Endpoint("127.0.0.1", port), connections=2, retry_interval_s=0.1)
    with trio.fail_after(TEST_BOUND), caplog.at_level("INFO", logger="sidecar.engine"):
        async with open_engine_client(edge, config) as client:
            start = trio.current_time()
            with pytest.raises(EngineRpcError) as caught:
                await client.wait_connected(start + 1.0)
            took = trio.current_time() - start
    assert 0.9 < took < 2.0
    error = caught.value
    assert error.code is GrpcCode.UNAVAILABLE
    assert error.rpc == "GetServerInfo"
    assert str(error).startswith(
        f"GetServerInfo: UNAVAILABLE: could not reach OpenEngine at 127.0.0.1:{port} within 1s:"
    )
    assert "refused" in str(error)
    # Throttled: the first failure is logged, the identical ones after it are not (30 s rule).
    waiting = [r for r in caplog.records if "not reachable yet" in r.getMessage()]
    assert len(waiting) == 1


async def test_wait_connected_waits_through_startup_delay(edge: Edge) -> None:
    with trio.fail_after(TEST_BOUND):
        async with start_mock("--startup-delay", "1") as mock, connected_client(edge, mock.endpoint) as client:
            # Connected (the port is open) though the engine is still STARTING: readiness is Health's business.
            health = await client.health()
            assert health.state in (HealthState.STARTING, HealthState.READY)


async def test_pool_round_robin_uses_every_connection(edge: Edge, mock_engine: SharedMock) -> None:
    with trio.fail_after(TEST_BOUND):
        async with connected_client(edge, mock_engine.endpoint, connections=4) as client:
            before = await client.channel_stats()
            assert [s.connected for s in before] == [True] * 4
            for _ in range(8):
                await collect(client, make_request(max_tokens=2))
            after = await client.channel_stats()
    generated = [a.calls_started - b.calls_started for a, b in zip(after, before, strict=True)]
    assert generated == [2, 2, 2, 2]


async def test_close_is_idempotent_and_final(edge: Edge, mock_engine: SharedMock) -> None:
    with trio.fail_after(TEST_BOUND):
        async with connected_client(edge, mock_engine.endpoint) as client:
            await client.aclose()
            await client.aclose()
            assert client.closed
            with pytest.raises(EngineRpcError) as caught:
                await client.get_load()
            assert caught.value.code is GrpcCode.UNAVAILABLE
            with pytest.raises(EngineRpcError):
                async with client.generate(make_request()):
                    pass
        await client.aclose()


async def test_engine_exit_mid_stream_is_unavailable(edge: Edge) -> None:
    with trio.fail_after(TEST_BOUND):
        async with start_mock() as mock, connected_client(edge, mock.endpoint) as client:
            with pytest.raises(EngineRpcError) as caught:
                await kill_mid_stream(client, mock)
            assert caught.value.code is GrpcCode.UNAVAILABLE


async def kill_mid_stream(client: EngineClient, mock: MockEngine) -> None:
    """Kill the engine process (SIGKILL) once the first batch arrived, then keep reading."""
    async with client.generate(make_request(max_tokens=50, mock={"hang_after_tokens": 2})) as stream:
        async for _ in stream:
            mock.process.kill()


async def test_the_mock_takes_more_than_100_streams_per_connection(edge: Edge, mock_engine: SharedMock) -> None:
    """grpcio (TensorRT-LLM's server) sets no HTTP/2 stream limit, and neither does the mock by default: h2's own
    default of 100 would make the 101st stream on a connection wait for a slot."""
    streams = 150
    with trio.fail_after(TEST_BOUND):
        async with (
            connected_client(edge, mock_engine.endpoint, connections=1) as client,
            trio.open_nursery() as nursery,
        ):
            streaming = 0

            async def one() -> None:
                nonlocal streaming
                async with client.generate(make_request(max_tokens=8, mock={"hang_after_tokens": 1})) as stream:
                    async for _ in stream:
                        streaming += 1

            for _ in range(streams):
                nursery.start_soon(one)
            await wait_until(lambda: streaming >= streams, interval=0.02)
            nursery.cancel_scope.cancel()
