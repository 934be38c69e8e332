"""End to end, disaggregated (context-first, 1P1D): the real Dynamo frontend → a prefill sidecar → a prefill
``openengine-mock``, then → a decode sidecar → a decode ``openengine-mock``, as five processes.

Each engine's own counters (``ServerInfo.extra.mock_stats``, ``GetLoad``) prove which engine did which leg and that
nothing is left behind: no running request, no KV session. Rules as in ``test_aggregated.py``: loopback only,
OS-picked ports, every wait bounded, every process killed by the fixture that started it.

The engines are TensorRT-LLM's server (``--profile trtllm``): they report no role, so each worker is told its phase
(``--disaggregation-mode``), and their GetLoad shows neither KV blocks nor sessions (the leak checks read the mock's
own gauges in ``mock_stats``). The richer ``full`` engine, which reports its role and a MOCK connector with endpoints,
runs the main flows too.
"""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import openai
import pytest
import trio
from openai.types.chat import ChatCompletionMessageParam

from openengine_bp.openengine.v1 import LoadInfo
from sidecar.convert.structjson import bp_struct_to_json
from sidecar.edge import open_edge
from sidecar.engine import EngineClientConfig, open_engine_client, parse_endpoint
from tests.helpers.processes import DynamoEnv, Frontend, wait_for_model
from tests.helpers.stack import MODEL, Engine, dump_logs, start_engine, start_sidecar
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.e2e

T = TypeVar("T")


@dataclass
class Disagg:
    frontend: Frontend
    prefill: Engine
    decode: Engine
    prefill_worker: Any
    decode_worker: Any

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.frontend.url}/v1", api_key="unused", timeout=60, max_retries=0)

    async def call(self, fn: Callable[[openai.OpenAI], T]) -> T:
        return await trio.to_thread.run_sync(lambda: fn(self.client()))


async def engine_view(address: str) -> tuple[LoadInfo, dict[str, Any]]:
    """The engine's ``GetLoad`` and its cumulative ``mock_stats`` (from ``ServerInfo.extra``)."""
    async with (
        open_edge() as edge,
        open_engine_client(edge, EngineClientConfig(endpoint=parse_endpoint(address), connections=1)) as client,
    ):
        load = await client.get_load()
        info = await client.get_server_info()
    assert info.extra is not None
    stats = bp_struct_to_json(info.extra).get("mock_stats") or {}
    assert isinstance(stats, dict)
    return load, stats


async def wait_quiet(address: str, timeout: float = 10.0) -> tuple[LoadInfo, dict[str, Any]]:
    """Poll until the engine runs nothing and holds no KV session or block; returns its final view."""

    async def quiet() -> tuple[LoadInfo, dict[str, Any]] | None:
        load, stats = await engine_view(address)
        idle = not stats.get("live_requests") and not stats.get("active_kv_sessions")
        return (load, stats) if idle and not stats.get("used_kv_blocks") and not load.running_requests else None

    view: tuple[LoadInfo, dict[str, Any]] | None = await wait_until(
        quiet, timeout=timeout, interval=0.02, what=f"engine {address} quiet"
    )
    assert view is not None
    return view


#: Both engine profiles; the tests that differ only in setup run on TensorRT-LLM's alone.
PROFILES = pytest.mark.parametrize("profile", ["trtllm", "full"])


def engine_args(profile: str, role: str) -> tuple[str, ...]:
    """TensorRT-LLM's engines report no role (any leg on any engine); the full engine is given its role."""
    return ("--profile", "full", "--role", role) if profile == "full" else ("--profile", "trtllm")


def worker_args(profile: str, role: str) -> tuple[str, ...]:
    """A worker in front of an engine that reports no role is told its phase."""
    return () if profile == "full" else ("--disaggregation-mode", role)


@asynccontextmanager
async def start_disagg(
    denv: DynamoEnv,
    frontend: Frontend,
    *,
    profile: str = "trtllm",
    prefill_args: tuple[str, ...] = (),
    decode_args: tuple[str, ...] = (),
) -> AsyncIterator[Disagg]:
    async with (
        start_engine(denv, *engine_args(profile, "prefill"), *prefill_args, name="prefill-engine") as prefill,
        start_engine(denv, *engine_args(profile, "decode"), *decode_args, name="decode-engine") as decode,
        start_sidecar(
            denv, decode.address, "--abort-timeout-secs", "1", *worker_args(profile, "decode"), name="decode-sidecar"
        ) as decode_worker,
        start_sidecar(
            denv, prefill.address, "--abort-timeout-secs", "1", *worker_args(profile, "prefill"), name="prefill-sidecar"
        ) as prefill_worker,
    ):
        await wait_for_model(frontend.url, MODEL, timeout=60)
        stack = Disagg(frontend, prefill, decode, prefill_worker, decode_worker)
        # The frontend lists the model once the decode worker is up; wait until a request really goes through both.
        with trio.fail_after(30):
            while True:
                try:
                    await stack.call(
                        lambda c: c.completions.create(model=MODEL, prompt="warm up", max_tokens=2, temperature=0)
                    )
                    break
                except openai.APIError:
                    await trio.sleep(0.1)  # the poll interval of this retry loop (a request is the probe)
        try:
            yield stack
        except BaseException:
            dump_logs(denv)
            raise


def user(text: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": text}]


def stream_chat(client: openai.OpenAI, text: str, max_tokens: int) -> tuple[str, int, int]:
    """Stream one chat answer; returns (text, content pieces, completion tokens from usage)."""
    answer, pieces, usage = "", 0, None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=user(text),
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            answer += chunk.choices[0].delta.content
            pieces += 1
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    assert usage is not None
    return answer, pieces, usage


@PROFILES
async def test_streamed_chat_is_prefilled_on_one_engine_and_decoded_on_the_other(
    dynamo_env: DynamoEnv, frontend: Frontend, profile: str
) -> None:
    with trio.fail_after(150):
        async with start_disagg(dynamo_env, frontend, profile=profile, prefill_args=("--speedup", "0")) as stack:
            _, before_p = await engine_view(stack.prefill.address)
            _, before_d = await engine_view(stack.decode.address)
            answer, pieces, completion = await stack.call(lambda c: stream_chat(c, "Tell me about the river.", 12))
            assert answer
            # The decode engine replays the prefill's first token; the client sees it once: exactly max_tokens.
            assert completion == 12
            assert 1 <= pieces <= 12
            unary = await stack.call(
                lambda c: c.chat.completions.create(
                    model=MODEL,
                    messages=user("Tell me about the river."),
                    max_tokens=12,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
            )
            assert unary.choices[0].message.content == answer, "greedy: streamed and unary answers agree"
            assert unary.usage is not None
            assert unary.usage.completion_tokens == 12

            _, stats_p = await wait_quiet(stack.prefill.address)
            _, stats_d = await wait_quiet(stack.decode.address)
            # Prefill on one engine, decode on the other: two requests, two legs each.
            assert stats_p.get("prefill_legs", 0) - before_p.get("prefill_legs", 0) == 2
            assert stats_p.get("decode_legs", 0) == 0
            assert stats_p.get("requests", 0) == 0
            assert stats_d.get("decode_legs", 0) - before_d.get("decode_legs", 0) == 2
            assert stats_d.get("prefill_legs", 0) == 0
            assert stats_d.get("requests", 0) == 0
            # Every session handed off was claimed by the decode engine; none expired.
            assert stats_p["kv_sessions_created"] == stats_p["kv_sessions_claimed"]
            assert stats_p.get("kv_sessions_expired", 0) == 0
            assert stats_p["used_kv_blocks"] == 0
            assert stats_d["used_kv_blocks"] == 0


async def test_32_concurrent_disaggregated_requests_complete_and_leave_nothing_behind(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    results: list[tuple[str, int, int]] = []
    with trio.fail_after(180):
        async with start_disagg(
            dynamo_env,
            frontend,
            prefill_args=("--decode-ms-per-token", "5"),
            decode_args=("--decode-ms-per-token", "5"),
        ) as stack:
            _, before_p = await engine_view(stack.prefill.address)
            _, before_d = await engine_view(stack.decode.address)
            client = stack.client()
            limiter = trio.CapacityLimiter(32)

            async def one(i: int) -> None:
                results.append(
                    await trio.to_thread.run_sync(stream_chat, client, f"Story number {i}.", 24, limiter=limiter)
                )

            started = time.monotonic()
            async with trio.open_nursery() as nursery:
                for i in range(32):
                    nursery.start_soon(one, i)
            elapsed = time.monotonic() - started
            print(f"32 concurrent disaggregated streams (24 tokens each) took {elapsed:.2f} s")
            assert len(results) == 32
            assert all(completion == 24 for _, _, completion in results), results
            assert all(answer for answer, _, _ in results)

            load_p, stats_p = await wait_quiet(stack.prefill.address)
            load_d, stats_d = await wait_quiet(stack.decode.address)
            assert not load_p.running_requests
            assert stats_p["active_kv_sessions"] == 0
            assert not load_d.running_requests
            assert stats_d["active_kv_sessions"] == 0
            assert stats_p["prefill_legs"] - before_p.get("prefill_legs", 0) == 32
            assert stats_d["decode_legs"] - before_d.get("decode_legs", 0) == 32
            assert stats_p["kv_sessions_claimed"] - before_p.get("kv_sessions_claimed", 0) == 32
            assert stats_p.get("kv_sessions_expired", 0) == 0


async def test_a_client_gone_before_the_first_decode_token_strands_no_kv_session(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    # The KV transfer takes 1.5 s; the client disconnects 0.3 s after its request, while the decode leg waits for it.
    with trio.fail_after(150):
        async with start_disagg(
            dynamo_env, frontend, prefill_args=("--kv-transfer-ms", "1500", "--kv-session-timeout", "60")
        ) as stack:
            _, before_p = await engine_view(stack.prefill.address)
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Tell me about the river."}],
                "max_tokens": 400,
                "stream": True,
                "ignore_eos": True,
            }
            with trio.move_on_after(0.3):
                async with (
                    httpx.AsyncClient(timeout=30) as http,
                    http.stream("POST", f"{frontend.url}/v1/chat/completions", json=body) as response,
                ):
                    async for line in response.aiter_lines():
                        assert not line.startswith('data: {"id"') or '"content"' not in line, "no token yet"
            gone_at = trio.current_time()
            # Deferred, then aborted: the session was claimed (not stranded), and the decode engine stopped.
            _, stats_p = await wait_quiet(stack.prefill.address, timeout=10)
            _, stats_d = await wait_quiet(stack.decode.address, timeout=10)
            waited = trio.current_time() - gone_at
            assert waited < 5, f"the decode leg ran on for {waited:.1f} s after the client left"
            assert stats_p["kv_sessions_claimed"] - before_p.get("kv_sessions_claimed", 0) == 1
            assert stats_p.get("kv_sessions_expired", 0) == 0
            assert stats_p["used_kv_blocks"] == 0
            assert stats_d["used_kv_blocks"] == 0
            await stack.decode_worker.process.wait_for_log(r"client stop deferred until the KV transfer lands", 5)


async def test_a_prefill_engine_error_reaches_the_client_and_no_decode_runs(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    fault = "Tell me about the river. [mock-fault error_after_tokens=0 error_code=INTERNAL]"
    with trio.fail_after(150):
        async with start_disagg(dynamo_env, frontend, prefill_args=("--speedup", "0", "--faults-from-prompt")) as stack:
            _, before_d = await engine_view(stack.decode.address)
            with pytest.raises(openai.InternalServerError):
                await stack.call(lambda c: c.chat.completions.create(model=MODEL, messages=user(fault), max_tokens=8))
            _, stats_d = await wait_quiet(stack.decode.address)
            await wait_quiet(stack.prefill.address)
            assert stats_d.get("decode_legs", 0) == before_d.get("decode_legs", 0), "no decode after a failed prefill"
            ok = await stack.call(lambda c: stream_chat(c, "And the sea?", 4))
            assert ok[2] == 4, "the workers keep serving"


@PROFILES
async def test_a_prefill_engine_without_a_cache_transceiver_fails_saying_why(
    dynamo_env: DynamoEnv, frontend: Frontend, profile: str
) -> None:
    prefill_engine = (*engine_args(profile, "prefill"), "--no-cache-transceiver")
    with trio.fail_after(150):
        async with (
            start_engine(dynamo_env, *prefill_engine, name="prefill-engine") as prefill,
            start_engine(dynamo_env, *engine_args(profile, "decode"), name="decode-engine") as decode,
            start_sidecar(dynamo_env, decode.address, *worker_args(profile, "decode"), name="decode-sidecar"),
            start_sidecar(
                dynamo_env, prefill.address, *worker_args(profile, "prefill"), name="prefill-sidecar"
            ) as prefill_worker,
        ):
            await wait_for_model(frontend.url, MODEL, timeout=60)
            await prefill_worker.process.wait_for_log(r"reports no KV connector", 5)
            body = {"model": MODEL, "messages": user("Tell me about the river."), "max_tokens": 8, "stream": True}
            events: list[dict[str, Any]] = []
            with trio.fail_after(30):
                while not events:
                    async with (
                        httpx.AsyncClient(timeout=30) as http,
                        http.stream("POST", f"{frontend.url}/v1/chat/completions", json=body) as response,
                    ):
                        text = await response.aread()
                    if response.status_code >= 500 or b"error" in text:
                        events.append({"status": response.status_code, "body": text.decode(errors="replace")})
                    else:
                        await trio.sleep(0.2)  # not a synchronisation: the retry's pace until a request fails
            assert events[0]["status"] >= 400 or "error" in events[0]["body"]
            # TensorRT-LLM fails the context-only request (EngineError INTERNAL naming the missing transceiver);
            # the full engine serves it as a plain one-token generation, which the worker refuses to hand off.
            said = (
                r"cache_transceiver_config" if profile == "trtllm" else r"no PrefillReady: .*cache_transceiver_config"
            )
            await prefill_worker.process.wait_for_log(said, 5)
            _, stats = await wait_quiet(prefill.address)
            assert stats["active_kv_sessions"] == 0


@PROFILES
async def test_a_dead_decode_engine_is_a_migratable_error_and_the_orphan_session_times_out(
    dynamo_env: DynamoEnv, frontend: Frontend, profile: str
) -> None:
    with trio.fail_after(150):
        async with start_disagg(
            dynamo_env, frontend, profile=profile, prefill_args=("--speedup", "0", "--kv-session-timeout", "2")
        ) as stack:
            _, before_p = await engine_view(stack.prefill.address)
            stack.decode.process.signal(signal.SIGKILL)
            await stack.decode.process.wait(10)
            async with httpx.AsyncClient(timeout=30) as http:
                response = await http.post(
                    f"{frontend.url}/v1/chat/completions",
                    json={"model": MODEL, "messages": user("Tell me about the river."), "max_tokens": 8},
                )
            # The decode leg's transport loss is Disconnected: migratable (503 at --migration-limit 0; another
            # decode worker would take it over at a higher limit).
            assert response.status_code == 503, response.text
            await stack.decode_worker.process.wait_for_log(r"dynamo\._core\.Disconnected: Generate: UNAVAILABLE", 10)
            # The prefill leg handed its session off, but no decode claimed it: the prefill engine holds it until its
            # --kv-session-timeout, then releases it (counted as expired).
            load_p, stats_p = await engine_view(stack.prefill.address)
            assert not load_p.running_requests
            assert stats_p["kv_sessions_created"] - before_p.get("kv_sessions_created", 0) == 1
            _, stats_p = await wait_quiet(stack.prefill.address, timeout=10)
            assert stats_p.get("kv_sessions_expired", 0) == 1
            assert stats_p["used_kv_blocks"] == 0
