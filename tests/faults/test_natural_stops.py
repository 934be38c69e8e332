"""Natural stops, engine detokenization and load without KV usage through the real frontend, against
``openengine-mock``'s TensorRT-LLM profile (issue 14 items 1, 7, 8).

* Item 1: with the engine's ``finished`` following the last token ``--split-finish-ms`` later (what TensorRT-LLM's
  stream does now and then), no complete answer is counted cancelled, no Abort is sent, and EOS-stopped answers keep
  their usage with ``cached_tokens``.
* Item 8: ``extra.detokenize=false`` reaches the engine (``engine_name == "tensorrt_llm"``), the output is the same
  with and without it, and the engine's detokenization work drops to zero.
* Item 7: an engine whose GetLoad carries ``running_requests`` only still gets load published to Dynamo.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from tests.helpers.processes import DynamoEnv, Frontend
from tests.helpers.stack import metric_sum, mock_stats, start_engine, start_sidecar, wait_routable
from tests.helpers.waits import wait_until

from ._natural import ENDED, PROMPTS, natural_stops, run_all, worker_metrics

pytestmark = pytest.mark.e2e

# ------------------------------------------------------------------- item 1: a complete answer is a finish


@pytest.mark.timeout(720)  # its own bound plus two minutes for the processes around it
async def test_two_hundred_natural_stops_with_a_split_finish_are_finishes_without_aborts(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """120 answers end at EOS, 80 at a stop string; the engine's ``finished`` follows the last token 5 ms later at
    10 ms per token (TensorRT-LLM's stream now and then). The hold waits for it: the added latency is the split."""
    with trio.fail_after(600):
        async with (
            start_engine(dynamo_env, "--decode-ms-per-token", "10", "--split-finish-ms", "5") as engine,
            start_sidecar(dynamo_env, engine.address) as worker,
        ):
            await wait_routable(frontend.url, workers=1)
            await natural_stops(frontend.url, engine, worker, eos=120, stops=80)


# ------------------------------------------------ issue 27 item 4(c): a stop string matched inside a token


async def test_a_stop_string_the_frontend_matches_inside_a_token_ends_the_answer_with_its_usage(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """TensorRT-LLM matches stop strings as token sequences: " th" (one token) never matches inside " the" (another
    token), so the engine goes on, while the frontend matches " th" in the text of " the" and ends the answer there.
    The answer is complete for the client: it must be counted a finish (the frontend's stop string ended it, not the
    client), and its usage must carry the engine's ``cached_tokens``. Failed before: every such request was counted
    ``cancelled`` ("stopped by the client"), with usage the frontend made up without ``cached_tokens``."""
    bodies = [
        {"prompt": f"{PROMPTS[i % 6]} {i}", "max_tokens": 40, "temperature": 0, "stop": [" th"]} for i in range(12)
    ]
    with trio.fail_after(300):
        async with (
            start_engine(dynamo_env, "--profile", "trtllm", "--decode-ms-per-token", "10") as engine,
            start_sidecar(dynamo_env, engine.address) as worker,
        ):
            await wait_routable(frontend.url, workers=1)
            before = await worker_metrics(worker.system_url)
            answers = await run_all(frontend.url, bodies, concurrency=4)
            await trio.sleep(1.0)  # the last requests' ends reach the metrics
            after = await worker_metrics(worker.system_url)
            log = worker.process.log()

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    assert all(" th" not in a.text for a in answers), "the frontend ends every answer before its stop string"
    assert all(a.complete for a in answers), [a for a in answers if not a.complete][:2]
    assert sum(not a.cached_tokens for a in answers) == 0, "usage lost its cached_tokens"
    assert delta(ENDED, outcome="cancelled") == 0, "a complete answer counted as cancelled"
    assert delta(ENDED, outcome="finished") == len(bodies)
    assert "stopped by the client" not in log
    assert "matched by the frontend" in log, "the answers ended inside a token say their stop string ended them"


# -------------------------------------------------------------------------- item 8: no wasted detokenization


def detokenized(stats: dict[str, Any]) -> int:
    """The engine's detokenization counter(s) in ``mock_stats`` (tokens it detokenized)."""
    return sum(int(v) for k, v in stats.items() if "detoken" in k and isinstance(v, int | float))


@pytest.mark.timeout(420)  # its own bound plus two minutes for the processes around it
async def test_tensorrt_llm_is_asked_not_to_detokenize_and_the_output_is_the_same(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """The same greedy prompts through a worker with ``--engine-detokenize auto`` (TensorRT-LLM: off) and ``on``:
    the same text, and the engine detokenizes nothing in the first run (``--detokenize-cost-us`` makes the saving
    show in the benchmark). A request with top logprobs keeps the engine's token strings."""
    bodies = [{"prompt": f"{p} {i}", "max_tokens": 24, "temperature": 0} for i, p in enumerate(PROMPTS)]
    texts: dict[str, list[str]] = {}
    work: dict[str, int] = {}
    with trio.fail_after(300):
        async with start_engine(dynamo_env, "--speedup", "0", "--detokenize-cost-us", "200") as engine:
            for mode in ("auto", "on"):
                async with start_sidecar(dynamo_env, engine.address, "--engine-detokenize", mode, name=mode) as worker:
                    await wait_routable(frontend.url, workers=1)
                    before = detokenized(await mock_stats(engine.address))
                    answers = await run_all(frontend.url, bodies, concurrency=3)
                    work[mode] = detokenized(await mock_stats(engine.address)) - before
                    assert all(a.status == 200 and a.finish_reason in ("stop", "length") for a in answers)
                    texts[mode] = [a.text for a in answers]
                    assert "engine detokenization" in worker.process.log()
                    if mode == "auto":
                        before = detokenized(await mock_stats(engine.address))
                        [logprobs] = await run_all(frontend.url, [{**bodies[0], "logprobs": 2}], concurrency=1)
                        assert logprobs.status == 200
                        work["logprobs"] = detokenized(await mock_stats(engine.address)) - before
                await wait_routable_gone(frontend.url)
    print(f"tokens the engine detokenized for {len(bodies)} requests: auto {work['auto']}, on {work['on']}")
    assert work["auto"] == 0, "extra.detokenize=false reached TensorRT-LLM"
    assert work["on"] > 0
    assert work["logprobs"] > 0, "top logprobs keep the engine's token strings"
    assert texts["auto"] == texts["on"], "the same output either way"


async def wait_routable_gone(url: str, timeout: float = 30.0) -> None:
    """Wait until the frontend no longer lists an instance (the previous worker drained)."""
    async with httpx.AsyncClient(timeout=10) as http:

        async def gone() -> bool:
            return not (await http.get(f"{url}/health")).json().get("instances")

        await wait_until(gone, timeout=timeout, interval=0.1, what="no instance listed")


# ------------------------------------------------------------------- item 7: load without KV usage in GetLoad


@pytest.mark.timeout(420)  # its own bound plus two minutes for the processes around it
async def test_an_engine_without_kv_usage_still_gets_load_published(dynamo_env: DynamoEnv, frontend: Frontend) -> None:
    """Failed before: nothing was published (`no_kv_usage` rejected every poll, a warning every minute)."""
    bodies = [{"prompt": f"{PROMPTS[i % 6]} {i}", "max_tokens": 200, "ignore_eos": True} for i in range(6)]
    with trio.fail_after(300):
        async with (
            start_engine(dynamo_env, "--decode-ms-per-token", "20") as engine,
            start_sidecar(dynamo_env, engine.address, "--load-poll-interval-secs", "0.2") as worker,
        ):
            await wait_routable(frontend.url, workers=1)
            used: list[float] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_all, frontend.url, bodies, 6)
                for _ in range(20):
                    await trio.sleep(0.2)  # not a synchronisation: the sampling period of the load series
                    page = await worker_metrics(worker.system_url)
                    used.append(metric_sum(page, "openengine_sidecar_engine_kv_blocks", kind="used"))
            page = await worker_metrics(worker.system_url)
            log = worker.process.log()
    print(f"estimated KV blocks in use while 6 requests ran: max {max(used):.0f}")
    assert max(used) > 0
    assert metric_sum(page, "openengine_sidecar_load_snapshots_rejected_total", reason="no_kv_usage") == 0
    assert metric_sum(page, "openengine_sidecar_load_snapshots_published_total") > 0
    assert "publishing an estimate" in log
    assert "not publishing load" not in log
