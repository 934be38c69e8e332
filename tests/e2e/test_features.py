"""End to end: capability-gated request features (issue #7) through the real frontend → sidecar → ``openengine-mock``.

With the features advertised, the engine honours them (guided JSON object and choice outputs, prompt logprobs in the
response) and its ``mock_stats`` show priority and cache salt arrived; without, each is refused with a 400 naming it,
before any RPC (the engine serves nothing).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from tests.helpers.processes import DynamoEnv, Frontend
from tests.helpers.stack import MODEL, engine_and_worker, mock_stats

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Tell me about the river."}]


async def chat(url: str, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body})


async def test_advertised_features_reach_the_engine(dynamo_env: DynamoEnv, frontend: Frontend) -> None:
    with trio.fail_after(120):
        # The full engine: guided choice and priority (TensorRT-LLM offers neither).
        async with engine_and_worker(
            dynamo_env, frontend, "--profile", "full", "--capability", "guided=true", "--capability", "priority=true"
        ) as engine:
            url = frontend.url
            # The mock's JSON objects run up to 45 tokens (100,000 seeds); a smaller budget cuts 30 % of them short,
            # as xgrammar's would be: a valid object needs room to finish.
            answer = await chat(url, max_tokens=128, response_format={"type": "json_object"})
            assert answer.status_code == 200, answer.text
            choice = answer.json()["choices"][0]
            assert choice["finish_reason"] == "stop", choice
            assert isinstance(json.loads(choice["message"]["content"]), dict)

            answer = await chat(url, max_tokens=32, guided_choice=["maybe", "never"])
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"] in ("maybe", "never")

            answer = await chat(url, max_tokens=2, prompt_logprobs=1)
            assert answer.status_code == 200, answer.text
            prompt_logprobs = answer.json()["prompt_logprobs"]
            assert prompt_logprobs[0] is None
            assert len(prompt_logprobs) == answer.json()["usage"]["prompt_tokens"]
            assert all(isinstance(position, dict) and position for position in prompt_logprobs[1:])

            before = await mock_stats(engine)
            answer = await chat(url, max_tokens=2, nvext={"agent_hints": {"priority": 7}, "cache_salt": "tenant-a"})
            assert answer.status_code == 200, answer.text
            after = await mock_stats(engine)
            assert after.get("priority_requests", 0) == before.get("priority_requests", 0) + 1
            assert after["last_priority"] == 7
            assert after.get("cache_salt_requests", 0) == before.get("cache_salt_requests", 0) + 1
            assert after.get("guided_requests", 0) >= 2

            # Engine-specific knobs ride in GenerateRequest.extra (openengine-mock's own: a scripted output).
            scripted = {"mock": {"tokens": [268, 268, 268]}}
            answer = await chat(url, max_tokens=3, nvext={"annotations": [f"openengine-extra:{json.dumps(scripted)}"]})
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 3
            assert answer.json()["choices"][0]["message"]["content"].replace(" ", "") == "TheTheThe"
            answer = await chat(url, max_tokens=3, nvext={"annotations": ["openengine-extra:[1]"]})
            assert answer.status_code == 400
            assert "openengine-extra" in answer.json()["message"]

            # A mode the engine does not offer is refused naming it.
            answer = await chat(url, max_tokens=2, guided_regex="a+")
            assert answer.status_code == 400
            assert "guided_decoding.regex" in answer.json()["message"]


async def test_unadvertised_features_are_refused_before_any_rpc(dynamo_env: DynamoEnv, frontend: Frontend) -> None:
    with trio.fail_after(120):
        # TensorRT-LLM's server without a guided decoding backend, cache salt or prompt logprobs.
        async with engine_and_worker(
            dynamo_env,
            frontend,
            "--capability",
            "guided=false",
            "--capability",
            "cache_salt=false",
            "--capability",
            "prompt_logprobs=false",
        ) as engine:
            url = frontend.url
            before = await mock_stats(engine)
            cases: list[tuple[dict[str, Any], str]] = [
                ({"response_format": {"type": "json_object"}}, "sampling_options.guided_decoding"),
                ({"guided_choice": ["a", "b"]}, "sampling_options.guided_decoding"),
                ({"prompt_logprobs": 1}, "output_options.prompt_logprobs"),
                ({"nvext": {"agent_hints": {"priority": 7}}}, "routing.priority"),
                ({"nvext": {"cache_salt": "tenant-a"}}, "routing.cache_salt"),
            ]
            for body, field in cases:
                answer = await chat(url, max_tokens=2, **body)
                assert answer.status_code == 400, (body, answer.text)
                assert field in answer.json()["message"], (body, answer.text)
            after = await mock_stats(engine)
            assert after.get("requests", 0) == before.get("requests", 0), "nothing reached the engine"
