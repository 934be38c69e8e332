"""The mock's KV event stream: the block pool's events as sequence-numbered batches, snapshots, replay and faults.

Theory of operation
-------------------
The block pool (``kvcache.py``) reports every registration and eviction synchronously. :class:`KvEventFeed` collects
them and, once per event-loop iteration (``loop.call_soon``), turns what accumulated into one ``KvEventBatch`` for
DP rank 0 with the next ``sequence_number`` (the first batch is #1) and ``timestamp_unix_nanos``. Consecutive
``BlockStored`` events that extend one chain (same LoRA, each block's parent the previous block) are merged into one
event carrying several hashes, as vLLM and TensorRT-LLM do; consecutive removals are merged too. Hashes travel as
``KvBlockHash{value: decimal text, encoding: "decimal_int64"}``.

A subscription (``SubscribeKvEvents``) gets every batch flushed after it joined, in order, through its own queue:

* ``include_snapshot=true``: pending events are flushed first, then the subscription starts with one snapshot batch
  carrying the sequence number of the last batch flushed (0 before the first): ``AllBlocksCleared`` followed by
  ``BlockStored`` for every registered block, parents first. Live batches then continue at that number + 1.
* ``start_sequence_number = N > 0``: replay batches ``N…`` from the bounded batch log, then live ones
  (``OUT_OF_RANGE`` when ``N`` is no longer, or not yet, in the log).
* A subscriber that falls more than :data:`QUEUE_LIMIT` batches behind gets ``EngineError(OVERLOADED, retryable)``.

Faults (``--kv-fault KIND@N``, each fires once, when batch ``#N`` is flushed, for every subscription open then):
``gap`` — batch N is not delivered (the subscriber sees N−1 then N+1); ``repeat`` — delivered twice; ``drop`` — the
stream ends with status UNAVAILABLE instead of batch N; ``error`` — a final ``EngineError(INTERNAL, retryable=true)``
then OK; ``eof`` — the stream ends with OK and no error. Batch N stays in the replay log either way.

ZMQ (``--kv-events zmq``, as TensorRT-LLM's newer builds and vLLM publish): the same batches also go out on a ZeroMQ
PUB socket (``zmtp.py``) as the three frames ``[topic, sequence (8 bytes big-endian), msgpack([timestamp, [event,
…], dp_rank])]``, each event a map ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
"block_size"[, "lora_name"]}`` / ``{"type": "BlockRemoved", "block_hashes"}`` (vLLM's wire format, as Dynamo's own
``ZmqKvEventPublisher`` writes it). ``gap`` and ``repeat`` apply there too.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Literal, get_args

from grpclib.const import Status

from openengine.v1 import error_pb2, kv_pb2

from .kvcache import BlockPool, BlockStored, KvEvent
from .validate import Rejection
from .zmtp import ZmtpPublisher

__all__ = [
    "HASH_ENCODING",
    "KV_FAULTS",
    "QUEUE_LIMIT",
    "KvEventFeed",
    "KvFault",
    "Subscription",
    "encode_hash",
    "to_batch_events",
    "vllm_payload",
]

log = logging.getLogger("openengine_mock")

HASH_ENCODING = "decimal_int64"
KvFault = Literal["gap", "repeat", "drop", "error", "eof"]
KV_FAULTS: tuple[str, ...] = get_args(KvFault)
#: Batches a subscription may fall behind before it is ended with OVERLOADED.
QUEUE_LIMIT = 10_000

#: What a subscription's queue carries: a batch to send, or how the stream ends.
Item = kv_pb2.KvEventBatch | Literal["drop", "error", "eof", "overloaded"]


def encode_hash(value: int) -> kv_pb2.KvBlockHash:
    """A signed 64-bit block hash in the ``decimal_int64`` encoding."""
    return kv_pb2.KvBlockHash(value=str(value).encode("ascii"), encoding=HASH_ENCODING)


def to_batch_events(events: Iterable[KvEvent], lora_id_of: Callable[[str], int] = lambda _: 0) -> list[kv_pb2.KvEvent]:
    """Pool events as wire ``KvEvent``s, merging chain-extending stores and consecutive removals."""
    out: list[kv_pb2.KvEvent] = []
    last_stored: BlockStored | None = None
    for event in events:
        previous = out[-1] if out else None
        if isinstance(event, BlockStored):
            if (
                previous is not None
                and previous.HasField("block_stored")
                and last_stored is not None
                and event.parent_hash == last_stored.block_hash
                and event.lora_name == last_stored.lora_name
            ):
                stored = previous.block_stored
            else:
                wire = kv_pb2.KvEvent()
                out.append(wire)
                stored = wire.block_stored
                stored.block_size = event.block_size
                stored.medium = kv_pb2.STORAGE_MEDIUM_GPU
                if event.parent_hash is not None:
                    stored.parent_block_hash.CopyFrom(encode_hash(event.parent_hash))
                if event.lora_name:
                    stored.lora_name = event.lora_name
                    stored.lora_id = lora_id_of(event.lora_name)
            stored.block_hashes.append(encode_hash(event.block_hash))
            stored.token_ids.extend(event.token_ids)
            last_stored = event
        else:
            last_stored = None
            if previous is not None and previous.HasField("block_removed"):
                removed = previous.block_removed
            else:
                wire = kv_pb2.KvEvent()
                out.append(wire)
                removed = wire.block_removed
                removed.medium = kv_pb2.STORAGE_MEDIUM_GPU
            removed.block_hashes.append(encode_hash(event.block_hash))
    return out


def _decimal(block_hash: kv_pb2.KvBlockHash) -> int:
    return int(block_hash.value)


def vllm_payload(batch: kv_pb2.KvEventBatch) -> bytes:
    """One batch in vLLM's ZMQ wire format: msgpack of ``[timestamp_s, [event map, …], dp_rank]``."""
    import msgspec  # the frontend's dependency; only --kv-events zmq needs it here

    events: list[dict[str, object]] = []
    for event in batch.events:
        if event.HasField("block_stored"):
            stored = event.block_stored
            item: dict[str, object] = {
                "type": "BlockStored",
                "block_hashes": [_decimal(h) for h in stored.block_hashes],
                "parent_block_hash": _decimal(stored.parent_block_hash)
                if stored.HasField("parent_block_hash")
                else None,
                "token_ids": list(stored.token_ids),
                "block_size": stored.block_size,
            }
            if stored.lora_name:
                item["lora_name"] = stored.lora_name
            events.append(item)
        elif event.HasField("block_removed"):
            events.append(
                {"type": "BlockRemoved", "block_hashes": [_decimal(h) for h in event.block_removed.block_hashes]}
            )
        elif event.HasField("all_blocks_cleared"):
            events.append({"type": "AllBlocksCleared"})
    payload: bytes = msgspec.msgpack.encode([batch.timestamp_unix_nanos / 1e9, events, batch.data_parallel_rank])
    return payload


@dataclasses.dataclass(eq=False)
class Subscription:
    """One open ``SubscribeKvEvents`` stream: a queue of batches (and at most one way of ending)."""

    queue: asyncio.Queue[Item] = dataclasses.field(default_factory=asyncio.Queue)
    closed: bool = False

    def put(self, item: Item) -> None:
        if self.closed:
            return
        if self.queue.qsize() >= QUEUE_LIMIT:
            self.closed = True
            self.queue.put_nowait("overloaded")
            return
        self.queue.put_nowait(item)
        if not isinstance(item, kv_pb2.KvEventBatch):
            self.closed = True

    async def get(self) -> Item:
        return await self.queue.get()


class KvEventFeed:
    """The mock's single KV event source (DP rank 0) over ``pool``."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        faults: Mapping[int, KvFault] | Iterable[tuple[int, KvFault]] = (),
        log_size: int = 1024,
        lora_id_of: Callable[[str], int] = lambda _: 0,
        rank: int = 0,
        enabled: bool = True,
    ) -> None:
        self.pool = pool
        self.rank = rank
        #: The ZeroMQ publisher of ``--kv-events zmq`` (started by :meth:`start_zmq`), and its topic.
        self.zmq: ZmtpPublisher | None = None
        self.zmq_topic = "kv"
        self.next_seq = 1
        self.batches: collections.deque[kv_pb2.KvEventBatch] = collections.deque(maxlen=log_size)
        self.faults: dict[int, KvFault] = dict(faults)
        self.subscriptions: set[Subscription] = set()
        self._lora_id_of = lora_id_of
        self._pending: list[KvEvent] = []
        self._scheduled = False
        if enabled:  # an engine without KV events (--kv-events disabled|unimplemented) does no work for them
            pool.subscribe(self._on_event)

    # -- producing ---------------------------------------------------------------------------------------------------

    def _on_event(self, event: KvEvent) -> None:
        self._pending.append(event)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> kv_pb2.KvEventBatch | None:
        """Turn the pending events into the next batch and deliver it (idempotent when nothing is pending)."""
        self._scheduled = False
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        batch = kv_pb2.KvEventBatch(
            sequence_number=self.next_seq, timestamp_unix_nanos=time.time_ns(), data_parallel_rank=self.rank
        )
        batch.events.extend(to_batch_events(pending, self._lora_id_of))
        self.next_seq += 1
        self.batches.append(batch)
        fault = self.faults.pop(batch.sequence_number, None)
        if fault is not None:
            log.warning(
                "KV events: injecting %r at batch #%d (%d subscriber(s))",
                fault,
                batch.sequence_number,
                len(self.subscriptions),
            )
        if self.zmq is not None and fault != "gap":
            frames = [self.zmq_topic.encode(), batch.sequence_number.to_bytes(8, "big"), vllm_payload(batch)]
            for _ in range(2 if fault == "repeat" else 1):
                self.zmq.publish(frames)
        for sub in tuple(self.subscriptions):
            if fault == "gap":
                continue
            if fault == "drop" or fault == "error" or fault == "eof":
                sub.put(fault)
                continue
            sub.put(batch)
            if fault == "repeat":
                sub.put(batch)
        return batch

    def snapshot(self) -> kv_pb2.KvEventBatch:
        """What is registered now, as one batch numbered like the last one flushed (pending events flushed first)."""
        self.flush()
        batch = kv_pb2.KvEventBatch(
            sequence_number=self.next_seq - 1, timestamp_unix_nanos=time.time_ns(), data_parallel_rank=self.rank
        )
        batch.events.add().all_blocks_cleared.SetInParent()
        batch.events.extend(to_batch_events(self.pool.snapshot(), self._lora_id_of))
        return batch

    # -- subscribing -------------------------------------------------------------------------------------------------

    def sources(self, request: kv_pb2.GetKvEventSourcesRequest) -> kv_pb2.GetKvEventSourcesResponse:
        """``GetKvEventSources``: one gRPC source for rank 0 (an unknown rank → INVALID_ARGUMENT)."""
        self._check_ranks(request.data_parallel_ranks)
        response = kv_pb2.GetKvEventSourcesResponse()
        source = response.sources.add(transport="grpc", encoding="protobuf", data_parallel_rank=self.rank)
        source.schema_version = 1
        return response

    async def start_zmq(self, host: str) -> None:
        """Start the ZeroMQ publisher (idempotent)."""
        if self.zmq is None:
            publisher = ZmtpPublisher()
            await publisher.start(host, 0)
            self.zmq = publisher

    def zmq_sources(self, request: kv_pb2.GetKvEventSourcesRequest) -> kv_pb2.GetKvEventSourcesResponse:
        """``GetKvEventSources`` of ``--kv-events zmq``: one msgpack publisher for rank 0 (after :meth:`start_zmq`)."""
        assert self.zmq is not None
        self._check_ranks(request.data_parallel_ranks)
        response = kv_pb2.GetKvEventSourcesResponse()
        source = response.sources.add(
            transport="zmq", encoding="msgpack", topic=self.zmq_topic, data_parallel_rank=self.rank
        )
        source.endpoint_addr.host = self.zmq.host
        source.endpoint_addr.port = self.zmq.port
        source.endpoint_addr.protocol = "tcp"
        source.schema_version = 1
        return response

    def subscribe(self, request: kv_pb2.SubscribeKvEventsRequest) -> Subscription:
        """Open a subscription (raises :class:`Rejection` with the status to answer)."""
        self._check_ranks(request.data_parallel_ranks)
        start = request.start_sequence_number
        if start and request.include_snapshot:
            raise Rejection(Status.INVALID_ARGUMENT, "include_snapshot and start_sequence_number exclude each other")
        sub = Subscription()
        if request.include_snapshot:
            sub.put(self.snapshot())
        elif start:
            self.flush()
            oldest = self.batches[0].sequence_number if self.batches else self.next_seq
            if not oldest <= start <= self.next_seq:
                raise Rejection(
                    Status.OUT_OF_RANGE,
                    f"start_sequence_number {start} is not replayable (held: {oldest}..{self.next_seq - 1})",
                )
            for batch in self.batches:
                if batch.sequence_number >= start:
                    sub.put(batch)
        self.subscriptions.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        sub.closed = True
        self.subscriptions.discard(sub)

    def _check_ranks(self, ranks: Iterable[int]) -> None:
        unknown = sorted(set(ranks) - {self.rank})
        if unknown:
            raise Rejection(Status.INVALID_ARGUMENT, f"unknown data-parallel rank(s) {unknown} (this engine has 0)")

    # -- serving one stream ------------------------------------------------------------------------------------------

    @staticmethod
    def response(item: Item) -> kv_pb2.SubscribeKvEventsResponse | None:
        """The message for ``item`` (``None`` = end with OK); raises ``Rejection`` for a dropped stream."""
        if isinstance(item, kv_pb2.KvEventBatch):
            return kv_pb2.SubscribeKvEventsResponse(batch=item)
        if item == "drop":
            raise Rejection(Status.UNAVAILABLE, "openengine-mock: KV event stream dropped (--kv-fault drop)")
        if item == "eof":
            return None
        if item == "overloaded":
            error = error_pb2.EngineError(
                code=error_pb2.ERROR_CODE_OVERLOADED, message="KV event subscriber too slow", retryable=True
            )
        else:
            error = error_pb2.EngineError(
                code=error_pb2.ERROR_CODE_INTERNAL, message="openengine-mock: injected KV event error", retryable=True
            )
        return kv_pb2.SubscribeKvEventsResponse(error=error)
