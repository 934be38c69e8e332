"""The layer's client side, piece by piece: a channel that heard a GOAWAY takes no new call, the first close reason
wins, the frame splitter runs only on channels with direct streams, and a DATA frame that skips h2 leaves h2 as h2
would. (Draining against a real grpc-core server: ``tests/engine/test_goaway.py``; the kit's two policies:
``tests/conformance/test_wire.py``.)"""

from __future__ import annotations

import asyncio

import grpclib.client
import h2.stream
from grpclib.encoding.proto import ProtoCodec

from sidecar.http2 import ClientProtocol, Goaway, GoawayPolicy, Http2Channel, grpclib_configuration
from sidecar.http2._client import SplittingProtocol, _Processor, account_data_frame
from sidecar.testing.h2pair import connected_pair
from tests.engine.raw_h2 import token


def _channel(*, goaway: GoawayPolicy = GoawayPolicy.DRAIN, direct: bool = False) -> Http2Channel:
    async def make() -> Http2Channel:
        config = grpclib_configuration(keepalive_s=None)
        return Http2Channel("127.0.0.1", 1, codec=ProtoCodec(), config=config, goaway=goaway, direct=direct)

    return asyncio.run(make())


def test_a_connection_that_heard_a_goaway_is_not_reused_for_new_calls() -> None:
    # Even one that heard it before the channel adopted it (between connection_made and the end of the connect).
    channel = _channel()

    class Processor:
        goaway: Goaway | None = None

    class Protocol:
        handler = grpclib.client.Handler()
        processor = Processor()

    processor = Protocol.processor
    channel._protocol = Protocol()  # type: ignore[assignment]
    before = channel.connected
    processor.goaway = Goaway(0.0, 0, 1, None, first=True)
    assert (before, channel.connected, channel._connected) == (True, False, False)  # _connected: grpclib asks it
    channel._protocol = None


def test_the_first_close_reason_is_the_one_streams_see() -> None:
    reasons: list[str] = []

    class Stream:
        def __terminated__(self, reason: str) -> None:
            reasons.append(reason)

    class Connection:
        def close(self) -> None: ...

    processor = _Processor(grpclib.client.Handler(), Connection(), None)  # type: ignore[arg-type]
    processor.streams[1] = Stream()  # type: ignore[assignment]
    processor.close("TLS: the engine answers in TLS")
    processor.close("Connection lost")
    assert reasons == ["TLS: the engine answers in TLS"] * 2


def test_the_frame_splitter_engages_only_on_a_channel_with_direct_streams() -> None:
    plain = _channel()._protocol_factory()
    assert type(plain) is ClientProtocol
    assert type(plain).data_received is ClientProtocol.data_received  # grpclib's, after a look at the first bytes
    assert isinstance(_channel(direct=True)._protocol_factory(), SplittingProtocol)
    assert _channel(goaway=GoawayPolicy.CLOSE)._protocol_factory().policy is GoawayPolicy.CLOSE


def test_a_plain_data_frame_accounted_by_the_layer_leaves_h2_as_h2_would() -> None:
    """The same DATA frame through h2 and through ``account_data_frame``: the same windows and counters after."""
    via_h2, server, stream_id = connected_pair()
    server.send_data(stream_id, token(1))
    frame = server.data_to_send()
    via_h2.receive_data(frame)

    direct, _, _ = connected_pair()
    assert account_data_frame(direct, stream_id, len(frame) - 9)
    for conn in (via_h2, direct):
        assert conn.streams[stream_id].state_machine.state is h2.stream.StreamState.OPEN
    assert (
        direct._inbound_flow_control_window_manager.current_window_size
        == via_h2._inbound_flow_control_window_manager.current_window_size
        < 65535
    )
    ours, theirs = direct.streams[stream_id], via_h2.streams[stream_id]
    assert ours._inbound_window_manager.current_window_size == theirs._inbound_window_manager.current_window_size
    assert ours._actual_content_length == theirs._actual_content_length


def test_a_frame_h2_must_judge_is_left_to_h2() -> None:
    client, _, stream_id = connected_pair()
    assert not account_data_frame(client, stream_id, 70_000), "beyond the window: h2 answers FLOW_CONTROL_ERROR"
    assert not account_data_frame(client, stream_id + 2, 5), "an unknown stream: h2 answers it"
    client.close_connection()
    assert not account_data_frame(client, stream_id, 5), "a closed connection"
