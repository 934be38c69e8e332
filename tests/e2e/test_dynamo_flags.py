"""Dynamo's own sidecar's flags at work, through the real frontend (issue 36 §1).

* **The card-level flags** change what the engine receives: ``--custom-jinja-template`` renders every chat prompt,
  ``--exclude-tools-when-tool-choice-none false`` keeps the tools in it when ``tool_choice`` is none (the default
  leaves them out), ``--dyn-default-thinking-mode`` sets the template's thinking switch unless the request sets it.
  The template prints each of these, and the mock reports the prompt it received (``mock_stats``).
* **The planes and the namespace**: a worker on ``--response-plane quic`` serves a frontend on QUIC (a worker left on
  TCP could not: the frontend answers 503); ``DYN_NAMESPACE_WORKER_SUFFIX`` moves it to ``<namespace>-<suffix>``.
  The same start is given every other flag of theirs (component, endpoint, parsers, planes, the ``--grpc-*`` bounds,
  the window): it serves, registered where and as they say.
* **``--enable-rl``** serves the RL discovery endpoint as Dynamo's workers do: ``{"method": "routes"}`` answers
  with the system port's ``/engine`` routes and its URL, which serves them.
* **``--model-path`` as a Hugging Face id** the cache does not hold: refused in one line (Dynamo could not fetch it).

Parsing and refusals of every flag are unit tests (``tests/test_cli_dynamo.py``); the flags exactly as Dynamo's
manifests give them, in ``tests/e2e/test_dynamo_drop_in.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.helpers.dropin import call_endpoint, last_prompt, start_ours
from tests.helpers.processes import DynamoEnv, Frontend, start_frontend, wait_for_model
from tests.helpers.stack import MODEL, MODEL_DIR, dump_logs, start_engine, start_sidecar

pytestmark = pytest.mark.e2e

#: A chat template that shows what the card asked for: every message, the tools when the frontend passed them, and
#: the thinking switch when it was set.
TEMPLATE = (
    "{%- for m in messages -%}CUSTOM[{{ m['role'] }}]{{ m['content'] }}{%- endfor -%}"
    "{%- if tools is defined and tools -%}TOOLS{%- endif -%}"
    "{%- if enable_thinking is defined -%}THINK={{ enable_thinking }}{%- endif -%}"
)
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


async def chat(url: str, model: str, **extra: Any) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


async def test_the_card_level_flags_change_the_prompt_the_engine_receives(
    dynamo_env: DynamoEnv, frontend: Frontend, tmp_path: Path
) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    flagged = ["--custom-jinja-template", str(template), "--exclude-tools-when-tool-choice-none", "false"]
    flagged += ["--dyn-default-thinking-mode", "disabled", "--namespace", "flagged"]
    plain = ["--custom-jinja-template", str(template), "--namespace", "plain"]
    # An engine each, serving the worker's name: one frontend holds two models apart only when no name is shared.
    with trio.fail_after(180):
        async with (
            start_engine(dynamo_env, "--speedup", "0", name="flagged-engine", model="flagged") as flagged_engine,
            start_engine(dynamo_env, "--speedup", "0", name="plain-engine", model="plain") as plain_engine,
            start_sidecar(dynamo_env, flagged_engine.address, *flagged, name="flagged", model="flagged"),
            start_sidecar(dynamo_env, plain_engine.address, *plain, name="plain", model="plain"),
        ):
            try:
                for model in ("flagged", "plain"):
                    await wait_for_model(frontend.url, model, timeout=30)
                # The defaults: the custom template, tools left out when tool_choice is none, no thinking switch.
                await chat(frontend.url, "plain", tools=TOOLS, tool_choice="none")
                assert await last_prompt(plain_engine.address) == "CUSTOM[user]hi"
                await chat(frontend.url, "plain", tools=TOOLS, tool_choice="auto")
                assert await last_prompt(plain_engine.address) == "CUSTOM[user]hiTOOLS", "the template renders tools"
                # --exclude-tools-when-tool-choice-none false and --dyn-default-thinking-mode disabled.
                await chat(frontend.url, "flagged", tools=TOOLS, tool_choice="none")
                assert await last_prompt(flagged_engine.address) == "CUSTOM[user]hiTOOLSTHINK=False"
                # A request's own thinking switch wins over the deployment's default.
                await chat(frontend.url, "flagged", chat_template_kwargs={"enable_thinking": True})
                assert await last_prompt(flagged_engine.address) == "CUSTOM[user]hiTHINK=True"
            except BaseException:
                dump_logs(dynamo_env)
                raise


async def test_response_plane_namespace_suffix_and_rl_endpoint(dynamo_env: DynamoEnv) -> None:
    """One start with every other flag of theirs too, each as Dynamo's manifests would give it."""
    args = ["--model-path", str(MODEL_DIR), "--served-model-name", MODEL, "--namespace", "team"]
    args += ["--response-plane", "quic", "--enable-rl", "--component", "workers", "--endpoint", "serve"]
    args += [
        "--dyn-reasoning-parser",
        "qwen3",
        "--dyn-tool-call-parser",
        "hermes",
        "--endpoint-types",
        "chat,completions",
    ]
    args += ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq", "--grpc-connections", "2"]
    args += ["--grpc-connect-attempt-timeout-secs", "5", "--grpc-retry-interval-secs", "1"]
    args += ["--grpc-startup-deadline-secs", "60", "--disaggregation-mode", "agg", "--context-length", "1024"]
    env = {"DYN_NAMESPACE_WORKER_SUFFIX": "v2"}
    with trio.fail_after(180):
        async with (
            start_frontend(dynamo_env, extra_args=["--response-plane", "quic"]) as frontend,
            start_engine(dynamo_env, "--speedup", "0") as engine,
            start_ours(dynamo_env, ["--grpc-endpoint", engine.address, *args], name="ours", env=env) as worker,
        ):
            try:
                await wait_for_model(frontend.url, MODEL, timeout=30)
                async with httpx.AsyncClient(timeout=60) as http:
                    body = {"model": MODEL, "prompt": "The river", "max_tokens": 4, "stream": True}
                    async with http.stream("POST", f"{frontend.url}/v1/completions", json=body) as response:
                        assert response.status_code == 200
                        events = [line async for line in response.aiter_lines() if line.startswith("data: {")]
                    text = "".join(json.loads(e[6:])["choices"][0].get("text") or "" for e in events if "choices" in e)
                    assert text, events
                    instances = {p.name for p in (dynamo_env.file_kv / "v1" / "instances").iterdir()}
                    # Dynamo's file keys spell '-' as %2D and '/' as %2F.
                    prefix = "team%2Dv2%2Fworkers%2F"
                    assert {n.split("%2F")[2] for n in instances if n.startswith(prefix)} == {"serve", "rl"}
                    (card,) = [json.loads(p.read_text()) for p in (dynamo_env.file_kv / "v1" / "mdc").iterdir()]
                    assert card["endpoint"] == "serve"
                    runtime = card["card_json"]["runtime_config"]
                    assert (runtime["reasoning_parser"], runtime["tool_call_parser"]) == ("qwen3", "hermes")
                    assert runtime["context_length"] == 1024
                    asks = [{"method": "routes"}, {"method": "x"}, {}]
                    routes, wrong, missing = await call_endpoint(
                        dynamo_env, "team-v2.workers.rl", asks, response_plane="quic"
                    )
                    assert routes == {"status": "ok", "routes": ["live"], "system_url": worker.system_url}
                    assert wrong["status"] == "error"
                    assert "only supports method='routes'" in wrong["message"]
                    assert missing == {"status": "error", "message": "rl_dispatch: missing 'method' (str)"}
                    live = await http.get(f"{routes['system_url']}/engine/{routes['routes'][0]}")
                    assert live.status_code == 200, live.text
                    assert live.json()["state"] == "serving", live.text
            except BaseException:
                dump_logs(dynamo_env)
                raise


async def test_a_hugging_face_id_dynamo_cannot_fetch_is_refused_in_one_line(dynamo_env: DynamoEnv) -> None:
    """Not in the cache, and the hub is offline (``HF_HUB_OFFLINE=1``): one line, exit 1, no traceback."""
    with trio.fail_after(120):
        async with start_engine(dynamo_env, "--speedup", "0") as engine:
            argv = ["--grpc-endpoint", engine.address, "--model-path", "nobody/absent-model"]
            async with start_ours(dynamo_env, argv, name="ours", ready=None) as worker:
                assert await worker.process.wait(90) == 1
                log = worker.process.log()
    refusals = [line for line in log.splitlines() if "refusing to start" in line]
    assert len(refusals) == 1, log
    assert "--model-path 'nobody/absent-model' is not a local directory, and Dynamo could not fetch it" in refusals[0]
    assert "Traceback" not in log
