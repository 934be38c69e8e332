"""A streaming completion client that keeps everything a fault test needs to judge the outcome."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from tests.helpers.stack import MODEL


@dataclass
class Outcome:
    """What the client saw: HTTP status, text pieces, finish reason, usage, and an error event if any."""

    status: int
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: Any = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def succeeded(self) -> bool:
        return self.status == 200 and self.error is None and self.finish_reason in ("stop", "length")

    @property
    def failed_cleanly(self) -> bool:
        """An error the client can see (status or SSE error event) — never a success with missing tokens."""
        return (self.status != 200 or self.error is not None) and self.finish_reason not in ("stop", "length")


async def stream_completion(
    url: str,
    prompt: str,
    *,
    max_tokens: int,
    ignore_eos: bool = True,
    timeout: float = 60.0,
    into: Outcome | None = None,
    **extra: Any,
) -> Outcome:
    """POST a streaming /v1/completions and collect the whole answer (bounded by ``timeout``).

    ``into``: the outcome to fill as the tokens arrive, so that a test can act mid-stream.
    """
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
        **extra,
    }
    with trio.fail_after(timeout):
        async with (
            httpx.AsyncClient(timeout=timeout) as http,
            http.stream("POST", f"{url}/v1/completions", json=body) as response,
        ):
            outcome = into if into is not None else Outcome(status=0)
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.error = (await response.aread()).decode(errors="replace")
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    outcome.error = event["error"]
                for choice in event.get("choices", []):
                    if choice.get("text"):
                        outcome.pieces.append(choice["text"])
                    if choice.get("finish_reason"):
                        outcome.finish_reason = choice["finish_reason"]
                usage = event.get("usage")
                if usage:
                    outcome.completion_tokens = usage.get("completion_tokens")
    return outcome


async def stream_many(url: str, count: int, outcomes: list[Outcome], *, max_tokens: int, timeout: float = 60.0) -> None:
    """``count`` streams at once (prompts "Story 0." …), each outcome appended to ``outcomes`` as its stream ends."""
    async with trio.open_nursery() as nursery:
        for i in range(count):

            async def one(i: int = i) -> None:
                outcomes.append(await stream_completion(url, f"Story {i}.", max_tokens=max_tokens, timeout=timeout))

            nursery.start_soon(one)
