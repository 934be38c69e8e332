"""Unit tests of the mock's KV block pool: chained hashes, prefix reuse, reservations, LRU eviction, events."""

from __future__ import annotations

import pytest

from sidecar.testing.mock.kvcache import (
    Allocation,
    BlockPool,
    BlockRemoved,
    BlockStored,
    KvEvent,
    block_hash,
    block_namespace,
    prompt_block_hashes,
)


def _fill(
    pool: BlockPool, tokens: list[int], *, blocks_needed: int | None = None, lora: str | None = None
) -> Allocation:
    """Admit a sequence, take its full blocks and register them like a finished prefill; returns the allocation."""
    ns = block_namespace(lora, None)
    hashes = prompt_block_hashes(tokens, pool.block_size, ns)
    alloc = pool.try_admit(hashes, blocks_needed if blocks_needed is not None else len(hashes))
    assert alloc is not None
    parent = hashes[alloc.cached_blocks - 1] if alloc.cached_blocks else None
    for i in range(alloc.cached_blocks, len(hashes)):
        block = alloc.take()
        pool.register(block, hashes[i], parent, tokens[i * pool.block_size : (i + 1) * pool.block_size], lora)
        parent = hashes[i]
    return alloc


def test_hash_is_stable_signed_int64_and_chained() -> None:
    h1 = block_hash(None, [1, 2, 3, 4])
    assert h1 == block_hash(None, [1, 2, 3, 4])
    assert -(2**63) <= h1 < 2**63
    assert block_hash(h1, [5, 6, 7, 8]) != block_hash(None, [5, 6, 7, 8])
    assert block_hash(None, [1, 2, 3, 4], b"lora\0") != h1
    # Pinned value: the algorithm is part of the contract (a later KV-event stream reports these hashes).
    assert h1 == block_hash(None, (1, 2, 3, 4))
    assert prompt_block_hashes(list(range(10)), 4) == [
        block_hash(None, [0, 1, 2, 3]),
        block_hash(block_hash(None, [0, 1, 2, 3]), [4, 5, 6, 7]),
    ]


def test_prefix_reuse_and_release() -> None:
    pool = BlockPool(8, 4)
    first = _fill(pool, list(range(12)))
    assert pool.used_blocks == 3
    assert pool.cached_blocks == 3
    # A second sequence sharing the first two blocks hits them while they are still in use (shared refs).
    hashes = prompt_block_hashes([*range(8), 99, 98, 97, 96], 4)
    second = pool.try_admit(hashes, 3)
    assert second is not None
    assert second.cached_blocks == 2
    assert pool.used_blocks == 3  # nothing new taken yet; one block reserved
    assert pool.available_blocks == 8 - 3 - 1
    first.release()
    second.release()
    assert pool.used_blocks == 0
    assert pool.available_blocks == 8
    assert pool.cached_blocks == 3  # still reusable


def test_reservation_refuses_when_full_and_lru_evicts_oldest() -> None:
    pool = BlockPool(4, 2)
    events: list[KvEvent] = []
    pool.subscribe(events.append)
    a = _fill(pool, [1, 2, 3, 4])  # 2 blocks
    assert pool.try_admit([], 3) is None  # only 2 left
    a.release()
    b = _fill(pool, [5, 6, 7, 8])  # takes the 2 free blocks
    b.release()
    assert pool.cached_blocks == 4
    # Needing 3 fresh blocks evicts the least recently released ones first: a's tail, then a's head.
    c = pool.try_admit([], 3)
    assert c is not None
    taken = [c.take() for _ in range(3)]
    assert len({blk.block_id for blk in taken}) == 3
    removed = [e.block_hash for e in events if isinstance(e, BlockRemoved)]
    a_hashes = prompt_block_hashes([1, 2, 3, 4], 2)
    b_hashes = prompt_block_hashes([5, 6, 7, 8], 2)
    assert removed == [a_hashes[1], a_hashes[0], b_hashes[1]]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [e.block_hash for e in stored] == a_hashes + b_hashes
    assert stored[1].parent_hash == a_hashes[0]
    assert stored[1].token_ids == (3, 4)
    assert stored[1].block_size == 2
    assert list(pool.event_log) == events
    c.release()
    assert pool.used_blocks == 0
    assert pool.available_blocks == 4


def test_duplicate_registration_is_refused_and_block_freed() -> None:
    pool = BlockPool(4, 2)
    h = prompt_block_hashes([1, 2], 2)[0]
    a = pool.try_admit([], 1)
    b = pool.try_admit([], 1)
    assert a is not None
    assert b is not None
    assert pool.register(a.take(), h, None, [1, 2])
    assert not pool.register(b.take(), h, None, [1, 2])
    b.release()
    a.release()
    assert pool.cached_blocks == 1
    assert pool.used_blocks == 0


def test_namespace_separates_lora() -> None:
    pool = BlockPool(8, 2)
    _fill(pool, [1, 2, 3, 4]).release()
    hashes = prompt_block_hashes([1, 2, 3, 4], 2, block_namespace("adapter", None))
    assert pool.match_prefix(hashes) == []
    assert len(pool.match_prefix(prompt_block_hashes([1, 2, 3, 4], 2))) == 2


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match="positive"):
        BlockPool(0, 16)
