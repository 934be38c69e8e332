"""KV-aware routing end to end: the real frontend (``--router-mode kv``) in front of two aggregated workers, each
``python -m sidecar`` driving its own ``openengine-mock``; then the same engines behind a round-robin frontend.

A long prompt is sent once (it lands on some worker: the *warm* one, whose engine now caches its prefix), then 20
more times. With KV events forwarded, the router sends the repeats to the warm worker (≥ 90 % required); round-robin
spreads them (~50 %). Which worker served a request is read from each sidecar's own request counter
(``openengine_sidecar_requests_received`` on its system port); the frontend's metrics must show the applied events.

Then load routed by *another* frontend (issue 27 item 8): Dynamo 1.6.1's KV router counts in its cost only the
requests it routed itself; a worker's published KV usage reaches it as well, but only its overload filter
(``--active-decode-blocks-threshold``, against the model card's ``total_kv_blocks``) reads it. TensorRT-LLM reports no
pool size and no KV usage: the sidecar publishes its estimate and registers ``--total-kv-blocks``, so the filter keeps
new requests off the worker that another frontend loaded.
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
    LONG_PROMPT,
    MODEL,
    Engine,
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


async def served_by(
    http: httpx.AsyncClient, url: str, workers: list[Worker], count: int, prompt: str = LONG_PROMPT
) -> tuple[list[int], int]:
    """Send the prompt ``count`` times, one after the other; requests per worker and how many had cached tokens."""
    before = [await requests_received(http, w) for w in workers]
    cached = 0
    for _ in range(count):
        cached += (await cached_completion(http, url, prompt)) > 0
    after = [await requests_received(http, w) for w in workers]
    return [b - a for a, b in zip(before, after, strict=True)], cached


async def two_engines(stack: AsyncExitStack, denv: DynamoEnv, *args: str, name: str = "engine") -> list[Engine]:
    """Two ``openengine-mock`` engines started with ``args``, kept until ``stack`` closes."""
    return [await stack.enter_async_context(start_engine(denv, *args, name=f"{name}{i}")) for i in range(2)]


@pytest.mark.timeout(420)  # its own bound plus two minutes for the processes around it
async def test_a_repeated_long_prompt_lands_on_the_worker_holding_its_prefix(dynamo_env: DynamoEnv) -> None:
    denv = dynamo_env
    with trio.fail_after(300):
        try:
            async with AsyncExitStack() as engines, httpx.AsyncClient(timeout=30) as http:
                addresses = [e.address for e in await two_engines(engines, denv, "--profile", "full", "--speedup", "0")]
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


#: The KV pool each sidecar registers (``--total-kv-blocks``) and the frontend's overload threshold: a worker whose
#: published usage exceeds THRESHOLD × TOTAL_KV_BLOCKS = 16 blocks takes no new request from it.
TOTAL_KV_BLOCKS = 64
THRESHOLD = 0.25
LOADS = 6
PROBES = 10


async def published_used_blocks(http: httpx.AsyncClient, system_url: str) -> float:
    """The KV blocks a worker last published as in use (its estimate, for an engine without KV usage)."""
    page = (await http.get(f"{system_url}/metrics")).text
    return metric_sum(page, "openengine_sidecar_engine_kv_blocks", kind="used")


async def wait_published_over(http: httpx.AsyncClient, system_url: str, blocks: float, timeout: float = 30) -> None:
    """Wait until a worker publishes more than ``blocks`` KV blocks in use, then for two more publications (the
    frontends have then received one of them at least)."""

    async def published() -> float:
        page = (await http.get(f"{system_url}/metrics")).text
        return metric_sum(page, "openengine_sidecar_load_snapshots_published_total")

    with trio.fail_after(timeout):
        while await published_used_blocks(http, system_url) <= blocks:
            await trio.sleep(0.1)
        after = await published() + 2
        while await published() < after:
            await trio.sleep(0.1)


async def test_a_kv_router_keeps_new_requests_off_a_worker_another_frontend_loaded(dynamo_env: DynamoEnv) -> None:
    """Two TensorRT-LLM-profile engines (``GetLoad`` without KV usage, no KV events); worker A loaded with long streams
    through frontend F2, then worker B joins; frontend F1 (``--router-mode kv --active-decode-blocks-threshold 0.25``)
    has routed none of that load. Failed before: the card had no ``total_kv_blocks``, so F1 could not judge the
    published estimate (18-24 blocks, "processed active load update ... total_blocks=None") and sent 4-7 of 10 new
    requests to A. Now all of them go to B."""
    denv = dynamo_env
    with trio.fail_after(240):
        try:
            async with AsyncExitStack() as stack, httpx.AsyncClient(timeout=60) as http:
                engines = await two_engines(stack, denv, "--decode-ms-per-token", "50", name="load-engine")
                f1 = await stack.enter_async_context(
                    start_frontend(
                        denv, extra_args=["--router-mode", "kv", "--active-decode-blocks-threshold", str(THRESHOLD)]
                    )
                )
                f2 = await stack.enter_async_context(start_frontend(denv, extra_args=["--router-mode", "round-robin"]))
                card = ("--total-kv-blocks", str(TOTAL_KV_BLOCKS))
                a = await stack.enter_async_context(start_worker(denv, engines[0].address, *card, name="loaded"))
                await wait_routable(f2.url, workers=1)
                async with trio.open_nursery() as load:

                    async def stream_through_f2() -> None:
                        body = {"model": MODEL, "prompt": "The river", "max_tokens": 400, "ignore_eos": True}
                        await http.post(f"{f2.url}/v1/completions", json=body)

                    for _ in range(LOADS):
                        load.start_soon(stream_through_f2)
                    b = await stack.enter_async_context(start_worker(denv, engines[1].address, *card, name="idle"))
                    await wait_routable(f1.url, workers=2)
                    await wait_published_over(http, a.system_url, THRESHOLD * TOTAL_KV_BLOCKS)
                    counts, _ = await served_by(http, f1.url, [a, b], PROBES, prompt="Hello there")
                    estimate = await published_used_blocks(http, a.system_url)
                    load.cancel_scope.cancel()
        except BaseException:
            dump_logs(denv)
            raise
    print(f"\nload through F2: A's published estimate {estimate:.0f} of {TOTAL_KV_BLOCKS} blocks; F1 sent {counts}")
    assert estimate > THRESHOLD * TOTAL_KV_BLOCKS
    assert counts == [0, PROBES], f"F1 sent {counts[0]} of {PROBES} new requests to the loaded worker"
