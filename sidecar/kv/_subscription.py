"""One data-parallel rank's ``SubscribeKvEvents`` stream, forwarded to Dynamo's router, resynchronised on any doubt.

The task drives one :class:`~statemachines.KvSubscriptionLifecycle` (``statemachines/kv_subscription.py``)::

    subscribe → (first batch) synced → batches, each exactly one after the previous
              ↘ gap | repeat | EngineError | dropped | ended | wrong rank | unreadable removal
                → resync: clear-all for the rank at Dynamo, back off, subscribe again (with a snapshot if offered)

Every batch the edge delivers (several stream messages at once) becomes *one* ``publish_batch`` call: the engine's
events are validated and converted by the rank's :class:`~sidecar.kv._convert.RankIndex`, which also remembers what
Dynamo was told, so a resync can take back exactly that. Ops converted before a fault in the same delivery are
published first, so the clear that follows never names a block Dynamo has not seen.

Snapshots. The v0.1.0 schema has no capability flag for them: the first subscription asks
(``include_snapshot=true``); an engine that refuses (``UNIMPLEMENTED``/``INVALID_ARGUMENT``/``FAILED_PRECONDITION``/
``OUT_OF_RANGE`` before any batch, or an in-band ``UNSUPPORTED_FEATURE``/``INVALID_ARGUMENT`` error) is asked without
from then on. Without a snapshot the rank starts empty after a resync and fills as blocks are stored again: the
router's view is then a subset of the truth (a missed hit), never a superset (a wrong hit). An engine that refuses
``SubscribeKvEvents`` itself (``UNIMPLEMENTED`` without a snapshot request) ends the rank in ``failed``.

Nothing here can take the worker down: a bug in this task fails the rank (logged with the traceback), and only
cancellation (the worker stopping) propagates.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING, Final

import trio

from openengine_bp.openengine.v1 import ErrorCode, SubscribeKvEventsRequest
from sidecar.convert.enums import bp_enum
from sidecar.errors import EngineRpcError, GrpcCode
from statemachines import KvSubscriptionLifecycle

from . import _metrics as m
from ._convert import NeedsResync, RankIndex, RemovedBlocks, StoredBlocks

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

    from openengine_bp.openengine.v1 import SubscribeKvEventsResponse

    from ._config import RoutingConfig
    from ._convert import PublishOp
    from ._types import KvPublisher, RoutingClient

__all__ = ["RankSubscription", "dynamo_events"]

log: Final = logging.getLogger("sidecar.kv")

#: Statuses that, answered to a subscription asking for a snapshot before any batch, mean "not with a snapshot".
_SNAPSHOT_REFUSALS: Final = frozenset(
    {GrpcCode.UNIMPLEMENTED, GrpcCode.INVALID_ARGUMENT, GrpcCode.FAILED_PRECONDITION, GrpcCode.OUT_OF_RANGE}
)
_SNAPSHOT_REFUSAL_ERRORS: Final = frozenset({ErrorCode.UNSUPPORTED_FEATURE, ErrorCode.INVALID_ARGUMENT})


class _Resync(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Fatal(Exception):
    pass


def dynamo_events(ops: Sequence[PublishOp]) -> list[dict[str, Any]]:
    """Publish ops as Dynamo's ``publish_batch`` input (``KvStoredEventInput`` / ``KvRemovedEventInput``)."""
    events: list[dict[str, Any]] = []
    for op in ops:
        if isinstance(op, StoredBlocks):
            event: dict[str, Any] = {
                "type": "stored",
                "token_ids": list(op.token_ids),
                "num_block_tokens": [op.block_size] * len(op.block_hashes),
                "block_hashes": list(op.block_hashes),
                "parent_hash": op.parent_hash,
            }
            if op.lora_name is not None:
                event["lora_name"] = op.lora_name
            events.append(event)
        else:
            events.append({"type": "removed", "block_hashes": list(op.block_hashes)})
    return events


class RankSubscription:
    """The KV event subscription of one rank. ``await run()`` until cancelled (or the rank fails).

    ``synced`` is set once a subscription has delivered its first batch; ``resynced`` counts resyncs.
    """

    def __init__(
        self,
        client: RoutingClient,
        sink: KvPublisher,
        rank: int,
        block_size: int,
        config: RoutingConfig,
        *,
        index_limit: int = 1 << 16,
    ) -> None:
        self.client = client
        self.sink = sink
        self.rank = rank
        self.config = config
        self.lifecycle = KvSubscriptionLifecycle(rank)
        self.index = RankIndex(rank, block_size, limit=index_limit)
        self.snapshot = config.snapshot
        self.synced = trio.Event()
        self.resynced = 0
        self._skipped_seen: dict[str, int] = {}

    async def run(self) -> None:
        life = self.lifecycle
        backoff = self.config.resync_backoff_s
        try:
            while True:
                life.fire("subscribe", reason="with snapshot" if self.snapshot else "without snapshot")
                began = trio.current_time()
                try:
                    await self._stream()
                    raise _Resync("ended", "the stream ended without an error (subscriptions never end by themselves)")
                except _Resync as resync:
                    reason, message = resync.reason, str(resync)
                except EngineRpcError as exc:
                    reason, message = self._rpc_failure(exc)
                streamed = life.state == "streaming" and trio.current_time() - began >= self.config.healthy_stream_s
                await self._resync(reason, message)
                if streamed:
                    backoff = self.config.resync_backoff_s
                await trio.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(max(backoff, 0.001) * 2, self.config.resync_backoff_max_s)
        except _Fatal as fatal:
            await self._fail(str(fatal))
        except trio.Cancelled:
            life.fire("stop", reason="worker stopping")
            raise
        except Exception as exc:  # a bug must not take the worker down with it
            log.exception("KV events rank %d: subscription task failed", self.rank)
            await self._fail(f"{type(exc).__name__}: {exc}")

    # -- one subscription ---------------------------------------------------------------------------------------

    async def _stream(self) -> None:
        life = self.lifecycle
        request = SubscribeKvEventsRequest(data_parallel_ranks=[self.rank], include_snapshot=self.snapshot)
        expected: int | None = None
        async with self.client.subscribe_kv_events(request) as stream:
            async for messages in stream:
                ops: list[PublishOp] = []
                stamps: list[int] = []
                try:
                    for message in messages:
                        expected = self._check(message, expected)
                        batch = message.batch
                        assert batch is not None
                        if life.state == "subscribing":
                            life.fire("synced", reason=f"first batch #{batch.sequence_number}")
                            self.synced.set()
                        for event in batch.events:
                            try:
                                ops.extend(self.index.apply(event))
                            except NeedsResync as exc:
                                raise _Resync(exc.reason, str(exc)) from None
                        if batch.timestamp_unix_nanos:
                            stamps.append(batch.timestamp_unix_nanos)
                finally:
                    # What was converted before a fault is published first: the index already counts it as told.
                    await self._publish(ops, stamps)

    def _check(self, message: SubscribeKvEventsResponse, expected: int | None) -> int:
        """The sequence number the next batch must carry; raises :class:`_Resync` when ``message`` breaks the run."""
        if message.error is not None:
            error = message.error
            code = bp_enum(error.code)
            if expected is None and self.snapshot and code in _SNAPSHOT_REFUSAL_ERRORS:
                self.snapshot = False
                raise _Resync("snapshot_refused", f"the engine refused a snapshot: {code.name}: {error.message}")
            raise _Resync("engine_error", f"EngineError {code.name} (retryable={error.retryable}): {error.message}")
        batch = message.batch
        if batch is None:
            raise _Resync("unreadable", "a subscription message with neither a batch nor an error")
        if batch.data_parallel_rank != self.rank:
            raise _Resync("wrong_rank", f"a batch for rank {batch.data_parallel_rank} on rank {self.rank}'s stream")
        seq = batch.sequence_number
        if expected is not None and seq != expected:
            if seq < expected:
                raise _Resync("repeat", f"batch #{seq} repeats (expected #{expected})")
            raise _Resync("gap", f"batch #{seq} after #{expected - 1}: {seq - expected} batch(es) missing")
        return seq + 1

    def _rpc_failure(self, exc: EngineRpcError) -> tuple[str, str]:
        if self.lifecycle.state == "subscribing" and exc.code in _SNAPSHOT_REFUSALS:
            if self.snapshot:
                self.snapshot = False
                return "snapshot_refused", f"the engine refused a snapshot: {exc}"
            if exc.code is GrpcCode.UNIMPLEMENTED:
                raise _Fatal(f"the engine advertises a gRPC KV event source but does not implement it: {exc}")
        return "dropped", str(exc)

    async def _publish(self, ops: list[PublishOp], stamps: list[int]) -> None:
        if ops:
            await self.sink.publish(dynamo_events(ops))
            for op in ops:
                kind = "stored" if isinstance(op, StoredBlocks) else "removed"
                m.KV_EVENTS_FORWARDED.labels(kind=kind).inc(len(op.block_hashes))
        if stamps:
            now = time.time_ns()
            for stamp in stamps:
                m.KV_EVENT_LAG.observe(max(0, now - stamp) / 1e9)
        m.KV_BLOCKS_PUBLISHED.labels(rank=str(self.rank)).set(len(self.index))
        for reason, count in self.index.skipped.items():
            seen = self._skipped_seen.get(reason, 0)
            if count > seen:
                m.KV_EVENTS_SKIPPED.labels(reason=reason).inc(count - seen)
                if not seen:
                    log.warning("KV events rank %d: not forwarding events that fail the %r rule", self.rank, reason)
                self._skipped_seen[reason] = count

    # -- resync and failure -------------------------------------------------------------------------------------

    async def _clear(self) -> int:
        ops = self.index.clear()
        cleared = sum(len(op.block_hashes) for op in ops if isinstance(op, RemovedBlocks))
        if ops:
            await self.sink.publish(dynamo_events(ops))
            m.KV_EVENTS_FORWARDED.labels(kind="cleared").inc(cleared)
        m.KV_BLOCKS_PUBLISHED.labels(rank=str(self.rank)).set(0)
        return cleared

    async def _resync(self, reason: str, message: str) -> None:
        self.lifecycle.fire("resync", reason=f"{reason}: {message}")
        self.resynced += 1
        m.KV_EVENT_RESYNCS.labels(reason=reason).inc()
        cleared = await self._clear()
        log.warning(
            "KV events rank %d: resynchronising (%s: %s); cleared %d block(s) at Dynamo's router",
            self.rank,
            reason,
            message,
            cleared,
        )

    async def _fail(self, reason: str) -> None:
        self.lifecycle.fire("fail", reason=reason)
        log.error("KV events rank %d: no more events are forwarded: %s", self.rank, reason)
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            try:
                await self._clear()
            except Exception:
                log.exception("KV events rank %d: clearing the published blocks failed", self.rank)
