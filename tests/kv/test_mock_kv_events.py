"""``openengine-mock``'s KV event RPCs, read raw with the project's client: sources, batches, snapshots, replay,
and every ``--kv-fault``. Each test starts its own mock (``--speedup 0``), bounded in time, killed afterwards."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from openengine_bp.openengine.v1 import (
    ErrorCode,
    StorageMedium,
    SubscribeKvEventsRequest,
    SubscribeKvEventsResponse,
)
from sidecar.edge import open_edge
from sidecar.engine import EngineClient, EngineClientConfig, open_engine_client
from sidecar.errors import EngineRpcError, GrpcCode
from sidecar.kv._convert import decode_block_hash
from sidecar.testing.mock.kvcache import prompt_block_hashes
from tests.engine.conftest import start_mock
from tests.helpers.waits import wait_until

from .mock_traffic import BS, generate, prompt

TIMEOUT = 60


@asynccontextmanager
async def mock_client(*flags: str) -> AsyncIterator[EngineClient]:
    async with (
        start_mock("--profile", "full", *flags) as mock,  # KV events over gRPC: the full engine
        open_edge() as edge,
        open_engine_client(edge, EngineClientConfig(endpoint=mock.endpoint, connections=1)) as client,
    ):
        await client.wait_connected(trio.current_time() + 20)
        yield client


class Reader:
    """Reads one subscription in the background; ``messages`` grows as they arrive, ``ended`` says how it ended."""

    def __init__(self) -> None:
        self.messages: list[SubscribeKvEventsResponse] = []
        self.error: EngineRpcError | None = None
        self.ended = trio.Event()

    async def run(self, client: EngineClient, request: SubscribeKvEventsRequest) -> None:
        try:
            async with client.subscribe_kv_events(request) as stream:
                async for messages in stream:
                    self.messages.extend(messages)
        except EngineRpcError as exc:
            self.error = exc
        finally:
            self.ended.set()

    async def wait(self, count: int) -> list[SubscribeKvEventsResponse]:
        await wait_until(lambda: len(self.messages) >= count or self.ended.is_set(), timeout=10)
        return self.messages

    def seqs(self) -> list[int]:
        return [m.batch.sequence_number for m in self.messages if m.batch is not None]


@asynccontextmanager
async def reading(client: EngineClient, **request: object) -> AsyncIterator[Reader]:
    reader = Reader()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader.run, client, SubscribeKvEventsRequest(**request))  # type: ignore[arg-type]
        # Subscribed before the test makes events. Still a synchronisation by time: neither the stream nor the mock
        # tells when the engine has registered the subscriber (a warm-up event would shift every sequence number).
        await trio.sleep(0.2)
        yield reader
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ((), "one grpc source"),
        (("--kv-events", "zmq"), "one zmq source"),
        (("--kv-events", "disabled"), "empty"),
        (("--kv-events", "unimplemented"), "refused"),
    ],
)
async def test_sources_per_mode(flags: tuple[str, ...], expected: str) -> None:
    with trio.fail_after(TIMEOUT):
        async with mock_client(*flags) as client:
            if expected == "refused":
                with pytest.raises(EngineRpcError) as caught:
                    await client.get_kv_event_sources()
                assert caught.value.code is GrpcCode.UNIMPLEMENTED
                return
            sources = (await client.get_kv_event_sources()).sources
            if expected == "empty":
                assert sources == []
                return
            [source] = sources
            if expected == "one zmq source":
                assert (source.transport, source.encoding, source.topic, source.data_parallel_rank) == (
                    "zmq",
                    "msgpack",
                    "kv",
                    0,
                )
                assert source.endpoint_addr is not None
                assert source.endpoint_addr.host == "127.0.0.1"
                assert 0 < source.endpoint_addr.port < 65536
                assert source.endpoint_addr.protocol == "tcp"
                return
            assert (source.transport, source.encoding, source.data_parallel_rank) == ("grpc", "protobuf", 0)
            assert source.schema_version == 1
            with pytest.raises(EngineRpcError) as unknown:
                await client.get_kv_event_sources([3])
            assert unknown.value.code is GrpcCode.INVALID_ARGUMENT


async def test_stored_blocks_are_chained_decimal_int64_and_the_snapshot_matches() -> None:
    with trio.fail_after(TIMEOUT):
        async with mock_client() as client, reading(client, include_snapshot=True) as live:
            [snapshot] = await live.wait(1)
            assert snapshot.batch is not None
            assert snapshot.batch.sequence_number == 0
            assert snapshot.batch.events[0].all_blocks_cleared is not None
            ids = prompt(1)
            await generate(client, "a", ids)
            messages = await live.wait(2)
            batch = messages[1].batch
            assert batch is not None
            assert batch.sequence_number == 1
            assert batch.data_parallel_rank == 0
            assert batch.timestamp_unix_nanos > 0
            [event] = batch.events
            stored = event.block_stored
            assert stored is not None
            assert stored.parent_block_hash is None
            assert stored.block_size == BS
            assert stored.medium == StorageMedium.GPU
            assert {h.encoding for h in stored.block_hashes} == {"decimal_int64"}
            hashes = [decode_block_hash(h) for h in stored.block_hashes]
            assert hashes == prompt_block_hashes(ids, BS), "hashes chain from the parent over each block's tokens"
            assert list(stored.token_ids) == ids
            # A second subscriber's snapshot holds exactly the registered blocks, numbered like the last batch.
            async with reading(client, include_snapshot=True) as second:
                [snap] = await second.wait(1)
                assert snap.batch is not None
                assert snap.batch.sequence_number == 1
                snap_hashes = [
                    decode_block_hash(h)
                    for e in snap.batch.events
                    if e.block_stored is not None
                    for h in e.block_stored.block_hashes
                ]
                assert snap_hashes == hashes


async def test_evictions_are_removals() -> None:
    with trio.fail_after(TIMEOUT):
        async with mock_client("--total-kv-blocks", "10") as client, reading(client) as live:
            for i in range(3):
                await generate(client, f"r{i}", prompt(i))
            await wait_until(lambda: _removals(live), timeout=10, what="removal events")
            removed = [
                decode_block_hash(h)
                for m in live.messages
                if m.batch is not None
                for e in m.batch.events
                if e.block_removed is not None
                for h in e.block_removed.block_hashes
            ]
            assert removed, "a full pool evicts registered blocks"
            assert set(removed) <= set(prompt_block_hashes(prompt(0), BS) + prompt_block_hashes(prompt(1), BS))
            assert live.seqs() == list(range(1, len(live.seqs()) + 1)), "consecutive sequence numbers"


@pytest.mark.parametrize("kind", ["gap", "repeat", "drop", "error", "eof"])
async def test_kv_fault_switches(kind: str) -> None:
    with trio.fail_after(TIMEOUT):
        async with mock_client("--kv-fault", f"{kind}@2") as client, reading(client) as live:
            for i in range(3):
                await generate(client, f"r{i}", prompt(i))
            expected = {"gap": [1, 3], "repeat": [1, 2, 2, 3]}.get(kind, [1])
            await wait_until(lambda: live.seqs() == expected and (kind in ("gap", "repeat") or live.ended.is_set()))
            seqs = live.seqs()
            if kind == "gap":
                assert seqs == [1, 3]
            elif kind == "repeat":
                assert seqs == [1, 2, 2, 3]
            else:
                assert seqs == [1]
                assert live.ended.is_set()
            if kind == "drop":
                assert live.error is not None
                assert live.error.code is GrpcCode.UNAVAILABLE
            if kind == "error":
                assert live.error is None
                last = live.messages[-1].error
                assert last is not None
                assert last.code == ErrorCode.INTERNAL
                assert last.retryable
            if kind == "eof":
                assert live.error is None
                assert live.messages[-1].batch is not None
            # The fault fired once: a new subscription streams normally.
            async with reading(client) as again:
                await generate(client, "later", prompt(9))
                await wait_until(lambda: again.seqs(), timeout=10)
                assert again.seqs() == [4]


async def test_snapshots_can_be_refused_and_replay_is_bounded() -> None:
    with trio.fail_after(TIMEOUT):
        async with mock_client("--no-kv-snapshot") as client:
            async with reading(client, include_snapshot=True) as refused:
                await refused.ended.wait()
                assert refused.error is not None
                assert refused.error.code is GrpcCode.UNIMPLEMENTED
            await generate(client, "a", prompt(1))
            await generate(client, "b", prompt(2))
            async with reading(client, start_sequence_number=1) as replay:
                await replay.wait(2)
                assert replay.seqs() == [1, 2]
            async with reading(client, start_sequence_number=7) as beyond:
                await beyond.ended.wait()
                assert beyond.error is not None
                assert beyond.error.code is GrpcCode.OUT_OF_RANGE


@pytest.mark.parametrize(
    ("flags", "request_fields", "code"),
    [
        ((), {"include_snapshot": True, "start_sequence_number": 1}, GrpcCode.INVALID_ARGUMENT),
        ((), {"data_parallel_ranks": [1]}, GrpcCode.INVALID_ARGUMENT),
        (("--kv-events", "disabled"), {}, GrpcCode.FAILED_PRECONDITION),
        (("--kv-events", "unimplemented"), {}, GrpcCode.UNIMPLEMENTED),
        (("--kv-events", "zmq"), {}, GrpcCode.UNIMPLEMENTED),
    ],
)
async def test_subscriptions_the_mock_refuses(
    flags: tuple[str, ...], request_fields: dict[str, object], code: GrpcCode
) -> None:
    with trio.fail_after(TIMEOUT):
        async with mock_client(*flags) as client, reading(client, **request_fields) as refused:
            await refused.ended.wait()
            assert refused.error is not None
            assert refused.error.code is code


def _removals(reader: Reader) -> bool:
    return any(
        m.batch is not None and any(e.block_removed is not None for e in m.batch.events) for m in reader.messages
    )
