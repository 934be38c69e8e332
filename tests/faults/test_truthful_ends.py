"""Stream ends and engine lifecycle through the real frontend (issue 14 items 2, 4, 5; issue 15 item 9).

Runs on today's ``openengine-mock``; the cases that need its TensorRT-LLM profile (split finish, detokenization
counters, GetLoad without KV usage) are in ``test_natural_stops.py``.
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack

import httpx
import pytest
import trio

from tests.helpers.processes import DynamoEnv, Frontend, free_port
from tests.helpers.stack import (
    MODEL,
    metric_sum,
    start_engine,
    start_sidecar,
    wait_engine_idle,
    wait_routable,
)
from tests.helpers.waits import wait_until

from ._client import Outcome, stream_completion
from ._natural import natural_stops

pytestmark = pytest.mark.e2e

ABORTS = "openengine_sidecar_aborts_total"
#: An engine without KV events: its worker registers for round-robin routing.
ROUND_ROBIN = ("--kv-events", "disabled")


async def worker_metrics(url: str) -> str:
    async with httpx.AsyncClient(timeout=10) as http:
        return (await http.get(f"{url}/metrics")).text


async def aborts_sent(url: str) -> float:
    return metric_sum(await worker_metrics(url), ABORTS, result="sent")


# -------------------------------------------------------------------- item 1: a complete answer is a finish


@pytest.mark.timeout(720)  # its own bound plus two minutes for the processes around it
async def test_two_hundred_natural_stops_are_finishes_without_aborts(dynamo_env: DynamoEnv, frontend: Frontend) -> None:
    """120 greedy answers end at EOS, 80 at the stop string " the" (10 ms per token, 16 at a time). Failed before:
    44 of the 200 were counted cancelled, each with an Abort -- the engine's last token reached the frontend in a
    chunk of its own, the frontend ended the stream there and dropped the finish (and the usage) after it."""
    with trio.fail_after(600):
        async with (
            start_engine(dynamo_env, "--decode-ms-per-token", "10") as engine,
            start_sidecar(dynamo_env, engine.address) as worker,
        ):
            await wait_routable(frontend.url, workers=1)
            await natural_stops(frontend.url, engine, worker, eos=120, stops=80)


# ------------------------------------------------------------ item 2: tokens sent before a terminal error arrive


async def test_every_client_sees_the_tokens_the_engine_sent_before_its_error(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """At 0 ms/token the 4 tokens and the EngineError come in one batch. Failed before: 6 of 10 clients saw no text
    (the error discarded the tokens mapped from its own batch)."""
    prompt = "river [mock-fault error_after_tokens=4 error_code=INTERNAL error_retryable=false]"
    with trio.fail_after(120):
        async with (
            start_engine(dynamo_env, "--speedup", "0", "--faults-from-prompt") as engine,
            start_sidecar(dynamo_env, engine.address),
        ):
            await wait_routable(frontend.url, workers=1)
            outcomes: list[Outcome] = []
            async with trio.open_nursery() as nursery:
                for _ in range(10):

                    async def client() -> None:
                        outcomes.append(await stream_completion(frontend.url, prompt, max_tokens=20))

                    nursery.start_soon(client)
            assert all(o.failed_cleanly for o in outcomes), outcomes
            with_text = sum(bool(o.text) for o in outcomes)
            print(f"clients that saw the tokens before the error: {with_text}/10")
            assert with_text == 10, outcomes
            await wait_engine_idle(engine.address, timeout=3)


# ------------------------------------------------------ issue 15 item 9: one Abort per disconnect, none otherwise


async def test_a_client_disconnect_mid_stream_is_exactly_one_abort_and_a_completed_request_none(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    body = {"model": MODEL, "prompt": "The river", "max_tokens": 300, "stream": True, "ignore_eos": True}
    with trio.fail_after(120):
        async with (
            start_engine(dynamo_env, "--decode-ms-per-token", "20") as engine,
            start_sidecar(dynamo_env, engine.address) as worker,
        ):
            await wait_routable(frontend.url, workers=1)
            before = await aborts_sent(worker.system_url)
            assert (await stream_completion(frontend.url, "The river", max_tokens=8)).succeeded
            await wait_engine_idle(engine.address, timeout=3)
            assert await aborts_sent(worker.system_url) == before, "a completed request sends no Abort"
            async with (
                httpx.AsyncClient(timeout=30) as http,
                http.stream("POST", f"{frontend.url}/v1/completions", json=body) as response,
            ):
                seen = 0
                lines = response.aiter_lines()
                async for line in lines:
                    seen += line.startswith("data: {")
                    if seen >= 3:
                        break
            await wait_engine_idle(engine.address, timeout=3)

            async def one_abort() -> bool:
                return await aborts_sent(worker.system_url) >= before + 1

            await wait_until(one_abort, timeout=5, interval=0.05)
            await trio.sleep(0.5)  # not a synchronisation: a negative check, time for a second Abort to show
            assert await aborts_sent(worker.system_url) == before + 1, "exactly one Abort for the disconnect"


# ------------------------------------------------------------------ item 4: a hung engine costs one timeout


@pytest.mark.parametrize("frontend", [3], indirect=True)
async def test_with_one_worker_a_hung_engine_costs_one_timeout_then_a_503(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """`--migration-limit 3`, one worker, Health READY, the request's stream silent. Failed before: the frontend
    migrated the request back to the same worker 3 times -- four timeouts (8.2 s here) before the client's error.

    The engine publishes no KV events (TensorRT-LLM's baseline), so the worker registers for round-robin routing,
    which retries the same worker; Dynamo's KV router excludes a worker already tried ("no untried eligible worker").
    """
    timeout = 2.0
    with trio.fail_after(120):
        async with (
            start_engine(dynamo_env, "--speedup", "0", "--faults-from-prompt", *ROUND_ROBIN) as engine,
            start_sidecar(
                dynamo_env,
                engine.address,
                "--request-inactivity-timeout-secs", str(timeout), "--health-poll-interval-secs", "0.5",
            ) as worker,
        ):  # fmt: skip
            await wait_routable(frontend.url, workers=1)
            started = trio.current_time()
            outcome = await stream_completion(frontend.url, "river [mock-fault hang_after_tokens=0]", max_tokens=20)
            took = trio.current_time() - started
            print(f"hung engine: the client's error came after {took:.1f}s (inactivity timeout {timeout:g}s)")
            assert outcome.failed_cleanly, outcome
            assert took < 2 * timeout, f"{took:.1f}s: more than one timeout"
            log = worker.process.log()
            assert "serving -> degraded (degrade): engine not producing" in log
            # The engine serves other requests: the canary generation succeeds and the worker is back.
            await worker.process.wait_for_log(r"canary generation answered", timeout=20)
            await worker.process.wait_for_log(r"degraded -> registering", timeout=20)

            async def answers() -> bool:
                return (await stream_completion(frontend.url, "The river", max_tokens=4)).succeeded

            await wait_until(answers, timeout=20, interval=0.2)
            await wait_engine_idle(engine.address, timeout=5)


# ------------------------------------------------------------- item 5: a quick restart with other capabilities


async def guided(url: str) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Answer in JSON"}],
        # Room for the whole object the mock's guide builds (up to three keys with scalar values).
        "max_tokens": 128,
        "response_format": {"type": "json_object"},
    }
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(f"{url}/v1/chat/completions", json=body)


#: The mock's default profile (TensorRT-LLM's server) advertises guided decoding; the "plain" engine must not.
NO_GUIDED = ("--capability", "guided=false")


@pytest.mark.timeout(360)  # its own bound plus two minutes for the processes around it
async def test_an_engine_restarted_within_a_second_with_guided_added_then_removed_is_rediscovered(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """Failed before: the sidecar kept the first engine's capabilities -- guided decoding still refused after the
    restart that added it, and forwarded (then refused by the engine) after the one that removed it.

    The worker keeps the default health watch (2 s polls, 3 failures). A restart of under a second is noticed by the
    load poller (a new instance id), or by a health poll that lands in the outage and finds the port refusing.
    """
    port = free_port()
    with trio.fail_after(240):
        async with AsyncExitStack() as stack:
            engine = await stack.enter_async_context(
                start_engine(dynamo_env, "--speedup", "0", *NO_GUIDED, port=port, name="engine-plain")
            )
            worker = await stack.enter_async_context(start_sidecar(dynamo_env, engine.address))
            await wait_routable(frontend.url, workers=1)
            refused = await guided(frontend.url)
            assert refused.status_code == 400, refused.text
            assert "guided" in refused.text
            for name, args, expect in [
                ("engine-guided", ("--capability", "guided=true"), 200),
                ("engine-plain-again", NO_GUIDED, 400),
            ]:
                mark = len(worker.process.log())
                killed = trio.current_time()
                engine.process.proc.kill()
                engine = await stack.enter_async_context(
                    start_engine(dynamo_env, "--speedup", "0", *args, port=port, name=name)
                )
                outage = trio.current_time() - killed
                await worker.process.wait_for_log(r"registering -> serving", timeout=30, start=mark)
                after = worker.process.log()[mark:]
                by_instance = "engine restarted: instance" in after
                by_port = "nothing accepts connections" in after
                by = "load poller" if by_instance else "health watch (the port refused)" if by_port else "nothing"
                print(f"{name}: engine back after {outage:.2f}s; noticed by the {by}")
                assert by_instance or by_port, "a quick restart is noticed before three health polls could call it"
                await wait_routable(frontend.url, workers=1)
                answer = await guided(frontend.url)
                assert answer.status_code == expect, (name, answer.text)
                if expect == 200:
                    choice = answer.json()["choices"][0]
                    assert choice["finish_reason"] == "stop", choice
                    assert isinstance(json.loads(choice["message"]["content"]), dict), choice
                else:
                    assert "guided" in answer.text, "refused by the sidecar (400), not forwarded to the engine"
            assert worker.process.returncode is None
