"""Readiness tells the truth by default: the system port's ``/health`` is 503 whenever the worker is not ``serving``.

A real ``openengine-sidecar`` against ``openengine-mock``, nothing set but the system port:

* during start-up (no engine yet) the port already answers: ``/health`` 503 with the state and the reason,
  ``/live`` and ``/engine/live`` 200, ``/metrics`` with the sidecar's families;
* serving: ``/health`` 200;
* the engine killed: ``/health`` 503 within the health threshold (``--health-poll-interval-secs`` x
  ``--health-failure-threshold``), ``/engine/live`` still 200 and saying ``reconnecting``;
* the engine back: ``/health`` 200 again;
* an unhealthy engine (degraded) and a draining worker: 503 as well.
"""

from __future__ import annotations

import re
import signal
from typing import Any

import httpx
import pytest
import trio

from tests.helpers.processes import DynamoEnv, Frontend, free_port
from tests.helpers.stack import dump_logs, running_requests, start_engine, start_sidecar, wait_routable
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.e2e

POLL_S = 0.5
THRESHOLD = 3
# The engine is gone after THRESHOLD failed polls; a loaded 2-core machine gets generous slack on top.
WITHIN_S = POLL_S * THRESHOLD + 5.0
WATCH = (
    "--health-poll-interval-secs", str(POLL_S), "--health-failure-threshold", str(THRESHOLD),
    "--grpc-retry-interval-secs", "0.2", "--reconnect-backoff-max-secs", "0.5",
)  # fmt: skip


async def get(url: str) -> tuple[int, Any]:
    """Status and JSON body (text when not JSON); ``(0, reason)`` when nothing answers."""
    async with httpx.AsyncClient(timeout=5) as http:
        try:
            response = await http.get(url)
        except httpx.HTTPError as exc:
            return 0, str(exc)
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text


async def wait_status(url: str, status: int, timeout: float) -> tuple[float, Any]:
    """Poll ``url`` until it answers ``status``; returns the seconds it took and the body."""
    start = trio.current_time()
    answer: list[Any] = []

    async def answers() -> bool:
        code, body = await get(url)
        answer[:] = [body]
        return code == status

    await wait_until(answers, timeout=timeout, interval=0.05, what=f"{url} answering {status}")
    return trio.current_time() - start, answer[0]


async def test_health_is_503_while_connecting_and_reconnecting_and_200_while_serving(dynamo_env: DynamoEnv) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    try:
        with trio.fail_after(180):
            async with start_sidecar(dynamo_env, address, *WATCH, ready=None) as worker:
                base = worker.system_url
                # Start-up, no engine: the port answers at once, not ready, with the state and the reason; once the
                # first attempt has failed, its error says what is happening now.
                _, body = await wait_status(f"{base}/health", 503, timeout=30)
                assert body["status"] == "notready"
                assert body["state"] == "connecting"
                assert address in body["reason"]

                async def explained() -> bool:
                    code, body = await get(f"{base}/health")
                    return code == 503 and "not reachable" in body["detail"]

                await wait_until(explained, timeout=10, interval=0.05, what="the last attempt's error on /health")
                for path in ("/live", "/engine/live"):
                    code, live = await get(f"{base}{path}")
                    assert (code, live["status"], live["ready"]) == (200, "live", False), path
                code, text = await get(f"{base}/metrics")
                assert code == 200
                assert 'openengine_sidecar_worker_state{dynamo_component="backend"' in text

                async with start_engine(dynamo_env, "--speedup", "0", port=port) as engine:
                    _, body = await wait_status(f"{base}/health", 200, timeout=60)
                    assert (body["status"], body["state"]) == ("ready", "serving")
                    for path in ("/live", "/engine/live"):
                        code, live = await get(f"{base}{path}")
                        assert (code, live["state"], live["ready"]) == (200, "serving", True), path
                    code, text = await get(f"{base}/metrics")
                    assert "dynamo_component_requests_total" in text  # relayed to Dynamo's own server
                    # Dynamo's own port answers /engine/live with the state too (all there is with DYN_SYSTEM_PORT=0).
                    inner = re.search(r"relayed to Dynamo's system server on (\S+):(\d+)", worker.process.log())
                    assert inner is not None
                    code, live = await get(f"http://{inner[1]}:{inner[2]}/engine/live")
                    assert (code, live["state"]) == (200, "serving")
                    assert "openengine_sidecar_worker_state" in text

                    # Kill the engine: 503 within the health threshold.
                    engine.process.proc.kill()
                    took, body = await wait_status(f"{base}/health", 503, timeout=30)
                    assert took <= WITHIN_S, f"/health turned 503 {took:.1f}s after the kill (bound {WITHIN_S}s)"
                # The same port, after Dynamo's runtime was created: still the state and why, on every path.
                assert (body["status"], body["state"]) == ("notready", "reconnecting")
                assert body["reason"]
                for path in ("/live", "/engine/live"):
                    code, live = await get(f"{base}{path}")
                    assert (code, live["state"], live["ready"]) == (200, "reconnecting", False), path
                    assert live["reason"]

                async with start_engine(dynamo_env, "--speedup", "0", port=port, name="engine-restarted"):
                    await wait_status(f"{base}/health", 200, timeout=60)
                    assert worker.process.returncode is None
    except BaseException:
        dump_logs(dynamo_env)
        raise


async def test_health_is_503_while_degraded_and_while_draining(dynamo_env: DynamoEnv, frontend: Frontend) -> None:
    try:
        with trio.fail_after(180):
            async with (
                start_engine(dynamo_env, "--decode-ms-per-token", "20") as engine,
                start_sidecar(dynamo_env, engine.address, *WATCH, "--drain-timeout-secs", "30") as worker,
            ):
                base = worker.system_url
                await wait_routable(frontend.url, workers=1)
                await wait_status(f"{base}/health", 200, timeout=10)

                engine.process.signal(signal.SIGUSR1)  # the mock's Health turns NOT_READY
                took, body = await wait_status(f"{base}/health", 503, timeout=30)
                assert took <= WITHIN_S
                assert body["state"] == "degraded"
                assert (await get(f"{base}/live"))[1]["state"] == "degraded"
                engine.process.signal(signal.SIGUSR1)
                await wait_status(f"{base}/health", 200, timeout=30)
                await wait_routable(frontend.url, workers=1)  # the frontend has seen the instance come back

                # A long request keeps the worker draining after SIGTERM: /health says so meanwhile.
                body = {"model": "tiny-oe", "prompt": "The river", "max_tokens": 300, "ignore_eos": True}
                async with httpx.AsyncClient(timeout=60) as http, trio.open_nursery() as nursery:

                    async def long_request() -> None:
                        await http.post(f"{frontend.url}/v1/completions", json=body)

                    nursery.start_soon(long_request)

                    async def running() -> bool:
                        return await running_requests(engine.address) >= 1

                    await wait_until(running, timeout=10, interval=0.05)
                    worker.process.signal(signal.SIGTERM)
                    await worker.process.wait_for_log(r"serving -> draining", timeout=10)
                    code, body = await get(f"{base}/health")
                    # The request runs for seconds more: the runtime is still up, draining.
                    assert (code, body["state"]) == (503, "draining")
                    code, live = await get(f"{base}/engine/live")
                    assert (code, live["state"]) == (200, "draining")
    except BaseException:
        dump_logs(dynamo_env)
        raise
