"""End to end, through the real frontend: the sidecar's answers where its behaviour changes with TensorRT-LLM's server
(``--profile trtllm``, TensorRT-LLM's server on the wire; issue 22).

* **Stop words** are matched by TensorRT-LLM as token sequences and trimmed: never streamed, not counted. The client
  gets exactly the text and ``completion_tokens`` TensorRT-LLM produced, the request ends as a finish (no cancel, no
  Abort). The ``full`` engine, which keeps and counts the stopping token, runs the same cases beside it.
* **A KV transfer failure** reaches a decode leg on TensorRT-LLM as a plain ``EngineError(INTERNAL)``; the client gets
  a 500 (an engine failure, not its own fault), as it does for the ``full`` engine's ``KV_TRANSFER_FAILED`` and
  ``KV_SESSION_NOT_FOUND``.
* **Logprobs across the handoff**: TensorRT-LLM's ``PrefillReady`` carries ``first_gen_log_probs`` and the decode leg
  replays the first token with them; the client's first token has its real logprob and candidates, not the floor.

The load estimate for an engine whose ``GetLoad`` has no KV usage (TensorRT-LLM's) is in
``tests/faults/test_natural_stops.py``. Outputs are scripted (``extra.mock.tokens`` through the ``openengine-extra``
annotation) or checked against the mock's own language model, so every expected figure is computed, not recorded.
"""

from __future__ import annotations

import json
import math
import signal
from typing import Any

import httpx
import pytest
import trio

from sidecar.convert.response import LOGPROB_FLOOR
from sidecar.testing.mock.lm import TinyLM
from tests.e2e.test_disagg import Disagg, engine_view, start_disagg, user, wait_quiet
from tests.helpers.processes import DynamoEnv, Frontend
from tests.helpers.stack import (
    MODEL,
    MODEL_DIR,
    dump_logs,
    metric_sum,
    mock_stats,
    start_engine,
    start_sidecar,
    wait_engine_idle,
    wait_routable,
)
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.e2e

ENDED = "openengine_sidecar_requests_ended_total"
ABORTS = "openengine_sidecar_aborts_total"


@pytest.fixture(scope="module")
def lm() -> TinyLM:
    return TinyLM.load(MODEL_DIR)


async def worker_metrics(url: str) -> str:
    async with httpx.AsyncClient(timeout=10) as http:
        return (await http.get(f"{url}/metrics")).text


async def stream_completion(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed completion as the client saw it: text, finish reason, usage, [DONE], any error event."""
    seen: dict[str, Any] = {"text": "", "finish_reason": None, "usage": None, "done": False, "error": None}
    payload = {**body, "model": MODEL, "stream": True, "stream_options": {"include_usage": True}}
    async with (
        httpx.AsyncClient(timeout=60) as http,
        http.stream("POST", f"{url}/v1/completions", json=payload) as response,
    ):
        seen["status"] = response.status_code
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                seen["done"] = True
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            seen["error"] = seen["error"] or event.get("error")
            for choice in event.get("choices", []):
                seen["text"] += choice.get("text") or ""
                seen["finish_reason"] = choice.get("finish_reason") or seen["finish_reason"]
            seen["usage"] = event.get("usage") or seen["usage"]
    return seen


# ------------------------------------------------------------------------------------ stop trimming and usage

#: The scripted output: nine single-token words (`lm.encode` checks it), then the script runs out (LENGTH).
SCRIPT_TEXT = " the river flows to the sea and the mill"


def scripted(ids: list[int]) -> dict[str, Any]:
    return {"nvext": {"annotations": [f"openengine-extra:{json.dumps({'mock': {'tokens': ids}})}"]}}


@pytest.mark.parametrize("profile", ["trtllm", "full"])
async def test_a_stop_word_is_trimmed_and_uncounted_on_tensorrt_llm_and_ends_as_a_finish(
    dynamo_env: DynamoEnv, frontend: Frontend, lm: TinyLM, profile: str
) -> None:
    script = lm.encode(SCRIPT_TEXT)
    assert len(script) == 9, script
    sea, the = lm.encode(" sea"), lm.encode(" the")
    assert len(sea) == len(the) == 1
    at_sea = script.index(sea[0])
    # (request, tokens the output keeps before the stop, the stopping tokens)
    cases: list[tuple[dict[str, Any], int, int]] = [
        ({"stop": [" sea"]}, at_sea, 1),  # a one-token stop word
        ({"stop": [" and the"]}, at_sea + 1, 2),  # two tokens: held back, then trimmed together
        ({"stop_token_ids": sea}, at_sea, 1),  # a stop token id
        ({"stop": [" the"]}, 0, 1),  # a stop on the very first token: TensorRT-LLM sends no token at all
    ]
    with trio.fail_after(180):
        async with (
            start_engine(dynamo_env, "--profile", profile, "--speedup", "0") as engine,
            start_sidecar(dynamo_env, engine.address, "--abort-timeout-secs", "1") as worker,
        ):
            await wait_routable(frontend.url, workers=1)
            try:
                metrics_before = await worker_metrics(worker.system_url)
                stats_before = await mock_stats(engine.address)
                for extra, kept, stopping in cases:
                    body = {"prompt": "The river", "max_tokens": 16, "temperature": 0, **extra, **scripted(script)}
                    answer = await stream_completion(frontend.url, body)
                    expected_text = lm.decode(script[:kept])
                    # TensorRT-LLM trims the stop word's tokens; the full engine keeps and counts the stopping token
                    # (the frontend hides its text).
                    expected_tokens = kept if profile == "trtllm" else kept + stopping
                    assert answer["status"] == 200, (extra, answer)
                    assert answer["error"] is None, (extra, answer)
                    assert answer["done"], (extra, answer)
                    assert answer["finish_reason"] == "stop", (extra, answer)
                    assert answer["text"] == expected_text, (extra, answer)
                    assert answer["usage"]["completion_tokens"] == expected_tokens, (extra, answer)
                    async with httpx.AsyncClient(timeout=60) as http:
                        unary = await http.post(f"{frontend.url}/v1/completions", json={"model": MODEL, **body})
                    assert unary.status_code == 200, unary.text
                    assert unary.json()["choices"][0]["text"] == expected_text, (extra, unary.text)
                    assert unary.json()["usage"]["completion_tokens"] == expected_tokens, (extra, unary.text)
                await wait_engine_idle(engine.address, timeout=10)

                async def every_end_counted() -> str:
                    text = await worker_metrics(worker.system_url)
                    ended = metric_sum(text, ENDED) - metric_sum(metrics_before, ENDED)
                    return text if ended >= 2 * len(cases) else ""

                metrics_after = await wait_until(every_end_counted, timeout=10, what="the last request's end")
                stats_after = await mock_stats(engine.address)
            except BaseException:
                dump_logs(dynamo_env)
                raise

    def delta(name: str, **labels: str) -> float:
        return metric_sum(metrics_after, name, **labels) - metric_sum(metrics_before, name, **labels)

    # Every answer was complete: each request ended as a finish, none was cancelled or aborted on either side.
    assert delta(ENDED, outcome="finished") == 2 * len(cases)
    assert delta(ENDED, outcome="cancelled") == 0, "a stopped answer counted as cancelled"
    assert delta(ABORTS) == 0, "an Abort for a complete answer"
    for counter in ("aborts_received", "requests_cancelled", "requests_aborted"):
        assert stats_after.get(counter, 0) == stats_before.get(counter, 0), counter
    assert "stopped by the client" not in worker.process.log()


# ------------------------------------------------------------------------------ KV transfer failure → HTTP status

#: What the decode worker's log says about the failed leg, per engine: TensorRT-LLM reports every failed transfer as a
#: plain executor error; the full engine names it.
EXPIRED = {"trtllm": r"OpenEngine \[INTERNAL\]: KV session \S+ expired", "full": r"\[KV_SESSION_NOT_FOUND\]: .*expired"}
CUT = {"trtllm": r"OpenEngine \[INTERNAL\]: .*closed the KV transfer", "full": r"\[KV_TRANSFER_FAILED\]: .*closed"}


async def chat_status(url: str, text: str, max_tokens: int = 8) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as http:
        body = {"model": MODEL, "messages": user(text), "max_tokens": max_tokens, "ignore_eos": True}
        return await http.post(f"{url}/v1/chat/completions", json=body)


@pytest.mark.parametrize("profile", ["trtllm", "full"])
async def test_a_kv_session_that_expired_before_the_decode_claim_is_a_500(
    dynamo_env: DynamoEnv, frontend: Frontend, profile: str
) -> None:
    """The decode engine runs one request at a time; while a long answer holds it, a second request's decode leg
    queues there longer than the prefill engine holds its KV session (2 s): the claim finds the session expired."""
    with trio.fail_after(180):
        async with start_disagg(
            dynamo_env,
            frontend,
            profile=profile,
            prefill_args=("--kv-session-timeout", "2"),
            decode_args=("--max-running-requests", "1"),
        ) as stack:
            _, before_p = await engine_view(stack.prefill.address)
            _, before_d = await engine_view(stack.decode.address)
            long: list[httpx.Response] = []
            async with trio.open_nursery() as nursery:

                async def blocker() -> None:
                    long.append(await chat_status(frontend.url, "Tell me a long story.", max_tokens=600))

                nursery.start_soon(blocker)
                await wait_until(lambda: _decode_view(stack, "live_requests"), timeout=30, interval=0.05)
                victim = await chat_status(frontend.url, "Tell me about the river.")
            # A failed KV transfer is the engines' failure, never the client's: 500, not 4xx. The frontend hides a
            # 500's message; the decode worker's log says why.
            assert victim.status_code == 500, (victim.status_code, victim.text)
            await stack.decode_worker.process.wait_for_log(EXPIRED[profile], 10)
            # Nothing lost: the long answer is whole, the expired session was released, no engine holds anything.
            assert long[0].status_code == 200, long[0].text
            assert long[0].json()["usage"]["completion_tokens"] == 600
            _, stats_p = await wait_quiet(stack.prefill.address)
            _, stats_d = await wait_quiet(stack.decode.address)
            assert stats_p.get("kv_sessions_expired", 0) - before_p.get("kv_sessions_expired", 0) == 1
            assert stats_d.get("decode_kv_failures", 0) - before_d.get("decode_kv_failures", 0) == 1
            assert stats_p["used_kv_blocks"] == 0


@pytest.mark.parametrize("profile", ["trtllm", "full"])
async def test_a_kv_transfer_cut_by_the_prefill_engine_dying_is_a_500(
    dynamo_env: DynamoEnv, frontend: Frontend, profile: str
) -> None:
    """The KV transfer takes 3 s; the prefill engine is killed while the decode engine pulls the KV cache."""
    with trio.fail_after(180):
        async with start_disagg(
            dynamo_env, frontend, profile=profile, prefill_args=("--kv-transfer-ms", "3000")
        ) as stack:
            _, before_d = await engine_view(stack.decode.address)
            answers: list[httpx.Response] = []
            async with trio.open_nursery() as nursery:

                async def request() -> None:
                    answers.append(await chat_status(frontend.url, "Tell me about the river."))

                nursery.start_soon(request)
                # The decode engine's claim is in flight.
                await wait_until(lambda: _decode_view(stack, "active_kv_sessions"), timeout=30, interval=0.05)
                stack.prefill.process.signal(signal.SIGKILL)
                await stack.prefill.process.wait(10)
            assert answers[0].status_code == 500, (answers[0].status_code, answers[0].text)
            await stack.decode_worker.process.wait_for_log(CUT[profile], 10)
            _, stats_d = await wait_quiet(stack.decode.address)
            assert stats_d.get("decode_kv_failures", 0) - before_d.get("decode_kv_failures", 0) == 1
            assert stats_d["used_kv_blocks"] == 0


# ----------------------------------------------------------------------------------- logprobs across the handoff


async def test_the_first_token_keeps_its_logprob_and_candidates_across_the_handoff(
    dynamo_env: DynamoEnv, frontend: Frontend, lm: TinyLM
) -> None:
    """Prefill on one TensorRT-LLM engine, decode on the other, with top-2 logprobs: every token's logprob and
    candidates are the model's own (``lm``), the first one included, which the decode engine replays from the prefill
    leg's ``first_gen_log_probs`` (without them the sidecar would fill in the −9999 floor and no candidates)."""
    prompt = lm.encode("The river")
    expected: list[list[tuple[str, float]]] = []  # per position, the greedy top-2: (token text, logprob)
    context = list(prompt)
    for _ in range(6):
        top = lm.top_logprobs(context, 2)
        expected.append([(lm.decode([token]), logprob) for token, logprob in top])
        context.append(top[0][0])
    with trio.fail_after(150):
        async with start_disagg(dynamo_env, frontend, prefill_args=("--speedup", "0")) as stack:
            _, before_p = await engine_view(stack.prefill.address)
            _, before_d = await engine_view(stack.decode.address)
            async with httpx.AsyncClient(timeout=60) as http:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2}
                response = await http.post(f"{frontend.url}/v1/completions", json=body)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            _, stats_p = await wait_quiet(stack.prefill.address)
            _, stats_d = await wait_quiet(stack.decode.address)
    # It really was split: one leg on each engine.
    assert stats_p["prefill_legs"] - before_p.get("prefill_legs", 0) == 1
    assert stats_d["decode_legs"] - before_d.get("decode_legs", 0) == 1
    logprobs = choice["logprobs"]
    assert choice["text"] == "".join(top[0][0] for top in expected)
    assert logprobs["tokens"] == [top[0][0] for top in expected]
    for position, (got, top, want) in enumerate(
        zip(logprobs["token_logprobs"], logprobs["top_logprobs"], expected, strict=True)
    ):
        assert math.isfinite(got), (position, got)
        assert got > LOGPROB_FLOOR, (position, got)
        assert got == pytest.approx(want[0][1], abs=1e-5), position
        assert sorted(top) == sorted(text for text, _ in want), (position, top)
        for text, logprob in want:
            assert top[text] == pytest.approx(logprob, abs=1e-5), (position, text)


async def _decode_view(stack: Disagg, key: str) -> int:
    """One count of the decode engine's own view (``mock_stats``), e.g. its live requests."""
    return int((await engine_view(stack.decode.address))[1].get(key) or 0)
