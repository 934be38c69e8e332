"""What newer TensorRT-LLM OpenEngine servers do (issue 36 §2), through the real frontend: ``openengine-mock
--profile trtllm-newer`` with ``--frontends 2`` (two processes on one port around one engine, as ``trtllm-serve
--num_serve_frontends 2``), in front of ``python -m sidecar``.

* Generate streams go round-robin over the sidecar's connections, which the kernel spreads over both frontends; a
  cancelled request is aborted on the engine whichever frontend its Abort lands on, and GetLoad counts every
  frontend's requests.
* A stream that delivered every response and then ends ``UNAVAILABLE`` is a complete answer: finished once, never
  migrated (``--migration-limit 3``).
* Request ids stay within the 1024-byte limit (Dynamo's ids, both legs of a disaggregated request); DP ranks are
  forwarded exactly when the engine advertises targeting; ``X-Dynamo-Session-ID`` reaches both legs as
  ``extra.conversation_id``; ``extra.detokenize = false`` is honoured (the engine sends no text, the frontend
  detokenizes).

The kernel hashes connections to listeners: an assertion that both frontends got some is made over 16 connections
or more (all on one frontend with probability 2^-15).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from tests.e2e.test_disagg import start_disagg, wait_quiet
from tests.helpers.processes import DynamoEnv, Frontend, free_low_port, start_frontend
from tests.helpers.stack import (
    MODEL,
    Engine,
    Worker,
    dump_logs,
    engine_load,
    metric_sum,
    mock_stats,
    start_engine,
    start_sidecar,
    wait_engine_idle,
    wait_routable,
)
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.e2e

NEWER = ("--profile", "trtllm-newer")
CONNECTIONS = 16


def group_args(*extra: str) -> tuple[str, ...]:
    """A two-frontend ``trtllm-newer`` engine on a fixed port (as ``--num_serve_frontends`` needs), no delays."""
    return (*NEWER, "--frontends", "2", "--port", str(free_low_port()), "--speedup", "0", *extra)


@asynccontextmanager
async def stack(
    denv: DynamoEnv, frontend: Frontend, engine_args: tuple[str, ...], *sidecar_args: str
) -> AsyncIterator[tuple[Engine, Worker]]:
    async with (
        start_engine(denv, *engine_args) as engine,
        start_sidecar(denv, engine.address, *sidecar_args) as worker,
    ):
        await wait_routable(frontend.url, workers=1)
        try:
            yield engine, worker
        except BaseException:
            dump_logs(denv)
            raise


async def complete(
    http: httpx.AsyncClient, url: str, prompt: str, *, max_tokens: int = 4, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = await http.post(f"{url}/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def streams_by_connection(stats: dict[str, Any]) -> dict[str, tuple[str, int]]:
    """Client connection → (the frontend it landed on, the Generate streams it carried)."""
    return {
        peer: (index, int(counts["generate"]))
        for index, frontend in stats["frontends"].items()
        for peer, counts in frontend["connections"].items()
    }


async def test_generate_streams_spread_over_every_connection_and_both_frontends(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    with trio.fail_after(150):
        async with (
            stack(dynamo_env, frontend, group_args(), "--grpc-connections", str(CONNECTIONS)) as (engine, _),
            httpx.AsyncClient(timeout=30) as http,
        ):
            before = streams_by_connection(await mock_stats(engine.address))
            for i in range(2 * CONNECTIONS):
                await complete(http, frontend.url, f"river {i}")
            after = await mock_stats(engine.address)
            now = streams_by_connection(after)
            added = {peer: n - before.get(peer, (index, 0))[1] for peer, (index, n) in now.items()}
            used = {peer: n for peer, n in added.items() if n}
            assert sorted(used.values()) == [2] * CONNECTIONS, "round-robin: two streams on each of 16 connections"
            assert {now[peer][0] for peer in used} == {"0", "1"}, "the connections landed on both processes"
            pids = {f["pid"] for f in after["frontends"].values()}
            assert len(pids) == 2, "two processes"
            assert after["max_request_id_bytes"] <= 1024, "the ids stay within the multi-frontend limit"
            assert (after["live_requests"], after["used_kv_blocks"]) == (0, 0)


async def test_a_cancelled_request_is_aborted_on_the_engine_and_get_load_counts_every_frontend(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """Hung requests until both frontends carry one; GetLoad through fresh connections (landing on either frontend)
    counts them all; the clients leave: each request is aborted on the engine (the sidecar's Abort leaves on its
    Control connection, on one frontend, for streams on both) and nothing is left behind."""
    engine_args = group_args("--faults-from-prompt")
    with trio.fail_after(200):
        async with stack(dynamo_env, frontend, engine_args, "--grpc-connections", str(CONNECTIONS)) as (engine, _):
            base = await mock_stats(engine.address)
            hung: dict[str, str] = {}  # request id → the frontend its stream came in on
            async with trio.open_nursery() as nursery:
                for i in range(2 * CONNECTIONS):
                    nursery.start_soon(_hang, frontend.url, f"river {i} [mock-fault hang_after_tokens=1]")
                    count = len(hung) + 1
                    await wait_until(partial(_live_at_least, engine.address, count), timeout=20, what=f"{count} hung")
                    served = (await mock_stats(engine.address))["served_by"]
                    hung.update({r: str(int(o["frontend"])) for r, o in served.items() if r not in base["served_by"]})
                    if set(hung.values()) == {"0", "1"}:
                        break
                assert set(hung.values()) == {"0", "1"}, hung
                loads = [(await engine_load(engine.address)).running_requests for _ in range(20)]  # fresh connections
                assert loads == [len(hung)] * 20, "every GetLoad counts both frontends' requests"
                probed = await mock_stats(engine.address)
                nursery.cancel_scope.cancel()  # the clients go away
            await wait_engine_idle(engine.address, timeout=20)
            end = await mock_stats(engine.address)
        ended = sum(end.get(k, 0) - base.get(k, 0) for k in ("requests_aborted", "requests_cancelled"))
        assert ended == len(hung), "each request ended on the engine"
        aborts = {rid: str(int(o["frontend"])) for rid, o in end["aborted_from"].items() if rid in hung}
        assert set(aborts) == set(hung), "the sidecar sent an Abort for each"
        assert any(aborts[rid] != hung[rid] for rid in hung), "an Abort reached a stream on the other frontend"
        assert (end["live_requests"], end["used_kv_blocks"], end["prefilling_requests"]) == (0, 0, 0)
        probes = [
            index
            for index, f in probed["frontends"].items()
            for peer, counts in f["connections"].items()
            if counts["control"] and not counts["generate"] and peer not in streams_by_connection(base)
        ]
        assert {"0", "1"} <= set(probes), "the GetLoad probes landed on both frontends"


async def _hang(url: str, prompt: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for _ in r.aiter_lines():
            pass


async def _live_at_least(address: str, count: int) -> bool:
    return ((await engine_load(address)).running_requests or 0) >= count


@pytest.mark.parametrize("frontend", [3], indirect=True)
async def test_a_trailing_unavailable_after_every_response_is_a_finished_answer_never_migrated(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """TensorRT-LLM's coordinator failing during final cleanup ends a delivered stream ``UNAVAILABLE``. With
    ``--migration-limit 3`` a migratable failure would be retried: the client must get the answer once, the worker
    count it finished, and the engine see the request once. Failed before: the worker raised the trailing status,
    the frontend migrated the request three times and the client got an error."""
    engine_args = group_args("--faults-from-prompt")
    prompt = "The river [mock-fault trailing_unavailable=true]"
    with trio.fail_after(150):
        async with (
            stack(dynamo_env, frontend, engine_args) as (engine, worker),
            httpx.AsyncClient(timeout=30) as http,
        ):
            before = await mock_stats(engine.address)
            metrics_before = (await http.get(f"{worker.system_url}/metrics")).text
            pieces, finish, usage, errors = await _stream(http, frontend.url, prompt, max_tokens=8)
            assert errors == [], errors
            assert (finish, usage) == ("length", 8)
            assert 1 <= len(pieces) <= 8, "the tokens once (a migration would resend and add to them)"
            after = await mock_stats(engine.address)
            assert after["trailing_unavailable"] - before.get("trailing_unavailable", 0) == 1
            assert after["requests"] - before["requests"] == 1, "the engine saw it once: no retry, no migration"
            metrics = (await http.get(f"{worker.system_url}/metrics")).text
            ended = "openengine_sidecar_requests_ended_total"
            for outcome, expected in (("finished", 1), ("failed", 0), ("cancelled", 0)):
                counted = metric_sum(metrics, ended, outcome=outcome) - metric_sum(
                    metrics_before, ended, outcome=outcome
                )
                assert counted == expected, (outcome, counted)
            await wait_engine_idle(engine.address, timeout=5)


async def _stream(
    http: httpx.AsyncClient, url: str, prompt: str, *, max_tokens: int
) -> tuple[list[str], str | None, int | None, list[Any]]:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0,
    }
    pieces: list[str] = []
    finish: str | None = None
    usage: int | None = None
    errors: list[Any] = []
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                errors.append(event["error"])
            for choice in event.get("choices", []):
                if choice.get("text"):
                    pieces.append(choice["text"])
                finish = choice.get("finish_reason") or finish
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
    return pieces, finish, usage, errors


@pytest.mark.parametrize("profile", ["trtllm", "trtllm-newer"])
async def test_dp_ranks_are_forwarded_exactly_when_the_engine_advertises_targeting(
    dynamo_env: DynamoEnv, profile: str
) -> None:
    """Dynamo's KV router stamps ``routing.dp_rank`` on every request it routes. TensorRT-LLM's merged server
    advertises no targeting (it would answer ``openengine-target-dp-rank`` UNIMPLEMENTED, and any ``openengine-*`` key
    but three): nothing is sent. The newer one with two attention-DP ranks advertises it: every request carries the
    router's rank, in range."""
    dp = ("--data-parallel-size", "2") if profile == "trtllm-newer" else ()
    engine_args = ("--speedup", "0", "--profile", profile, *dp)
    with trio.fail_after(150):
        async with (
            start_frontend(dynamo_env, extra_args=("--router-mode", "kv")) as kv_frontend,
            stack(dynamo_env, kv_frontend, engine_args) as (engine, _),
            httpx.AsyncClient(timeout=30) as http,
        ):
            before = await mock_stats(engine.address)
            for i in range(8):
                await complete(http, kv_frontend.url, f"the mill {i}", headers={"X-Dynamo-Session-ID": "chat-1"})
            after = await mock_stats(engine.address)
            targeted = {r: n - before.get("target_dp_ranks", {}).get(r, 0) for r, n in after["target_dp_ranks"].items()}
            if profile == "trtllm":
                assert after["target_dp_ranks"] == {}, "no DP metadata to the merged server"
            else:
                assert sum(targeted.values()) == 8, "every request targeted the router's rank"
                assert set(targeted) <= {"0", "1"}
            # Both get the session as extra.conversation_id: the newer server reads it, the merged one ignores
            # unknown extra keys (so sending it there is safe; the mock records what it received).
            conversations = after["conversation_ids"].get("chat-1", 0) - before["conversation_ids"].get("chat-1", 0)
            assert conversations == 8
            assert after["requests"] - before["requests"] == 8


async def test_the_session_is_the_conversation_id_on_both_legs_and_every_turn(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """Disaggregated over two two-frontend ``trtllm-newer`` engines: each turn's prefill and decode legs carry the same
    ``extra.conversation_id`` (the client's ``X-Dynamo-Session-ID``) and the same request id, within the limit; the
    decode engine detokenizes nothing (``extra.detokenize=false``) while the client gets its text."""
    prefill_args = group_args()
    decode_args = group_args()
    with trio.fail_after(200):
        async with (
            start_disagg(dynamo_env, frontend, prefill_args=prefill_args, decode_args=decode_args) as disagg,
            httpx.AsyncClient(timeout=30) as http,
        ):
            _, prefill_before = await wait_quiet(disagg.prefill.address)
            _, decode_before = await wait_quiet(disagg.decode.address)
            texts = []
            for turn in range(2):
                answer = await complete(
                    http, frontend.url, f"turn {turn}: the river", max_tokens=6, headers={"X-Dynamo-Session-ID": "s-42"}
                )
                texts.append(answer["choices"][0]["text"])
            _, prefill = await wait_quiet(disagg.prefill.address)
            _, decode = await wait_quiet(disagg.decode.address)
            for before, after in ((prefill_before, prefill), (decode_before, decode)):
                turns = after["conversation_ids"].get("s-42", 0) - before.get("conversation_ids", {}).get("s-42", 0)
                assert turns == 2, "both turns, on this leg"
                assert after["max_request_id_bytes"] <= 1024
            new_prefill = set(prefill["served_by"]) - set(prefill_before["served_by"])
            new_decode = set(decode["served_by"]) - set(decode_before["served_by"])
            assert len(new_prefill) == 2
            assert new_prefill == new_decode, "one request id on both legs, no prefix"
            assert all(texts), "the frontend detokenized the token ids"
            assert decode.get("detokenized_tokens", 0) == decode_before.get("detokenized_tokens", 0), (
                "extra.detokenize=false: the decode engine sent no text"
            )
