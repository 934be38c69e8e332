"""A raw HTTP/2 gRPC client for wire-level tests: every frame the server writes, with its arrival time.

h2's own state machine refuses to go on after a GOAWAY (which is exactly what these tests look at), so frames are
built and parsed with hyperframe and HPACK directly. Blocking sockets with timeouts: every read is bounded.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import time
from typing import TypeVar

import hpack
from hyperframe.frame import (
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from openengine.v1 import generation_pb2

from ._client import split_address

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
GENERATE = "/openengine.v1.Inference/Generate"
F = TypeVar("F", bound=Frame)
#: Flow-control window the client grants (large, so the server never blocks on it in these tests).
_WINDOW = 1 << 30


@dataclasses.dataclass
class Received:
    """One frame as it arrived."""

    at: float
    frame: Frame
    #: Which ``recv`` brought the frame's last byte (1 = the first): frames of one read arrived together.
    read: int = 0


class RawH2:
    """One HTTP/2 connection to the mock; ``read`` returns frames (PINGs and SETTINGS are acknowledged)."""

    def __init__(self, address: str, *, timeout: float = 10.0) -> None:
        host, port = split_address(address)
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.settimeout(timeout)
        self._encoder = hpack.Encoder()
        self._decoder = hpack.Decoder()
        self._buffer = b""
        self.reads = 0
        self.frames: list[Received] = []
        #: Every header block received: ``(stream id, decoded headers, ends the stream)``.
        self.header_blocks: list[tuple[int, list[tuple[str, str]], bool]] = []
        self.sock.sendall(
            PREFACE
            + SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: _WINDOW - 1}).serialize()
            + WindowUpdateFrame(0, window_increment=_WINDOW - 65535).serialize()
        )

    def close(self) -> None:
        self.sock.close()

    def generate(self, stream_id: int, request: generation_pb2.GenerateRequest) -> None:
        """Open ``stream_id`` with one ``Generate`` request (HEADERS + one DATA frame ending the stream)."""
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", GENERATE),
            (":authority", "mock"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        body = request.SerializeToString()
        message = b"\x00" + struct.pack(">I", len(body)) + body
        self.sock.sendall(
            HeadersFrame(stream_id, data=self._encoder.encode(headers), flags=["END_HEADERS"]).serialize()
            + DataFrame(stream_id, data=message, flags=["END_STREAM"]).serialize()
        )

    def _read_exactly(self, size: int) -> bytes | None:
        while len(self._buffer) < size:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.reads += 1
            self._buffer += chunk
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    def read(self) -> Received | None:
        """The next frame (``None`` when the server closed the connection)."""
        header = self._read_exactly(9)
        if header is None:
            return None
        frame, length = Frame.parse_frame_header(memoryview(header))
        body = self._read_exactly(length)
        if body is None:
            return None
        frame.parse_body(memoryview(body))
        received = Received(time.monotonic(), frame, self.reads)
        self.frames.append(received)
        if isinstance(frame, PingFrame) and "ACK" not in frame.flags:
            self.sock.sendall(PingFrame(0, opaque_data=frame.opaque_data, flags=["ACK"]).serialize())
        elif isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
            self.sock.sendall(SettingsFrame(0, flags=["ACK"]).serialize())
        elif isinstance(frame, HeadersFrame):
            decoded = [(str(k), str(v)) for k, v in self._decoder.decode(frame.data)]
            self.header_blocks.append((frame.stream_id, decoded, "END_STREAM" in frame.flags))
        return received

    def read_until(self, kind: type[F], *, stream_id: int | None = None, deadline_s: float = 10.0) -> tuple[float, F]:
        """Read until a frame of type ``kind`` (on ``stream_id`` if given) arrives: its arrival time and the frame.
        Fails on EOF or after ``deadline_s``."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            received = self.read()
            if received is None:
                raise EOFError(f"connection closed before a {kind.__name__}")
            frame = received.frame
            if isinstance(frame, kind) and (stream_id is None or frame.stream_id == stream_id):
                return received.at, frame
        raise TimeoutError(f"no {kind.__name__} within {deadline_s} s")

    def read_all(self, *, deadline_s: float = 15.0) -> None:
        """Read until the server closes the connection."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.read() is None:
                return
        raise TimeoutError(f"the connection stayed open for {deadline_s} s")

    def messages(self, stream_id: int) -> list[tuple[float, generation_pb2.GenerateResponse]]:
        """The ``GenerateResponse`` messages of ``stream_id`` with the arrival time of the frame completing each."""
        out: list[tuple[float, generation_pb2.GenerateResponse]] = []
        pending = b""
        for received in self.frames:
            frame = received.frame
            if not isinstance(frame, DataFrame) or frame.stream_id != stream_id:
                continue
            pending += frame.data
            while len(pending) >= 5:
                (size,) = struct.unpack(">I", pending[1:5])
                if len(pending) < 5 + size:
                    break
                out.append((received.at, generation_pb2.GenerateResponse.FromString(pending[5 : 5 + size])))
                pending = pending[5 + size :]
        return out

    def data_frames(self, stream_id: int) -> list[Received]:
        return [r for r in self.frames if isinstance(r.frame, DataFrame) and r.frame.stream_id == stream_id]

    def goaways(self) -> list[GoAwayFrame]:
        return [r.frame for r in self.frames if isinstance(r.frame, GoAwayFrame)]

    def frames_of(self, kind: type[F]) -> list[F]:
        return [r.frame for r in self.frames if isinstance(r.frame, kind)]

    def resets(self) -> dict[int, int]:
        """``stream id → error code`` of every RST_STREAM received."""
        return {r.frame.stream_id: r.frame.error_code for r in self.frames if isinstance(r.frame, RstStreamFrame)}
