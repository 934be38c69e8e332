"""One canary per library internal ``sidecar.http2`` touches: each fails when its name moves or stops meaning what
the layer relies on, so a grpclib, h2 or hyperframe upgrade fails here, by name, rather than somewhere downstream
(or silently). The list is the layer's docstring: the two must name the same internals.

The exact versions are pinned in ``constraints.txt``; the image build runs these tests too.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import re
from collections.abc import Callable
from typing import Any

import grpclib.client
import grpclib.config
import grpclib.protocol
import grpclib.server
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.stream
import hyperframe.frame
import pytest
from grpclib.const import Status
from hyperframe.frame import DataFrame, GoAwayFrame

import sidecar.http2
from sidecar.http2 import grpclib_configuration, h2_configuration
from sidecar.testing.h2pair import connected_pair

from . import test_frame_repr


class _Transport(asyncio.Transport):
    """Enough of a transport for grpclib's protocol to be made and to write (into a list)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return False


def _protocol() -> grpclib.protocol.H2Protocol:
    """grpclib's own client protocol on a fake transport (inside a loop: its keepalive needs one)."""

    async def make() -> grpclib.protocol.H2Protocol:
        protocol = grpclib.protocol.H2Protocol(
            grpclib.client.Handler(), grpclib_configuration(keepalive_s=None), h2_configuration(client_side=True)
        )
        protocol.connection_made(_Transport())
        return protocol

    return asyncio.run(make())


def _channel() -> grpclib.client.Channel:
    async def make() -> grpclib.client.Channel:
        return grpclib.client.Channel("127.0.0.1", 1)

    return asyncio.run(make())


def _server() -> grpclib.server.Server:
    async def make() -> grpclib.server.Server:
        return grpclib.server.Server([])

    return asyncio.run(make())


def _source(obj: Any) -> str:
    return inspect.getsource(obj)


def _code_names(function: Any) -> set[str]:
    return set(function.__code__.co_names)


def _processor_dispatches(name: str, event: type) -> None:
    """``EventsProcessor.<name>`` exists and is what ``process`` calls for ``event`` (so overriding it works)."""
    assert callable(getattr(grpclib.protocol.EventsProcessor, name))
    processor = grpclib.protocol.EventsProcessor(grpclib.client.Handler(), None)  # type: ignore[arg-type]
    bound = processor.processors[event]
    assert bound.__func__ is getattr(grpclib.protocol.EventsProcessor, name)  # type: ignore[attr-defined]


def _channel_attribute(name: str) -> None:
    assert name in vars(_channel()), f"grpclib's Channel no longer sets {name}"


def _connection_attribute(name: str) -> None:
    assert hasattr(_protocol().connection, name), f"grpclib's Connection no longer has {name}"


def _configuration_field(name: str) -> None:
    assert name in {f.name for f in dataclasses.fields(grpclib.config.Configuration)}
    assert name in _source(grpclib.protocol), f"grpclib.protocol no longer reads Configuration.{name}"


def _lean_name(name: str) -> None:
    assert f"{name}()" in _source(grpclib.protocol), f"grpclib.protocol no longer calls {name}()"
    assert getattr(grpclib.protocol, name) in (asyncio.Event, asyncio.Queue, collections.deque), name


def _h2_stream() -> h2.stream.H2Stream:
    client, _, stream_id = connected_pair()
    return client.streams[stream_id]


def _status_map() -> None:
    assert grpclib.client._H2_TO_GRPC_STATUS_MAP["503"] is Status.UNAVAILABLE
    assert grpclib.client._H2_TO_GRPC_STATUS_MAP["401"] is Status.UNAUTHENTICATED


def _connect() -> None:
    assert inspect.iscoroutinefunction(grpclib.client.Channel.__connect__)
    assert {"_connected", "_create_connection", "_protocol"} <= _code_names(grpclib.client.Channel.__connect__)


def _connected() -> None:
    connected = grpclib.client.Channel.__dict__["_connected"]
    assert isinstance(connected, property)
    assert "_connected" in _code_names(grpclib.client.Channel.__connect__)


def _create_connection() -> None:
    assert inspect.iscoroutinefunction(grpclib.client.Channel._create_connection)
    assert "_protocol_factory" in _code_names(grpclib.client.Channel._create_connection)


def _protocol_factory() -> None:
    assert "H2Protocol" in _code_names(grpclib.client.Channel._protocol_factory)


def _calls(name: str) -> None:
    assert getattr(grpclib.client.Channel, name) == 0, f"grpclib's Channel no longer counts {name}"
    assert f"_channel.{name} += 1" in _source(grpclib.client.Stream), f"grpclib's Stream no longer counts {name}"


def _handler_connection_lost() -> None:
    handler = grpclib.client.Handler()
    assert handler.connection_lost is False
    handler.close()
    assert handler.connection_lost is True


def _transport_attribute() -> None:
    connection = _protocol().connection
    assert isinstance(connection._transport, _Transport)


def _close() -> None:
    connection = _protocol().connection
    assert callable(connection.close)
    assert "_frame_dispatch_table" in _source(grpclib.protocol.Connection.close)


def _send_process(name: str) -> None:
    assert callable(getattr(grpclib.protocol.Connection, name))


def _feed() -> None:
    assert _protocol().connection.feed(b"") == []


def _flush() -> None:
    transport = _protocol().connection._transport
    assert isinstance(transport, _Transport)
    assert transport.written, "connection_made flushes the preamble through Connection.flush"


def _counter(name: str) -> None:
    assert isinstance(getattr(grpclib.protocol.Connection, name), int)


def _event(name: str) -> None:
    assert isinstance(getattr(_protocol().connection, name), asyncio.Event)


def _processor_close() -> None:
    assert "__terminated__" in _source(grpclib.protocol.EventsProcessor.close)


def _processor_attribute(name: str) -> None:
    assert hasattr(_protocol().processor, name)


def _processor_process() -> None:
    assert "processors" in _code_names(grpclib.protocol.EventsProcessor.process)


def _protocol_attribute(name: str) -> None:
    assert hasattr(_protocol(), name)


def _connection_lost() -> None:
    assert "processor" in _code_names(grpclib.protocol.H2Protocol.connection_lost)


def _connection_made() -> None:
    names = _code_names(grpclib.protocol.H2Protocol.connection_made)
    assert {"EventsProcessor", "Connection", "processor", "connection"} <= names


def _data_received() -> None:
    assert {"feed", "flush", "process"} <= _code_names(grpclib.protocol.H2Protocol.data_received)


def _terminated() -> None:
    assert callable(grpclib.protocol.Stream.__terminated__)
    assert "__terminated__" in _source(grpclib.protocol.EventsProcessor.close)


def _stream_transport() -> None:
    assert "_transport" in _code_names(grpclib.protocol.Stream.__init__)


def _server_attribute(name: str) -> None:
    assert name in vars(_server())


def _server_factory() -> None:
    assert "_protocol_factory" in _source(grpclib.server.Server.start)


def _handler_tasks() -> None:
    assert "_tasks" in _code_names(grpclib.server.Handler.__init__)


def _server_stream() -> None:
    assert "_stream" in _code_names(grpclib.server.Stream.__init__)


def _frame_dispatch_table() -> None:
    connection = h2.connection.H2Connection()
    assert connection._frame_dispatch_table[GoAwayFrame] == connection._receive_goaway_frame


def _inbound_window() -> None:
    client, _, _ = connected_pair()
    assert client._inbound_flow_control_window_manager.current_window_size == 65535


def _next_stream_id() -> None:
    connection = h2.connection.H2Connection()
    assert "get_next_available_stream_id" in vars(type(connection))  # a method, replaceable per instance
    assert callable(connection.get_next_available_stream_id)


def _headers_buffer() -> None:
    client, _, _ = connected_pair()
    assert client.incoming_buffer._headers_buffer == []


def _connection_state_machine() -> None:
    client, _, _ = connected_pair()
    assert client.state_machine.state is h2.connection.ConnectionState.CLIENT_OPEN


def _streams() -> None:
    client, _, stream_id = connected_pair()
    assert isinstance(client.streams[stream_id], h2.stream.H2Stream)


def _actual_content_length() -> None:
    assert _h2_stream()._actual_content_length == 0


def _expected_content_length() -> None:
    assert _h2_stream()._expected_content_length is None


def _stream_window() -> None:
    assert _h2_stream()._inbound_window_manager.current_window_size == 65535


def _stream_state_machine() -> None:
    machine = _h2_stream().state_machine
    assert machine.state is h2.stream.StreamState.OPEN
    assert machine.headers_received is True
    assert machine.headers_sent is True  # the client's stream: its request headers went out


def _frame_repr() -> None:
    # Defined once, on the base class: replacing it there is what every frame type uses.
    assert "__repr__" in vars(hyperframe.frame.Frame)
    for kind in (hyperframe.frame.DataFrame, hyperframe.frame.HeadersFrame, GoAwayFrame):
        assert "__repr__" not in vars(kind), kind


def _event_internal(name: str) -> None:
    event = asyncio.Event()
    assert name in vars(event)
    assert name in _code_names(asyncio.Event.set)


#: Every internal the layer touches, and its check.
CANARIES: dict[str, Callable[[], None]] = {
    "asyncio.Event._value": lambda: _event_internal("_value"),
    "asyncio.Event._waiters": lambda: _event_internal("_waiters"),
    "grpclib.client.Channel.__connect__": _connect,
    "grpclib.client.Channel._authority": lambda: _channel_attribute("_authority"),
    "grpclib.client.Channel._calls_failed": lambda: _calls("_calls_failed"),
    "grpclib.client.Channel._calls_started": lambda: _calls("_calls_started"),
    "grpclib.client.Channel._calls_succeeded": lambda: _calls("_calls_succeeded"),
    "grpclib.client.Channel._config": lambda: _channel_attribute("_config"),
    "grpclib.client.Channel._connected": _connected,
    "grpclib.client.Channel._create_connection": _create_connection,
    "grpclib.client.Channel._h2_config": lambda: _channel_attribute("_h2_config"),
    "grpclib.client.Channel._loop": lambda: _channel_attribute("_loop"),
    "grpclib.client.Channel._protocol": lambda: _connect(),
    "grpclib.client.Channel._protocol_factory": _protocol_factory,
    "grpclib.client.Channel._scheme": lambda: _channel_attribute("_scheme"),
    "grpclib.client.Handler.connection_lost": _handler_connection_lost,
    "grpclib.client._H2_TO_GRPC_STATUS_MAP": _status_map,
    "grpclib.config.Configuration._http2_max_pings_without_data": lambda: _configuration_field(
        "_http2_max_pings_without_data"
    ),
    "grpclib.config.Configuration._http2_min_sent_ping_interval_without_data": lambda: _configuration_field(
        "_http2_min_sent_ping_interval_without_data"
    ),
    "grpclib.config.Configuration._keepalive_permit_without_calls": lambda: _configuration_field(
        "_keepalive_permit_without_calls"
    ),
    "grpclib.config.Configuration._keepalive_time": lambda: _configuration_field("_keepalive_time"),
    "grpclib.config.Configuration._keepalive_timeout": lambda: _configuration_field("_keepalive_timeout"),
    "grpclib.protocol.Connection._connection": lambda: _connection_attribute("_connection"),
    "grpclib.protocol.Connection._transport": _transport_attribute,
    "grpclib.protocol.Connection.close": _close,
    "grpclib.protocol.Connection.data_send_process": lambda: _send_process("data_send_process"),
    "grpclib.protocol.Connection.feed": _feed,
    "grpclib.protocol.Connection.flush": _flush,
    "grpclib.protocol.Connection.headers_send_process": lambda: _send_process("headers_send_process"),
    "grpclib.protocol.Connection.is_closing": lambda: _connection_attribute("is_closing"),
    "grpclib.protocol.Connection.stream_close_waiter": lambda: _event("stream_close_waiter"),
    "grpclib.protocol.Connection.streams_failed": lambda: _counter("streams_failed"),
    "grpclib.protocol.Connection.streams_started": lambda: _counter("streams_started"),
    "grpclib.protocol.Connection.streams_succeeded": lambda: _counter("streams_succeeded"),
    "grpclib.protocol.Connection.write_ready": lambda: _event("write_ready"),
    "grpclib.protocol.Event": lambda: _lean_name("Event"),
    "grpclib.protocol.EventsProcessor.close": _processor_close,
    "grpclib.protocol.EventsProcessor.connection": lambda: _processor_attribute("connection"),
    "grpclib.protocol.EventsProcessor.handler": lambda: _processor_attribute("handler"),
    "grpclib.protocol.EventsProcessor.process": _processor_process,
    "grpclib.protocol.EventsProcessor.process_connection_terminated": lambda: _processor_dispatches(
        "process_connection_terminated", h2.events.ConnectionTerminated
    ),
    "grpclib.protocol.EventsProcessor.process_data_received": lambda: _processor_dispatches(
        "process_data_received", h2.events.DataReceived
    ),
    "grpclib.protocol.EventsProcessor.process_response_received": lambda: _processor_dispatches(
        "process_response_received", h2.events.ResponseReceived
    ),
    "grpclib.protocol.EventsProcessor.process_stream_ended": lambda: _processor_dispatches(
        "process_stream_ended", h2.events.StreamEnded
    ),
    "grpclib.protocol.EventsProcessor.process_stream_reset": lambda: _processor_dispatches(
        "process_stream_reset", h2.events.StreamReset
    ),
    "grpclib.protocol.EventsProcessor.process_trailers_received": lambda: _processor_dispatches(
        "process_trailers_received", h2.events.TrailersReceived
    ),
    "grpclib.protocol.EventsProcessor.streams": lambda: _processor_attribute("streams"),
    "grpclib.protocol.H2Protocol.config": lambda: _protocol_attribute("config"),
    "grpclib.protocol.H2Protocol.connection": lambda: _protocol_attribute("connection"),
    "grpclib.protocol.H2Protocol.connection_lost": _connection_lost,
    "grpclib.protocol.H2Protocol.connection_made": _connection_made,
    "grpclib.protocol.H2Protocol.data_received": _data_received,
    "grpclib.protocol.H2Protocol.h2_config": lambda: _protocol_attribute("h2_config"),
    "grpclib.protocol.H2Protocol.handler": lambda: _protocol_attribute("handler"),
    "grpclib.protocol.H2Protocol.processor": lambda: _protocol_attribute("processor"),
    "grpclib.protocol.Queue": lambda: _lean_name("Queue"),
    "grpclib.protocol.Stream.__terminated__": _terminated,
    "grpclib.protocol.Stream._transport": _stream_transport,
    "grpclib.protocol.deque": lambda: _lean_name("deque"),
    "grpclib.server.Handler._tasks": _handler_tasks,
    "grpclib.server.Server._handlers": lambda: _server_attribute("_handlers"),
    "grpclib.server.Server._protocol_factory": _server_factory,
    "grpclib.server.Server._server": lambda: _server_attribute("_server"),
    "grpclib.server.Stream._stream": _server_stream,
    "h2.connection.H2Connection._frame_dispatch_table": _frame_dispatch_table,
    "h2.connection.H2Connection._inbound_flow_control_window_manager": _inbound_window,
    "h2.connection.H2Connection.get_next_available_stream_id": _next_stream_id,
    "h2.connection.H2Connection.incoming_buffer._headers_buffer": _headers_buffer,
    "h2.connection.H2Connection.state_machine": _connection_state_machine,
    "h2.connection.H2Connection.streams": _streams,
    "h2.stream.H2Stream._actual_content_length": _actual_content_length,
    "h2.stream.H2Stream._expected_content_length": _expected_content_length,
    "h2.stream.H2Stream._inbound_window_manager": _stream_window,
    "h2.stream.H2Stream.state_machine": _stream_state_machine,
    "hyperframe.frame.Frame.__repr__": _frame_repr,
}
#: Internals whose canary is another test (the docstring's ``[tag]``), by tag.
ELSEWHERE: dict[str, Callable[..., None]] = {
    "repr": test_frame_repr.test_h2_still_formats_every_received_frame_with_the_original_repr,
}

_LISTED = re.compile(r"^\* ``(?P<name>[^`]+)`` — .*?(?: \[(?P<tag>\w+)\])?$")


def _listed() -> dict[str, str | None]:
    """The internals the layer's docstring lists, with their ``[tag]`` if any."""
    doc = sidecar.http2.__doc__ or ""
    found = {m["name"]: m["tag"] for line in doc.splitlines() if (m := _LISTED.match(line))}
    assert found, "the layer's docstring lists no internals"
    return found


@pytest.mark.parametrize("name", sorted(CANARIES))
def test_internal_is_still_there(name: str) -> None:
    CANARIES[name]()


def test_the_docstring_lists_exactly_the_internals_with_a_canary() -> None:
    listed = _listed()
    assert {name for name, tag in listed.items() if tag is None} == set(CANARIES)
    for name, tag in listed.items():
        if tag is not None:
            assert tag in ELSEWHERE, f"{name}: no canary test for [{tag}]"


def test_h2_still_closes_the_connection_on_goaway() -> None:
    # Why the layer replaces h2's GOAWAY handler (not just grpclib's processor): h2's own puts the connection in
    # CLOSED, and a DATA frame of a stream the GOAWAY let run is then a protocol error.
    client, _, stream_id = connected_pair()
    client.receive_data(GoAwayFrame(0, last_stream_id=(1 << 31) - 1).serialize())
    with pytest.raises(h2.exceptions.ProtocolError):
        client.receive_data(DataFrame(stream_id, data=b"\0\0\0\0\0").serialize())


def test_our_h2_configuration_is_grpclibs() -> None:
    """``h2_configuration`` (what ``h2pair`` and the benches use) is the one grpclib's channel and server build."""

    def settings(config: h2.config.H2Configuration) -> dict[str, object]:
        names = ("client_side", "header_encoding", "validate_inbound_headers", "validate_outbound_headers")
        more = ("normalize_inbound_headers", "normalize_outbound_headers")
        return {name: getattr(config, name) for name in (*names, *more)}

    async def theirs() -> tuple[h2.config.H2Configuration, h2.config.H2Configuration]:
        return grpclib.client.Channel("127.0.0.1", 1)._h2_config, grpclib.server.Server([])._h2_config

    client, server = asyncio.run(theirs())
    assert settings(h2_configuration(client_side=True)) == settings(client)
    assert settings(h2_configuration(client_side=False)) == settings(server)
