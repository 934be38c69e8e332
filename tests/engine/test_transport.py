"""The transport's premises and explanations: the grpclib/h2 internals it subclasses, one sentence per failure."""

from __future__ import annotations

import errno
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import grpclib.client
import grpclib.protocol
import h2.connection
import h2.exceptions
import pytest
from h2.events import ConnectionTerminated
from hyperframe.frame import DataFrame, GoAwayFrame

from sidecar.engine._transport import GracefulProcessor, GracefulProtocol, PooledChannel, _explain_unix

if TYPE_CHECKING:
    from sidecar.edge import Edge


def test_the_grpclib_and_h2_internals_the_transport_relies_on_are_there() -> None:
    # Names used by sidecar/engine/_transport.py; each missing one is a patch that silently stopped applying.
    processor = grpclib.protocol.EventsProcessor
    assert callable(processor.process_connection_terminated)
    assert {"processors", "streams", "connection", "handler"} <= set(vars(processor(None, None)))  # type: ignore[arg-type]
    assert hasattr(grpclib.protocol.Connection, "is_closing")
    assert "stream_close_waiter" in grpclib.protocol.Connection.__init__.__code__.co_names
    assert callable(grpclib.protocol.H2Protocol.connection_lost)
    assert callable(grpclib.client.Channel._protocol_factory)
    assert callable(grpclib.client.Channel._create_connection)
    channel_init = grpclib.client.Channel.__init__.__code__.co_names
    assert {"_authority", "_scheme", "_h2_config", "_config", "_loop"} <= set(channel_init)
    connection = h2.connection.H2Connection()
    assert connection._frame_dispatch_table[GoAwayFrame] == connection._receive_goaway_frame
    assert callable(connection.get_next_available_stream_id)
    assert issubclass(GracefulProcessor, processor)
    assert issubclass(GracefulProtocol, grpclib.protocol.H2Protocol)
    assert issubclass(PooledChannel, grpclib.client.Channel)
    assert ConnectionTerminated().last_stream_id is None


def test_h2_still_refuses_frames_after_a_goaway_without_the_patch() -> None:
    # Why the GOAWAY handler is replaced, not just grpclib's processor: h2's own puts the connection in CLOSED, and a
    # DATA frame of a stream the GOAWAY let run is then a protocol error.
    from sidecar.testing.h2pair import connected_pair

    client, _, stream_id = connected_pair()
    goaway = GoAwayFrame(0, last_stream_id=(1 << 31) - 1)
    client.receive_data(goaway.serialize())
    data = DataFrame(stream_id, data=b"\0\0\0\0\0")
    with pytest.raises(h2.exceptions.ProtocolError):
        client.receive_data(data.serialize())


def test_unix_socket_failures_are_one_sentence_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "engine.sock"
    assert _explain_unix(FileNotFoundError(errno.ENOENT, "x"), str(missing)) == (
        f"no Unix socket at {missing} (is the engine up and listening there?)"
    )
    gone = tmp_path / "nodir" / "engine.sock"
    assert "its directory" in _explain_unix(FileNotFoundError(errno.ENOENT, "x"), str(gone))
    regular = tmp_path / "file"
    regular.write_text("")
    assert _explain_unix(ConnectionRefusedError(errno.ECONNREFUSED, "x"), str(regular)).endswith(
        "is a regular file, not a Unix socket; check --grpc-endpoint"
    )
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(stale))
    assert "nothing listens" in _explain_unix(ConnectionRefusedError(errno.ECONNREFUSED, "x"), str(stale))
    denied = _explain_unix(PermissionError(errno.EACCES, "x"), str(stale))
    assert denied.startswith(f"permission denied on the Unix socket {stale}")


async def _channel_refuses_a_goaway_connection() -> tuple[bool, bool]:
    from grpclib.config import Configuration
    from grpclib.encoding.proto import ProtoCodec

    from sidecar.engine import Endpoint

    class Listener:
        def going_away(self, reason: str) -> None: ...

        def drained(self) -> None: ...

    channel = PooledChannel(
        Endpoint("127.0.0.1", 1), codec=ProtoCodec(), config=Configuration(), tls=None, listener=Listener()
    )

    class Processor:
        goaway: object = None

    class Protocol:
        handler = grpclib.client.Handler()
        processor = Processor()

    channel._protocol = Protocol()  # type: ignore[assignment]
    before = channel._connected
    Protocol.processor.goaway = ConnectionTerminated()
    after = channel._connected
    channel._protocol = None
    return before, after


async def test_a_connection_that_heard_a_goaway_is_not_reused_for_new_calls(edge: Edge) -> None:
    # Even one that heard it before the channel adopted it (between connection_made and the end of the connect).
    assert await edge.run(_channel_refuses_a_goaway_connection) == (True, False)


def test_the_first_close_reason_is_the_one_streams_see() -> None:
    reasons: list[str] = []

    class Stream:
        def __terminated__(self, reason: str) -> None:
            reasons.append(reason)

    class Connection:
        def close(self) -> None: ...

    processor = GracefulProcessor(grpclib.client.Handler(), Connection(), None)  # type: ignore[arg-type]
    processor.streams[1] = Stream()  # type: ignore[assignment]
    processor.close("TLS: the engine answers in TLS")
    processor.close("Connection lost")
    assert reasons == ["TLS: the engine answers in TLS"] * 2
