"""End to end: capability-gated request features (issue #7) through the real frontend → sidecar → ``openengine-mock``.

With the features advertised, the engine honours them (guided JSON object and choice outputs, prompt logprobs in the
response) and its ``mock_stats`` show priority and cache salt arrived; without, each is refused with a 400 naming it,
before any RPC (the engine serves nothing).

Then what the client sees where Dynamo's frontend and the engine each do part of the work (issue 27): a stop token
kept by ``include_stop_str_in_output``, chat logprobs without ``top_logprobs``, and usage after a migration.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from sidecar.testing.mock.lm import TinyLM
from tests.helpers.processes import DynamoEnv, Frontend
from tests.helpers.stack import (
    MODEL,
    MODEL_DIR,
    dump_logs,
    engine_and_worker,
    mock_stats,
    start_engine,
    start_sidecar,
    wait_routable,
)

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


# ------------------------------------------------------------------- where the frontend and the engine share the work


@pytest.fixture(scope="module")
def lm() -> TinyLM:
    return TinyLM.load(MODEL_DIR)


def scripted(ids: list[int]) -> dict[str, Any]:
    """The mock emits exactly these token ids (``extra.mock.tokens`` through the ``openengine-extra`` annotation)."""
    return {"nvext": {"annotations": [f"openengine-extra:{json.dumps({'mock': {'tokens': ids}})}"]}}


async def stream_chat(url: str, **body: Any) -> tuple[str, dict[str, Any]]:
    """A streamed chat completion: its text and its usage."""
    payload = {"model": MODEL, "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}, **body}
    text, usage = "", dict[str, Any]()
    async with (
        httpx.AsyncClient(timeout=30) as http,
        http.stream("POST", f"{url}/v1/chat/completions", json=payload) as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                text += "".join(c["delta"].get("content") or "" for c in event.get("choices", []))
                usage = event.get("usage") or usage
    return text, usage


async def test_a_stop_token_kept_by_include_stop_str_in_output_is_neither_shown_nor_counted(
    dynamo_env: DynamoEnv, frontend: Frontend, lm: TinyLM
) -> None:
    """Issue 27 item 4(a). TensorRT-LLM keeps the stop token id in its output with ``include_stop_in_output`` (tokens
    and count); Dynamo's frontend never shows a ``stop_token_ids`` token and counts every token id it is sent. Failed
    before: the text was "The river flows" and ``completion_tokens`` 4. A stop string stays visible with the flag."""
    script = lm.encode(" The river flows to the sea")
    to = lm.encode(" to")
    assert len(to) == 1
    assert to[0] in script
    kept = script[: script.index(to[0])]
    with trio.fail_after(120):
        async with engine_and_worker(dynamo_env, frontend):  # TensorRT-LLM's profile: supports_stop_in_output
            url = frontend.url
            body = {"max_tokens": 16, "stop_token_ids": to, "include_stop_str_in_output": True, **scripted(script)}
            answer = await chat(url, **body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"] == lm.decode(kept)
            assert answer.json()["choices"][0]["finish_reason"] == "stop"
            assert answer.json()["usage"]["completion_tokens"] == len(kept)
            text, usage = await stream_chat(url, **body)
            assert (text, usage["completion_tokens"]) == (lm.decode(kept), len(kept))
            # Without the flag TensorRT-LLM trims the stop token itself: the same answer.
            answer = await chat(url, max_tokens=16, stop_token_ids=to, **scripted(script))
            assert answer.json()["choices"][0]["message"]["content"] == lm.decode(kept)
            assert answer.json()["usage"]["completion_tokens"] == len(kept)
            # A stop string is shown with the flag, and counted.
            answer = await chat(url, max_tokens=16, stop=[" to"], include_stop_str_in_output=True, **scripted(script))
            assert answer.json()["choices"][0]["message"]["content"] == lm.decode([*kept, to[0]])
            assert answer.json()["usage"]["completion_tokens"] == len(kept) + 1


async def test_chat_logprobs_without_top_logprobs_get_one_candidate_from_dynamo(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """Issue 27 item 4(b), Dynamo 1.6.1's own mapping, pinned: the frontend turns chat ``logprobs: true`` without
    ``top_logprobs`` into ``output_options.logprobs = 1`` (the request a worker gets for ``top_logprobs: 1``) and
    adds the selected token to every candidate list that lacks it. So each token shows one ``top_logprobs`` entry
    (greedy: its own; sampled: the top candidate, and the selected token too when it differs) where OpenAI shows
    none; ``top_logprobs: 0`` gives OpenAI's empty lists. ``docs/request-features.md``."""
    with trio.fail_after(120):
        async with engine_and_worker(dynamo_env, frontend):
            url = frontend.url
            for extra, candidates in (({}, 1), ({"top_logprobs": 0}, 0), ({"top_logprobs": 2}, 2)):
                answer = await chat(url, max_tokens=4, logprobs=True, temperature=0, ignore_eos=True, **extra)
                assert answer.status_code == 200, answer.text
                content = answer.json()["choices"][0]["logprobs"]["content"]
                assert len(content) == 4
                for entry in content:
                    assert len(entry["top_logprobs"]) == candidates, (extra, entry)
                    if candidates == 1:
                        assert entry["top_logprobs"][0]["token"] == entry["token"]
                        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]


#: Engine A fails every request after 3 tokens with a retryable error (``--faults-from-prompt`` on A only).
MIGRATING = "The river [mock-fault error_after_tokens=3 error_code=OVERLOADED error_retryable=true]"


@pytest.mark.parametrize("frontend", [3], indirect=True)
async def test_after_a_migration_prompt_tokens_count_the_tokens_generated_before_it(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """Issue 27 item 7, Dynamo 1.6.1's behaviour, pinned (``docs/faults.md``). The frontend migrates a stream by
    sending the next worker the prompt plus the tokens generated so far (``max_tokens`` reduced) and takes
    ``prompt_tokens`` from that worker's usage; the request carries nothing else that names the original prompt
    (every field of a migrated request dict was compared with the first attempt's). So a request migrated after 3
    tokens reports 3 more prompt tokens; its text and ``completion_tokens`` are exact."""
    with trio.fail_after(180):
        async with (
            start_engine(dynamo_env, "--speedup", "0", "--faults-from-prompt", name="engine-a") as engine_a,
            start_engine(dynamo_env, "--speedup", "0", name="engine-b") as engine_b,
            start_sidecar(dynamo_env, engine_a.address, name="sidecar-a"),
            start_sidecar(dynamo_env, engine_b.address, name="sidecar-b"),
        ):
            try:
                await wait_routable(frontend.url, workers=2)
                async with httpx.AsyncClient(timeout=30) as http:
                    body = {"model": MODEL, "prompt": MIGRATING, "temperature": 0, "ignore_eos": True}
                    # One token: finished before the fault fires, on either worker.
                    probe = await http.post(f"{frontend.url}/v1/completions", json={**body, "max_tokens": 1})
                    prompt = probe.json()["usage"]["prompt_tokens"]
                    seen: list[int] = []
                    texts: set[str] = set()
                    for _ in range(4):  # round-robin: half of them start on A
                        answer = await http.post(f"{frontend.url}/v1/completions", json={**body, "max_tokens": 8})
                        assert answer.status_code == 200, answer.text
                        usage = answer.json()["usage"]
                        assert usage["completion_tokens"] == 8, usage
                        seen.append(usage["prompt_tokens"])
                        texts.add(answer.json()["choices"][0]["text"])
                stats_a = await mock_stats(engine_a.address)
            except BaseException:
                dump_logs(dynamo_env)
                raise
    print(f"\nprompt {prompt} tokens; prompt_tokens reported: {seen}")
    assert stats_a.get("requests", 0) >= 2, stats_a
    # Served by B alone, or migrated from A after 3 tokens (round-robin sends A at least one of the five).
    assert set(seen) <= {prompt, prompt + 3}, seen
    assert prompt + 3 in seen, seen
    assert len(texts) == 1, texts  # greedy: the migrated answers continue exactly where A stopped
