"""Launching ``echo_worker.py`` and talking to the frontend over HTTP, for the Dynamo adapter's e2e tests."""

from __future__ import annotations

import json
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from tests.helpers.processes import DynamoEnv, Process, start_process

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

ECHO_WORKER = Path(__file__).with_name("echo_worker.py")
PROMPT = "One two three four five six"


@dataclass
class EchoWorker:
    tag: str
    process: Process
    instance_hex: str
    timings: dict[str, float]
    system_port: int

    async def command(self, command: str, timeout: float = 10.0) -> str:
        """Send a stdin command and return its result field."""
        start = len(self.process.log())
        await self.process.send_line(command)
        match = await self.process.wait_for_log(rf"^OK {command.replace(' ', '_')} (\S+) ", timeout, start=start)
        return match.group(1)

    def count(self, word: str) -> int:
        return sum(1 for line in self.process.log().splitlines() if line.startswith(f"{word} {self.tag} "))


@asynccontextmanager
async def start_echo_worker(
    denv: DynamoEnv, model_dir: Path, *, tag: str = "a", extra: tuple[str, ...] = ()
) -> AsyncIterator[EchoWorker]:
    argv = [sys.executable, str(ECHO_WORKER), "--model-path", str(model_dir), "--tag", tag, "--stdin", *extra]
    env = denv.worker_env()
    async with start_process(
        argv, env, log_path=denv.log_path(f"worker-{tag}"), ready=r"^READY ", stdin=True
    ) as process:
        match = await process.wait_for_log(r"^READY (\S+) runtime=(\S+) serve=(\S+) register=(\S+)", 1)
        timings = {k: float(match.group(i)) for i, k in enumerate(("runtime", "serve", "register"), start=2)}
        yield EchoWorker(
            tag=tag,
            process=process,
            instance_hex=match.group(1),
            timings=timings,
            system_port=int(env["DYN_SYSTEM_PORT"]),
        )


def body(
    *, chat: bool = True, stream: bool = False, max_tokens: int = 6, annotations: list[str] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"model": "tiny", "max_tokens": max_tokens, "stream": stream}
    if chat:
        out["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        out["prompt"] = PROMPT
    if stream:
        out["stream_options"] = {"include_usage": True}
    if annotations:
        out["nvext"] = {"annotations": annotations}
    return out


def path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


@dataclass
class Reply:
    status: int
    json: dict[str, Any] | None  # non-streaming body
    events: list[dict[str, Any]]  # streaming: every ``data:`` JSON event
    done: bool  # streaming: saw ``data: [DONE]``

    def text(self) -> str:
        """The generated text, streaming or not, chat or completions."""
        if self.json is not None:
            choice = self.json["choices"][0]
            return str(choice.get("text") or (choice.get("message") or {}).get("content") or "")
        parts = []
        for event in self.events:
            for choice in event.get("choices") or []:
                parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        return "".join(parts)

    def finish_reason(self) -> str | None:
        if self.json is not None:
            return self.json["choices"][0].get("finish_reason")  # type: ignore[no-any-return]
        reasons = [
            c.get("finish_reason") for e in self.events for c in e.get("choices") or [] if c.get("finish_reason")
        ]
        return reasons[-1] if reasons else None

    def error(self) -> dict[str, Any] | None:
        """The error object: the JSON body of a non-200 answer, or an SSE ``{"error": ...}`` event."""
        if self.json is not None and self.status != 200:
            return self.json
        for event in self.events:
            if "error" in event:
                return event["error"]  # type: ignore[no-any-return]
        return None

    def error_code(self) -> int | None:
        error = self.error()
        return None if error is None else int(error.get("code", self.status))


def _json_or_raw(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {"raw": text}
    return value if isinstance(value, dict) else {"raw": value}


async def post(
    url: str,
    payload: dict[str, Any],
    *,
    chat: bool = True,
    timeout: float = 20.0,
    headers: dict[str, str] | None = None,
) -> Reply:
    """POST to the frontend; parse SSE when ``payload["stream"]``."""
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
        if not payload.get("stream"):
            response = await client.post(url + path(chat), json=payload)
            return Reply(response.status_code, _json_or_raw(response.text), [], False)
        async with client.stream("POST", url + path(chat), json=payload) as response:
            raw = (await response.aread()).decode()
    if response.status_code != 200:
        return Reply(response.status_code, _json_or_raw(raw), [], False)
    events: list[dict[str, Any]] = []
    done = False
    for line in raw.splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
        elif data:
            events.append(json.loads(data))
    return Reply(200, None, events, done)
