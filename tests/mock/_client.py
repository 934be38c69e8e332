"""A plain grpclib asyncio client for the mock, run from sync tests (``call``), plus request builders."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TypeVar

from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError, StreamTerminatedError

from openengine.v1 import generation_pb2, lifecycle_pb2, openengine_grpc, server_pb2
from sidecar.testing.mock.structs import fill_struct
from tests.helpers.waits import wait_until

T = TypeVar("T")

_ids = itertools.count()


def new_id(prefix: str = "req") -> str:
    return f"{prefix}-{next(_ids)}"


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def call(address: str, fn: Callable[[Channel], Awaitable[T]], *, timeout: float = 30.0) -> T:
    """Run ``fn(channel)`` on a fresh asyncio loop and channel, bounded by ``timeout`` seconds."""
    host, port = split_address(address)

    async def main() -> T:
        channel = Channel(host, port)
        try:
            return await asyncio.wait_for(fn(channel), timeout)
        finally:
            channel.close()

    return asyncio.run(main())


@dataclasses.dataclass
class Outcome:
    """Everything one Generate call produced."""

    messages: list[generation_pb2.GenerateResponse]
    status: Status
    details: str | None
    transport_error: BaseException | None = None

    @property
    def events(self) -> list[str]:
        return [str(m.WhichOneof("event")) for m in self.messages]

    def tokens(self, index: int = 0) -> list[int]:
        return [
            t.token_id
            for m in self.messages
            if m.WhichOneof("event") == "token" and m.token.output_index == index
            for t in m.token.tokens
        ]

    def text(self, index: int = 0) -> str:
        return "".join(
            m.token.text for m in self.messages if m.WhichOneof("event") == "token" and m.token.output_index == index
        )

    def finished(self) -> list[generation_pb2.GenerationFinished]:
        return [m.finished for m in self.messages if m.WhichOneof("event") == "finished"]

    @property
    def final(self) -> generation_pb2.GenerateResponse:
        return self.messages[-1]


async def generate(
    channel: Channel,
    request: generation_pb2.GenerateRequest,
    *,
    metadata: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
    timeout: float = 20.0,
) -> Outcome:
    """One Generate call, collecting messages and the final status (never raises for a status or transport loss)."""
    stub = openengine_grpc.InferenceStub(channel)
    messages: list[generation_pb2.GenerateResponse] = []
    try:
        async with stub.Generate.open(metadata=metadata, timeout=timeout) as stream:
            await stream.send_message(request, end=True)
            async for message in stream:
                messages.append(message)
    except GRPCError as exc:
        return Outcome(messages, exc.status, exc.message)
    except (StreamTerminatedError, ConnectionError) as exc:
        return Outcome(messages, Status.UNAVAILABLE, str(exc), transport_error=exc)
    return Outcome(messages, Status.OK, None)


def make_request(
    request_id: str | None = None,
    *,
    model: str = "tiny-oe",
    prompt: str | None = "The river",
    token_ids: Iterable[int] | None = None,
    max_tokens: int | None = 16,
    min_tokens: int | None = None,
    temperature: float | None = None,
    seed: int | None = None,
    n: int | None = None,
    stop_texts: Sequence[str] = (),
    stop_ids: Sequence[int] = (),
    ignore_eos: bool | None = None,
    include_stop: bool | None = None,
    logprobs_top_n: int | None = None,
    extra: Mapping[str, object] | None = None,
    mock: Mapping[str, object] | None = None,
) -> generation_pb2.GenerateRequest:
    """A ``GenerateRequest`` with the given options set (unset ones stay absent on the wire)."""
    req = generation_pb2.GenerateRequest(request_id=request_id if request_id is not None else new_id(), model=model)
    if token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    elif prompt is not None:
        req.prompt = prompt
    if max_tokens is not None:
        req.stopping.max_tokens = max_tokens
    if min_tokens is not None:
        req.stopping.min_tokens = min_tokens
    if ignore_eos is not None:
        req.stopping.ignore_eos = ignore_eos
    if include_stop is not None:
        req.stopping.include_stop_in_output = include_stop
    for text in stop_texts:
        req.stopping.conditions.add(stop_text=text)
    for token_id in stop_ids:
        req.stopping.conditions.add(stop_token_id=token_id)
    if temperature is not None:
        req.sampling.temperature = temperature
    if seed is not None:
        req.sampling.seed = seed
    if n is not None:
        req.sampling.num_sequences = n
    if logprobs_top_n is not None:
        req.response.return_output_logprobs = True
        req.response.output_candidates.top_n = logprobs_top_n
    values: dict[str, object] = dict(extra or {})
    if mock is not None:
        values["mock"] = dict(mock)
    if values:
        fill_struct(req.extra, values)
    return req


async def get_load(channel: Channel, *, per_rank: bool = False) -> server_pb2.LoadInfo:
    return await openengine_grpc.ControlStub(channel).GetLoad(server_pb2.GetLoadRequest(include_per_rank=per_rank))


async def abort(
    channel: Channel, request_id: str | None = None, *, all_requests: bool = False
) -> lifecycle_pb2.AbortResponse:
    req = lifecycle_pb2.AbortRequest()
    if all_requests:
        req.all_requests.SetInParent()
    elif request_id is not None:
        req.request_id = request_id
    return await openengine_grpc.ControlStub(channel).Abort(req)


async def wait_for_load(
    channel: Channel, predicate: Callable[[server_pb2.LoadInfo], bool], *, timeout: float = 5.0
) -> server_pb2.LoadInfo:
    """Poll ``GetLoad`` until ``predicate`` holds (``TimeoutError`` after ``timeout``)."""

    async def satisfied() -> server_pb2.LoadInfo | None:
        load = await get_load(channel)
        return load if predicate(load) else None

    found = await wait_until(satisfied, timeout=timeout, what="GetLoad satisfying the condition")
    assert found is not None
    return found


async def status_of(coro: Awaitable[object]) -> tuple[Status, str | None]:
    """The status of a unary call (``OK`` when it returns)."""
    try:
        await coro
    except GRPCError as exc:
        return exc.status, exc.message
    return Status.OK, None
