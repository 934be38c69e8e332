"""A scripted engine client, recording publishers that behave like Dynamo's router index, and a model engine."""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from openengine_bp.openengine.v1 import (
    GetKvEventSourcesResponse,
    KvEventSource,
    LoadInfo,
    SubscribeKvEventsRequest,
    SubscribeKvEventsResponse,
)
from sidecar.errors import EngineRpcError, GrpcCode
from sidecar.kv import KvPublisher, LoadPublisher, ZmqSource

from .factories import batch, cleared, removed, stored

HANG = "hang"
#: One step of a scripted stream: a delivery (list of messages), an exception to raise, or HANG (never ends).
Step = list[SubscribeKvEventsResponse] | BaseException | str


class FakeClient:
    """``subscribe_kv_events`` plays one script per call (then hangs); ``get_load``/``get_kv_event_sources`` answer
    from queues (an exception instance is raised)."""

    def __init__(self, *scripts: Sequence[Step]) -> None:
        self.scripts: collections.deque[Sequence[Step]] = collections.deque(scripts)
        self.requests: list[SubscribeKvEventsRequest] = []
        self.loads: collections.deque[LoadInfo | BaseException] = collections.deque()
        self.load_calls = 0
        self.sources: GetKvEventSourcesResponse | BaseException = GetKvEventSourcesResponse()
        self.subscribed = trio.Event()

    async def get_load(self, include_per_rank: bool = False, *, timeout_s: float | None = None) -> LoadInfo:
        self.load_calls += 1
        await trio.lowlevel.checkpoint()
        answer = self.loads.popleft() if len(self.loads) > 1 else self.loads[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def get_kv_event_sources(
        self, ranks: Sequence[int] = (), *, timeout_s: float | None = None
    ) -> GetKvEventSourcesResponse:
        await trio.lowlevel.checkpoint()
        if isinstance(self.sources, BaseException):
            raise self.sources
        return self.sources

    def set_sources(self, *sources: KvEventSource) -> None:
        self.sources = GetKvEventSourcesResponse(sources=list(sources))

    @asynccontextmanager
    async def subscribe_kv_events(
        self, request: SubscribeKvEventsRequest, *, timeout_s: float | None = None
    ) -> AsyncIterator[AsyncIterator[list[SubscribeKvEventsResponse]]]:
        self.requests.append(request)
        self.subscribed.set()
        script = self.scripts.popleft() if self.scripts else [HANG]
        yield self._play(script)

    @staticmethod
    async def _play(script: Sequence[Step]) -> AsyncIterator[list[SubscribeKvEventsResponse]]:
        for step in script:
            await trio.lowlevel.checkpoint()
            if isinstance(step, BaseException):
                raise step
            if isinstance(step, str):
                await trio.sleep_forever()
            else:
                yield list(step)


def rpc_error(code: GrpcCode, details: str = "") -> EngineRpcError:
    return EngineRpcError("SubscribeKvEvents", code, details)


@dataclass
class DynamoView:
    """What Dynamo's router index would hold for one worker rank, with the complaints Dynamo would log."""

    blocks: dict[int, int | None] = field(default_factory=dict)
    calls: list[list[dict[str, Any]]] = field(default_factory=list)
    unknown_removed: int = 0
    unknown_parent: int = 0
    closed: bool = False
    lora_names: list[str | None] = field(default_factory=list)

    async def publish(self, events: Sequence[dict[str, Any]]) -> None:
        await trio.lowlevel.checkpoint()
        self.calls.append(list(events))
        for event in events:
            if event["type"] == "stored":
                parent = event["parent_hash"]
                if parent is not None and parent not in self.blocks:
                    self.unknown_parent += 1
                    continue
                assert len(event["token_ids"]) == sum(event["num_block_tokens"])
                self.lora_names.append(event.get("lora_name"))
                for block_id in event["block_hashes"]:
                    assert -(2**63) <= block_id < 2**63
                    self.blocks[block_id] = parent
                    parent = block_id
            else:
                for block_id in event["block_hashes"]:
                    if self.blocks.pop(block_id, "missing") == "missing":
                        self.unknown_removed += 1

    async def close(self) -> None:
        self.closed = True


@dataclass
class RecordingLoad:
    figures: list[list[tuple[int, int]]] = field(default_factory=list)

    async def publish(self, figures: Sequence[tuple[int, int]]) -> None:
        await trio.lowlevel.checkpoint()
        self.figures.append(list(figures))


@dataclass
class RecordingPublishers:
    """A :class:`sidecar.kv.PublisherFactory` of :class:`DynamoView` per rank."""

    views: dict[int, DynamoView] = field(default_factory=dict)
    relays: dict[int, ZmqSource] = field(default_factory=dict)
    load_sink: RecordingLoad = field(default_factory=RecordingLoad)

    async def kv(self, rank: int, block_size: int, relay: ZmqSource | None) -> KvPublisher:
        if relay is not None:
            self.relays[rank] = relay
        view = self.views[rank] = DynamoView()
        return view

    async def load(self) -> LoadPublisher:
        return self.load_sink


class ModelEngine:
    """The truth: an engine's registered blocks, producing consistent batches and snapshots."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.blocks: dict[int, int | None] = {}
        self.seq = 0

    def store(self, ids: Sequence[int], parent: int | None = None) -> SubscribeKvEventsResponse:
        for block_id in ids:
            self.blocks[block_id] = parent
            parent = block_id
        self.seq += 1
        return batch(self.seq, stored(ids, self.blocks[ids[0]]), rank=self.rank)

    def remove(self, ids: Sequence[int]) -> SubscribeKvEventsResponse:
        for block_id in ids:
            del self.blocks[block_id]
        self.seq += 1
        return batch(self.seq, removed(ids), rank=self.rank)

    def snapshot(self) -> SubscribeKvEventsResponse:
        events = [cleared()]
        for block_id, parent in self.blocks.items():
            events.append(stored([block_id], parent))
        return batch(self.seq, *events, rank=self.rank)
