"""The load of ``bench.chaos``: a seeded catalogue of request templates and the clients that send them.

Every template is deterministic — greedy (temperature 0) or sampled with an explicit ``seed``; the mock seeds an
unseeded request from its request id, which differs between attempts — so each has a reference answer. The mix:
chat and completions, streamed and not, greedy and seeded, ``n=2``, stop strings, logprobs, the LoRA adapter, the
disaggregated pair's model, and "directive" templates whose prompt carries a ``[mock-fault …]`` directive (the
engines run ``--faults-from-prompt``): the engine answers them with a retryable or non-retryable ``EngineError``
after some tokens. Directive templates are only sent while the fault scheduler has an error window open.

A client is a closed loop: send, read, record, judge later. Each request is bounded (``REQUEST_TIMEOUT_S``) and so is
the loop (count and deadline). Three behaviours: a normal reader; a slow reader (pauses between reads, so the
frontend's and the sidecar's buffers fill); a client that disconnects at a random point. Everything received is kept
with its time (:class:`Transcript`): a violation prints it so the request can be replayed.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import httpx
import trio

from bench._chaos_topology import LORA, PD_MODEL
from tests.helpers.stack import MODEL

Api = Literal["chat", "completions"]
ModelKind = Literal["base", "lora", "pd"]
Behaviour = Literal["normal", "slow", "disconnect"]

#: Bound on one request, from sending to the last byte; a request that needs longer is a violation ("hang").
REQUEST_TIMEOUT_S: Final = 90.0
#: Directive templates: how many of each kind.
DIRECTIVE_TEMPLATES: Final = 6

PROMPTS: Final = (
    "Tell me a story about the river and the old mill.",
    "Describe the harbour at dawn.",
    "What did the gardener plant in April?",
    "Write about the village under snow.",
    "The schooner came into the bay because",
    "Once upon a time, in a town by the hills,",
    "List what the butcher counted after the storm.",
    "Explain how the bridge was built.",
    "A grey heron watched the path while",
    "Summarise the day at the market.",
    "Why did the reading group meet at night?",
    "The old farmhouse stood at the end of the village and",
)
STOPS: Final = ((" the",), (".",), (" and", "!"), (",",))


@dataclass(frozen=True, slots=True)
class Template:
    """One deterministic request; ``body`` lacks ``model`` and ``stream`` (see :meth:`body_for`)."""

    name: str
    api: Api
    stream: bool
    model_kind: ModelKind
    n: int
    body: dict[str, Any]
    #: ``error_retryable`` / ``error_fatal`` for directive templates (sent during that fault's windows only).
    directive: str | None = None

    def model(self, *, reference: bool = False) -> str:
        """The served model; the reference stack serves the pair's model as the base model (the same tokens)."""
        if self.model_kind == "lora":
            return LORA
        if self.model_kind == "pd" and not reference:
            return PD_MODEL
        return MODEL

    def body_for(self, *, reference: bool = False) -> dict[str, Any]:
        body = {"model": self.model(reference=reference), **self.body}
        if self.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"


def catalogue(seed: int, count: int = 40) -> list[Template]:
    """The run's templates: ``count`` ordinary ones (the first few pin every feature) and the directive ones."""
    rng = random.Random(f"catalogue-{seed}")
    pinned: list[dict[str, Any]] = [
        {"api": "chat", "stream": True},
        {"api": "completions", "stream": False},
        {"api": "chat", "stream": True, "n": 2},
        {"api": "completions", "stream": True, "n": 2, "logprobs": True},
        {"api": "chat", "stream": False, "logprobs": True},
        {"api": "chat", "stream": True, "stop": True},
        {"api": "completions", "stream": True, "stop": True},
        {"api": "chat", "stream": True, "model_kind": "lora"},
        {"api": "completions", "stream": False, "model_kind": "lora", "logprobs": True},
        {"api": "chat", "stream": True, "model_kind": "pd"},
        {"api": "completions", "stream": False, "model_kind": "pd"},
        {"api": "chat", "stream": True, "model_kind": "pd", "greedy": True},
    ]
    templates = []
    for index in range(count):
        spec = pinned[index] if index < len(pinned) else {}
        templates.append(_template(rng, f"t{index:02d}", spec))
    for kind in ("error_retryable", "error_fatal"):
        for index in range(DIRECTIVE_TEMPLATES):
            templates.append(_template(rng, f"{kind[6:9]}{index:02d}", {"model_kind": "base", "directive": kind}))
    return templates


def _template(rng: random.Random, name: str, spec: dict[str, Any]) -> Template:
    api: Api = spec.get("api") or rng.choice(("chat", "completions"))
    stream = spec["stream"] if "stream" in spec else rng.random() < 0.7
    model_kind: ModelKind = spec.get("model_kind") or rng.choices(("base", "lora", "pd"), (8, 1, 1))[0]
    if model_kind == "pd" and (spec.get("n", 1) > 1 or spec.get("logprobs")):
        # A prefill leg serves one output (TensorRT-LLM refuses n > 1 there), and the full engine does not carry
        # logprobs across the handoff: the pair's model takes neither.
        model_kind = "base"
    directive: str | None = spec.get("directive")
    pd = model_kind == "pd"
    n = spec.get("n") or (2 if not pd and not directive and rng.random() < 0.15 else 1)
    greedy = spec.get("greedy", n == 1 and rng.random() < 0.4)
    logprobs = spec.get("logprobs", not pd and rng.random() < 0.25)
    stop = spec.get("stop", rng.random() < 0.2)
    max_tokens = rng.randint(8, 48)
    prompt = rng.choice(PROMPTS)
    body: dict[str, Any] = {"max_tokens": max_tokens}
    if directive is not None:
        after = rng.randint(2, 12)
        retryable = "true" if directive == "error_retryable" else "false"
        prompt += f" [mock-fault error_after_tokens={after} error_code=INTERNAL error_retryable={retryable}]"
        body["max_tokens"] = max_tokens = rng.randint(after + 2, 40)
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if greedy:
        body["temperature"] = 0
    else:
        body["temperature"] = rng.choice((0.7, 0.9, 1.0))
        body["seed"] = rng.randrange(1, 2**31)
    if n > 1:
        body["n"] = n
    if stop:
        body["stop"] = list(rng.choice(STOPS))
    if logprobs:
        if api == "chat":
            body.update(logprobs=True, top_logprobs=2)
        else:
            body["logprobs"] = 2
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    label = [api[:4], "s" if stream else "u", model_kind, f"n{n}", "g" if greedy else "r"]
    label += ["lp"] if logprobs else []
    label += ["stop"] if stop else []
    return Template(f"{name}-{'-'.join(label)}", api, stream, model_kind, n, body, directive)


# ---------------------------------------------------------------------------------------------------- transcripts


@dataclass(slots=True)
class Transcript:
    """Everything one request saw, with times relative to the run's start (seconds)."""

    number: int
    client: int
    template: Template
    frontend: str
    behaviour: Behaviour
    started: float
    request: dict[str, Any]
    #: How long a slow reader pauses between reads, or after what a disconnecting client leaves (chunks or seconds).
    behaviour_detail: str = ""
    status: int | None = None
    #: Streamed: every line received (``(t, line)``); not streamed: one entry with the whole body.
    lines: list[tuple[float, str]] = field(default_factory=list)
    ended: float | None = None
    #: A client-side failure (connection refused or broken, timeout), with its type.
    transport_error: str | None = None
    timed_out: bool = False
    disconnected: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "client": self.client,
            "template": self.template.name,
            "frontend": self.frontend,
            "behaviour": self.behaviour,
            "behaviour_detail": self.behaviour_detail,
            "started": round(self.started, 4),
            "ended": None if self.ended is None else round(self.ended, 4),
            "request": self.request,
            "status": self.status,
            "transport_error": self.transport_error,
            "timed_out": self.timed_out,
            "disconnected": self.disconnected,
            "lines": [[round(t, 4), line] for t, line in self.lines],
        }


Clock = Callable[[], float]


async def send(
    http: httpx.AsyncClient,
    url: str,
    transcript: Transcript,
    clock: Clock,
    rng: random.Random,
) -> Transcript:
    """Send the transcript's request to ``url`` and record everything (never raises on a network failure)."""
    template, body = transcript.template, transcript.request
    leave_after_lines: int | None = None
    leave_after_s: float | None = None
    pause_s = 0.0
    if transcript.behaviour == "disconnect":
        if template.stream and rng.random() < 0.7:
            leave_after_lines = rng.randint(1, 3 + body.get("max_tokens", 16) * template.n // 2)
            transcript.behaviour_detail = f"leaves after {leave_after_lines} SSE lines"
        else:
            leave_after_s = rng.uniform(0.02, 1.5)
            transcript.behaviour_detail = f"leaves after {leave_after_s:.3f} s"
    elif transcript.behaviour == "slow":
        pause_s = rng.uniform(0.02, 0.15)
        transcript.behaviour_detail = f"pauses {pause_s:.3f} s between reads"
    with trio.move_on_after(REQUEST_TIMEOUT_S) as bound:
        with trio.move_on_after(leave_after_s if leave_after_s is not None else math.inf) as leave:
            try:
                await _exchange(http, url + template.path, transcript, clock, leave_after_lines, pause_s)
            except httpx.HTTPError as exc:
                transcript.transport_error = f"{type(exc).__name__}: {exc}"
        if leave.cancelled_caught:
            transcript.disconnected = True
    if bound.cancelled_caught:
        transcript.timed_out = True
    transcript.ended = clock()
    return transcript


async def _exchange(
    http: httpx.AsyncClient,
    url: str,
    transcript: Transcript,
    clock: Clock,
    leave_after_lines: int | None,
    pause_s: float,
) -> None:
    async with http.stream("POST", url, json=transcript.request, timeout=REQUEST_TIMEOUT_S) as response:
        transcript.status = response.status_code
        if not transcript.template.stream or response.status_code != 200:
            raw = await response.aread()
            transcript.lines.append((clock(), raw.decode(errors="replace")))
            return
        count = 0
        async for line in response.aiter_lines():
            if not line:
                continue
            transcript.lines.append((clock(), line))
            count += 1
            if leave_after_lines is not None and count >= leave_after_lines:
                transcript.disconnected = True
                return
            if pause_s:
                await trio.sleep(pause_s)


def events(transcript: Transcript) -> list[dict[str, Any] | str]:
    """The SSE events of a streamed transcript: parsed JSON objects, ``"[DONE]"``, or the raw text of a line that
    is not valid JSON."""
    parsed: list[dict[str, Any] | str] = []
    for _, line in transcript.lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            parsed.append("[DONE]")
            continue
        try:
            value = json.loads(data)
        except ValueError:
            parsed.append(data)
            continue
        parsed.append(value if isinstance(value, dict) else data)
    return parsed
