"""Natural stops through the real frontend: many greedy completions that end at EOS or at a stop string, and what
the worker and the engine counted for them (issue 14 item 1)."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from tests.helpers.stack import MODEL, Engine, Worker, metric_sum, mock_stats, wait_engine_idle
from tests.helpers.waits import wait_until

ENDED = "openengine_sidecar_requests_ended_total"
ABORTS = "openengine_sidecar_aborts_total"
PROMPTS = ("The river", "Once upon a time", "Tell me about the town", "A bridge", "The mill", "The old gardener")


@dataclass
class Answer:
    """One streamed completion as the client saw it."""

    status: int = 0
    done: bool = False  # [DONE] seen
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: Any = None
    #: Arrival time of each SSE event with a choice (monotonic), and whether it carried the finish_reason.
    events: list[tuple[float, bool]] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.done and self.error is None and self.finish_reason == "stop"

    @property
    def cached_tokens(self) -> bool:
        return "cached_tokens" in ((self.usage or {}).get("prompt_tokens_details") or {})


async def stream(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Answer:
    answer = Answer()
    payload = {**body, "model": MODEL, "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", f"{url}/v1/completions", json=payload) as response:
        answer.status = response.status_code
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                answer.done = True
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            answer.error = answer.error or event.get("error")
            for choice in event.get("choices", []):
                answer.text += choice.get("text") or ""
                finish = choice.get("finish_reason")
                answer.finish_reason = finish or answer.finish_reason
                answer.events.append((time.monotonic(), bool(finish)))
            answer.usage = event.get("usage") or answer.usage
    return answer


async def run_all(url: str, bodies: list[dict[str, Any]], concurrency: int) -> list[Answer]:
    """Every body once, ``concurrency`` at a time (bounded in count; each request bounded by the client timeout)."""
    answers: list[Answer] = [Answer() for _ in bodies]
    limit = trio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=60) as http, trio.open_nursery() as nursery:
        for i, body in enumerate(bodies):

            async def one(i: int = i, body: dict[str, Any] = body) -> None:
                async with limit:
                    answers[i] = await stream(http, url, body)

            nursery.start_soon(one)
    return answers


async def worker_metrics(url: str) -> str:
    async with httpx.AsyncClient(timeout=10) as http:
        return (await http.get(f"{url}/metrics")).text


def finish_delay(answers: list[Answer]) -> tuple[float, float]:
    """Median inter-token gap and median gap before the event carrying the finish_reason (seconds)."""
    gaps: list[float] = []
    finals: list[float] = []
    for answer in answers:
        for (t0, _), (t1, finish) in zip(answer.events, answer.events[1:], strict=False):
            (finals if finish else gaps).append(t1 - t0)
    return statistics.median(gaps), statistics.median(finals)


async def natural_stops(url: str, engine: Engine, worker: Worker, *, eos: int, stops: int) -> list[Answer]:
    """``eos`` greedy completions that end at EOS and ``stops`` that end at the stop string " the" (40 tokens at
    most, 16 at a time); asserts every one complete, none counted cancelled, no Abort sent (nor received when the
    engine counts them), and usage with ``cached_tokens`` on each. Returns the answers (EOS ones first)."""
    bodies = [{"prompt": f"{PROMPTS[i % 6]} {i}", "max_tokens": 40, "temperature": 0} for i in range(eos)]
    bodies += [{**bodies[i % eos], "stop": [" the"]} for i in range(stops)]
    before = await worker_metrics(worker.system_url)
    stats_before = await mock_stats(engine.address)
    answers = await run_all(url, bodies, concurrency=16)
    await wait_engine_idle(engine.address, timeout=10)

    async def every_end_counted() -> str:
        text = await worker_metrics(worker.system_url)
        return text if metric_sum(text, ENDED) - metric_sum(before, ENDED) >= len(bodies) else ""

    after = await wait_until(every_end_counted, timeout=10, what="the last requests' ends in the metrics")
    stats_after = await mock_stats(engine.address)

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    cancelled, finished, aborts = delta(ENDED, outcome="cancelled"), delta(ENDED, outcome="finished"), delta(ABORTS)
    received = int(stats_after.get("aborts_received", 0)) - int(stats_before.get("aborts_received", 0))
    missing = sum(not a.cached_tokens for a in answers)
    gap, final = finish_delay(answers[:eos])
    print(
        f"natural stops ({eos} EOS, {stops} stop string): {finished:.0f} finished, {cancelled:.0f} cancelled, "
        f"{aborts:.0f} Aborts sent, {received} received by the engine, {missing} without cached_tokens; "
        f"inter-token {gap * 1000:.1f} ms, finish event {final * 1000:.1f} ms after the token before it"
    )
    incomplete = [a for a in answers if not a.complete]
    assert not incomplete, incomplete[:3]
    assert cancelled == 0, "a complete answer counted as cancelled"
    assert finished >= eos + stops
    assert aborts == 0, "an Abort for a complete answer"
    assert received == 0
    assert missing == 0, "usage lost its cached_tokens"
    log = worker.process.log()
    assert "Failed to publish" not in log, "Dynamo could not deliver a chunk: the frontend had ended the stream"
    assert "stopped by the client" not in log
    return answers
