"""Stopping like grpc-core (``server.stop(grace)``, TensorRT-LLM's SIGTERM): two GOAWAYs, open streams run out the
grace, new connections and streams are refused, the rest is cut, exit 0 — seen by a grpcio client and on the wire."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Callable
from contextlib import suppress

import grpc
import pytest
from grpclib.const import Status
from h2.errors import ErrorCodes
from hyperframe.frame import DataFrame, GoAwayFrame, RstStreamFrame

from openengine.v1 import generation_pb2
from tests.helpers.waits import WaitTimeout, wait_until

from ._client import call, generate, make_request, split_address, wait_for_load
from ._h2 import RawH2
from .conftest import StartMock

_MAX_STREAM_ID = 2**31 - 1


async def _grpcio_streams(address: str, sigterm: Callable[[], None]) -> tuple[list[list[int]], list[object], object]:
    """8 streams of 40 tokens; SIGTERM once one of them has 10 tokens; then one more stream on the same channel."""
    async with grpc.aio.insecure_channel(address) as channel:
        rpc = channel.unary_stream(
            "/openengine.v1.Inference/Generate",
            request_serializer=generation_pb2.GenerateRequest.SerializeToString,
            response_deserializer=generation_pb2.GenerateResponse.FromString,
        )
        tokens: list[list[int]] = [[] for _ in range(8)]
        finals: list[object] = [None] * 8
        ten = asyncio.Event()

        async def one(i: int) -> None:
            request = make_request(f"goaway-{i}", max_tokens=40, ignore_eos=True, temperature=1.0, seed=i)
            async for response in rpc(request, timeout=30):
                event = response.WhichOneof("event")
                if event == "token":
                    tokens[i].extend(t.token_id for t in response.token.tokens)
                    if len(tokens[i]) >= 10:
                        ten.set()
                finals[i] = event

        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        await asyncio.wait_for(ten.wait(), 20)
        sigterm()
        # Wait (bounded) until grpcio has seen the GOAWAY and stopped using the connection for new calls.
        with suppress(WaitTimeout):  # a channel still READY then is the case the next call shows
            await wait_until(lambda: channel.get_state() != grpc.ChannelConnectivity.READY, timeout=3, interval=0.02)
        late: object
        try:
            late = [r async for r in rpc(make_request("after-goaway", max_tokens=2), timeout=10)]
        except grpc.aio.AioRpcError as exc:
            late = exc.code()
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
        return tokens, finals, late


def test_sigterm_sends_goaway_and_a_grpcio_client_gets_every_open_stream_complete(start_mock: StartMock) -> None:
    # A generous grace: the streams need ~0.7 s, but a loaded machine must not cut them (the cut has its own test).
    mock = start_mock("--speedup", "1", "--decode-ms-per-token", "20", "--stop-grace-secs", "30")
    tokens, finals, late = asyncio.run(_grpcio_streams(mock.address, lambda: mock.proc.send_signal(signal.SIGTERM)))
    assert [len(t) for t in tokens] == [40] * 8, f"every stream open at SIGTERM ran to its end\n{mock.log()}"
    assert finals == ["finished"] * 8, mock.log()
    assert late == grpc.StatusCode.UNAVAILABLE, f"a stream opened after the GOAWAY is refused: {late}"
    assert mock.proc.wait(10) == 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(split_address(mock.address), timeout=2).close()


def test_goaway_twice_then_new_streams_refused_and_the_rest_cut_after_the_grace(start_mock: StartMock) -> None:
    mock = start_mock("--speedup", "1", "--decode-ms-per-token", "20", "--stop-grace-secs", "4")
    raw = RawH2(mock.address)
    try:
        raw.generate(1, make_request("hung", max_tokens=40, ignore_eos=True, mock={"hang_after_tokens": 2}))
        while len(raw.messages(1)) < 2:
            raw.read_until(DataFrame, stream_id=1)
        signalled = time.monotonic()
        mock.proc.send_signal(signal.SIGTERM)
        _, first = raw.read_until(GoAwayFrame)
        assert (first.last_stream_id, first.error_code) == (_MAX_STREAM_ID, 0)
        _, second = raw.read_until(GoAwayFrame)  # after our PING ACK
        assert (second.last_stream_id, second.error_code) == (1, 0)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(split_address(mock.address), timeout=2).close()
        raw.generate(3, make_request("too-late", max_tokens=2))
        refused_at, refused = raw.read_until(RstStreamFrame, stream_id=3)
        assert refused.error_code == ErrorCodes.REFUSED_STREAM
        assert refused_at - signalled < 3.0, "refused at once, not at the end of the grace"
        cut_at, cut = raw.read_until(RstStreamFrame, stream_id=1)
        raw.read_all()
    finally:
        raw.close()
    # grpc-core's end of the grace: the call's trailers (UNAVAILABLE), then RST_STREAM NO_ERROR (issue 27 item 5f).
    trailers = [(headers, ends) for stream_id, headers, ends in raw.header_blocks if stream_id == 1][-1]
    assert trailers == ([("grpc-status", "14"), ("grpc-message", "Cancelling all calls")], True)
    assert cut.error_code == ErrorCodes.NO_ERROR
    assert cut_at - signalled >= 3.9, "the hung stream kept its grace"
    assert [m.WhichOneof("event") for _, m in raw.messages(1)] == ["token", "token"], "cut without a terminal event"
    assert len(raw.goaways()) == 2
    assert mock.proc.wait(10) == 0


def test_idle_mock_stops_at_once(start_mock: StartMock) -> None:
    mock = start_mock("--stop-grace-secs", "30")
    assert call(mock.address, lambda ch: generate(ch, make_request(max_tokens=2))).status == Status.OK
    started = time.monotonic()
    assert mock.stop(signal.SIGTERM, timeout=40) == 0
    assert time.monotonic() - started < 15.0, "nothing open: no need to wait out the grace"


def test_a_stream_cut_before_its_first_message_gets_a_trailers_only_unavailable(start_mock: StartMock) -> None:
    """grpc-core answers a call that never sent anything with one trailers-only HEADERS (status 200, UNAVAILABLE)."""
    mock = start_mock("--stop-grace-secs", "1")
    raw = RawH2(mock.address)
    try:
        raw.generate(1, make_request("silent", max_tokens=8, mock={"hang_after_tokens": 0}))
        call(mock.address, lambda ch: wait_for_load(ch, lambda load: load.running_requests == 1))
        mock.proc.send_signal(signal.SIGTERM)
        _, cut = raw.read_until(RstStreamFrame, stream_id=1)
        raw.read_all()
    finally:
        raw.close()
    (block,) = [(headers, ends) for stream_id, headers, ends in raw.header_blocks if stream_id == 1]
    assert block == (
        [
            (":status", "200"),
            ("content-type", "application/grpc"),
            ("grpc-status", "14"),
            ("grpc-message", "Cancelling all calls"),
        ],
        True,
    )
    assert cut.error_code == ErrorCodes.NO_ERROR
    assert raw.messages(1) == []
    assert mock.proc.wait(10) == 0
