"""KV-aware routing end to end: the real frontend (``--router-mode kv``) in front of two aggregated workers, each
``python -m sidecar`` driving its own ``openengine-mock``; then the same engines behind a round-robin frontend.

A long prompt is sent once (it lands on some worker: the *warm* one, whose engine now caches its prefix), then 20
more times. With KV events forwarded, the router sends the repeats to the warm worker (≥ 90 % required); round-robin
spreads them (~50 %). Which worker served a request is read from each sidecar's own request counter
(``openengine_sidecar_requests_received`` on its system port); the frontend's metrics must show the applied events.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
import pytest
import trio

from tests.helpers.processes import DynamoEnv, start_frontend
from tests.helpers.stack import (
    Worker,
    cached_completion,
    dump_logs,
    metric_sum,
    start_engine,
    start_sidecar,
    wait_routable,
)
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.e2e

REPEATS = 20


@asynccontextmanager
async def start_worker(denv: DynamoEnv, engine: str, *args: str, name: str) -> AsyncIterator[Worker]:
    async with start_sidecar(denv, engine, *args, name=name) as worker:
        yield worker


async def requests_received(http: httpx.AsyncClient, worker: Worker) -> int:
    text = (await http.get(f"{worker.system_url}/metrics")).text
    match = re.search(r"^openengine_sidecar_requests_received_total(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    return int(float(match.group(1))) if match else 0


async def served_by(http: httpx.AsyncClient, url: str, workers: list[Worker], count: int) -> tuple[list[int], int]:
    """Send the prompt ``count`` times, one after the other; requests per worker and how many had cached tokens."""
    before = [await requests_received(http, w) for w in workers]
    cached = 0
    for _ in range(count):
        cached += (await cached_completion(http, url)) > 0
    after = [await requests_received(http, w) for w in workers]
    return [b - a for a, b in zip(before, after, strict=True)], cached


@pytest.mark.timeout(420)  # its own bound plus two minutes for the processes around it
async def test_a_repeated_long_prompt_lands_on_the_worker_holding_its_prefix(dynamo_env: DynamoEnv) -> None:
    denv = dynamo_env
    with trio.fail_after(300):
        try:
            async with AsyncExitStack() as engines, httpx.AsyncClient(timeout=30) as http:
                addresses = [
                    (
                        await engines.enter_async_context(
                            start_engine(denv, "--profile", "full", "--speedup", "0", name=f"engine{i}")
                        )
                    ).address
                    for i in range(2)
                ]
                # -- KV-aware routing ------------------------------------------------------------------------------
                async with AsyncExitStack() as phase:
                    frontend = await phase.enter_async_context(start_frontend(denv, extra_args=["--router-mode", "kv"]))
                    workers = [
                        await phase.enter_async_context(start_worker(denv, address, name=f"kv-sidecar{i}"))
                        for i, address in enumerate(addresses)
                    ]
                    for worker in workers:
                        await worker.process.wait_for_log(
                            r"KV events on \(block size 16\): rank 0 via SubscribeKvEvents", 10
                        )
                    await wait_routable(frontend.url, workers=2)
                    counts, _ = await served_by(http, frontend.url, workers, 1)
                    warm = counts.index(1)

                    async def stored_applied() -> float:
                        page = (await http.get(f"{frontend.url}/metrics")).text
                        return metric_sum(
                            page, "dynamo_component_kv_cache_events_applied", event_type="stored", status="ok"
                        )

                    stored = await wait_until(stored_applied, timeout=15, interval=0.1)
                    kv_counts, kv_cached = await served_by(http, frontend.url, workers, REPEATS)
                    page = (await http.get(f"{frontend.url}/metrics")).text
                    assert (
                        metric_sum(page, "dynamo_component_kv_cache_events_applied", status="parent_block_not_found")
                        == 0
                    )
                    assert metric_sum(page, "dynamo_component_kv_cache_events_applied", status="block_not_found") == 0
                    hit_tokens = metric_sum(page, "dynamo_component_router_kv_selected_cached_prefix_tokens_total")
                # -- the same engines behind round-robin, KV events off ----------------------------------------------
                async with AsyncExitStack() as phase:
                    frontend = await phase.enter_async_context(
                        start_frontend(denv, extra_args=["--router-mode", "round-robin"])
                    )
                    workers = [
                        await phase.enter_async_context(
                            start_worker(denv, address, "--kv-events", "off", name=f"rr-sidecar{i}")
                        )
                        for i, address in enumerate(addresses)
                    ]
                    await wait_routable(frontend.url, workers=2)
                    rr_counts, _ = await served_by(http, frontend.url, workers, REPEATS)
        except BaseException:
            dump_logs(denv)
            raise
    kv_rate = kv_counts[warm] / REPEATS
    rr_rate = rr_counts[warm] / REPEATS
    print(
        f"\nKV routing: {kv_counts[warm]}/{REPEATS} ({kv_rate:.0%}) on the warm worker, {kv_cached} with cached "
        f"tokens, frontend saw {stored:.0f} stored event(s) and {hit_tokens:.0f} cached prefix tokens; "
        f"round-robin: {rr_counts[warm]}/{REPEATS} ({rr_rate:.0%})"
    )
    assert sum(kv_counts) == REPEATS
    assert sum(rr_counts) == REPEATS
    assert kv_rate >= 0.9, f"KV routing sent {kv_counts} (warm worker {warm})"
    assert kv_cached >= 0.9 * REPEATS
    assert hit_tokens > 0
    assert 0.25 <= rr_rate <= 0.75, f"round-robin sent {rr_counts}"
