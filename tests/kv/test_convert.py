"""Every validation rule of the routing signals, by table (``sidecar/kv/_convert.py``; ``docs/kv-events.md``)."""

from __future__ import annotations

from typing import Any

import pytest

from openengine_bp.openengine.v1 import KvBlockHash, KvEvent, StorageMedium
from sidecar.dynamo import Registration
from sidecar.kv import GrpcSource, RankIndex, RoutingPlan, ZmqSource
from sidecar.kv._convert import (
    I64_MAX,
    I64_MIN,
    InvalidLoad,
    NeedsResync,
    RemovedBlocks,
    StoredBlocks,
    UnusableSources,
    check_load,
    decode_block_hash,
    plan_sources,
    to_signed64,
)

from .factories import BS, cleared, grpc_source, load, removed, removed_raw, stored, tokens_for, zmq_source

NOW = 1_800_000_000 * 10**9

# -- block hashes -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "encoding", "expected"),
    [
        (b"0", "decimal_int64", 0),
        (b"123", "decimal_int64", 123),
        (b"-5", "decimal_int64", -5),
        (str(I64_MAX).encode(), "decimal_int64", I64_MAX),
        (str(I64_MIN).encode(), "decimal_int64", I64_MIN),
        (b"7", "decimal_uint64", 7),
        (str(2**63).encode(), "decimal_uint64", I64_MIN),
        (str(2**64 - 1).encode(), "decimal_uint64", -1),
    ],
)
def test_hashes_decode_to_signed_64_bit(value: bytes, encoding: str, expected: int) -> None:
    assert decode_block_hash(KvBlockHash(value=value, encoding=encoding)) == expected


@pytest.mark.parametrize(
    ("value", "encoding", "message"),
    [
        (b"5", "int64", "unsupported block hash encoding"),
        (b"5", "bytes", "unsupported block hash encoding"),
        (b"5", "", "unsupported block hash encoding"),
        (b"+5", "decimal_int64", "canonical"),
        (b"007", "decimal_int64", "canonical"),
        (b"-0", "decimal_int64", "canonical"),
        (b" 5", "decimal_int64", "canonical"),
        (b"", "decimal_int64", "canonical"),
        (b"1.0", "decimal_int64", "canonical"),
        (b"0x10", "decimal_int64", "canonical"),
        (str(2**63).encode(), "decimal_int64", "outside the signed"),
        (str(I64_MIN - 1).encode(), "decimal_int64", "outside the signed"),
        (b"-1", "decimal_uint64", "outside the unsigned"),
        (str(2**64).encode(), "decimal_uint64", "outside the unsigned"),
        (b"1" * 25, "decimal_int64", "canonical"),
    ],
)
def test_malformed_hashes_are_refused(value: bytes, encoding: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_block_hash(KvBlockHash(value=value, encoding=encoding))


def test_to_signed64() -> None:
    assert to_signed64(0) == 0
    assert to_signed64(2**63 - 1) == I64_MAX
    assert to_signed64(2**63) == I64_MIN
    with pytest.raises(ValueError, match="unsigned"):
        to_signed64(-1)


# -- a rank's index: KV events ------------------------------------------------------------------------------------


def index(*known: int) -> RankIndex:
    idx = RankIndex(0, BS, limit=1000)
    for block_id in known:
        idx.apply(stored([block_id]))
    assert idx.attributed == frozenset(known)
    return idx


def test_a_root_chain_is_published_with_its_tokens() -> None:
    idx = index()
    ops = idx.apply(stored([10, 11, 12]))
    assert ops == [StoredBlocks((10, 11, 12), None, tuple(tokens_for([10, 11, 12])), BS, None)]
    assert idx.attributed == {10, 11, 12}


def test_a_child_of_a_published_block_keeps_its_parent() -> None:
    idx = index(10)
    [op] = idx.apply(stored([20], parent=10))
    assert isinstance(op, StoredBlocks)
    assert op.parent_hash == 10


def test_lora_identity_is_kept() -> None:
    idx = index()
    [op] = idx.apply(stored([1], lora_id=3, lora_name="adapter-a"))
    assert isinstance(op, StoredBlocks)
    assert op.lora_name == "adapter-a"
    [op] = idx.apply(stored([2], lora_name="adapter-b"))
    assert isinstance(op, StoredBlocks)
    assert op.lora_name == "adapter-b"


def test_unsigned_hashes_become_signed() -> None:
    idx = index()
    [op] = idx.apply(stored([2**64 - 2], encoding="decimal_uint64"))
    assert isinstance(op, StoredBlocks)
    assert op.block_hashes == (-2,)


def test_full_attention_spec_is_accepted() -> None:
    assert index().apply(stored([1], spec_kind="full_attention"))


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (stored([5], parent=99), "orphan"),
        (stored([5], medium=StorageMedium.CPU_PINNED), "other_medium"),
        (stored([5], medium=StorageMedium.DISK), "other_medium"),
        (stored([5], group_idx=1), "other_group"),
        (stored([5], spec_kind="sliding_window"), "unsupported_spec"),
        (stored([5], sliding_window=128), "unsupported_spec"),
        (stored([5], extra_keys=[["trt_mm_v1", "0", "12", "0"]]), "extra_keys"),
        (stored([]), "no_hashes"),
        (stored([5], block_size=8), "block_size"),
        (stored([5], block_size=0, tokens=[]), "block_size"),
        (stored([5, 6], tokens=[1, 2, 3, 4, 5]), "token_count"),
        (stored([5], tokens=[1, 2, 3, 4, 5]), "token_count"),
        (stored([5], lora_id=3), "lora_identity"),
        (stored([5], lora_id=-1, lora_name="x"), "lora_identity"),
        (stored([5], encoding="bytes"), "hash_encoding"),
        (stored([5, 5]), "duplicate_hash"),
        (stored([5], parent=5), "duplicate_hash"),
        (KvEvent(), "unknown_event"),
    ],
)
def test_a_stored_event_that_breaks_a_rule_is_skipped(event: KvEvent, reason: str) -> None:
    idx = index(1)
    assert idx.apply(event) == []
    assert idx.skipped == {reason: 1}
    assert idx.attributed == {1}, "a skipped event changes nothing Dynamo was told"


def test_a_stored_event_with_an_unreadable_parent_is_skipped() -> None:
    idx = index(1)
    event = stored([5], parent=1)
    assert event.block_stored is not None
    event.block_stored.parent_block_hash = KvBlockHash(value=b"01", encoding="decimal_int64")
    assert idx.apply(event) == []
    assert idx.skipped == {"hash_encoding": 1}


def test_children_of_a_skipped_block_are_skipped_too() -> None:
    idx = index()
    assert idx.apply(stored([1], block_size=8)) == []
    assert idx.apply(stored([2], parent=1)) == []
    assert idx.skipped == {"block_size": 1, "orphan": 1}


def test_removals_take_back_published_blocks_only() -> None:
    idx = index(1, 2, 3)
    assert idx.apply(removed([2, 9])) == [RemovedBlocks((2,))]
    assert idx.skipped == {"unknown_removed": 1}
    assert idx.attributed == {1, 3}
    assert idx.apply(removed([9])) == []
    assert idx.apply(removed([3, 3])) == [RemovedBlocks((3,))]


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (removed([1], medium=StorageMedium.CPU_PINNED), "other_medium"),
        (removed([]), "no_hashes"),
    ],
)
def test_a_removal_outside_the_routed_cache_is_skipped(event: KvEvent, reason: str) -> None:
    idx = index(1)
    assert idx.apply(event) == []
    assert idx.skipped == {reason: 1}
    assert idx.attributed == {1}


@pytest.mark.parametrize(
    "raw",
    [[(b"1", "bytes")], [(b"01", "decimal_int64")], [(b"1", "decimal_int64"), (b"x", "decimal_int64")]],
)
def test_an_unreadable_removal_needs_a_resync(raw: list[tuple[bytes, str]]) -> None:
    idx = index(1)
    with pytest.raises(NeedsResync) as caught:
        idx.apply(removed_raw(raw))
    assert caught.value.reason == "invalid_removal"
    assert idx.attributed == {1}


def test_all_blocks_cleared_takes_back_everything() -> None:
    idx = index(1, 2)
    assert idx.apply(cleared()) == [RemovedBlocks((1, 2))]
    assert len(idx) == 0
    assert idx.apply(cleared()) == []
    assert idx.clear() == []


def test_the_index_is_bounded() -> None:
    idx = RankIndex(0, BS, limit=3)
    idx.apply(stored([1, 2]))
    with pytest.raises(NeedsResync) as caught:
        idx.apply(stored([3, 4], parent=2))
    assert caught.value.reason == "overflow"


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        RankIndex(0, 0, limit=10)


# -- load snapshots -----------------------------------------------------------------------------------------------


def check(info: Any, ranks: tuple[int, ...] = (0,)) -> list[tuple[int, int, int]]:
    result = check_load(info, ranks, now_ns=NOW, max_age_ns=5 * 10**9, max_future_ns=10**9)
    return [(r.rank, r.used_blocks, r.total_blocks) for r in result]


def test_a_fresh_consistent_snapshot_is_published() -> None:
    assert check(load(NOW, [(0, 3, 10)], age_s=1.0)) == [(0, 3, 10)]
    assert check(load(NOW, [(1, 0, 8), (0, 8, 8)]), (0, 1)) == [(0, 8, 8), (1, 0, 8)]
    assert check(load(NOW, [(0, 1, 4), (7, 99, 1)])) == [(0, 1, 4)], "ranks this worker does not serve are ignored"
    assert check(load(NOW, [], aggregate=(2, 5))) == [(0, 2, 5)], "one rank may use the aggregate"
    assert check(load(NOW, [(0, 1, 4)], stamp=False)) == [(0, 1, 4)], "no timestamp: the poll itself is fresh"


@pytest.mark.parametrize(
    ("info", "ranks", "reason"),
    [
        (load(NOW, age_s=6.0), (0,), "too_old"),
        (load(NOW, age_s=-2.0), (0,), "from_future"),
        (load(NOW, [(0, 1, 4)]), (0, 1), "missing_rank"),
        (load(NOW, []), (0, 1), "missing_rank"),
        (load(NOW, [], aggregate=(2, 5)), (0, 1), "missing_rank"),
        (load(NOW, [(0, 1, 4), (0, 1, 4)]), (0,), "duplicate_rank"),
        (load(NOW, [(None, 1, 4)]), (0,), "rank_without_id"),
        (load(NOW, [(0, None, 4)]), (0,), "no_kv_usage"),
        (load(NOW, []), (0,), "no_kv_usage"),
        (load(NOW, [(0, 1, None)]), (0,), "no_kv_total"),
        (load(NOW, [(0, 0, 0)]), (0,), "no_kv_total"),
        (load(NOW, [(0, 11, 10)]), (0,), "used_over_total"),
    ],
)
def test_stale_or_inconsistent_snapshots_are_refused(info: Any, ranks: tuple[int, ...], reason: str) -> None:
    with pytest.raises(InvalidLoad) as caught:
        check(info, ranks)
    assert caught.value.reason == reason


# -- KV event sources ---------------------------------------------------------------------------------------------


def test_no_sources_means_no_events() -> None:
    assert plan_sources([], (0,)) == ({}, [])


@pytest.mark.parametrize(
    ("sources", "ranks", "expected"),
    [
        ([grpc_source(0)], (0,), {0: GrpcSource(0)}),
        ([grpc_source(0, encoding="")], (0,), {0: GrpcSource(0)}),
        ([grpc_source(None)], (0,), {0: GrpcSource(0)}),
        ([zmq_source(0, topic="kv")], (0,), {0: ZmqSource(0, "tcp://127.0.0.1:5557", "kv")}),
        ([zmq_source(0, host="::1")], (0,), {0: ZmqSource(0, "tcp://[::1]:5557", "")}),
        ([zmq_source(0, protocol="", schema_version=None)], (0,), {0: ZmqSource(0, "tcp://127.0.0.1:5557", "")}),
        ([zmq_source(0), grpc_source(0)], (0,), {0: GrpcSource(0)}),
        (
            [grpc_source(2), zmq_source(3, port=6000)],
            (2, 3),
            {2: GrpcSource(2), 3: ZmqSource(3, "tcp://127.0.0.1:6000", "")},
        ),
        ([grpc_source(0), grpc_source(5)], (0,), {0: GrpcSource(0)}),
    ],
)
def test_one_usable_source_per_rank(sources: list[Any], ranks: tuple[int, ...], expected: dict[int, Any]) -> None:
    plan, _ = plan_sources(sources, ranks)
    assert plan == expected


@pytest.mark.parametrize(
    ("sources", "ranks", "message"),
    [
        ([zmq_source(0, host="0.0.0.0")], (0,), "bind wildcard"),
        ([zmq_source(0, host="*")], (0,), "bind wildcard"),
        ([zmq_source(0, host="::")], (0,), "bind wildcard"),
        ([zmq_source(0, host="")], (0,), "bind wildcard"),
        ([zmq_source(0, port=0)], (0,), "out of range"),
        ([zmq_source(0, port=70000)], (0,), "out of range"),
        ([zmq_source(0, encoding="json")], (0,), "not msgpack"),
        ([zmq_source(0, schema_version=2)], (0,), "schema_version"),
        ([zmq_source(0, protocol="ipc")], (0,), "not tcp"),
        ([zmq_source(0, endpoint=False)], (0,), "without endpoint_addr"),
        ([grpc_source(0, encoding="json")], (0,), "not protobuf"),
        ([grpc_source(0)], (0, 1), r"rank\(s\) \[1\]"),
        ([grpc_source(None)], (0, 1), "without data_parallel_rank"),
        ([grpc_source(4)], (0,), "does not serve"),
    ],
)
def test_advertised_but_unusable_sources_turn_events_off(
    sources: list[Any], ranks: tuple[int, ...], message: str
) -> None:
    with pytest.raises(UnusableSources, match=message):
        plan_sources(sources, ranks)


def test_unknown_transports_are_named() -> None:
    source = grpc_source(0)
    source.transport = "nixl"
    with pytest.raises(UnusableSources, match="'nixl' is not supported"):
        plan_sources([source], (0,))


# -- the plan and the registration --------------------------------------------------------------------------------


def test_kv_routing_mode_is_registered_only_when_events_flow() -> None:
    registration = Registration(model_path="/m", served_model_name="m", kv_block_size=None)
    off = RoutingPlan(ranks=(0,), block_size=16)
    assert off.registration(registration) is registration
    assert not off.kv_events
    on = RoutingPlan(ranks=(0,), block_size=16, sources={0: GrpcSource(0)})
    kv = on.registration(registration)
    assert (kv.router_mode, kv.kv_block_size, kv.kv_events) == ("kv", 16, True)
    assert on.grpc_ranks == (0,)
    assert "rank 0 via SubscribeKvEvents" in on.describe()
    relay = RoutingPlan(ranks=(0,), block_size=16, sources={0: ZmqSource(0, "tcp://h:1", "")})
    assert relay.zmq_sources == (ZmqSource(0, "tcp://h:1", ""),)
    assert "ZMQ listener at tcp://h:1" in relay.describe()
    assert RoutingPlan(ranks=(0,), block_size=16, total_kv_blocks=100_000).index_limit == 400_000
