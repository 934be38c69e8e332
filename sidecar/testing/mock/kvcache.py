"""The mock's KV block pool: fixed-size blocks, chained block hashes, prefix reuse, LRU eviction.

Theory of operation
-------------------
A sequence's tokens live in blocks of ``block_size`` tokens. A *full* block is identified by a chained hash over its
parent block's hash and its own token ids (plus a namespace for LoRA / cache salt), so two requests whose prompts share
a prefix share the hashes of the full blocks of that prefix. Every block is in exactly one of three places:

* **free** — empty, never registered (or reset): handed out first;
* **in use** — ``ref_count > 0``: pinned by one or more requests (shared prefix blocks have several references);
* **evictable** — registered (hashed, reusable) but unreferenced: kept in LRU order and reused by a later prefix hit,
  or evicted when the free list is empty: the oldest block **that no registered block names as its parent**.

Eviction works from the leaves, as TensorRT-LLM's KV cache manager does (a block of its radix tree is evictable only
while no child references it): a parent is never removed before its children, so a consumer that keeps the blocks as
a tree (Dynamo's radix-tree indexer) never sees a removal for a block it already dropped with its parent. A request
that computes a block already registered (the same prompt and seed again, or two identical prompts in flight) shares
the registered block — pinned like a prefix hit — instead of keeping a copy, so the parent of its next blocks cannot
be evicted under it either.

Admission follows TensorRT-LLM's default ``GUARANTEED_NO_EVICT`` policy: a request is admitted only when every block
it could ever need (prompt + ``max_tokens`` for each output) can be *reserved*; afterwards it takes physical blocks from
its reservation as its sequence grows, so a running request never waits for blocks and the pool never deadlocks. The
unused rest of the reservation is returned when the request ends.

Every registration and eviction is reported as a :class:`BlockStored` / :class:`BlockRemoved` event to subscribers and
kept in a bounded in-process log; :meth:`BlockPool.snapshot` lists what is registered now. ``kvevents.py`` turns them
into the ``SubscribeKvEvents`` stream.

Block hash (``BLOCK_HASH_ALGO = "mock-blake2b64-v1"``): ``blake2b(digest_size=8)`` over
``parent (8 bytes, little-endian signed; 8 zero bytes for the first block) || len(namespace) (4 bytes LE) ||
namespace (UTF-8 "lora_name\\0cache_salt", empty when both are unset) || token ids (uint32 LE each)``, read back as a
little-endian **signed int64**.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import struct
from collections.abc import Callable, Sequence

__all__ = [
    "BLOCK_HASH_ALGO",
    "Allocation",
    "Block",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "KvEvent",
    "block_hash",
    "block_namespace",
    "prompt_block_hashes",
]

BLOCK_HASH_ALGO = "mock-blake2b64-v1"
_NO_PARENT = bytes(8)


def block_namespace(lora_name: str | None, cache_salt: str | None) -> bytes:
    """The hash namespace of a request: empty for the base model without a cache salt."""
    if not lora_name and not cache_salt:
        return b""
    return f"{lora_name or ''}\0{cache_salt or ''}".encode()


def block_hash(parent: int | None, token_ids: Sequence[int], namespace: bytes = b"") -> int:
    """The chained 64-bit hash of one full block (see the module docstring for the exact byte layout)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(_NO_PARENT if parent is None else parent.to_bytes(8, "little", signed=True))
    h.update(len(namespace).to_bytes(4, "little"))
    h.update(namespace)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest(), "little", signed=True)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, namespace: bytes = b"") -> list[int]:
    """Hashes of the full blocks of ``token_ids``, chained from the first block."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size], namespace)
        hashes.append(parent)
    return hashes


@dataclasses.dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block became reusable (registered under ``block_hash``)."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A registered block was evicted; its hash no longer matches."""

    block_hash: int


KvEvent = BlockStored | BlockRemoved


@dataclasses.dataclass(slots=True, eq=False)
class Block:
    """One physical block. ``block_hash`` is set while the block is registered (reusable)."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    lora_name: str | None = None


class Allocation:
    """The blocks one request holds: pinned prefix hits, blocks taken from its reservation, and the rest reserved."""

    __slots__ = ("_pool", "blocks", "cached_blocks", "reserved")

    def __init__(self, pool: BlockPool, hits: list[Block], reserved: int) -> None:
        self._pool = pool
        self.blocks: list[Block] = list(hits)
        self.cached_blocks = len(hits)
        self.reserved = reserved

    def take(self) -> Block:
        """A fresh block for this request (from its reservation)."""
        return self._pool._take(self)

    def release(self) -> None:
        """Give every block and the unused reservation back (idempotent)."""
        self._pool._release(self)


class BlockPool:
    """A fixed pool of ``total_blocks`` blocks of ``block_size`` tokens with prefix caching."""

    def __init__(self, total_blocks: int, block_size: int, *, event_log_size: int = 10_000) -> None:
        if total_blocks <= 0 or block_size <= 0:
            raise ValueError("total_blocks and block_size must be positive")
        self.total_blocks = total_blocks
        self.block_size = block_size
        self._blocks = [Block(i) for i in range(total_blocks)]
        self._free: collections.deque[Block] = collections.deque(self._blocks)
        self._evictable: collections.OrderedDict[int, Block] = collections.OrderedDict()  # block_id → block, LRU first
        self._by_hash: dict[int, Block] = {}
        # parent hash → hashes of its registered children: a block with children is not evictable.
        self._children: dict[int, set[int]] = {}
        # block_id → the allocation holding it (blocks taken from a reservation), for sharing a duplicate.
        self._holder: dict[int, Allocation] = {}
        self._reserved = 0
        self._listeners: list[Callable[[KvEvent], None]] = []
        #: The most recent events, oldest first (bounded); a KV-event stream can replay from here.
        self.event_log: collections.deque[KvEvent] = collections.deque(maxlen=event_log_size)

    # -- observation -------------------------------------------------------------------------------------------------

    @property
    def used_blocks(self) -> int:
        """Blocks pinned by requests (``ref_count > 0``)."""
        return self.total_blocks - len(self._free) - len(self._evictable)

    @property
    def cached_blocks(self) -> int:
        """Registered blocks (in use or evictable)."""
        return len(self._by_hash)

    @property
    def available_blocks(self) -> int:
        """Blocks a new admission may still reserve."""
        return len(self._free) + len(self._evictable) - self._reserved

    def snapshot(self) -> list[BlockStored]:
        """Every registered block as a :class:`BlockStored`, each parent before its children (a KV-event snapshot).

        A block whose parent is not registered (a parent registered after it, which eviction from the leaves never
        allows, or none) starts a chain of its own; its ``parent_hash`` still names that parent, exactly as its live
        ``BlockStored`` did.
        """
        children: dict[int | None, list[Block]] = collections.defaultdict(list)
        for block in self._by_hash.values():
            parent = block.parent_hash if block.parent_hash in self._by_hash else None
            children[parent].append(block)
        ordered: list[BlockStored] = []
        stack = list(reversed(children.get(None, [])))
        while stack:
            block = stack.pop()
            assert block.block_hash is not None
            ordered.append(
                BlockStored(block.block_hash, block.parent_hash, block.token_ids, self.block_size, block.lora_name)
            )
            stack.extend(reversed(children.get(block.block_hash, [])))
        return ordered

    def subscribe(self, listener: Callable[[KvEvent], None]) -> Callable[[], None]:
        """Call ``listener(event)`` for every future event (synchronously); returns an unsubscribe function."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    # -- admission ---------------------------------------------------------------------------------------------------

    def match_prefix(self, hashes: Sequence[int]) -> list[Block]:
        """The registered blocks matching the longest prefix of ``hashes`` (nothing is pinned)."""
        hits: list[Block] = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def try_admit(self, hashes: Sequence[int], blocks_needed: int) -> Allocation | None:
        """Pin the prefix hits of ``hashes`` and reserve the remaining ``blocks_needed``, or ``None`` if it can't fit.

        ``blocks_needed`` counts every block the request may hold, hits included.
        """
        hits = self.match_prefix(hashes)
        new_blocks = max(0, blocks_needed - len(hits))
        evictable_hits = sum(1 for b in hits if b.ref_count == 0)
        if new_blocks + evictable_hits > self.available_blocks:
            return None
        for block in hits:
            if block.ref_count == 0:
                del self._evictable[block.block_id]
            block.ref_count += 1
        self._reserved += new_blocks
        return Allocation(self, hits, new_blocks)

    def register(
        self,
        block: Block,
        block_hash_: int,
        parent_hash: int | None,
        token_ids: Sequence[int],
        lora_name: str | None = None,
    ) -> bool:
        """Make a full block reusable under ``block_hash_``; ``False`` if that hash is already registered.

        In that case a request holding ``block`` shares the registered block instead (see the module docstring).
        """
        if block.block_hash is not None:
            return False
        existing = self._by_hash.get(block_hash_)
        if existing is not None:
            holder = self._holder.get(block.block_id)
            if holder is not None:
                self._share(holder, block, existing)
            return False
        block.block_hash = block_hash_
        block.parent_hash = parent_hash
        block.token_ids = tuple(token_ids)
        block.lora_name = lora_name
        self._by_hash[block_hash_] = block
        if parent_hash is not None and parent_hash in self._by_hash:
            self._children.setdefault(parent_hash, set()).add(block_hash_)
        self._emit(BlockStored(block_hash_, parent_hash, block.token_ids, self.block_size, lora_name))
        return True

    # -- internals ---------------------------------------------------------------------------------------------------

    def _take(self, alloc: Allocation) -> Block:
        if alloc.reserved > 0:
            alloc.reserved -= 1
            self._reserved -= 1
        elif self.available_blocks <= 0:
            raise RuntimeError("KV block pool exhausted beyond the reservation")
        block = self._free.popleft() if self._free else self._evict()
        block.ref_count = 1
        alloc.blocks.append(block)
        self._holder[block.block_id] = alloc
        return block

    def _evict(self) -> Block:
        """Unregister and return the least recently used evictable block that is a leaf (has no registered child).

        There always is one: a request pins its whole chain, so an evictable block's children are evictable too.
        """
        for block_id, block in self._evictable.items():
            if block.block_hash not in self._children:
                del self._evictable[block_id]
                self._unregister(block, announce=True)
                return block
        raise RuntimeError("no evictable leaf block although blocks are evictable")

    def _share(self, alloc: Allocation, copy: Block, registered: Block) -> None:
        """``alloc`` computed ``copy``, a duplicate of ``registered``: hold (pin) ``registered`` in its place."""
        index = len(alloc.blocks) - 1 - alloc.blocks[::-1].index(copy)
        alloc.blocks[index] = registered
        if registered.ref_count == 0:
            del self._evictable[registered.block_id]
        registered.ref_count += 1
        del self._holder[copy.block_id]
        copy.ref_count = 0
        self._reset(copy)
        self._free.append(copy)

    def _release(self, alloc: Allocation) -> None:
        self._reserved -= alloc.reserved
        alloc.reserved = 0
        # Tail blocks first, so the LRU evicts a sequence's tail before its (more shareable) head.
        for block in reversed(alloc.blocks):
            if self._holder.get(block.block_id) is alloc:
                del self._holder[block.block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.block_hash is not None:
                self._evictable[block.block_id] = block
            else:
                self._reset(block)
                self._free.append(block)
        alloc.blocks.clear()

    def _unregister(self, block: Block, *, announce: bool) -> None:
        if block.block_hash is not None:
            del self._by_hash[block.block_hash]
            self._children.pop(block.block_hash, None)
            siblings = self._children.get(block.parent_hash) if block.parent_hash is not None else None
            if siblings is not None:
                siblings.discard(block.block_hash)
                if not siblings:
                    del self._children[block.parent_hash]  # type: ignore[arg-type]
            if announce:
                self._emit(BlockRemoved(block.block_hash))
        self._reset(block)

    @staticmethod
    def _reset(block: Block) -> None:
        block.block_hash = None
        block.parent_hash = None
        block.token_ids = ()
        block.lora_name = None

    def _emit(self, event: KvEvent) -> None:
        self.event_log.append(event)
        for listener in tuple(self._listeners):
            listener(event)
