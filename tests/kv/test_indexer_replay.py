"""Replay of issue 16 item 2 against Dynamo's real radix-tree indexer (the worker-local one ``KvEventPublisher``
keeps for router recovery): ``openengine-mock`` (subprocess) → routing signals → Dynamo's ``KvEventPublisher`` with
its local indexer, in this process. The indexer logs ``Failed to find block to remove`` on stderr for every removal
of a block it does not hold; this test counts those lines (pytest's ``capfd``) and requires none.

The repro: one prompt and seed twice — first to a natural stop, then with ``ignore_eos`` and ``max_tokens`` 256, so
the second request regenerates the first one's output blocks (same hashes: duplicates that the engine does not store
again) and continues past them with blocks of its own — then the cache filled with unrelated traffic until
everything of the first two requests has been evicted.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import trio

from openengine.v1 import generation_pb2
from sidecar.engine import EngineClient
from sidecar.kv import RoutingConfig, run_routing_signals
from sidecar.testing.mock.kvcache import BlockPool, BlockRemoved, KvEvent, block_hash, prompt_block_hashes
from tests.helpers.waits import wait_until

from .dynamo_stack import engine_blocks, engine_with_plan, loopback_dynamo, registered_worker
from .mock_traffic import BS, prompt

CONFIG = RoutingConfig(resync_backoff_s=0.05, load_poll_interval_s=0.5)
REMOVE_WARNING = re.compile(r"Failed to find block to remove")
PARENT_WARNING = re.compile(r"Failed to find parent block")


async def run(
    client: EngineClient, request_id: str, tokens: list[int], *, max_tokens: int, seed: int, ignore_eos: bool = False
) -> tuple[int, int]:
    """One sampled request to its end; (finish reason, output tokens)."""
    request = generation_pb2.GenerateRequest(request_id=request_id, model="tiny-oe")
    request.token_ids.ids.extend(tokens)
    request.stopping.max_tokens = max_tokens
    request.stopping.ignore_eos = ignore_eos
    request.sampling.temperature = 1.0
    request.sampling.seed = seed
    finish, count = 0, 0
    async with client.generate(request) as stream:
        async for batch in stream:
            for response in batch:
                kind = response.WhichOneof("event")
                if kind == "token":
                    count += len(response.token.tokens)
                elif kind == "finished":
                    finish = response.finished.reason
    return finish, count


async def find_natural_stop(client: EngineClient, tokens: list[int]) -> tuple[int, int]:
    """A seed whose sampled continuation of ``tokens`` ends with EOS after at least one full block: (seed, length)."""
    for seed in range(1, 200):
        finish, count = await run(client, f"probe{seed}", tokens, max_tokens=256, seed=seed)
        if finish == generation_pb2.FINISH_REASON_STOP and count >= BS:
            return seed, count
    raise AssertionError("no seed stops naturally")


def fill_prompt(i: int) -> list[int]:
    """16 blocks no other prompt here starts with: the first two tokens spell ``i`` (``prompt`` repeats every 300)."""
    return [5 + i % 250, 5 + i // 250] + [(i * 7 + j) % 300 + 5 for j in range(16 * BS - 2)]


@pytest.mark.parametrize("total_blocks", [512, 4096])
async def test_the_repro_leaves_dynamos_indexer_without_warnings(
    total_blocks: int, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    loopback_dynamo(monkeypatch, tmp_path)
    mock_flags = ("--total-kv-blocks", str(total_blocks), "--kv-events", "grpc", "--kv-snapshot")
    with trio.fail_after(240):
        async with engine_with_plan(CONFIG, *mock_flags) as (edge, client, plan):
            shared = prompt(1, blocks=8)
            seed, natural = await find_natural_stop(client, shared)
            namespace = f"replay{id(tmp_path) % 100000}"
            async with registered_worker(edge, plan, namespace, context_length=4096) as (dynamo, nursery):
                signals = await nursery.start(run_routing_signals, client, dynamo, plan, CONFIG)
                subscription = signals.subscriptions[0]
                with trio.fail_after(10):
                    await subscription.synced.wait()
                capfd.readouterr()  # what was logged before the repro does not count
                assert await run(client, "first", shared, max_tokens=256, seed=seed) == (
                    generation_pb2.FINISH_REASON_STOP,
                    natural,
                )
                second = await run(client, "second", shared, max_tokens=256, seed=seed, ignore_eos=True)
                assert second == (generation_pb2.FINISH_REASON_LENGTH, 256)
                # Unrelated traffic: 17 new blocks a request, twice the pool in all, so everything above is evicted.
                for i in range(total_blocks // 8):
                    await run(client, f"fill{i}", fill_prompt(i), max_tokens=16, seed=i)
                assert not set(prompt_block_hashes(shared, BS)) & await engine_blocks(client)

                async def index_matches_engine() -> bool:
                    return len(subscription.index) == len(await engine_blocks(client))

                await wait_until(index_matches_engine, timeout=10, interval=0.05)
                nursery.cancel_scope.cancel()
    logged = capfd.readouterr()
    text = logged.out + logged.err
    removes, parents = len(REMOVE_WARNING.findall(text)), len(PARENT_WARNING.findall(text))
    print(
        f"\nDynamo's indexer: {removes} x 'Failed to find block to remove', {parents} x 'Failed to find parent block'"
    )
    assert subscription.resynced == 0
    assert (removes, parents) == (0, 0)


def test_the_mock_evicts_from_the_leaves_and_shares_a_recomputed_block() -> None:
    """The same chain as the replay, on the pool alone: request a stores A1 → O1; request b hits A1, recomputes O1
    (a duplicate) and stores O2 under it. b must hold a's O1 while it runs, and the removals must come leaf first
    (O2, O1, A1): with O1 evicted before O2, a tree-shaped index drops O2 with O1 and then cannot find it."""
    pool = BlockPool(6, 2)
    events: list[KvEvent] = []
    pool.subscribe(events.append)
    a1 = block_hash(None, [1, 2])
    o1 = block_hash(a1, [3, 4])
    o2 = block_hash(o1, [5, 6])
    a = pool.try_admit([], 2)
    assert a is not None
    assert pool.register(a.take(), a1, None, [1, 2])
    assert pool.register(a.take(), o1, a1, [3, 4])
    a.release()
    b = pool.try_admit([a1], 3)
    assert b is not None
    assert b.cached_blocks == 1
    assert not pool.register(b.take(), o1, a1, [3, 4])  # recomputed: b now holds the registered O1
    assert pool.match_prefix([a1, o1])[1].ref_count == 1
    assert pool.register(b.take(), o2, o1, [5, 6])
    b.release()
    assert pool.cached_blocks == 3
    c = pool.try_admit([], 6)
    assert c is not None
    for _ in range(6):
        c.take()
    removed = [e.block_hash for e in events if isinstance(e, BlockRemoved)]
    assert removed == [o2, o1, a1]
    c.release()
    assert pool.used_blocks == 0
