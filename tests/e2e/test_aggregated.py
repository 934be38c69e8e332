"""End to end: the real Dynamo frontend → ``openengine-sidecar`` → ``openengine-mock``, as three processes.

The engine is the mock's default profile, TensorRT-LLM's server (``--profile trtllm``); the richer ``full`` engine
is run too where the two differ in what the client sees (stop words).

Rules: loopback only, OS-picked ports (system ports below 32768: Dynamo parses them as i16), every wait bounded,
every process killed by the fixture that started it. Clients are real OpenAI clients over HTTP (run in a thread);
the engine's own view (GetLoad) is read with the project's OpenEngine client.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
import trio
from openai.types.chat import ChatCompletionMessageParam

from tests.helpers.processes import DynamoEnv, Frontend
from tests.helpers.stack import (
    MODEL,
    dump_logs,
    mock_stats,
    running_requests,
    start_engine,
    start_sidecar,
    wait_routable,
)
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.e2e

T = TypeVar("T")


@dataclass
class Stack:
    frontend: Frontend
    engine: str
    worker_pid: int

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.frontend.url}/v1", api_key="unused", timeout=60, max_retries=0)

    async def call(self, fn: Callable[[openai.OpenAI], T]) -> T:
        return await trio.to_thread.run_sync(lambda: fn(self.client()))

    async def running_requests(self) -> int:
        return await running_requests(self.engine)


@asynccontextmanager
async def start_stack(
    denv: DynamoEnv, frontend: Frontend, *mock_args: str, sidecar_args: tuple[str, ...] = ()
) -> AsyncIterator[Stack]:
    async with (
        start_engine(denv, *mock_args) as engine,
        start_sidecar(denv, engine.address, "--abort-timeout-secs", "1", *sidecar_args) as worker,
    ):
        await wait_routable(frontend.url, workers=1)
        try:
            yield Stack(frontend, engine.address, worker.process.pid)
        except BaseException:
            dump_logs(denv)
            raise


def user(text: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": text}]


CHAT = user("Tell me about the river.")


async def test_chat_and_completions_streaming_and_not_with_usage(dynamo_env: DynamoEnv, frontend: Frontend) -> None:
    with trio.fail_after(120):
        async with start_stack(dynamo_env, frontend, "--speedup", "0") as stack:
            chat = await stack.call(
                lambda c: c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
            )
            assert chat.choices[0].message.content
            assert chat.usage is not None
            assert 0 < chat.usage.completion_tokens <= 16
            assert chat.choices[0].finish_reason in ("stop", "length")

            def stream_chat(c: openai.OpenAI) -> tuple[str, Any]:
                text, usage = "", None
                for chunk in c.chat.completions.create(
                    model=MODEL,
                    messages=CHAT,
                    max_tokens=16,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                ):
                    if chunk.choices and chunk.choices[0].delta.content:
                        text += chunk.choices[0].delta.content
                    if chunk.usage is not None:
                        usage = chunk.usage
                return text, usage

            streamed, usage = await stack.call(stream_chat)
            assert streamed == chat.choices[0].message.content, "greedy: streamed and unary answers agree"
            assert usage is not None
            assert usage.completion_tokens == chat.usage.completion_tokens

            completion = await stack.call(
                lambda c: c.completions.create(
                    model=MODEL, prompt="The river", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
                )
            )
            assert completion.choices[0].finish_reason == "length"
            assert completion.usage is not None
            assert completion.usage.completion_tokens == 5

            def stream_completion(c: openai.OpenAI) -> int:
                return sum(
                    1
                    for chunk in c.completions.create(
                        model=MODEL, prompt="The river", max_tokens=7, stream=True, extra_body={"ignore_eos": True}
                    )
                    if chunk.choices and chunk.choices[0].text
                )

            assert 1 <= await stack.call(stream_completion) <= 7


@pytest.mark.parametrize("profile", ["trtllm", "full"])
async def test_n2_logprobs_stop_strings_and_max_tokens(dynamo_env: DynamoEnv, frontend: Frontend, profile: str) -> None:
    with trio.fail_after(120):
        async with start_stack(dynamo_env, frontend, "--profile", profile, "--speedup", "0") as stack:
            two = await stack.call(
                lambda c: c.completions.create(
                    model=MODEL,
                    prompt="The river",
                    max_tokens=8,
                    n=2,
                    temperature=1.0,
                    seed=7,
                    extra_body={"ignore_eos": True},
                )
            )
            assert sorted(choice.index for choice in two.choices) == [0, 1]
            assert two.usage is not None
            assert two.usage.completion_tokens == 16

            with_logprobs = await stack.call(
                lambda c: c.completions.create(
                    model=MODEL,
                    prompt="The river",
                    max_tokens=4,
                    logprobs=2,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
            )
            logprobs = with_logprobs.choices[0].logprobs
            assert logprobs is not None
            assert logprobs.token_logprobs is not None
            assert len(logprobs.token_logprobs) == 4
            assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs)
            assert logprobs.top_logprobs is not None
            assert all(len(top) >= 1 for top in logprobs.top_logprobs)

            # No ignore_eos here: with it the frontend drops stop strings before they reach the worker.
            greedy = await stack.call(
                lambda c: c.completions.create(model=MODEL, prompt="The river", max_tokens=24, temperature=0)
            )
            text = greedy.choices[0].text
            words = text.split()
            assert len(words) >= 3, text
            stop_word = words[2]
            stopped = await stack.call(
                lambda c: c.completions.create(
                    model=MODEL, prompt="The river", max_tokens=24, temperature=0, stop=[stop_word]
                )
            )
            assert stopped.choices[0].finish_reason == "stop"
            assert stop_word not in stopped.choices[0].text
            assert text.startswith(stopped.choices[0].text)


def _thread_policies(pid: int) -> set[int]:
    """The scheduling policy (``/proc/<pid>/task/<tid>/stat`` field 41) of every thread of ``pid``."""
    policies = set()
    for task in (Path(f"/proc/{pid}/task")).iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        policies.add(int(fields[38]))
    return policies


@pytest.mark.parametrize(
    ("egress", "scheduling"), [("push", "batch"), ("pull", "normal")], ids=["push-batch", "pull-normal"]
)
async def test_64_concurrent_streams_all_complete_with_exact_token_counts(
    dynamo_env: DynamoEnv, frontend: Frontend, egress: str, scheduling: str
) -> None:
    """Both ways chunks reach Dynamo (``--dynamo-egress``: push through its ResponseSender, the default; pull from
    the handler's iterator) serve every stream exactly, and ``--cpu-scheduling`` holds for every thread the worker
    runs, Dynamo's own included (they start after the policy is set)."""
    counts: list[tuple[int, int]] = []

    def one(c: openai.OpenAI, i: int) -> tuple[int, int]:
        pieces, usage = 0, None
        for chunk in c.chat.completions.create(
            model=MODEL,
            messages=user(f"Story number {i}."),
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces += 1
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        assert usage is not None
        return pieces, usage

    args = ("--dynamo-egress", egress, "--cpu-scheduling", scheduling)
    with trio.fail_after(180):
        async with start_stack(dynamo_env, frontend, "--decode-ms-per-token", "5", sidecar_args=args) as stack:
            client = stack.client()

            async def run(i: int) -> None:
                counts.append(await trio.to_thread.run_sync(one, client, i, limiter=limiter))

            limiter = trio.CapacityLimiter(64)
            async with trio.open_nursery() as nursery:
                for i in range(64):
                    nursery.start_soon(run, i)
            assert len(counts) == 64
            assert all(usage == 24 for _, usage in counts), counts
            assert all(pieces >= 1 for pieces, _ in counts)
            assert await stack.running_requests() == 0
            expected = os.SCHED_BATCH if scheduling == "batch" else os.SCHED_OTHER
            assert _thread_policies(stack.worker_pid) == {expected}


async def test_an_unsupported_feature_gets_a_400_naming_it_and_the_worker_stays_healthy(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    with trio.fail_after(120):
        # TensorRT-LLM started without a guided decoding backend advertises none.
        async with start_stack(dynamo_env, frontend, "--speedup", "0", "--capability", "guided=false") as stack:
            with pytest.raises(openai.BadRequestError) as refused:
                await stack.call(
                    lambda c: c.chat.completions.create(
                        model=MODEL,
                        messages=CHAT,
                        max_tokens=8,
                        response_format={"type": "json_object"},
                    )
                )
            assert refused.value.status_code == 400
            assert "guided_decoding" in str(refused.value)
            ok = await stack.call(lambda c: c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4))
            assert ok.choices[0].message.content is not None


async def test_a_json_object_response_format_is_honoured_by_default(dynamo_env: DynamoEnv, frontend: Frontend) -> None:
    with trio.fail_after(120):
        async with start_stack(dynamo_env, frontend, "--speedup", "0") as stack:
            answer = await stack.call(
                lambda c: c.chat.completions.create(
                    model=MODEL, messages=CHAT, max_tokens=64, response_format={"type": "json_object"}
                )
            )
            content = answer.choices[0].message.content
            assert content is not None
            assert isinstance(json.loads(content), dict), content


async def test_a_client_that_disconnects_mid_stream_leaves_no_engine_request(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    with trio.fail_after(120):
        async with start_stack(dynamo_env, frontend, "--decode-ms-per-token", "20") as stack:
            body = {"model": MODEL, "prompt": "The river", "max_tokens": 500, "stream": True, "ignore_eos": True}
            async with (
                httpx.AsyncClient(timeout=30) as http,
                http.stream("POST", f"{frontend.url}/v1/completions", json=body) as response,
            ):
                assert response.status_code == 200
                seen = 0
                # Keep a reference: trio finalises an abandoned async generator, which would close the response.
                lines = response.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):
                        seen += 1
                    if seen >= 3:
                        break
                assert await stack.running_requests() == 1
            # The connection is closed: within 1 s the engine must hold nothing for this client.

            async def released() -> bool:
                return await stack.running_requests() == 0

            await wait_until(released, timeout=1.0, interval=0.02, what="the engine released the request")
            # Besides resetting the stream, the worker sent Control.Abort for it (the mock's abort log).

            async def aborted() -> dict[str, Any]:
                stats = await mock_stats(stack.engine)
                return stats if stats.get("aborts_by_request_id") else {}

            stats = await wait_until(aborted, timeout=10, interval=0.05)
            assert stats["aborts_received"] == 1, stats


async def test_an_engine_error_mid_stream_reaches_the_client_as_an_error(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    fault = "Tell me about the river. [mock-fault error_after_tokens=3 error_code=INTERNAL]"
    with trio.fail_after(120):
        async with start_stack(dynamo_env, frontend, "--speedup", "0", "--faults-from-prompt") as stack:
            with pytest.raises(openai.InternalServerError):
                await stack.call(
                    lambda c: c.chat.completions.create(
                        model=MODEL,
                        messages=user(fault),
                        max_tokens=16,
                        extra_body={"ignore_eos": True},
                    )
                )
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": fault}],
                "max_tokens": 16,
                "stream": True,
                "ignore_eos": True,
            }
            events: list[dict[str, Any]] = []
            async with (
                httpx.AsyncClient(timeout=30) as http,
                http.stream("POST", f"{frontend.url}/v1/chat/completions", json=body) as response,
            ):
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line.removeprefix("data: ")))
            finishes = [c.get("finish_reason") for e in events for c in e.get("choices", [])]
            assert any("error" in e for e in events), events
            assert "stop" not in finishes, "an engine error must not look like success"
            assert "length" not in finishes, "an engine error must not look like success"
            assert await stack.running_requests() == 0
