"""One scripted, in-memory engine client for the request-task tests (``tests/test_requests.py``,
``tests/disagg/test_deferral.py``), in trio's virtual time.

:class:`ScriptedEngine` plays a scripted ``Generate`` stream and records what the engine side would observe: the
opened requests and their metadata, streams closed before their end, and aborts. Its ``abort`` reaches a
checkpoint **before** it records the id, as a real RPC would: an Abort sent from a cancelled task without a shield
never arrives, so a test asserting the abort catches an unshielded one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from openengine.v1 import generation_pb2 as pb
from openengine_bp.openengine.v1 import (
    AbortResponse,
    AbortStatus,
    DeploymentCapacity,
    GenerationCapabilities,
    HealthResponse,
    HealthState,
    LogprobCapabilities,
    ModelInfo,
    ServerInfo,
)
from sidecar.convert import Capabilities
from sidecar.dynamo import RequestContext
from sidecar.requests import RequestServer
from statemachines import REQUEST, RequestLifecycle

__all__ = [
    "RID",
    "Recorder",
    "ScriptedEngine",
    "Step",
    "caps",
    "collect",
    "error",
    "finished",
    "recorder",
    "token",
]

RID = "req-1"

# A scripted engine answer: a pause (virtual seconds) then a batch, an exception, or None to hang forever.
Step = tuple[float, "list[pb.GenerateResponse] | BaseException | None"]


class ScriptedEngine:
    """Plays a scripted Generate stream (the same script for every request) and records what the engine saw."""

    def __init__(self, script: Sequence[Step], *, health: HealthState = HealthState.READY) -> None:
        self.script = list(script)
        self.opened: list[pb.GenerateRequest] = []
        self.metadata: list[tuple[tuple[str, str], ...]] = []
        self.stream_closed_early = 0
        self.aborts: list[str] = []
        self.health_state = health
        #: Virtual time of each abort, in order (for "aborted at once" checks).
        self.abort_times: list[float] = []

    @asynccontextmanager
    async def generate(
        self, request: pb.GenerateRequest, *, metadata: Sequence[tuple[str, str]] = ()
    ) -> AsyncIterator[AsyncIterator[list[pb.GenerateResponse]]]:
        self.opened.append(request)
        self.metadata.append(tuple(metadata))
        stream = _ScriptedStream(self.script, request.request_id)
        try:
            yield stream
        finally:
            if not stream.finished:
                self.stream_closed_early += 1

    async def abort(self, request_id: str, *, timeout_s: float | None = None) -> AbortResponse:
        # A real Abort is an RPC: its first await is where an unshielded, cancelled caller stops.
        await trio.lowlevel.checkpoint()
        self.aborts.append(request_id)
        self.abort_times.append(trio.current_time())
        return AbortResponse(status=AbortStatus.ABORTED)

    async def health(self, *, timeout_s: float | None = None) -> HealthResponse:
        await trio.lowlevel.checkpoint()
        return HealthResponse(state=self.health_state)


class _ScriptedStream:
    """The engine side of one stream: each step is due at a fixed time after the open (the engine works whether or
    not the reader is waiting), and a read interrupted by cancellation loses nothing (as the bridge's stream)."""

    def __init__(self, script: Sequence[Step], request_id: str) -> None:
        self._steps = list(script)
        self._request_id = request_id
        self._due: list[float] = []
        at = trio.current_time()
        for delay, _ in self._steps:
            at += delay
            self._due.append(at)
        self._next = 0
        self.finished = False

    def __aiter__(self) -> _ScriptedStream:
        return self

    async def __anext__(self) -> list[pb.GenerateResponse]:
        if self._next >= len(self._steps):
            self.finished = True
            await trio.lowlevel.checkpoint()
            raise StopAsyncIteration
        await trio.sleep_until(self._due[self._next])
        _, item = self._steps[self._next]
        if item is None:
            await trio.sleep_forever()
        self._next += 1
        if isinstance(item, BaseException):
            raise item
        return [_with_id(r, self._request_id) for r in item]


def _with_id(response: pb.GenerateResponse, request_id: str) -> pb.GenerateResponse:
    """Scripts are written for :data:`RID`; another request (a canary, a second request) gets its own id."""
    if response.request_id != RID or request_id == RID:
        return response
    copy = pb.GenerateResponse()
    copy.CopyFrom(response)
    copy.request_id = request_id
    return copy


def caps() -> Capabilities:
    server = ServerInfo(
        engine_name="fake",
        schema_revision=1,
        minimum_client_revision=1,
        supported_models=["tiny"],
        capacity=DeploymentCapacity(kv_block_size=16, total_kv_blocks=100, max_running_requests=8),
    )
    model = ModelInfo(
        model_id="tiny",
        served_model_name="tiny",
        max_context_length=256,
        supports_token_ids_input=True,
        generation=GenerationCapabilities(
            max_num_sequences=2,
            output_logprobs=LogprobCapabilities(supported=True, max_top_n=5),
        ),
    )
    return Capabilities.from_discovery(server, model)


def token(index: int, *ids: int, text: str | None = None) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=RID)
    response.token.output_index = index
    for i in ids:
        response.token.tokens.add(token_id=i)
    if text is not None:
        response.token.text = text
    return response


def finished(
    index: int,
    reason: int = pb.FINISH_REASON_LENGTH,
    usage: tuple[int, int] | None = (3, 2),
    *,
    cached: int | None = None,
) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=RID)
    response.finished.output_index = index
    response.finished.reason = reason  # type: ignore[assignment]
    if usage is not None:
        response.usage.prompt_tokens, response.usage.completion_tokens = usage
        response.usage.total_tokens = sum(usage)
        if cached is not None:
            response.usage.cached_prompt_tokens = cached
    return response


def error(code: int, retryable: bool, message: str = "boom") -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=RID)
    response.error.code = code  # type: ignore[assignment]
    response.error.message = message
    response.error.retryable = retryable
    response.usage.prompt_tokens = 3
    return response


class Recorder:
    """Observes request transitions (the machine is shared: filter by our request id)."""

    def __init__(self, request_id: str = RID) -> None:
        self.request_id = request_id
        self.events: list[tuple[str, str]] = []

    def __call__(self, model: RequestLifecycle, event: str, source: str, dest: str) -> None:
        if model.request_id == self.request_id:
            self.events.append((event, dest))

    @property
    def final(self) -> str:
        return self.events[-1][1]


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    REQUEST.observers.append(rec)
    yield rec
    REQUEST.observers.remove(rec)


async def collect(server: RequestServer, body: dict[str, Any], request_id: str = RID) -> list[dict[str, Any]]:
    """Run one request to its end as a client that reads everything; returns every chunk."""
    out: list[dict[str, Any]] = []
    async for batch in server.handle(body, RequestContext(request_id=request_id)):
        out.extend(batch)
    return out
