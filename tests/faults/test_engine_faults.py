"""Engine faults: crash, restart, hang, terminal errors (retryable or not), overload, protocol violations, unhealth."""

from __future__ import annotations

import signal

import pytest
import trio

from tests.helpers.processes import DynamoEnv, Frontend, free_port
from tests.helpers.stack import engine_load, start_engine, start_sidecar, wait_engine_idle, wait_routable
from tests.helpers.waits import wait_until

from ._client import Outcome, stream_completion

pytestmark = pytest.mark.e2e

# Fast supervision so faults are seen within a second, not the production default of seconds.
FAST_WATCH = (
    "--health-poll-interval-secs", "0.2", "--health-failure-threshold", "2", "--grpc-retry-interval-secs", "0.2",
    "--reconnect-backoff-max-secs", "0.5", "--abort-timeout-secs", "1",
)  # fmt: skip


# Engines without KV events: their workers register for round-robin routing, which these tests rely on.
ROUND_ROBIN = ("--speedup", "0", "--kv-events", "disabled")


async def test_an_engine_killed_mid_stream_fails_the_request_and_the_worker_reconnects_to_its_restart(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """Killed engine → the in-flight request gets an error (not a truncated success); the worker withdraws,
    reconnects with backoff to the restarted engine, rediscovers it and serves again without a process restart."""
    port = free_port()
    with trio.fail_after(120):
        async with (
            start_engine(dynamo_env, "--decode-ms-per-token", "20", port=port) as engine,
            start_sidecar(dynamo_env, engine.address, *FAST_WATCH) as worker,
        ):
            await wait_routable(frontend.url, workers=1)
            outcome: list[Outcome] = []
            async with trio.open_nursery() as nursery:

                async def long_request() -> None:
                    outcome.append(await stream_completion(frontend.url, "The river", max_tokens=400))

                nursery.start_soon(long_request)
                await wait_until(lambda: _running_at_least(1, engine.address), timeout=20)  # the request is streaming
                engine.process.proc.kill()
            assert outcome[0].failed_cleanly, outcome[0]
            await worker.process.wait_for_log(r"serving -> reconnecting", timeout=10)
            async with start_engine(dynamo_env, "--speedup", "0", port=port, name="engine-restarted"):
                await worker.process.wait_for_log(r"reconnecting -> discovering", timeout=20)
                await worker.process.wait_for_log(r"(?s)reconnecting.*registering -> serving", timeout=20)
                assert worker.process.returncode is None, "the worker survived the engine restart"
                again = await stream_completion(frontend.url, "The river", max_tokens=8)
                assert again.succeeded, again
                assert again.completion_tokens == 8


@pytest.mark.parametrize("frontend", [3], indirect=True)
async def test_with_two_workers_a_killed_engines_requests_complete_on_the_other(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """Migration: the request the dead engine was serving moves to the other worker; the client sees one answer."""
    with trio.fail_after(120):
        async with (
            # Round-robin (no KV events) spreads the four requests over both workers, so A's die mid-stream.
            start_engine(
                dynamo_env, "--decode-ms-per-token", "20", "--kv-events", "disabled", name="engine-a"
            ) as engine_a,
            start_engine(
                dynamo_env, "--decode-ms-per-token", "20", "--kv-events", "disabled", name="engine-b"
            ) as engine_b,
            start_sidecar(dynamo_env, engine_a.address, *FAST_WATCH, name="sidecar-a"),
            start_sidecar(dynamo_env, engine_b.address, *FAST_WATCH, name="sidecar-b"),
        ):
            await wait_routable(frontend.url, workers=2)
            outcomes: list[Outcome] = []
            async with trio.open_nursery() as nursery:

                async def request() -> None:
                    outcomes.append(await stream_completion(frontend.url, "The river", max_tokens=120))

                for _ in range(4):
                    nursery.start_soon(request)
                # All four stream, spread over both engines.
                await wait_until(lambda: _running_at_least(4, engine_a.address, engine_b.address), timeout=20)
                engine_a.process.proc.kill()
            assert len(outcomes) == 4
            assert all(o.succeeded and o.completion_tokens == 120 for o in outcomes), outcomes
            await wait_engine_idle(engine_b.address, timeout=5)


async def test_a_hung_engine_request_fails_after_the_inactivity_timeout_and_is_aborted(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    with trio.fail_after(90):
        async with (
            start_engine(dynamo_env, "--speedup", "0", "--faults-from-prompt") as engine,
            start_sidecar(dynamo_env, engine.address, *FAST_WATCH, "--request-inactivity-timeout-secs", "1") as worker,
        ):
            await wait_routable(frontend.url, workers=1)
            started = trio.current_time()
            outcome = await stream_completion(frontend.url, "river [mock-fault hang_after_tokens=3]", max_tokens=20)
            assert outcome.failed_cleanly, outcome
            assert 1.0 <= trio.current_time() - started < 10
            await wait_engine_idle(engine.address, timeout=3)
            # Nothing came from the engine for the timeout: the worker withdrew, and serves again once a canary
            # generation is answered (only the prompted request hangs).
            await worker.process.wait_for_log(r"canary generation answered", timeout=20)
            await wait_until(lambda: _answers(frontend.url), timeout=20, interval=0.1)


async def test_a_non_retryable_engine_error_mid_stream_is_an_error_for_the_client(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    with trio.fail_after(90):
        async with (
            start_engine(dynamo_env, "--speedup", "0", "--faults-from-prompt") as engine,
            start_sidecar(dynamo_env, engine.address, *FAST_WATCH),
        ):
            await wait_routable(frontend.url, workers=1)
            prompt = "river [mock-fault error_after_tokens=3 error_code=INTERNAL error_retryable=false]"
            outcome = await stream_completion(frontend.url, prompt, max_tokens=20)
            assert outcome.failed_cleanly, outcome
            await wait_engine_idle(engine.address, timeout=3)


@pytest.mark.parametrize("frontend", [3], indirect=True)
@pytest.mark.parametrize("code", ["INTERNAL", "OVERLOADED"])
async def test_a_retryable_engine_error_migrates_to_another_worker(
    dynamo_env: DynamoEnv, frontend: Frontend, code: str
) -> None:
    """``EngineError.retryable`` is honoured (Dynamo's Rust sidecars ignore it): the frontend retries elsewhere.

    Only engine A reads fault directives from the prompt, so the retry on B succeeds. The engines publish no KV
    events, so the workers register for round-robin routing and A is sure to get some of the requests (a KV router
    would send the repeated prompt wherever it first landed).
    """
    prompt = f"river [mock-fault error_after_tokens=2 error_code={code} error_retryable=true]"
    with trio.fail_after(120):
        async with (
            start_engine(dynamo_env, *ROUND_ROBIN, "--faults-from-prompt", name="engine-a") as engine_a,
            start_engine(dynamo_env, *ROUND_ROBIN, name="engine-b") as engine_b,
            start_sidecar(dynamo_env, engine_a.address, *FAST_WATCH, name="sidecar-a") as worker_a,
            start_sidecar(dynamo_env, engine_b.address, *FAST_WATCH, name="sidecar-b"),
        ):
            await wait_routable(frontend.url, workers=2)
            outcomes = [await stream_completion(frontend.url, prompt, max_tokens=12) for _ in range(6)]
            assert all(o.succeeded and o.completion_tokens == 12 for o in outcomes), outcomes
            assert f"ERROR_CODE_{code}" in worker_a.process.log(), "round-robin sent some requests to A, which failed"
            await wait_engine_idle(engine_a.address, timeout=3)
            await wait_engine_idle(engine_b.address, timeout=3)


@pytest.mark.parametrize(
    ("mock_violation", "our_violation"),
    [
        ("wrong_request_id", "wrong_request_id"),
        ("event_after_terminal", "event_after_terminal"),
        ("missing_output_index", "missing_output_index"),
        ("usage_on_non_final", "usage_before_end"),
        ("eof_before_terminal", "eof_before_terminal"),
        ("unspecified_finish", "unspecified_finish_reason"),
    ],
)
async def test_each_protocol_violation_fails_that_request_only(
    dynamo_env: DynamoEnv, frontend: Frontend, mock_violation: str, our_violation: str
) -> None:
    with trio.fail_after(90):
        async with (
            start_engine(dynamo_env, "--speedup", "0", "--faults-from-prompt") as engine,
            start_sidecar(dynamo_env, engine.address, *FAST_WATCH) as worker,
        ):
            await wait_routable(frontend.url, workers=1)
            prompt = f"river [mock-fault violation={mock_violation}]"
            outcome = await stream_completion(frontend.url, prompt, max_tokens=6)
            assert outcome.failed_cleanly, outcome
            await worker.process.wait_for_log(rf"engine protocol violation \({our_violation}\)", timeout=15)
            assert (await stream_completion(frontend.url, "The river", max_tokens=4)).succeeded
            assert worker.process.returncode is None
            await wait_engine_idle(engine.address, timeout=3)


async def test_an_unhealthy_engine_degrades_the_worker_and_recovery_reregisters_it(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """Health NOT_READY → degraded (withdrawn from routing, the process stays); READY again → serving again."""
    with trio.fail_after(90):
        async with (
            start_engine(dynamo_env, "--speedup", "0") as engine,
            start_sidecar(dynamo_env, engine.address, *FAST_WATCH) as worker,
        ):
            await wait_routable(frontend.url, workers=1)
            engine.process.signal(signal.SIGUSR1)
            await worker.process.wait_for_log(r"serving -> degraded", timeout=10)
            refused = await stream_completion(frontend.url, "The river", max_tokens=4)
            assert refused.failed_cleanly, refused
            engine.process.signal(signal.SIGUSR1)
            await worker.process.wait_for_log(r"degraded -> registering", timeout=10)
            await wait_until(lambda: _answers(frontend.url), timeout=10, interval=0.1)


async def test_an_engine_whose_health_lags_while_tokens_flow_is_busy_not_stalled(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """Health timing out while the engine's streams deliver tokens means busy: the in-flight request completes and
    the worker keeps serving. The same silence with nothing flowing is a stalled engine (the worker withdraws), which
    shows the difference is the token flow, not a laxer watch."""
    lagging_watch = (
        "--health-poll-interval-secs", "0.2", "--health-failure-threshold", "4", "--health-timeout-secs", "0.4",
        "--grpc-retry-interval-secs", "0.2", "--reconnect-backoff-max-secs", "0.5",
    )  # fmt: skip
    with trio.fail_after(120):
        async with (
            start_engine(
                dynamo_env, "--decode-ms-per-token", "20", "--fault-health-delay-ms", "1000", *ROUND_ROBIN[2:]
            ) as engine,
            start_sidecar(dynamo_env, engine.address, *lagging_watch) as worker,
        ):
            await wait_routable(frontend.url, workers=1)
            start = len(worker.process.log())
            assert "serving -> stalled" not in worker.process.log(), "the idle stall came before the stream started"
            outcome = await stream_completion(frontend.url, "The river", max_tokens=300)
            assert outcome.succeeded, outcome
            assert outcome.completion_tokens == 300
            during = worker.process.log()[start:]
            assert "busy, not stalled" in during
            assert "serving -> stalled" not in during
            await worker.process.wait_for_log(r"serving -> stalled", timeout=15, start=len(worker.process.log()))


async def _running_at_least(count: int, *addresses: str) -> bool:
    return sum([(await engine_load(address)).running_requests or 0 for address in addresses]) >= count


async def _answers(url: str) -> bool:
    return (await stream_completion(url, "The river", max_tokens=4)).succeeded
