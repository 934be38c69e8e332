"""KV-aware routing across frontends: the workers' KV events travel over the NATS event plane to *every* frontend, so
a prefix cached on one worker pulls the repeats of a long prompt to that worker, whichever frontend they enter by.

And load across frontends (issue 27 item 8): a worker's published KV usage travels the same way (subject
``kv_metrics``); Dynamo 1.6.1's KV router reads it only in its overload filter (``--active-decode-blocks-threshold``
against the card's ``total_kv_blocks``), which keeps the requests of one frontend off a worker another one loaded.
"""

from __future__ import annotations

import time

import httpx
import pytest
import trio

from tests.e2e.test_kv_routing import wait_published_over
from tests.helpers.stack import LONG_PROMPT, MODEL, cached_completion, metric_sum
from tests.helpers.waits import wait_until

from .report import record
from .topology import Cluster, ClusterFrontend, ClusterWorker, wait_instances

# pytest.mark.timeout: the cluster (hosts, etcd, NATS, two frontends, three workers) starts inside each test's bound
pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(600)]

REPEATS = 10
KV_EVENTS_APPLIED = "dynamo_component_kv_cache_events_applied"


async def _stored_events(http: httpx.AsyncClient, frontend: ClusterFrontend) -> float:
    text = (await http.get(f"{frontend.url}/metrics")).text
    return metric_sum(text, KV_EVENTS_APPLIED, event_type="stored", status="ok")


async def _served(
    http: httpx.AsyncClient,
    frontend: ClusterFrontend,
    workers: list[ClusterWorker],
    count: int,
    prompt: str = LONG_PROMPT,
) -> tuple[dict[str, int], int]:
    before = {w.name: w.received() for w in workers}
    cached = 0
    for _ in range(count):
        cached += (await cached_completion(http, frontend.url, prompt)) > 0
    return {w.name: w.received() - before[w.name] for w in workers}, cached


@pytest.mark.parametrize(
    "cluster", [{"engine_args": ("--speedup", "0"), "frontend_args": ("--router-mode", "kv")}], indirect=True
)
async def test_both_frontends_route_a_repeated_prefix_to_the_worker_holding_it(cluster: Cluster) -> None:
    with trio.fail_after(180):
        frontends = list(cluster.frontends.values())
        workers = list(cluster.workers.values())
        for worker in workers:
            await worker.sidecar.wait_for_log(r"KV events on \(block size \d+\)", timeout=10)
        await wait_instances(frontends, {w.instance_id() or 0 for w in workers}, timeout=30)
        async with httpx.AsyncClient(timeout=30) as http:
            first, _ = await _served(http, frontends[0], workers, 1)
            warm = next(name for name, n in first.items() if n == 1)
            stored = time.monotonic()
            # The stored event reaches both frontends' routers over the event plane.
            with trio.fail_after(20):
                for frontend in frontends:
                    await wait_until(lambda: _stored(http, frontend), interval=0.05)  # noqa: B023
            propagated = time.monotonic() - stored
            results = {f.name: await _served(http, f, workers, REPEATS) for f in frontends}
    for name, (counts, cached) in results.items():
        assert sum(counts.values()) == REPEATS, counts
        assert counts[warm] >= 0.9 * REPEATS, f"{name} sent {counts} (warm worker {warm})"
        assert cached >= 0.9 * REPEATS, f"{name}: only {cached} answers reported cached tokens"
    shares = ", ".join(f"{name} {counts[warm]}/{REPEATS}" for name, (counts, _) in results.items())
    record("KV routing across frontends: stored event seen by both frontends", propagated, f"warm worker: {shares}")


#: Each sidecar registers a pool of 64 blocks; the frontends' filter excludes a worker above 0.25 × 64 = 16 blocks.
LOAD_ARGS = {
    "workers": ("w1",),
    "engine_args": ("--profile", "trtllm", "--decode-ms-per-token", "50"),
    "sidecar_args": ("--total-kv-blocks", "64"),
    "frontend_args": ("--router-mode", "kv", "--active-decode-blocks-threshold", "0.25"),
}


@pytest.mark.parametrize("cluster", [LOAD_ARGS], indirect=True)
async def test_over_nats_a_kv_router_keeps_new_requests_off_a_worker_another_frontend_loaded(cluster: Cluster) -> None:
    """w1 (TensorRT-LLM's profile: no KV usage in GetLoad, the sidecar's estimate) loaded with 6 long streams through
    fe2; then w2 joins; fe1 routes 10 short requests: all to w2."""
    with trio.fail_after(240):
        fe1, fe2 = cluster.frontends["fe1"], cluster.frontends["fe2"]
        w1 = cluster.workers["w1"]
        async with httpx.AsyncClient(timeout=60) as http, trio.open_nursery() as load:

            async def stream_through_fe2() -> None:
                body = {"model": MODEL, "prompt": "The river", "max_tokens": 400, "ignore_eos": True}
                await http.post(f"{fe2.url}/v1/completions", json=body)

            await wait_instances([fe2], {w1.instance_id() or 0}, timeout=30)
            for _ in range(6):
                load.start_soon(stream_through_fe2)
            w2 = await cluster.start_worker("w2")
            await wait_instances([fe1], {w1.instance_id() or 0, w2.instance_id() or 0}, timeout=30)
            await wait_published_over(http, w1.system_url, 16)
            counts, _ = await _served(http, fe1, [w1, w2], 10, prompt="Hello there")
            load.cancel_scope.cancel()
    assert counts == {"w1": 0, "w2": 10}, counts
    record("Load across frontends over NATS: fe1's requests per worker", None, f"{counts}")


async def _stored(http: httpx.AsyncClient, frontend: ClusterFrontend) -> bool:
    return await _stored_events(http, frontend) >= 1
