"""Pure checks and conversions behind the routing signals: load snapshots, KV event sources, KV events.

Nothing here does I/O or imports trio, asyncio, grpclib or ``dynamo``: every rule is a function of its inputs and is
tested by tables (``tests/kv/test_convert.py``). The rules, and why each exists, are listed in ``docs/kv-events.md``.

Block hashes. Dynamo's ``KvEventPublisher`` takes block ids as **signed** 64-bit integers (an unsigned one raises
``ValueError: expected i64``). OpenEngine carries each id as a ``KvBlockHash{value: bytes, encoding: str}``; the
encodings understood here are ``decimal_int64`` (ASCII decimal of a signed 64-bit integer, what ``openengine-mock``
sends) and ``decimal_uint64`` (ASCII decimal of an unsigned one, folded to signed two's complement). Both must be in
canonical form (no sign on zero, no ``+``, no leading zeros, no spaces) so one block has exactly one spelling. The ids
are identities only: Dynamo's router matches requests by hashing the *token ids* of each block itself, so an id
only has to be stable and unique per block.

A rank's index. :class:`RankIndex` remembers which block ids this worker has told Dynamo about for one rank. It is
what makes a resync possible without a "cleared" call (Dynamo 1.6.1's Python publisher has none): a clear-all is a
``removed`` of every id still attributed. It also keeps Dynamo's tree consistent: a stored block whose parent Dynamo
never heard of (stored before the subscription, or skipped as invalid) is not forwarded, since the router cannot place
it; a removal of a block Dynamo never heard of is dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import TYPE_CHECKING, Final

from openengine_bp.openengine.v1 import StorageMedium
from sidecar.convert.enums import bp_enum

if TYPE_CHECKING:
    from collections.abc import Sequence

    from openengine_bp.openengine.v1 import (
        BlockRemoved,
        BlockStored,
        KvBlockHash,
        KvEvent,
        KvEventSource,
        LoadInfo,
    )

__all__ = [
    "HASH_ENCODINGS",
    "I64_MAX",
    "I64_MIN",
    "GrpcSource",
    "InvalidLoad",
    "KvSource",
    "NeedsResync",
    "RankIndex",
    "RankLoad",
    "RemovedBlocks",
    "StoredBlocks",
    "UnusableSources",
    "ZmqSource",
    "check_load",
    "decode_block_hash",
    "plan_sources",
    "to_signed64",
]

I64_MIN: Final = -(2**63)
I64_MAX: Final = 2**63 - 1
_U64_MAX: Final = 2**64 - 1

HASH_ENCODINGS: Final = ("decimal_int64", "decimal_uint64")
_CANONICAL_DECIMAL: Final = re.compile(rb"(?:0|-?[1-9][0-9]{0,19})")
#: Media whose blocks Dynamo's router models: device memory (or not said). Offloaded copies are not routed on.
_ROUTED_MEDIA: Final = frozenset({StorageMedium.UNSPECIFIED, StorageMedium.GPU})
#: ``BlockStored.kv_cache_spec_kind`` values that are plain full-attention blocks (vLLM's name, or none given).
_FULL_ATTENTION: Final = frozenset({"", "full_attention"})
#: ZMQ hosts that are bind wildcards, never connectable (wire §7.7).
_WILDCARD_HOSTS: Final = frozenset({"", "*", "0.0.0.0", "::", "[::]"})


def to_signed64(value: int) -> int:
    """An unsigned 64-bit id as Dynamo's signed i64 (two's complement); raises ``ValueError`` outside u64."""
    if not 0 <= value <= _U64_MAX:
        raise ValueError(f"{value} is not an unsigned 64-bit integer")
    return value - 2**64 if value > I64_MAX else value


# -- KV events ----------------------------------------------------------------------------------------------------


class NeedsResync(Exception):
    """The rank's stream can no longer be trusted; ``reason`` is a short label (metrics, logs)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Skip(Exception):
    """One event is not forwarded; ``reason`` labels the skip counter."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def decode_block_hash(block_hash: KvBlockHash) -> int:
    """A ``KvBlockHash`` as Dynamo's signed 64-bit block id; raises ``ValueError`` naming what is wrong."""
    encoding = block_hash.encoding
    value = block_hash.value
    if encoding not in HASH_ENCODINGS:
        raise ValueError(f"unsupported block hash encoding {encoding!r} (supported: {', '.join(HASH_ENCODINGS)})")
    if _CANONICAL_DECIMAL.fullmatch(value) is None:
        raise ValueError(f"{encoding} block hash {value[:32]!r} is not a canonical decimal integer")
    number = int(value)
    if encoding == "decimal_int64":
        if not I64_MIN <= number <= I64_MAX:
            raise ValueError(f"decimal_int64 block hash {number} is outside the signed 64-bit range")
        return number
    if number < 0 or number > _U64_MAX:
        raise ValueError(f"decimal_uint64 block hash {number} is outside the unsigned 64-bit range")
    return to_signed64(number)


@dataclasses.dataclass(frozen=True, slots=True)
class StoredBlocks:
    """A chain of full blocks to publish as stored: ``block_hashes[i]`` holds ``token_ids[i*bs:(i+1)*bs]``."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class RemovedBlocks:
    """Block ids to publish as removed."""

    block_hashes: tuple[int, ...]


PublishOp = StoredBlocks | RemovedBlocks


class RankIndex:
    """The block ids one rank has published to Dynamo, and the rules that turn engine events into publish ops.

    :meth:`apply` converts one ``KvEvent`` and updates the index; :meth:`clear` empties it and returns the ops that
    take every published block back. ``skipped`` counts events (or parts) not forwarded, by reason. ``limit`` bounds
    the index: an engine that stores without ever removing would otherwise grow it forever.
    """

    __slots__ = ("_attributed", "block_size", "limit", "rank", "skipped")

    def __init__(self, rank: int, block_size: int, *, limit: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.rank = rank
        self.block_size = block_size
        self.limit = limit
        # An insertion-ordered set: a clear removes children after their parents were stored, oldest first.
        self._attributed: dict[int, None] = {}
        self.skipped: collections.Counter[str] = collections.Counter()

    def __len__(self) -> int:
        return len(self._attributed)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._attributed

    @property
    def attributed(self) -> frozenset[int]:
        """Every block id currently published as stored for this rank."""
        return frozenset(self._attributed)

    def clear(self) -> list[PublishOp]:
        """Forget everything; the ops that make Dynamo forget it too (nothing when nothing was published)."""
        if not self._attributed:
            return []
        ids = tuple(self._attributed)
        self._attributed.clear()
        return [RemovedBlocks(ids)]

    def apply(self, event: KvEvent) -> list[PublishOp]:
        """The publish ops for one engine event (possibly none); raises :class:`NeedsResync`.

        A stored event that breaks a rule is skipped (counted in :attr:`skipped`): leaving a block out only costs a
        cache hit. A removal that cannot be read raises :class:`NeedsResync`: some published block may be gone, and
        which one is unknown.
        """
        try:
            if event.block_stored is not None:
                return self._stored(event.block_stored)
            if event.block_removed is not None:
                return self._removed(event.block_removed)
            if event.all_blocks_cleared is not None:
                return self.clear()
            raise _Skip("unknown_event", "a KV event of a kind this build does not know")
        except _Skip as skip:
            self.skipped[skip.reason] += 1
            return []

    def _stored(self, stored: BlockStored) -> list[PublishOp]:
        if bp_enum(stored.medium) not in _ROUTED_MEDIA:
            raise _Skip("other_medium", f"blocks stored on {bp_enum(stored.medium).name}")
        if stored.group_idx != 0:
            raise _Skip("other_group", f"blocks of KV cache group {stored.group_idx}")
        if stored.kv_cache_spec_kind not in _FULL_ATTENTION or stored.kv_cache_spec_sliding_window != 0:
            raise _Skip("unsupported_spec", f"KV cache spec {stored.kv_cache_spec_kind!r}")
        if stored.extra_keys:
            raise _Skip("extra_keys", "blocks with extra keys (multimodal) cannot be routed on by token ids alone")
        if not stored.block_hashes:
            raise _Skip("no_hashes", "BlockStored without block hashes")
        if stored.block_size != self.block_size:
            raise _Skip(
                "block_size", f"BlockStored.block_size {stored.block_size} is not the engine's {self.block_size}"
            )
        count = len(stored.block_hashes)
        if len(stored.token_ids) != count * self.block_size:
            raise _Skip(
                "token_count", f"{len(stored.token_ids)} token ids for {count} block(s) of {self.block_size} tokens"
            )
        if stored.lora_id < 0 or (stored.lora_id != 0 and not stored.lora_name):
            raise _Skip("lora_identity", f"lora_id {stored.lora_id} without a LoRA name")
        try:
            ids = tuple(decode_block_hash(h) for h in stored.block_hashes)
            parent = None if stored.parent_block_hash is None else decode_block_hash(stored.parent_block_hash)
        except ValueError as exc:
            raise _Skip("hash_encoding", str(exc)) from None
        if len(set(ids)) != count or (parent is not None and parent in ids):
            raise _Skip("duplicate_hash", "a block id repeats within one BlockStored chain")
        if parent is not None and parent not in self._attributed:
            raise _Skip("orphan", f"parent block {parent} was never published for rank {self.rank}")
        if len(self._attributed) + count > self.limit:
            raise NeedsResync("overflow", f"rank {self.rank} would attribute more than {self.limit} blocks")
        for block_id in ids:
            self._attributed[block_id] = None
        return [
            StoredBlocks(
                block_hashes=ids,
                parent_hash=parent,
                token_ids=tuple(stored.token_ids),
                block_size=self.block_size,
                lora_name=stored.lora_name or None,
            )
        ]

    def _removed(self, removed: BlockRemoved) -> list[PublishOp]:
        if bp_enum(removed.medium) not in _ROUTED_MEDIA:
            raise _Skip("other_medium", f"blocks removed from {bp_enum(removed.medium).name}")
        if removed.group_idx != 0:
            raise _Skip("other_group", f"blocks of KV cache group {removed.group_idx}")
        if not removed.block_hashes:
            raise _Skip("no_hashes", "BlockRemoved without block hashes")
        try:
            ids = [decode_block_hash(h) for h in removed.block_hashes]
        except ValueError as exc:
            raise NeedsResync("invalid_removal", f"unreadable BlockRemoved: {exc}") from None
        known = tuple(block_id for block_id in dict.fromkeys(ids) if block_id in self._attributed)
        if len(known) < len(ids):
            self.skipped["unknown_removed"] += len(ids) - len(known)
        for block_id in known:
            del self._attributed[block_id]
        return [RemovedBlocks(known)] if known else []


# -- load snapshots -----------------------------------------------------------------------------------------------


class InvalidLoad(ValueError):
    """A ``GetLoad`` snapshot that must not be published; ``reason`` labels the rejection counter."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True, slots=True)
class RankLoad:
    """KV usage of one data-parallel rank, checked."""

    rank: int
    used_blocks: int
    total_blocks: int


def check_load(
    load: LoadInfo, ranks: Sequence[int], *, now_ns: int, max_age_ns: int, max_future_ns: int
) -> list[RankLoad]:
    """The per-rank KV usage of ``load`` for the ``ranks`` this worker serves, or :class:`InvalidLoad`.

    A snapshot is refused whole when its timestamp is older than ``max_age_ns`` or ahead of ``now_ns`` by more than
    ``max_future_ns``, when a served rank is missing (or listed twice, or listed without its number), or when a rank
    lacks ``used_kv_blocks``/``total_kv_blocks``, reports ``total_kv_blocks = 0`` or ``used > total``. Ranks the engine
    lists beyond ours are ignored. A single-rank worker may read the aggregate when the engine lists no ranks.
    """
    stamp = load.timestamp_unix_nanos
    if stamp is not None and stamp != 0:
        if now_ns - stamp > max_age_ns:
            raise InvalidLoad("too_old", f"load snapshot is {(now_ns - stamp) / 1e9:.1f}s old")
        if stamp - now_ns > max_future_ns:
            raise InvalidLoad("from_future", f"load snapshot is {(stamp - now_ns) / 1e9:.1f}s in the future")
    listed: dict[int, tuple[int | None, int | None]] = {}
    for entry in load.ranks:
        if entry.data_parallel_rank is None:
            raise InvalidLoad("rank_without_id", "a per-rank load entry has no data_parallel_rank")
        if entry.data_parallel_rank in listed:
            raise InvalidLoad("duplicate_rank", f"rank {entry.data_parallel_rank} is listed twice")
        listed[entry.data_parallel_rank] = (entry.used_kv_blocks, entry.total_kv_blocks)
    if not listed and len(ranks) == 1:
        listed[ranks[0]] = (load.used_kv_blocks, load.total_kv_blocks)
    result: list[RankLoad] = []
    for rank in ranks:
        if rank not in listed:
            raise InvalidLoad("missing_rank", f"rank {rank} is missing from the load snapshot")
        used, total = listed[rank]
        if used is None:
            raise InvalidLoad("no_kv_usage", f"rank {rank} reports no used_kv_blocks")
        if not total:
            raise InvalidLoad("no_kv_total", f"rank {rank} reports no (or zero) total_kv_blocks")
        if used > total:
            raise InvalidLoad("used_over_total", f"rank {rank} reports {used} used of {total} KV blocks")
        result.append(RankLoad(rank, used, total))
    return result


# -- KV event sources ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class GrpcSource:
    """Events of ``rank`` come over ``Control.SubscribeKvEvents`` (this sidecar forwards them)."""

    rank: int


@dataclasses.dataclass(frozen=True, slots=True)
class ZmqSource:
    """Events of ``rank`` come from the engine's ZMQ publisher; Dynamo's own listener subscribes to ``endpoint``."""

    rank: int
    endpoint: str
    topic: str


KvSource = GrpcSource | ZmqSource


class UnusableSources(ValueError):
    """The engine advertises KV event sources but not a usable one for every rank: KV routing stays off."""


def _zmq_endpoint(source: KvEventSource) -> str:
    if source.encoding != "msgpack":
        raise ValueError(f"ZMQ source encoding {source.encoding!r} is not msgpack")
    if source.schema_version not in (None, 1):
        raise ValueError(f"ZMQ source schema_version {source.schema_version} is not 1")
    addr = source.endpoint_addr
    if addr is None:
        raise ValueError("ZMQ source without endpoint_addr")
    host = addr.host.strip()
    if host in _WILDCARD_HOSTS:
        raise ValueError(f"ZMQ source host {addr.host!r} is a bind wildcard, not a connectable address")
    if not 0 < addr.port <= 65535:
        raise ValueError(f"ZMQ source port {addr.port} is out of range")
    if addr.protocol not in ("", "tcp"):
        raise ValueError(f"ZMQ source protocol {addr.protocol!r} is not tcp")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{addr.port}"


def plan_sources(sources: Sequence[KvEventSource], ranks: Sequence[int]) -> tuple[dict[int, KvSource], list[str]]:
    """One usable source per served rank, preferring ``SubscribeKvEvents`` over ZMQ (wire §7.7); plus warnings.

    Returns ``({}, [])`` when the engine advertises nothing (events off). Raises :class:`UnusableSources` when it
    advertises sources but some served rank has none that works: half a cache view would bias routing.
    A source without ``data_parallel_rank`` belongs to the only rank of a single-rank worker.
    """
    if not sources:
        return {}, []
    served = set(ranks)
    warnings: list[str] = []
    grpc: dict[int, GrpcSource] = {}
    zmq: dict[int, ZmqSource] = {}
    for source in sources:
        rank = source.data_parallel_rank
        if rank is None:
            if len(ranks) != 1:
                warnings.append(f"ignoring a {source.transport!r} KV event source without data_parallel_rank")
                continue
            rank = ranks[0]
        if rank not in served:
            warnings.append(f"ignoring a KV event source for rank {rank}, which this worker does not serve")
            continue
        if source.transport == "grpc":
            if source.encoding not in ("", "protobuf"):
                warnings.append(f"rank {rank}: gRPC source encoding {source.encoding!r} is not protobuf")
                continue
            if rank in grpc:
                warnings.append(f"rank {rank}: duplicate gRPC KV event source ignored")
            grpc[rank] = GrpcSource(rank)
        elif source.transport == "zmq":
            try:
                endpoint = _zmq_endpoint(source)
            except ValueError as exc:
                warnings.append(f"rank {rank}: {exc}")
                continue
            if rank in zmq:
                warnings.append(f"rank {rank}: duplicate ZMQ KV event source ignored")
                continue
            zmq[rank] = ZmqSource(rank, endpoint, source.topic)
        else:
            warnings.append(f"rank {rank}: KV event transport {source.transport!r} is not supported")
    plan: dict[int, KvSource] = {}
    missing: list[int] = []
    for rank in ranks:
        chosen: KvSource | None = grpc.get(rank) or zmq.get(rank)
        if chosen is None:
            missing.append(rank)
        else:
            plan[rank] = chosen
    if missing:
        detail = "; ".join(warnings) or "no source listed"
        raise UnusableSources(f"no usable KV event source for rank(s) {missing}: {detail}")
    return plan, warnings
