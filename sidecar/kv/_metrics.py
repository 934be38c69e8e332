"""Metrics of the routing signals, registered in the sidecar's one registry (:data:`sidecar.ops.metrics.REGISTRY`).

``sidecar.ops.metrics`` already defines the KV event lag histogram and the resync counter; the rest lives here so
the operator-surface module is not edited for every feature. Label values come from fixed sets (reasons, event
kinds, the worker's data-parallel ranks).
"""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Gauge

from sidecar.ops.metrics import KV_EVENT_LAG, KV_EVENT_RESYNCS, PREFIX, REGISTRY

__all__ = [
    "KV_BLOCKS_PUBLISHED",
    "KV_EVENTS_FORWARDED",
    "KV_EVENTS_SKIPPED",
    "KV_EVENT_LAG",
    "KV_EVENT_RESYNCS",
    "LOAD_FRESH",
    "LOAD_PUBLISHED",
    "LOAD_REJECTED",
    "RANK_KV_BLOCKS",
]

LOAD_PUBLISHED: Final = Counter(
    f"{PREFIX}_load_snapshots_published",
    "GetLoad snapshots whose per-rank KV usage was published to Dynamo's router",
    registry=REGISTRY,
)
LOAD_REJECTED: Final = Counter(
    f"{PREFIX}_load_snapshots_rejected",
    "GetLoad polls that published nothing, by reason (too_old, from_future, missing_rank, duplicate_rank, "
    "rank_without_id, no_kv_usage, no_kv_total, used_over_total, rpc_failed)",
    ["reason"],
    registry=REGISTRY,
)
LOAD_FRESH: Final = Gauge(
    f"{PREFIX}_load_fresh",
    "1 while the last GetLoad poll was published to Dynamo; 0 while load is unknown (nothing stale is published)",
    registry=REGISTRY,
)
RANK_KV_BLOCKS: Final = Gauge(
    f"{PREFIX}_engine_kv_blocks",
    "The engine's KV blocks per data-parallel rank from the last published GetLoad (kind=used|total)",
    ["rank", "kind"],
    registry=REGISTRY,
)
KV_EVENTS_FORWARDED: Final = Counter(
    f"{PREFIX}_kv_blocks_forwarded",
    "KV cache blocks forwarded to Dynamo's router, by kind (stored, removed, cleared = removed by a clear-all)",
    ["kind"],
    registry=REGISTRY,
)
KV_EVENTS_SKIPPED: Final = Counter(
    f"{PREFIX}_kv_events_skipped",
    "Engine KV events (or blocks) not forwarded, by rule (block_size, token_count, hash_encoding, orphan, ...)",
    ["reason"],
    registry=REGISTRY,
)
KV_BLOCKS_PUBLISHED: Final = Gauge(
    f"{PREFIX}_kv_blocks_attributed",
    "KV cache blocks this worker currently attributes to each data-parallel rank at Dynamo's router",
    ["rank"],
    registry=REGISTRY,
)

LOAD_FRESH.set(0)
for _kind in ("stored", "removed", "cleared"):
    KV_EVENTS_FORWARDED.labels(kind=_kind)
