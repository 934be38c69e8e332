"""Resync against the real thing: ``openengine-mock`` (subprocess) → routing signals → Dynamo's ``KvEventPublisher``
→ Dynamo's own ``KvRouter`` index, all real, in one process (in-memory discovery, ZMQ event plane on loopback).

For each ``--kv-fault`` the mock breaks the batch that carries an eviction (#4: with 12 KV blocks the third request
evicts the first request's tail block). Without the resync the router would keep that block: a stale hit. After the
resync, the router's view of every prompt must equal the engine's own (read from a fresh snapshot subscription).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.dynamo import DynamoWorker
from sidecar.edge import Edge
from sidecar.engine import EngineClient
from sidecar.kv import RoutingConfig, RoutingSignals, run_routing_signals
from sidecar.testing.mock.kvcache import prompt_block_hashes
from tests.helpers.waits import WaitTimeout, wait_until

from .dynamo_stack import engine_blocks, engine_with_plan, loopback_dynamo, registered_worker
from .mock_traffic import BS, generate, prompt

CONFIG = RoutingConfig(resync_backoff_s=0.05, load_poll_interval_s=0.2)


async def _new_router(endpoint: Any) -> Any:
    from dynamo.llm import KvRouter, KvRouterConfig

    return KvRouter(endpoint, BS, KvRouterConfig())


async def _overlap(router: Any, tokens: list[int]) -> int:
    scores = await router.get_overlap_scores(tokens)
    return sum(int(w["device_blocks"]) for w in scores["workers"])


async def _dump(router: Any) -> str:
    text: str = await router.dump_events()
    return text


@dataclass
class Setup:
    edge: Edge
    client: EngineClient
    dynamo: DynamoWorker
    router: Any
    signals: RoutingSignals

    async def router_hits(self, tokens: list[int]) -> int:
        return await self.edge.run(_overlap, self.router, tokens)

    async def router_blocks(self) -> int:
        events = json.loads(await self.edge.run(_dump, self.router))
        return sum(len(e["event"]["data"]["stored"]["blocks"]) for e in events if "stored" in e["event"]["data"])

    async def engine_blocks(self) -> set[int]:
        return await engine_blocks(self.client)


@asynccontextmanager
async def setup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *mock_flags: str) -> AsyncIterator[Setup]:
    loopback_dynamo(monkeypatch, tmp_path)
    flags = ("--profile", "full", "--total-kv-blocks", "12", *mock_flags)
    async with engine_with_plan(CONFIG, *flags) as (edge, client, plan):
        namespace = f"kvview{id(tmp_path) % 100000}"
        async with registered_worker(edge, plan, namespace, context_length=2048) as (dynamo, nursery):
            router = await edge.run(_new_router, dynamo._endpoint)
            # The router finds the worker and its event publisher. Still a synchronisation by time: Dynamo's
            # KvRouter does not say when it has; a lost event would show as a router behind the engine below.
            await trio.sleep(0.5)
            signals = await nursery.start(run_routing_signals, client, dynamo, plan, CONFIG)
            yield Setup(edge, client, dynamo, router, signals)
            nursery.cancel_scope.cancel()


def engine_hits(tokens: list[int], registered: set[int]) -> int:
    hits = 0
    for block_hash in prompt_block_hashes(tokens, BS):
        if block_hash not in registered:
            break
        hits += 1
    return hits


async def settle(s: Setup, prompts: list[list[int]]) -> tuple[list[int], list[int]]:
    """Wait (bounded) until the router agrees with the engine on every prompt; return both views."""
    expected: list[int] = []
    seen: list[int] = []

    async def agree() -> bool:
        nonlocal expected, seen
        registered = await s.engine_blocks()
        expected = [engine_hits(p, registered) for p in prompts]
        seen = [await s.router_hits(p) for p in prompts]
        return seen == expected and await s.router_blocks() == len(registered)

    with suppress(WaitTimeout):  # the caller compares the two views and says how they differ
        await wait_until(agree, timeout=10, interval=0.1)
    return expected, seen


async def test_the_router_sees_what_the_engine_caches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with trio.fail_after(90):
        async with setup(monkeypatch, tmp_path) as s:
            prompts = [prompt(i) for i in range(3)]
            await generate(s.client, "r0", prompts[0])
            expected, seen = await settle(s, prompts[:1])
            assert expected == seen == [4]
            for i in (1, 2):
                await generate(s.client, f"r{i}", prompts[i])
            expected, seen = await settle(s, prompts)
            assert seen == expected
            assert expected[0] < 4, "the third request evicted a block of the first"
            assert s.signals.subscriptions[0].resynced == 0


def scenario() -> list[list[int]]:
    """r0, r1, r2 fill the 12-block pool; r2's decode evicts r0's tail block: batch #4 is that removal. r3 reuses
    r0's first three blocks and stores a new fourth (batch #5), touching nothing else the test looks at."""
    prompts = [prompt(i) for i in range(3)]
    return [*prompts, prompts[0][: 3 * BS] + prompt(7)[:BS]]


@pytest.mark.parametrize(
    ("kind", "batch"),
    [("gap", 4), ("gap", 2), ("repeat", 4), ("drop", 4), ("error", 4), ("eof", 4)],
    ids=["gap-removal", "gap-stores", "repeat", "drop", "error", "eof"],
)
async def test_after_each_fault_no_stale_block_stays_attributed(
    kind: str, batch: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with trio.fail_after(90):
        async with setup(monkeypatch, tmp_path, "--kv-fault", f"{kind}@{batch}") as s:
            sub = s.signals.subscriptions[0]
            prompts = scenario()
            for i, tokens in enumerate(prompts):
                await generate(s.client, f"r{i}", tokens)
                await trio.sleep(0.05)  # not a synchronisation: the requests' pace, one event batch each
            await wait_until(lambda: sub.resynced >= 1 and sub.lifecycle.state == "streaming", timeout=10)
            expected, seen = await settle(s, prompts)
            assert seen == expected, f"router {seen} vs engine {expected} after a {kind} resync"
            assert expected[0] == 3, "r0's tail block was evicted: a router still counting 4 would be stale"
            assert await s.router_blocks() == len(await s.engine_blocks())
            assert sub.resynced == 1


async def test_a_zmq_source_is_relayed_by_dynamos_own_listener(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--kv-events zmq``: the engine advertises a msgpack ZMQ publisher; Dynamo's listener subscribes to it itself
    (nothing passes through the sidecar) and the router sees the engine's cache all the same."""
    with trio.fail_after(90):
        async with setup(monkeypatch, tmp_path, "--kv-events", "zmq", "--total-kv-blocks", "4096") as s:
            assert s.signals.subscriptions == {}, "no SubscribeKvEvents for a ZMQ rank"
            [relay] = s.signals.relays.values()
            assert getattr(relay, "relay", "").startswith("tcp://127.0.0.1:")
            # ZMQ is PUB/SUB: what is published before Dynamo's listener has subscribed is lost. Probe until a
            # fresh prompt shows up at the router, then check the real ones.
            with trio.fail_after(20):
                for probe in range(100, 1000):
                    await generate(s.client, f"probe{probe}", prompt(probe))
                    # Not a synchronisation: each probe's time to arrive; a probe ZMQ lost is expected, the next goes.
                    await trio.sleep(0.2)
                    if await s.router_hits(prompt(probe)) == 4:
                        break
            prompts = [prompt(i) for i in range(3)]
            for i, tokens in enumerate(prompts):
                await generate(s.client, f"r{i}", tokens)

            async def all_seen() -> bool:
                return [await s.router_hits(p) for p in prompts] == [4, 4, 4]

            with suppress(WaitTimeout):  # the assert below says what the router saw
                await wait_until(all_seen, timeout=10, interval=0.05)
            assert [await s.router_hits(p) for p in prompts] == [4, 4, 4]
            assert await s.router_hits(prompt(999)) == 0
