"""Builders of OpenEngine KV-event and load messages (betterproto2, as the sidecar's client returns them)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from openengine_bp.openengine.v1 import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineError,
    ErrorCode,
    KvBlockHash,
    KvEndpoint,
    KvEvent,
    KvEventBatch,
    KvEventSource,
    LoadInfo,
    OpaqueKeyTuple,
    RankLoadInfo,
    StorageMedium,
    SubscribeKvEventsResponse,
)

BS = 4


def h(value: int, encoding: str = "decimal_int64") -> KvBlockHash:
    return KvBlockHash(value=str(value).encode(), encoding=encoding)


def tokens_for(hashes: Sequence[int], block_size: int = BS) -> list[int]:
    """Distinct, deterministic token ids for a chain (``block_size`` per block)."""
    return [abs(x) % 1000 + i for x in hashes for i in range(block_size)]


def stored(
    hashes: Sequence[int],
    parent: int | None = None,
    *,
    tokens: Sequence[int] | None = None,
    block_size: int = BS,
    lora_id: int = 0,
    lora_name: str = "",
    medium: StorageMedium = StorageMedium.GPU,
    extra_keys: Iterable[Sequence[str]] = (),
    group_idx: int = 0,
    spec_kind: str = "",
    sliding_window: int = 0,
    encoding: str = "decimal_int64",
) -> KvEvent:
    return KvEvent(
        block_stored=BlockStored(
            block_hashes=[h(x, encoding) for x in hashes],
            parent_block_hash=None if parent is None else h(parent, encoding),
            token_ids=list(tokens_for(hashes, block_size) if tokens is None else tokens),
            block_size=block_size,
            lora_id=lora_id,
            lora_name=lora_name,
            medium=medium,
            extra_keys=[OpaqueKeyTuple(values=list(k)) for k in extra_keys],
            group_idx=group_idx,
            kv_cache_spec_kind=spec_kind,
            kv_cache_spec_sliding_window=sliding_window,
        )
    )


def removed(
    hashes: Sequence[int], *, medium: StorageMedium = StorageMedium.GPU, encoding: str = "decimal_int64"
) -> KvEvent:
    return KvEvent(block_removed=BlockRemoved(block_hashes=[h(x, encoding) for x in hashes], medium=medium))


def removed_raw(values: Sequence[tuple[bytes, str]]) -> KvEvent:
    return KvEvent(block_removed=BlockRemoved(block_hashes=[KvBlockHash(value=v, encoding=e) for v, e in values]))


def cleared() -> KvEvent:
    return KvEvent(all_blocks_cleared=AllBlocksCleared())


def batch(seq: int, *events: KvEvent, rank: int = 0, stamp: int = 0) -> SubscribeKvEventsResponse:
    return SubscribeKvEventsResponse(
        batch=KvEventBatch(
            sequence_number=seq, timestamp_unix_nanos=stamp, data_parallel_rank=rank, events=list(events)
        )
    )


def error(
    code: ErrorCode = ErrorCode.INTERNAL, *, retryable: bool = True, message: str = "boom"
) -> SubscribeKvEventsResponse:
    return SubscribeKvEventsResponse(error=EngineError(code=code, message=message, retryable=retryable))


def grpc_source(rank: int | None = 0, encoding: str = "protobuf") -> KvEventSource:
    return KvEventSource(transport="grpc", encoding=encoding, data_parallel_rank=rank)


def zmq_source(
    rank: int | None = 0,
    host: str = "127.0.0.1",
    port: int = 5557,
    *,
    encoding: str = "msgpack",
    topic: str = "",
    protocol: str = "tcp",
    schema_version: int | None = 1,
    endpoint: bool = True,
) -> KvEventSource:
    return KvEventSource(
        transport="zmq",
        encoding=encoding,
        data_parallel_rank=rank,
        topic=topic,
        schema_version=schema_version,
        endpoint_addr=KvEndpoint(host=host, port=port, protocol=protocol) if endpoint else None,
    )


def load(
    now_ns: int,
    ranks: Iterable[tuple[int | None, int | None, int | None]] = ((0, 3, 10),),
    *,
    age_s: float = 0.0,
    stamp: bool = True,
    aggregate: tuple[int | None, int | None] = (None, None),
) -> LoadInfo:
    """``ranks`` is ``(rank, used, total)`` per entry (``None`` = absent)."""
    return LoadInfo(
        instance_id="engine",
        timestamp_unix_nanos=now_ns - int(age_s * 1e9) if stamp else None,
        used_kv_blocks=aggregate[0],
        total_kv_blocks=aggregate[1],
        ranks=[RankLoadInfo(data_parallel_rank=r, used_kv_blocks=u, total_kv_blocks=t) for r, u, t in ranks],
    )
