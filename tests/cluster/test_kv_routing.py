"""KV-aware routing across frontends: the workers' KV events travel over the NATS event plane to *every* frontend, so
a prefix cached on one worker pulls the repeats of a long prompt to that worker, whichever frontend they enter by.
"""

from __future__ import annotations

import time

import httpx
import pytest
import trio

from tests.helpers.stack import cached_completion, metric_sum
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
    http: httpx.AsyncClient, frontend: ClusterFrontend, workers: list[ClusterWorker], count: int
) -> tuple[dict[str, int], int]:
    before = {w.name: w.received() for w in workers}
    cached = 0
    for _ in range(count):
        cached += (await cached_completion(http, frontend.url)) > 0
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


async def _stored(http: httpx.AsyncClient, frontend: ClusterFrontend) -> bool:
    return await _stored_events(http, frontend) >= 1
