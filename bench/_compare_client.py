"""The client side of ``bench.compare``: what one request saw through the real frontend, as a user would judge it.

Every request is bounded (``timeout``) and never raises on a network failure: a refused connection, a broken stream
or a request past its bound is an outcome too (``transport``, ``no_answer``), because the comparison reports what
the client saw, whatever the sidecar did.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import httpx
import trio

from tests.helpers.stack import MODEL

Api = Literal["completions", "chat"]

#: How often a recovery probe is sent (the issue's figures were measured this way).
PROBE_INTERVAL_S: Final = 0.05
#: Bound on one probe request: a probe that hangs must not stop the polling.
PROBE_TIMEOUT_S: Final = 2.0


def path_of(api: Api) -> str:
    return "/v1/chat/completions" if api == "chat" else "/v1/completions"


def body_for(api: Api, text: str, **extra: Any) -> dict[str, Any]:
    """A request for the test model: ``text`` as the prompt (completions) or the user message (chat)."""
    body: dict[str, Any] = {"model": MODEL}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    body.update(extra)
    return body


@dataclass
class Seen:
    """One request as the client saw it (times are ``time.monotonic()``)."""

    started: float = 0.0
    ended: float | None = None
    status: int | None = None
    #: The SSE ``error`` event (streamed) or the error body (unary, non-200).
    error: Any = None
    done: bool = False
    finish_reasons: list[str] = field(default_factory=list)
    choices: set[int] = field(default_factory=set)
    pieces: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    transport: str | None = None
    timed_out: bool = False
    #: When the first piece of text arrived.
    first_piece: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def completion_tokens(self) -> int | None:
        value = (self.usage or {}).get("completion_tokens")
        return int(value) if isinstance(value, int) else None

    @property
    def cached_tokens_present(self) -> bool:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return isinstance(details, dict) and details.get("cached_tokens") is not None

    @property
    def error_code(self) -> int | None:
        if isinstance(self.error, dict):
            code = self.error.get("code")
            return int(code) if isinstance(code, int) else None
        return None

    @property
    def message(self) -> str:
        """The error's message (SSE event or error body), or ''."""
        if isinstance(self.error, dict):
            return str(self.error.get("message") or "")
        return str(self.error or "")

    def complete(self, choices: int = 1, tokens: int | None = None) -> bool:
        """HTTP 200, no error, every choice finished, ``[DONE]`` seen; with ``tokens``, exactly that many."""
        whole = (
            self.status == 200
            and self.error is None
            and self.transport is None
            and not self.timed_out
            and self.done
            and len(self.finish_reasons) >= choices
        )
        return whole and (tokens is None or self.completion_tokens == tokens)

    @property
    def truncated(self) -> bool:
        """A 200 that neither finished nor said why: the one outcome no client can tell from success."""
        return self.status == 200 and self.error is None and not self.finish_reasons and self.transport is None

    @property
    def seconds(self) -> float | None:
        return None if self.ended is None else self.ended - self.started

    def kind(self) -> str:
        """One phrase for the outcome: ``complete``, ``SSE 503``, ``HTTP 400``, ``no answer``, ``transport``…"""
        if self.timed_out:
            return "no answer"
        if self.status is None:
            return "transport"
        if self.status != 200:
            return f"HTTP {self.status}"
        if self.error is not None:
            return f"SSE {self.error_code}" if self.error_code is not None else "SSE error"
        if self.transport is not None:
            return "broken 200"
        if self.finish_reasons and self.done:
            return "complete"
        return "truncated 200"


async def stream(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], *, api: Api = "completions", bound_s: float = 60.0,
    into: Seen | None = None,
) -> Seen:  # fmt: skip
    """A streamed request (``stream_options.include_usage``), bounded by ``bound_s``; ``into`` fills as the events
    arrive."""
    seen = into if into is not None else Seen()
    seen.started = time.monotonic()
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with trio.move_on_after(bound_s) as bound:
        try:
            async with http.stream("POST", url + path_of(api), json=payload, timeout=bound_s) as response:
                seen.status = response.status_code
                if response.status_code != 200:
                    seen.error = _error_body(await response.aread())
                else:
                    async for line in response.aiter_lines():
                        _line(seen, api, line)
        except httpx.HTTPError as exc:
            seen.transport = f"{type(exc).__name__}: {exc}"
    seen.timed_out = bound.cancelled_caught
    seen.ended = time.monotonic()
    return seen


async def unary(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], *, api: Api = "completions", bound_s: float = 60.0
) -> Seen:
    """A request without streaming (bounded by ``bound_s``): the status, and the body's choices, usage or error."""
    seen = Seen(started=time.monotonic())
    with trio.move_on_after(bound_s) as bound:
        try:
            response = await http.post(url + path_of(api), json=body, timeout=bound_s)
            seen.status = response.status_code
            if response.status_code != 200:
                seen.error = _error_body(response.content)
            else:
                value = response.json()
                seen.done = True
                seen.usage = value.get("usage")
                for choice in value.get("choices") or []:
                    _choice(seen, api, choice, streamed=False)
        except (httpx.HTTPError, ValueError) as exc:
            seen.transport = f"{type(exc).__name__}: {exc}"
    seen.timed_out = bound.cancelled_caught
    seen.ended = time.monotonic()
    return seen


def _error_body(raw: bytes) -> Any:
    try:
        value = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:300]
    if isinstance(value, dict) and isinstance(value.get("error"), dict):
        return value["error"]
    return value


def _line(seen: Seen, api: Api, line: str) -> None:
    if not line.startswith("data:"):
        return
    data = line[5:].strip()
    if data == "[DONE]":
        seen.done = True
        return
    try:
        event = json.loads(data)
    except ValueError:
        return
    if not isinstance(event, dict):
        return
    if event.get("error") is not None:
        seen.error = event["error"]
    if event.get("usage"):
        seen.usage = event["usage"]
    for choice in event.get("choices") or []:
        _choice(seen, api, choice, streamed=True)


def _choice(seen: Seen, api: Api, choice: dict[str, Any], *, streamed: bool) -> None:
    seen.choices.add(int(choice.get("index") or 0))
    if api == "chat":
        content = (choice.get("delta" if streamed else "message") or {}).get("content")
    else:
        content = choice.get("text")
    if isinstance(content, str) and content:
        seen.pieces.append(content)
        if seen.first_piece is None:
            seen.first_piece = time.monotonic()
    if choice.get("finish_reason"):
        seen.finish_reasons.append(str(choice["finish_reason"]))


async def serves(http: httpx.AsyncClient, url: str) -> bool:
    """One tiny request answered 200 within the probe bound."""
    seen = await unary(http, url, body_for("completions", "ping", max_tokens=1), bound_s=PROBE_TIMEOUT_S)
    return seen.status == 200


async def serving_after(http: httpx.AsyncClient, url: str, bound_s: float) -> float | None:
    """Seconds until :func:`serves` (probed every ``PROBE_INTERVAL_S``), or None within ``bound_s``."""
    start = time.monotonic()
    while time.monotonic() - start < bound_s:
        if await serves(http, url):
            return time.monotonic() - start
        await trio.sleep(PROBE_INTERVAL_S)
    return None


async def unroutable_window(http: httpx.AsyncClient, url: str, window_s: float, bound_s: float) -> float:
    """After a request: for ``window_s`` seconds (and until it serves again, at most ``bound_s``), probe every
    ``PROBE_INTERVAL_S``; returns how long, in all, the model did not serve (0.0: every probe served)."""
    start = time.monotonic()
    unserved = 0.0
    failing_since: float | None = None
    while True:
        now = time.monotonic()
        ok = await serves(http, url)
        after = time.monotonic()
        if ok and failing_since is not None:
            unserved += now - failing_since
            failing_since = None
        elif not ok and failing_since is None:
            failing_since = now
        if after - start >= window_s and failing_since is None:
            return unserved
        if after - start >= bound_s:
            return unserved + (after - failing_since if failing_since is not None else 0.0)
        await trio.sleep(PROBE_INTERVAL_S)


@dataclass
class HealthLog:
    """``GET /health`` on a worker's system port every ``interval`` seconds, while running: ``(t, status)``
    (status 0 = no answer)."""

    url: str
    interval: float = 0.05
    samples: list[tuple[float, int]] = field(default_factory=list)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with httpx.AsyncClient(timeout=1.0) as http:
            task_status.started()
            while True:
                try:
                    status = (await http.get(f"{self.url}/health")).status_code
                except httpx.HTTPError:
                    status = 0
                self.samples.append((time.monotonic(), status))
                await trio.sleep(self.interval)

    def between(self, start: float, end: float = math.inf) -> Counter[int]:
        return Counter(status for t, status in self.samples if start <= t <= end)


def statuses(counts: Counter[int]) -> str:
    """``{503: 20, 200: 3}`` as ``503 ×20, 200 ×3`` (0 = no answer)."""
    if not counts:
        return "not sampled"
    return ", ".join(f"{'no answer' if s == 0 else s} ×{n}" for s, n in counts.most_common())


def tally(outcomes: Sequence[Seen], *, choices: int = 1, tokens: int | None = None) -> str:
    """``8/8 complete`` or ``0/8 complete (8× SSE 503)``."""
    done = sum(1 for o in outcomes if o.complete(choices, tokens))
    others = Counter(
        o.kind() if o.kind() != "complete" else "complete, wrong length"
        for o in outcomes
        if not o.complete(choices, tokens)
    )
    text = f"{done}/{len(outcomes)} complete"
    if others:
        text += " (" + ", ".join(f"{n}× {k}" for k, n in others.most_common()) + ")"
    return text


__all__ = [
    "PROBE_INTERVAL_S",
    "Api",
    "HealthLog",
    "Seen",
    "body_for",
    "serves",
    "serving_after",
    "statuses",
    "stream",
    "tally",
    "unary",
    "unroutable_window",
]
