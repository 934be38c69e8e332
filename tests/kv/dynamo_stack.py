"""The in-process stack of the KV tests that run Dynamo's own KV machinery: ``openengine-mock`` (subprocess), our
engine client on the edge with its routing plan, and a Dynamo worker (in-memory discovery, planes on loopback) that
answers every request with one token."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from openengine_bp.openengine.v1 import SubscribeKvEventsRequest
from sidecar.convert import Capabilities
from sidecar.dynamo import DynamoSettings, DynamoWorker, Registration, RequestContext, open_dynamo
from sidecar.edge import Edge, open_edge
from sidecar.engine import EngineClient, EngineClientConfig, open_engine_client
from sidecar.kv import RoutingConfig, RoutingPlan, discover_routing
from sidecar.kv._convert import decode_block_hash
from tests.engine.conftest import start_mock
from tests.helpers.handlers import batches_handler
from tests.helpers.stack import MODEL, MODEL_DIR


def loopback_dynamo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every Dynamo listener of this process on loopback, no host metadata, ``HOME`` in ``tmp_path``."""
    for name in ("DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_SYSTEM_HOST"):
        monkeypatch.setenv(name, "127.0.0.1")
    monkeypatch.setenv("DYN_SELF_HOST_METADATA", "0")
    monkeypatch.setenv("HOME", str(tmp_path))


@asynccontextmanager
async def engine_with_plan(
    config: RoutingConfig, *mock_flags: str
) -> AsyncIterator[tuple[Edge, EngineClient, RoutingPlan]]:
    """``openengine-mock`` with ``mock_flags``, our client to it and the routing plan it discovers (KV events on)."""
    async with (
        start_mock(*mock_flags) as mock,
        open_edge() as edge,
        open_engine_client(edge, EngineClientConfig(endpoint=mock.endpoint, connections=2)) as client,
    ):
        await client.wait_connected(trio.current_time() + 20)
        caps = Capabilities.from_discovery(await client.get_server_info(), await client.get_model_info(MODEL))
        plan = await discover_routing(client, caps, config)
        assert plan.kv_events
        yield edge, client, plan


async def _one_token(request: dict[str, Any], ctx: RequestContext) -> AsyncIterator[list[dict[str, Any]]]:
    yield [{"token_ids": [1], "finish_reason": "length"}]


@asynccontextmanager
async def registered_worker(
    edge: Edge, plan: RoutingPlan, namespace: str, context_length: int
) -> AsyncIterator[tuple[DynamoWorker, trio.Nursery]]:
    """A Dynamo worker serving and registered with ``plan``; the body runs in its nursery (cancel it to end)."""
    settings = DynamoSettings(discovery_backend="mem", namespace=namespace)
    registration = Registration(model_path=str(MODEL_DIR), served_model_name=MODEL, context_length=context_length)
    async with open_dynamo(edge, settings) as dynamo, trio.open_nursery() as nursery:
        await dynamo.serve(nursery, batches_handler(edge, _one_token))
        await dynamo.register(plan.registration(registration))
        yield dynamo, nursery


async def engine_blocks(client: EngineClient) -> set[int]:
    """The engine's registered blocks, from a snapshot subscription of our own."""
    request = SubscribeKvEventsRequest(data_parallel_ranks=[0], include_snapshot=True)
    async with client.subscribe_kv_events(request) as stream:
        async for messages in stream:
            batch = messages[0].batch
            assert batch is not None
            stored = (e.block_stored for e in batch.events if e.block_stored is not None)
            return {decode_block_hash(h) for event in stored for h in event.block_hashes}
    raise AssertionError("no snapshot")
