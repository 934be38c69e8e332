"""Dynamo's own manifests, run with this worker (issue 36 §1): ``deploy/dynamo-drop-in/{agg,disagg}.yaml`` are
Dynamo's ``lib/sidecar/trtllm/deploy/`` manifests with only the sidecar's command changed; each worker's sidecar is
started with exactly the arguments and variables its ``main`` container is given there, on the launchers' loopback
stack (file discovery, TCP; the stand-ins for what Dynamo's operator injects), in front of ``openengine-mock``
serving what its ``trtllm-engine`` container serves (the model named by its first argument, its ``--max_seq_len``
window). Only the engine's address is substituted for the pod's ``127.0.0.1:50051``.

The arguments name the model by a Hugging Face id (``--model-path Qwen/Qwen3-0.6B``): Dynamo fetches the tokenizer
through the hub's cache, which holds the tiny model under that id here (the hub itself is offline). The model is
served under that name, as Dynamo's own sidecar serves it, with that window; requests go through the real frontend,
and on the disaggregated graph through both workers.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest
import trio

from tests.deploy.test_dynamo_drop_in import container, flag, workers
from tests.helpers.dropin import cache_model, start_ours
from tests.helpers.processes import DynamoEnv, Frontend, wait_for_model
from tests.helpers.stack import Engine, dump_logs, mock_stats, start_engine
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.e2e

#: Where the manifests' sidecars reach their engine (the pod's loopback), replaced by the mock's address.
POD_ENGINE = "127.0.0.1:50051"


def sidecar_args(component: dict[str, Any], engine: Engine) -> list[str]:
    main = container(component["podTemplate"]["spec"], "main")
    assert main["command"] == ["openengine-sidecar"]
    args = list(main["args"])
    assert flag(args, "--grpc-endpoint") == POD_ENGINE
    args[args.index(POD_ENGINE)] = engine.address
    return args


def engine_args(component: dict[str, Any]) -> tuple[str, list[str]]:
    """The model the ``trtllm-engine`` container serves, and the mock's flags for what its arguments set."""
    engine = container(component["podTemplate"]["spec"], "trtllm-engine")
    model = engine["args"][0]
    return model, ["--speedup", "0", "--max-context-length", flag(engine["args"], "--max_seq_len")]


async def served(url: str, model: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=60) as http:
        listed = (await http.get(f"{url}/v1/models")).json()["data"]
        chat = {"model": model, "messages": [{"role": "user", "content": "The river"}], "max_tokens": 4}
        answer = await http.post(f"{url}/v1/chat/completions", json=chat)
        assert answer.status_code == 200, answer.text
        prompt = {"model": model, "prompt": "The river", "max_tokens": 3}
        completion = await http.post(f"{url}/v1/completions", json=prompt)
        assert completion.status_code == 200, completion.text
    (entry,) = [m for m in listed if m["id"] == model]
    body: dict[str, Any] = answer.json()
    assert body["model"] == completion.json()["model"] == model
    assert body["choices"][0]["message"]["content"]
    return dict(entry)


@pytest.mark.parametrize("manifest", ["agg.yaml", "disagg.yaml"])
async def test_dynamos_manifest_serves_with_this_worker(
    manifest: str, dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    components = workers(manifest)
    models = {engine_args(c)[0] for c in components}
    (model,) = models
    cache_model(dynamo_env, model)
    with trio.fail_after(240):
        async with AsyncExitStack() as stack:
            engines: list[Engine] = []
            for component in components:
                name, mock_flags = engine_args(component)
                role = component["type"]
                engine = await stack.enter_async_context(
                    start_engine(dynamo_env, *mock_flags, name=f"{role}-engine", model=name)
                )
                engines.append(engine)
                await stack.enter_async_context(
                    start_ours(dynamo_env, sidecar_args(component, engine), name=f"{role}-sidecar")
                )
            try:
                await wait_for_model(frontend.url, model, timeout=60)

                async def through() -> dict[str, Any] | None:
                    try:
                        return await served(frontend.url, model)
                    except AssertionError:
                        return None  # a disaggregated graph lists the model before both legs are routable

                entry = await wait_until(through, timeout=60, interval=0.1, what=f"{model} served")
                assert entry["context_window"] == 4096, "the window the arguments give (--context-length)"
                stats = [await mock_stats(e.address) for e in engines]
                assert {s["last_model"] for s in stats} == {model}, "GenerateRequest.model: the engine's own"
                if manifest == "disagg.yaml":
                    by_role = dict(zip([c["type"] for c in components], stats, strict=True))
                    assert by_role["prefill"].get("prefill_legs", 0) >= 2
                    assert by_role["decode"].get("decode_legs", 0) >= 2
                else:
                    assert stats[0].get("requests", 0) >= 2
            except BaseException:
                dump_logs(dynamo_env)
                raise
