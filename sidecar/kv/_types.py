"""What the routing signals need from the engine client and from Dynamo, as protocols (tests pass fakes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence
    from contextlib import AbstractAsyncContextManager

    from openengine_bp.openengine.v1 import (
        GetKvEventSourcesResponse,
        LoadInfo,
        SubscribeKvEventsRequest,
        SubscribeKvEventsResponse,
    )

    from ._convert import ZmqSource

__all__ = ["KvPublisher", "LoadPublisher", "PublisherFactory", "RoutingClient"]


class RoutingClient(Protocol):
    """The part of :class:`sidecar.engine.EngineClient` the routing signals use."""

    async def get_load(self, include_per_rank: bool = ..., *, timeout_s: float | None = ...) -> LoadInfo: ...

    async def get_kv_event_sources(
        self, ranks: Sequence[int] = ..., *, timeout_s: float | None = ...
    ) -> GetKvEventSourcesResponse: ...

    def subscribe_kv_events(
        self, request: SubscribeKvEventsRequest, *, timeout_s: float | None = ...
    ) -> AbstractAsyncContextManager[AsyncIterator[list[SubscribeKvEventsResponse]]]: ...


class KvPublisher(Protocol):
    """One rank's KV event publisher (:class:`sidecar.dynamo.KvEventSink`)."""

    async def publish(self, events: Sequence[dict[str, Any]]) -> None: ...

    async def close(self) -> None: ...


class LoadPublisher(Protocol):
    """The worker's load publisher (:class:`sidecar.dynamo.LoadSink`)."""

    async def publish(self, figures: Sequence[tuple[int, int]]) -> None: ...


class PublisherFactory(Protocol):
    """Creates the publishers (Dynamo's, or a test's recording ones)."""

    async def kv(self, rank: int, block_size: int, relay: ZmqSource | None) -> KvPublisher: ...

    async def load(self) -> LoadPublisher: ...
