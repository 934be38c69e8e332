"""KV events, only when advertised: source descriptors, the snapshot, sequence continuity (wire §7.3, §7.7;
trtllm §11; the sidecar's reading of them: ``docs/kv-events.md``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from grpclib.const import Status
from grpclib.exceptions import GRPCError, StreamTerminatedError

from openengine.v1 import kv_pb2, openengine_grpc

from ._context import Context
from ._model import FailCheck, Outcome, SkipCheck
from ._registry import check
from ._wire import Call

_WILDCARD_HOSTS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})
#: Statuses that refuse a snapshot request (the sidecar falls back to subscribing without one).
_SNAPSHOT_REFUSALS = frozenset({Status.UNIMPLEMENTED, Status.INVALID_ARGUMENT, Status.FAILED_PRECONDITION})


async def _sources(ctx: Context) -> list[kv_pb2.KvEventSource]:
    """The advertised sources, asked once per run; a skip when the engine has none."""
    answer = ctx.memo.get("kv.sources")
    if answer is None:
        answer = await ctx.unary(ctx.control.GetKvEventSources, kv_pb2.GetKvEventSourcesRequest())
        ctx.memo["kv.sources"] = answer
    assert isinstance(answer, Call)
    if answer.status is Status.UNIMPLEMENTED:
        raise SkipCheck("not advertised: GetKvEventSources is UNIMPLEMENTED")
    if not answer.ok:
        raise FailCheck(f"GetKvEventSources: {answer.describe()}")
    sources = list(answer.get().sources)
    if not sources:
        raise SkipCheck("not advertised: GetKvEventSources lists no source (KV events disabled)")
    return sources


async def _grpc_source(ctx: Context) -> kv_pb2.KvEventSource:
    sources = await _sources(ctx)
    for source in sources:
        if source.transport == "grpc":
            return source
    raise SkipCheck(f"no gRPC source (transports {sorted({s.transport for s in sources})}): SubscribeKvEvents unused")


@check(
    "kv.sources",
    "GetKvEventSources lists sources with a transport and encoding, routable endpoints, one per DP rank",
    "wire §7.7 'KV event sources'; trtllm §11",
)
async def sources(ctx: Context) -> Outcome:
    found = await _sources(ctx)
    ranks: list[int] = []
    for source in found:
        if source.transport not in ("grpc", "zmq"):
            raise FailCheck(f"unknown transport {source.transport!r}")
        if not source.encoding:
            raise FailCheck(f"{source.transport} source without an encoding")
        if source.transport == "zmq":
            addr = source.endpoint_addr
            if addr.host in _WILDCARD_HOSTS or not 0 < addr.port < 65536:
                raise FailCheck(f"ZMQ endpoint {addr.host!r}:{addr.port} is not routable (a bind wildcard?)")
        if source.HasField("data_parallel_rank"):
            ranks.append(source.data_parallel_rank)
    if len(set(ranks)) != len(ranks):
        raise FailCheck(f"ranks repeat: {ranks}")
    shown = [f"{s.transport}/{s.encoding}" for s in found]
    return Outcome.passed(f"{len(found)} source(s) {shown}, ranks {ranks or 'unstated'}")


@dataclass(slots=True)
class _Watch:
    """Messages of one subscription, read by a background task."""

    messages: list[kv_pb2.SubscribeKvEventsResponse] = field(default_factory=list)
    status: Status | None = None
    details: str | None = None
    error: str | None = None
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def batches(self) -> list[kv_pb2.KvEventBatch]:
        return [m.batch for m in self.messages if m.WhichOneof("event") == "batch"]

    async def wait_for(self, count: int, bound: float) -> bool:
        """Wait until ``count`` messages arrived (or the subscription ended, or ``bound`` seconds passed)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound
        while len(self.messages) < count and self.status is None and self.error is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), remaining)
            except TimeoutError:
                return False
        return len(self.messages) >= count


async def _read(ctx: Context, request: kv_pb2.SubscribeKvEventsRequest, watch: _Watch) -> None:
    stub = openengine_grpc.ControlStub(ctx.inference_channel)
    try:
        async with stub.SubscribeKvEvents.open(timeout=ctx.config.settle * 3 + ctx.config.rpc_timeout) as stream:
            await stream.send_message(request, end=True)
            async for message in stream:
                watch.messages.append(message)
                watch.arrived.set()
        watch.status = Status.OK
    except GRPCError as exc:
        watch.status, watch.details = exc.status, exc.message
    except (StreamTerminatedError, ConnectionError, OSError, TimeoutError) as exc:
        watch.error = repr(exc)
    finally:
        watch.arrived.set()


def _unique_prompt(ctx: Context, salt: str) -> str:
    """A prompt no earlier request shares a block with, long enough to fill a few KV blocks."""
    info = ctx.server_info.response
    block = info.capacity.kv_block_size if info is not None and info.capacity.HasField("kv_block_size") else 64
    words = " ".join(f"w{i}{salt}" for i in range(block * 2))
    return f"{salt} {ctx.nonce} {words}"


async def _store_blocks(ctx: Context, salt: str) -> None:
    if ctx.advertised("supports_text_input") is False:
        raise SkipCheck("needs text input to store fresh KV blocks")
    request = ctx.request(f"kv-{salt}", max_tokens=2)
    request.prompt = _unique_prompt(ctx, salt)
    obs = await ctx.observe(request)
    if not obs.accepted:
        raise SkipCheck(f"a request to store KV blocks was refused ({obs.describe_end()})")


def _ranks(source: kv_pb2.KvEventSource) -> list[int]:
    return [source.data_parallel_rank] if source.HasField("data_parallel_rank") else []


@asynccontextmanager
async def _subscribed(ctx: Context, *, include_snapshot: bool) -> AsyncIterator[tuple[_Watch, list[int]]]:
    """SubscribeKvEvents on the gRPC source for its rank, read in the background while the block runs.

    Yields the watch and the ranks asked; skips when there is no gRPC source or no request can be sent.
    """
    source = await _grpc_source(ctx)
    ctx.require_generation()
    ranks = _ranks(source)
    request = kv_pb2.SubscribeKvEventsRequest(data_parallel_ranks=ranks, include_snapshot=include_snapshot)
    watch = _Watch()
    task = asyncio.create_task(_read(ctx, request, watch))
    try:
        yield watch, ranks
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _check_batches(batches: list[kv_pb2.KvEventBatch], ranks: list[int], first: int | None) -> str:
    expected = first
    for batch in batches:
        if expected is not None and batch.sequence_number != expected:
            seqs = [b.sequence_number for b in batches]
            raise FailCheck(f"sequence numbers {seqs}: #{batch.sequence_number} where #{expected} was due")
        if not batch.timestamp_unix_nanos:
            raise FailCheck(f"batch #{batch.sequence_number} has no timestamp")
        if ranks and batch.data_parallel_rank not in ranks:
            raise FailCheck(f"batch #{batch.sequence_number} for rank {batch.data_parallel_rank}, asked {ranks}")
        expected = batch.sequence_number + 1
    return f"#{batches[0].sequence_number}…#{batches[-1].sequence_number}"


@check(
    "kv.snapshot",
    "SubscribeKvEvents with include_snapshot starts with a snapshot batch; live batches continue at its number + 1",
    "wire §7.3, §7.7; docs/kv-events.md",
)
async def snapshot(ctx: Context) -> Outcome:
    async with _subscribed(ctx, include_snapshot=True) as (watch, ranks):
        if not await watch.wait_for(1, ctx.config.rpc_timeout):
            if watch.status in _SNAPSHOT_REFUSALS and not watch.messages:
                raise SkipCheck(f"snapshot not offered: {watch.status.name if watch.status else ''} {watch.details}")
            end = watch.error or (watch.status.name if watch.status else f"nothing in {ctx.config.rpc_timeout:g} s")
            raise FailCheck(f"no snapshot batch: {end}")
        first = watch.messages[0]
        if first.WhichOneof("event") != "batch":
            raise FailCheck(f"the subscription opened with {first.WhichOneof('event')}: {first.error.message!r}")
        number = first.batch.sequence_number
        await _store_blocks(ctx, "snapshot")
        if not await watch.wait_for(2, ctx.config.rpc_timeout):
            raise FailCheck(f"no live batch after the snapshot #{number} and a request storing new blocks")
        span = _check_batches(watch.batches(), ranks, number)
    return Outcome.passed(f"snapshot #{number} ({len(first.batch.events)} events), live batches {span}")


@check(
    "kv.sequence",
    "live KV event batches are numbered without gaps (+1 each), stamped, for the rank asked",
    "wire §7.7 'Batches carry a monotonic sequence_number'; docs/kv-events.md",
)
async def sequence(ctx: Context) -> Outcome:
    async with _subscribed(ctx, include_snapshot=False) as (watch, ranks):
        await asyncio.sleep(0.2)  # let the subscription join before the blocks are stored
        if watch.status is not None or watch.error is not None:
            raise FailCheck(f"the subscription ended at once: {watch.status or watch.error} {watch.details or ''}")
        for salt in ("seq-a", "seq-b", "seq-c"):
            await _store_blocks(ctx, salt)
        if not await watch.wait_for(2, ctx.config.rpc_timeout):
            raise FailCheck(f"{len(watch.messages)} batch(es) after three requests storing new blocks; expected ≥ 2")
        await asyncio.sleep(0.2)  # a last batch may still be on its way
        errors = [m.error for m in watch.messages if m.WhichOneof("event") == "error"]
        if errors:
            raise FailCheck(f"the subscription sent an error: {errors[0].code} {errors[0].message!r}")
        batches = watch.batches()
        span = _check_batches(batches, ranks, None)
    events = sum(len(b.events) for b in batches)
    return Outcome.passed(f"{len(batches)} batches {span}, {events} events, no gap")
