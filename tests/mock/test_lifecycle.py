"""Process lifecycle, robustness against bad input, scheduling (queueing, model time) and throughput."""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError

from openengine.v1 import generation_pb2, lifecycle_pb2, openengine_grpc

from ._client import Outcome, abort, call, generate, get_load, make_request, new_id, split_address, wait_for_load
from .conftest import MockProcess, StartMock


def test_port_file_and_listening_line(start_mock: StartMock) -> None:
    mock = start_mock()
    host, port = split_address(mock.address)
    assert host == "127.0.0.1"
    assert port > 0
    with socket.create_connection((host, port), timeout=5):
        pass
    deadline = time.monotonic() + 5
    while f"openengine-mock listening on {mock.address}" not in mock.log() and time.monotonic() < deadline:
        # The poll interval of a synchronous test (wait_until is async).
        time.sleep(0.02)
    assert f"openengine-mock listening on {mock.address}" in mock.log()
    assert not list(mock.port_file.parent.glob(".*.tmp")), "the temp file was renamed into place"


def test_sigterm_when_idle_exits_zero(start_mock: StartMock) -> None:
    mock = start_mock()
    assert call(mock.address, lambda ch: generate(ch, make_request(max_tokens=2))).status == Status.OK
    assert mock.stop(signal.SIGTERM) == 0


def test_sigint_exits_zero(start_mock: StartMock) -> None:
    mock = start_mock()
    assert mock.stop(signal.SIGINT) == 0


class _Garbage:
    """A "request" whose serialization is not a GenerateRequest."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:
        return self.data


async def _raw_generate(ch: Channel, data: bytes) -> tuple[Status, str | None]:
    try:
        async with ch.request(
            "/openengine.v1.Inference/Generate", Cardinality.UNARY_STREAM, _Garbage, generation_pb2.GenerateResponse
        ) as stream:
            await stream.send_message(_Garbage(data), end=True)
            async for _ in stream:
                raise AssertionError("no message expected")
    except GRPCError as exc:
        return exc.status, exc.message
    return Status.OK, None


def test_garbage_bytes_then_still_serving(addr: str) -> None:
    async def run(ch: Channel) -> tuple[tuple[Status, str | None], Outcome]:
        bad = await _raw_generate(ch, b"\xff\xff\xff\xff\x0f garbage")
        good = await generate(ch, make_request(max_tokens=2))
        return bad, good

    (status, message), good = call(addr, run)
    assert status == Status.INTERNAL
    assert message
    assert good.status == Status.OK


def test_empty_request_message_is_invalid(addr: str) -> None:
    status, message = call(addr, lambda ch: _raw_generate(ch, b""))  # decodes as an all-default GenerateRequest
    assert status == Status.INVALID_ARGUMENT
    assert message


@pytest.mark.slow
def test_oversized_request_is_refused(addr: str) -> None:
    big = make_request(max_tokens=2)
    big.prompt = "x" * (64 * 1024 * 1024 + 10)
    out = call(addr, lambda ch: generate(ch, big, timeout=60), timeout=90)
    assert (out.status, out.messages) == (Status.RESOURCE_EXHAUSTED, [])
    assert call(addr, lambda ch: generate(ch, make_request(max_tokens=2))).status == Status.OK


def test_requests_queue_for_kv_blocks(start_mock: StartMock) -> None:
    # 8 blocks of 16 tokens; each request needs ceil((prompt + 100) / 16) = 7 blocks, so only one runs at a time.
    mock = start_mock("--profile", "full", "--total-kv-blocks", "8")
    first_id = new_id("kv-first")

    async def run(ch: Channel) -> tuple[int, Outcome, Outcome]:
        first = asyncio.create_task(generate(ch, make_request(first_id, max_tokens=100, mock={"hang_after_tokens": 1})))
        await wait_for_load(ch, lambda load: load.running_requests == 1)
        second = asyncio.create_task(generate(ch, make_request(max_tokens=100, ignore_eos=True)))
        queued = await wait_for_load(ch, lambda load: load.queued_requests == 1)
        assert queued.waiting_tokens > 0
        await abort(ch, first_id)
        return queued.queued_requests, await first, await second

    queued, first, second = call(mock.address, run)
    assert queued == 1
    assert first.final.finished.reason == generation_pb2.FINISH_REASON_CANCELLED
    assert second.status == Status.OK
    assert second.final.usage.completion_tokens == 100


def test_too_big_for_the_pool_is_invalid(start_mock: StartMock) -> None:
    mock = start_mock("--profile", "full", "--total-kv-blocks", "4")
    out = call(mock.address, lambda ch: generate(ch, make_request(max_tokens=100)))
    assert (out.status, out.messages) == (Status.INVALID_ARGUMENT, [])


def test_abort_a_queued_request(start_mock: StartMock) -> None:
    mock = start_mock("--profile", "full", "--max-running-requests", "1")
    first_id, second_id = new_id("run"), new_id("queued")

    async def run(ch: Channel) -> Outcome:
        first = asyncio.create_task(generate(ch, make_request(first_id, mock={"hang_after_tokens": 0})))
        await wait_for_load(ch, lambda load: load.running_requests == 1)
        second = asyncio.create_task(generate(ch, make_request(second_id, n=2, seed=1)))
        await wait_for_load(ch, lambda load: load.queued_requests == 1)
        assert (await abort(ch, second_id)).status == lifecycle_pb2.ABORT_STATUS_ABORTED
        out = await second
        await abort(ch, first_id)
        await first
        return out

    out = call(mock.address, run)
    assert out.events == ["finished", "finished"]
    assert [f.output_index for f in out.finished()] == [0, 1]
    assert {f.reason for f in out.finished()} == {generation_pb2.FINISH_REASON_CANCELLED}
    assert out.final.usage.completion_tokens == 0


def test_model_time_with_speedup(start_mock: StartMock) -> None:
    mock = start_mock(
        "--profile", "full", "--speedup", "2", "--decode-ms-per-token", "40", "--prefill-tokens-per-s", "1000"
    )

    async def run(ch: Channel) -> tuple[float, Outcome]:
        started = time.monotonic()
        out = await generate(ch, make_request(token_ids=[268] * 200, max_tokens=10, ignore_eos=True))
        return time.monotonic() - started, out

    elapsed, out = call(mock.address, run)
    # prefill 200 / 1000 / 2 = 0.1 s, decode 10 x 40 ms / 2 = 0.2 s
    assert out.status == Status.OK
    assert 0.25 < elapsed < 5.0


def _throughput(ch: Channel) -> asyncio.Future[tuple[int, float]]:
    async def measure() -> tuple[int, float]:
        stub = openengine_grpc.InferenceStub(ch)
        req = make_request(max_tokens=2000, ignore_eos=True, token_ids=[268])
        count = 0
        started = time.perf_counter()
        async with stub.Generate.open() as stream:
            await stream.send_message(req, end=True)
            async for _ in stream:
                count += 1
        return count, time.perf_counter() - started

    return asyncio.ensure_future(measure())


def test_zero_delay_stream_throughput(mock_server: MockProcess, addr: str) -> None:
    count, elapsed = call(addr, _throughput)
    rate = count / elapsed
    print(f"\nopenengine-mock zero-delay stream: {count} messages in {elapsed:.3f} s = {rate:.0f} msg/s")
    assert count == 2001
    assert rate > 500  # generous: a shared CI core


def test_concurrent_streams_all_progress(addr: str) -> None:
    async def run(ch: Channel) -> list[Outcome]:
        return await asyncio.gather(
            *(generate(ch, make_request(max_tokens=200, ignore_eos=True, seed=i)) for i in range(32))
        )

    outs = call(addr, run)
    assert all(o.status == Status.OK and o.final.usage.completion_tokens == 200 for o in outs)
    assert call(addr, get_load).running_requests == 0
