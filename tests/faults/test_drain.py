"""Drain on SIGTERM, the hypercorn way: deregister first (within 1 s), let in-flight requests finish within
``--drain-timeout-secs``, cancel stragglers with a migratable error, confirm quiescence with GetLoad, exit 0."""

from __future__ import annotations

import signal
import time
from functools import partial

import pytest
import trio

from tests.helpers.processes import DynamoEnv, Frontend, list_models
from tests.helpers.stack import MODEL, engine_load, start_engine, start_sidecar, wait_engine_idle, wait_routable
from tests.helpers.waits import wait_until

from ._client import Outcome, stream_many

pytestmark = pytest.mark.e2e


async def _deregistered_after(url: str, since: float, timeout: float = 5.0) -> float:

    async def gone() -> bool:
        return MODEL not in await list_models(url)

    await wait_until(gone, timeout=timeout, what=f"{MODEL} unlisted")
    return time.monotonic() - since


async def test_sigterm_with_64_streams_in_flight_lets_all_finish_and_exits_0(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    outcomes: list[Outcome] = []
    with trio.fail_after(150):
        async with (
            start_engine(dynamo_env, "--decode-ms-per-token", "10") as engine,
            start_sidecar(dynamo_env, engine.address, "--drain-timeout-secs", "60") as worker,
        ):
            await wait_routable(frontend.url, workers=1)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(stream_many, frontend.url, 64, outcomes, max_tokens=150, timeout=90))
                await wait_until(lambda: _running_at_least(engine.address, 64), timeout=20, interval=0.02)
                sent = time.monotonic()
                worker.process.signal(signal.SIGTERM)
                deregistered = await _deregistered_after(frontend.url, sent)
                assert deregistered < 1.0, f"deregistered {deregistered:.3f}s after SIGTERM"
            with trio.fail_after(30):
                assert await worker.process.proc.wait() == 0
            assert len(outcomes) == 64
            assert all(o.succeeded and o.completion_tokens == 150 for o in outcomes), [
                o for o in outcomes if not o.succeeded
            ][:3]
            await wait_engine_idle(engine.address, timeout=2)
            log = worker.process.log()
            assert "serving -> draining" in log
            assert "draining -> stopped" in log
            assert "engine quiescent" in log
    print(f"deregistered {deregistered * 1000:.0f} ms after SIGTERM")


async def test_a_short_drain_deadline_gives_stragglers_a_migratable_error(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    outcomes: list[Outcome] = []
    with trio.fail_after(120):
        async with (
            start_engine(dynamo_env, "--decode-ms-per-token", "20") as engine,
            start_sidecar(dynamo_env, engine.address, "--drain-timeout-secs", "0.5") as worker,
        ):
            await wait_routable(frontend.url, workers=1)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(stream_many, frontend.url, 8, outcomes, max_tokens=2000, timeout=90))
                await wait_until(lambda: _running_at_least(engine.address, 8), timeout=20, interval=0.02)
                worker.process.signal(signal.SIGTERM)
            with trio.fail_after(30):
                assert await worker.process.proc.wait() == 0
            assert len(outcomes) == 8
            # No truncated successes: every straggler saw an error (503: migratable, no other worker to take it).
            assert all(o.failed_cleanly for o in outcomes), outcomes
            assert "drain deadline: cancelled 8 request(s)" in worker.process.log()
            await wait_engine_idle(engine.address, timeout=2)


async def test_a_second_sigterm_forces_a_fast_but_clean_exit(dynamo_env: DynamoEnv, frontend: Frontend) -> None:
    outcomes: list[Outcome] = []
    with trio.fail_after(120):
        async with (
            start_engine(dynamo_env, "--decode-ms-per-token", "20") as engine,
            start_sidecar(dynamo_env, engine.address, "--drain-timeout-secs", "60") as worker,
        ):
            await wait_routable(frontend.url, workers=1)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(stream_many, frontend.url, 4, outcomes, max_tokens=2000, timeout=90))
                await wait_until(lambda: _running_at_least(engine.address, 4), timeout=20, interval=0.02)
                worker.process.signal(signal.SIGTERM)
                await worker.process.wait_for_log(r"serving -> draining", timeout=5)
                second = time.monotonic()
                worker.process.signal(signal.SIGTERM)
                with trio.fail_after(20):
                    await worker.process.proc.wait()
                fast = time.monotonic() - second
            assert worker.process.returncode == 0
            assert fast < 10, f"forced exit took {fast:.1f}s"
            assert all(o.failed_cleanly for o in outcomes), outcomes
            await wait_engine_idle(engine.address, timeout=2)


async def _engine_running(address: str) -> int:
    return (await engine_load(address)).running_requests or 0


async def _running_at_least(address: str, count: int) -> bool:
    return await _engine_running(address) >= count


async def test_sigterm_while_the_engine_is_gone_exits_0(dynamo_env: DynamoEnv, frontend: Frontend) -> None:
    """The engine runs beside the worker: with nothing accepting on its address there is no engine process and
    nothing of ours left on one, so the drain is clean (exit 0, as Dynamo's sidecar exits). Failed before: GetLoad's
    UNAVAILABLE read as "could not confirm engine quiescence" and the worker exited 1 (bench.compare)."""
    with trio.fail_after(120):
        async with (
            start_engine(dynamo_env, "--speedup", "0") as engine,
            start_sidecar(dynamo_env, engine.address) as worker,
        ):
            await wait_routable(frontend.url, workers=1)
            engine.process.signal(signal.SIGKILL)
            await worker.process.wait_for_log(r"-> reconnecting", timeout=15)
            worker.process.signal(signal.SIGTERM)
            with trio.fail_after(30):
                await worker.process.proc.wait()
            assert worker.process.returncode == 0
            await worker.process.wait_for_log("engine quiescent: nothing listens", timeout=1)
