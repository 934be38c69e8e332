"""A stream that reaches the engine between its two GOAWAYs gets grpc-core's answer from ``openengine-mock`` too:
trailers-only ``grpc-status 1`` (``grpc-message: CANCELLED``), then ``RST_STREAM NO_ERROR`` -- seen side by side
with a real grpc-core server (grpcio's, which TensorRT-LLM's server runs on), on the wire.

The client writes every frame itself: it opens the new stream right after reading the first GOAWAY, before it
answers the PING that follows it, so the stream arrives before the server can send its second GOAWAY.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import hpack
from h2.errors import ErrorCodes
from hyperframe.frame import DataFrame, GoAwayFrame, HeadersFrame, RstStreamFrame

from openengine.v1 import generation_pb2
from tests.engine.grpcio_engine import grpcio_engine

from ._client import make_request
from ._h2 import RawH2
from .conftest import StartMock

_MAX_STREAM_ID = 2**31 - 1
#: What grpc-core sends (observed from grpcio 1.85, TensorRT-LLM's server runtime).
GRPC_CORE_ANSWER = [
    (":status", "200"),
    ("content-type", "application/grpc"),
    ("grpc-status", "1"),
    ("grpc-message", "CANCELLED"),
]


class _RecordingDecoder:
    """RawH2's HPACK decoder, keeping what each HEADERS frame decoded to (in the order the frames arrived)."""

    def __init__(self, inner: hpack.Decoder) -> None:
        self._inner = inner
        self.decoded: list[list[tuple[str, str]]] = []

    def decode(self, data: bytes, raw: bool = False) -> Any:
        headers = self._inner.decode(data, raw=raw)
        self.decoded.append([(str(k), str(v)) for k, v in headers])
        return headers


@dataclass
class Answer:
    """How the server answered the stream opened between its GOAWAYs."""

    first_goaway: int
    headers: list[tuple[str, str]]
    ended_by_headers: bool
    reset: int | None
    second_goaway: int
    data_frames: int


def _between_goaways(address: str, long_request: generation_pb2.GenerateRequest, stop: Callable[[], object]) -> Answer:
    raw = RawH2(address)
    decoder = _RecordingDecoder(raw._decoder)
    raw._decoder = decoder  # type: ignore[assignment]
    try:
        raw.generate(1, long_request)
        raw.read_until(DataFrame, stream_id=1)  # streaming: the stop finds it open
        stop()
        _, first = raw.read_until(GoAwayFrame)
        raw.generate(3, make_request("between-goaways", max_tokens=2))  # before the PING behind the GOAWAY is read
        while not any(
            isinstance(r.frame, HeadersFrame | RstStreamFrame)
            and r.frame.stream_id == 3
            and (isinstance(r.frame, RstStreamFrame) or "END_STREAM" in r.frame.flags)
            for r in raw.frames
        ):
            raw.read()
        while len(raw.goaways()) < 2:  # a RST_STREAM right behind the answer has arrived by then
            raw.read_until(GoAwayFrame)
    finally:
        raw.close()
    heads = [r.frame for r in raw.frames if isinstance(r.frame, HeadersFrame)]
    answers = [(frame, headers) for frame, headers in zip(heads, decoder.decoded, strict=True) if frame.stream_id == 3]
    return Answer(
        first_goaway=first.last_stream_id,
        headers=[pair for _, headers in answers for pair in headers],
        ended_by_headers=any("END_STREAM" in frame.flags for frame, _ in answers),
        reset=raw.resets().get(3),
        second_goaway=raw.goaways()[1].last_stream_id,
        data_frames=len(raw.data_frames(3)),
    )


def test_the_mock_answers_a_stream_between_its_goaways_as_grpc_core_does(start_mock: StartMock) -> None:
    with grpcio_engine(token_s=0.05) as engine:
        request = generation_pb2.GenerateRequest(request_id="long", model="m")
        request.stopping.max_tokens = 200
        reference = _between_goaways(engine.target, request, lambda: engine.stop(5.0))

    mock = start_mock("--speedup", "1", "--decode-ms-per-token", "20", "--stop-grace-secs", "5")
    long_request = make_request("long", max_tokens=200, ignore_eos=True)
    ours = _between_goaways(mock.address, long_request, lambda: mock.proc.send_signal(signal.SIGTERM))
    assert mock.proc.wait(15) == 0

    expected = Answer(_MAX_STREAM_ID, GRPC_CORE_ANSWER, True, ErrorCodes.NO_ERROR, 3, 0)
    assert reference == expected, "grpc-core itself answers differently now: the mock must follow"
    assert ours == expected, mock.log()
    assert "answered CANCELLED" in mock.log()
