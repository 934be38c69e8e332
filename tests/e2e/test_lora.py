"""End to end: the LoRA lifecycle (issue #7 item 1) through the real frontend → sidecar → ``openengine-mock``.

The rulebook:

* ``load_lora`` loads the adapter on the engine, then publishes its model card: ``/v1/models`` lists it and
  ``model=<adapter>`` runs on the engine with ``lora_name`` set (the mock's adapters visibly change the text).
* A repeated load with the same source answers ``already_loaded``; another source under the same name is a conflict.
* Sources are confined to ``--lora-root``: ``..`` and symlinks that leave it are refused; so is a directory without
  ``adapter_config.json``. The engine's ``max_loras`` refusal leaves nothing behind.
* ``unload_lora`` withdraws the card, then unloads the engine adapter: the model answers 404 afterwards.
* The controls are served both as ``/engine/<name>`` on the system port and as Dynamo endpoints.
* A worker started on an engine that already holds adapters adopts them; an engine restart reloads them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from dynamo.llm import lora_name_to_id

from sidecar.edge import open_edge
from sidecar.engine import EngineClientConfig, open_engine_client, parse_endpoint
from tests.helpers.processes import DynamoEnv, Frontend, free_port
from tests.helpers.stack import MODEL, Worker, dump_logs, start_engine, start_sidecar, wait_routable
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.e2e

#: The richer engine: LoRA lifecycle RPCs (TensorRT-LLM's answer UNIMPLEMENTED); no model-time delays.
FULL = ("--profile", "full", "--speedup", "0")

PROMPT = [{"role": "user", "content": "Tell me about the river and the old mill."}]
FAST_WATCH = (
    "--health-poll-interval-secs", "0.2", "--health-failure-threshold", "2", "--grpc-retry-interval-secs", "0.2",
    "--reconnect-backoff-max-secs", "0.5",
)  # fmt: skip


def make_adapter(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "peft_type": "LORA"}))
    return directory


@pytest.fixture
def lora_root(tmp_path: Path) -> Path:
    root = tmp_path / "loras"
    for name in ("tiny-lora-a", "tiny-lora-b", "tiny-lora-c", "other-a"):
        make_adapter(root / name)
    (root / "not-an-adapter").mkdir()
    outside = make_adapter(tmp_path / "outside" / "evil")
    (root / "escape").symlink_to(outside)
    return root


async def control(worker: Worker, name: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(f"{worker.system_url}/engine/{name}", json=body or {})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert isinstance(answer, dict)
    return answer


async def chat(url: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(f"{url}/v1/chat/completions", json=body)


async def listed_models(url: str) -> set[str]:
    async with httpx.AsyncClient(timeout=10) as http:
        return {m["id"] for m in (await http.get(f"{url}/v1/models")).json().get("data", [])}


async def wait_listed(url: str, model: str, present: bool, timeout: float = 10.0) -> None:

    async def as_wanted() -> bool:
        return (model in await listed_models(url)) == present

    await wait_until(as_wanted, timeout=timeout, interval=0.05, what=f"{model} {'listed' if present else 'unlisted'}")


async def engine_adapters(address: str) -> dict[str, int]:
    async with (
        open_edge() as edge,
        open_engine_client(edge, EngineClientConfig(endpoint=parse_endpoint(address), connections=1)) as client,
    ):
        return {a.lora_name: a.lora_id for a in (await client.list_loras()).adapters}


@asynccontextmanager
async def lora_stack(
    denv: DynamoEnv, frontend: Frontend, root: Path, *, port: int = 0
) -> AsyncIterator[tuple[str, Worker]]:
    async with (
        start_engine(denv, *FULL, "--capability", "lora=true", "--max-loras", "2", port=port) as engine,
        start_sidecar(denv, engine.address, "--lora-root", str(root), *FAST_WATCH) as worker,
    ):
        await wait_routable(frontend.url, workers=1)
        try:
            yield engine.address, worker
        except BaseException:
            dump_logs(denv)
            raise


async def test_a_lora_is_loaded_listed_served_differently_and_unloaded(
    dynamo_env: DynamoEnv, frontend: Frontend, lora_root: Path
) -> None:
    """load → listed by the frontend and the engine under Dynamo's id → its output differs from the base model's →
    a repeated load is idempotent, another source a conflict → unload → 404 and gone from the engine."""
    with trio.fail_after(120):
        async with lora_stack(dynamo_env, frontend, lora_root) as (engine, worker):
            assert await control(worker, "list_loras") == {"status": "ok", "loras": [], "count": 0}
            base = await chat(frontend.url, MODEL)
            assert base.status_code == 200, base.text

            path = lora_root / "tiny-lora-a"
            loaded = await control(worker, "load_lora", {"lora_name": "tiny-lora-a", "source_path": str(path)})
            assert loaded["status"] == "ok", loaded
            assert loaded["lora_id"] == lora_name_to_id("tiny-lora-a")
            assert loaded["already_loaded"] is False
            assert await engine_adapters(engine) == {"tiny-lora-a": lora_name_to_id("tiny-lora-a")}
            await wait_listed(frontend.url, "tiny-lora-a", present=True)

            adapted = await chat(frontend.url, "tiny-lora-a")
            assert adapted.status_code == 200, adapted.text
            base_text = base.json()["choices"][0]["message"]["content"]
            adapted_text = adapted.json()["choices"][0]["message"]["content"]
            assert adapted_text
            assert adapted_text != base_text
            # Same request again: deterministic, so the difference is the adapter, not chance.
            assert (await chat(frontend.url, "tiny-lora-a")).json()["choices"][0]["message"]["content"] == adapted_text

            again = await control(worker, "load_lora", {"lora_name": "tiny-lora-a", "source": {"uri": path.as_uri()}})
            assert again["status"] == "ok", again
            assert again["already_loaded"] is True, again
            other = lora_root / "other-a"
            conflict = await control(worker, "load_lora", {"lora_name": "tiny-lora-a", "source_path": str(other)})
            assert conflict["status"] == "error", conflict
            assert conflict["code"] == "conflict", conflict

            listing = await control(worker, "list_loras")
            assert listing["count"] == 1, listing
            assert listing["loras"][0]["state"] == "serving", listing

            unloaded = await control(worker, "unload_lora", {"lora_name": "tiny-lora-a"})
            assert unloaded["status"] == "ok", unloaded
            assert await engine_adapters(engine) == {}
            await wait_listed(frontend.url, "tiny-lora-a", present=False)
            gone = await chat(frontend.url, "tiny-lora-a")
            assert gone.status_code == 404, gone.text
            missing = await control(worker, "unload_lora", {"lora_name": "tiny-lora-a"})
            assert missing["status"] == "error", missing
            assert missing["code"] == "not_found", missing
            # The base model was never disturbed.
            assert (await chat(frontend.url, MODEL)).status_code == 200


async def test_sources_outside_the_lora_root_and_engine_refusals_leave_nothing_behind(
    dynamo_env: DynamoEnv, frontend: Frontend, lora_root: Path
) -> None:
    """Traversal, a symlink out of the root, a missing adapter_config.json, a relative path, an unknown scheme and
    bad bodies are refused before the engine sees anything; the engine's max_loras refusal (RESOURCE_EXHAUSTED)
    publishes no card."""
    with trio.fail_after(120):
        async with lora_stack(dynamo_env, frontend, lora_root) as (engine, worker):
            refusals: dict[str, dict[str, Any]] = {
                "..": {"lora_name": "x1", "source_path": f"{lora_root}/../outside/evil"},
                "outside the LoRA root": {"lora_name": "x2", "source_path": str(lora_root / "escape")},
                "adapter_config.json": {"lora_name": "x3", "source_path": str(lora_root / "not-an-adapter")},
                "not absolute": {"lora_name": "x4", "source_path": "loras/tiny-lora-a"},
                "unsupported scheme": {"lora_name": "x5", "source": {"uri": "ftp://host/adapter"}},
                "exactly one of": {"lora_name": "x6"},
                "unknown field": {"lora_name": "x7", "source_path": str(lora_root / "tiny-lora-a"), "rank": 8},
                "lora_name": {"lora_name": "bad name with spaces", "source_path": str(lora_root / "tiny-lora-a")},
                "base model": {"lora_name": MODEL, "source_path": str(lora_root / "tiny-lora-a")},
            }
            for needle, body in refusals.items():
                answer = await control(worker, "load_lora", body)
                assert answer["status"] == "error", (needle, answer)
                assert needle in answer["message"], (needle, answer)
            assert await engine_adapters(engine) == {}

            for name in ("tiny-lora-a", "tiny-lora-b"):
                ok = await control(worker, "load_lora", {"lora_name": name, "source_path": str(lora_root / name)})
                assert ok["status"] == "ok", ok
            full = await control(
                worker, "load_lora", {"lora_name": "tiny-lora-c", "source_path": str(lora_root / "tiny-lora-c")}
            )
            assert full["status"] == "error", full
            assert full["code"] == "capacity", full
            assert set(await engine_adapters(engine)) == {"tiny-lora-a", "tiny-lora-b"}
            assert {entry["lora_name"] for entry in (await control(worker, "list_loras"))["loras"]} == {
                "tiny-lora-a",
                "tiny-lora-b",
            }
            await wait_listed(frontend.url, "tiny-lora-b", present=True)
            assert "tiny-lora-c" not in await listed_models(frontend.url)


async def test_the_controls_are_dynamo_endpoints_too(
    dynamo_env: DynamoEnv, frontend: Frontend, lora_root: Path
) -> None:
    """``<namespace>.backend.load_lora`` / ``list_loras`` answer a Dynamo client the way Dynamo's Python workers do."""
    script = """
import asyncio, json, sys
from dynamo.runtime import DistributedRuntime

async def main():
    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
    answers = []
    for name, body in json.loads(sys.argv[1]):
        client = await runtime.endpoint(f"dynamo.backend.{name}").client()
        await asyncio.wait_for(client.wait_for_instances(), 20)
        async for item in await client.generate(body):
            answers.append(item.data() if hasattr(item, "data") else item)
    print(json.dumps(answers))
    runtime.shutdown()

asyncio.run(main())
"""
    with trio.fail_after(120):
        async with lora_stack(dynamo_env, frontend, lora_root) as (engine, _):
            calls = [
                ["load_lora", {"lora_name": "tiny-lora-b", "source_path": str(lora_root / "tiny-lora-b")}],
                ["list_loras", {}],
            ]
            env = dynamo_env.worker_env()
            env.pop("DYN_SYSTEM_PORT", None)
            done = await trio.run_process(
                [sys.executable, "-c", script, json.dumps(calls)], env=env, capture_stdout=True, check=False
            )
            assert done.returncode == 0, done
            load, listing = json.loads(done.stdout.decode().strip().splitlines()[-1])
            assert load["status"] == "ok", load
            assert load["lora_name"] == "tiny-lora-b", load
            assert listing["count"] == 1, listing
            assert set(await engine_adapters(engine)) == {"tiny-lora-b"}


async def test_a_new_worker_adopts_the_engines_adapters_and_an_engine_restart_reloads_them(
    dynamo_env: DynamoEnv, frontend: Frontend, lora_root: Path
) -> None:
    """The engine is the source of truth: a worker restarted next to a running engine publishes cards for what the
    engine holds; an engine that restarts empty gets every served adapter loaded again before the worker serves."""
    port = free_port()
    with trio.fail_after(150):
        async with start_engine(dynamo_env, *FULL, "--capability", "lora=true", port=port, name="engine-1") as engine:
            async with start_sidecar(dynamo_env, engine.address, "--lora-root", str(lora_root), name="w1") as first:
                await wait_routable(frontend.url, workers=1)
                body = {"lora_name": "tiny-lora-a", "source_path": str(lora_root / "tiny-lora-a")}
                assert (await control(first, "load_lora", body))["status"] == "ok"
                await wait_listed(frontend.url, "tiny-lora-a", present=True)
            await wait_listed(frontend.url, "tiny-lora-a", present=False)
            assert set(await engine_adapters(engine.address)) == {"tiny-lora-a"}, "the engine kept its adapter"

            async with start_sidecar(
                dynamo_env, engine.address, "--lora-root", str(lora_root), *FAST_WATCH, name="w2"
            ) as second:
                await wait_routable(frontend.url, workers=1)
                await wait_listed(frontend.url, "tiny-lora-a", present=True)
                listing = await control(second, "list_loras")
                assert [entry["lora_name"] for entry in listing["loras"]] == ["tiny-lora-a"], listing
                assert (await chat(frontend.url, "tiny-lora-a")).status_code == 200

                engine.process.proc.kill()
                await second.process.wait_for_log(r"serving -> reconnecting", timeout=15)
                async with start_engine(
                    dynamo_env, *FULL, "--capability", "lora=true", port=port, name="engine-2"
                ) as restarted:
                    await second.process.wait_for_log(r"reloaded after the engine restart", timeout=30)
                    await second.process.wait_for_log(r"(?s)reconnecting.*registering -> serving", timeout=30)
                    assert set(await engine_adapters(restarted.address)) == {"tiny-lora-a"}

                    async def adapter_answers() -> bool:
                        return (await chat(frontend.url, "tiny-lora-a")).status_code == 200

                    await wait_until(adapter_answers, timeout=15, interval=0.2)


async def test_a_lost_lora_card_is_published_again(dynamo_env: DynamoEnv, frontend: Frontend, lora_root: Path) -> None:
    """File discovery never restores a deleted card by itself: the registration watchdog puts a LoRA card back like
    the base card."""
    with trio.fail_after(90):
        async with (
            start_engine(dynamo_env, *FULL, "--capability", "lora=true") as engine,
            start_sidecar(
                dynamo_env, engine.address, "--lora-root", str(lora_root), "--registration-check-interval-secs", "0.2"
            ) as worker,
        ):
            await wait_routable(frontend.url, workers=1)
            body = {"lora_name": "tiny-lora-a", "source_path": str(lora_root / "tiny-lora-a")}
            assert (await control(worker, "load_lora", body))["status"] == "ok"
            cards = [
                path for path in (dynamo_env.file_kv / "v1" / "mdc").iterdir() if path.name.endswith("%2Dlora%2Da")
            ]
            assert len(cards) == 1, cards
            cards[0].unlink()
            await worker.process.wait_for_log(r"registration disappeared; publishing it again", timeout=10)
            await wait_until(cards[0].exists, timeout=10, interval=0.05)
            assert (await chat(frontend.url, "tiny-lora-a")).status_code == 200


def test_lora_name_to_id_is_deterministic_across_processes() -> None:
    """Every worker derives the same adapter id from a name (what lets KV events and routing agree)."""
    here = lora_name_to_id("tiny-lora-a")
    there = subprocess.run(
        [sys.executable, "-c", "from dynamo.llm import lora_name_to_id; print(lora_name_to_id('tiny-lora-a'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(there.stdout) == here > 0
