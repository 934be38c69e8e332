"""The one owned HTTP/2 layer: every adaptation of grpclib, h2 and hyperframe internals lives here, and only here.

grpclib 0.4.9 (on h2 4.x) gets three things wrong for an engine we must not lose requests to, and costs more per
message than it needs to; the engine client, the conformance kit and ``openengine-mock`` all build on this layer:

* **GOAWAY** (``_client.py``): connections that drain on the peer's GOAWAY (open streams run to their end, new
  calls go to a fresh connection, a call refused before it was sent raises :class:`GoawayRefused`), or close as
  grpclib's do; either way the channel hears of every GOAWAY (:meth:`Http2Channel.heard_goaway`), which is how the
  conformance kit records them and the engine client tells its owner.
* **The direct receive path's HTTP/2 half** (``_client.py``): :class:`DirectSink`, :class:`StreamLink` and the frame
  splitter, engaged only on channels made with ``direct=True``.
* **grpc-core's server behaviours** grpclib lacks, for ``openengine-mock`` (``_server.py``): no stream limit unless
  asked, the two-phase GOAWAY of a graceful stop, the ``CANCELLED`` answer between the two GOAWAYs.
* **Tunings** (``_tunings.py``), applied by an explicit call (:func:`apply_tunings`, the worker's start-up), never at
  import: importing any module of the project changes no library.

It imports grpclib, h2, hyperframe, hpack, multidict and the standard library only: never trio, uvloop or
``sidecar.*``. Their versions are pinned exactly in ``constraints.txt`` (the image build runs the canaries too).

Library internals touched (underscored names, and every name of ``grpclib.protocol``, a module grpclib does not
document); for each, ``tests/http2/test_canaries.py::test_internal_is_still_there[NAME]`` fails when it moves:

* ``asyncio.Event._value`` — set by the lean-streams tuning's ``LeanEvent``
* ``asyncio.Event._waiters`` — a list in the lean-streams tuning's ``LeanEvent``
* ``grpclib.client.Channel.__connect__`` — connect before a direct stream opens
* ``grpclib.client.Channel._authority`` — ``:authority`` of direct streams; set for Unix sockets
* ``grpclib.client.Channel._calls_failed`` — counted for direct streams, read for stats
* ``grpclib.client.Channel._calls_started`` — counted for direct streams, read for stats
* ``grpclib.client.Channel._calls_succeeded`` — counted for direct streams, read for stats
* ``grpclib.client.Channel._config`` — the configuration our protocols are built with
* ``grpclib.client.Channel._connected`` — overridden: no new calls on a connection that heard GOAWAY
* ``grpclib.client.Channel._create_connection`` — overridden: :meth:`Http2Channel.open_connection`
* ``grpclib.client.Channel._h2_config`` — the h2 configuration our protocols are built with
* ``grpclib.client.Channel._loop`` — the channel's loop
* ``grpclib.client.Channel._protocol`` — the current connection, dropped on GOAWAY
* ``grpclib.client.Channel._protocol_factory`` — overridden: our client protocols
* ``grpclib.client.Channel._scheme`` — ``:scheme`` of direct streams; set for per-connection TLS
* ``grpclib.client.Handler.connection_lost`` — a lost connection is not reused
* ``grpclib.client._H2_TO_GRPC_STATUS_MAP`` — HTTP ``:status`` → gRPC status of a direct stream
* ``grpclib.config.Configuration._http2_max_pings_without_data`` — keepalive setting
* ``grpclib.config.Configuration._http2_min_sent_ping_interval_without_data`` — keepalive setting
* ``grpclib.config.Configuration._keepalive_permit_without_calls`` — keepalive setting
* ``grpclib.config.Configuration._keepalive_time`` — keepalive setting
* ``grpclib.config.Configuration._keepalive_timeout`` — keepalive setting
* ``grpclib.protocol.Connection._connection`` — the h2 connection under grpclib's
* ``grpclib.protocol.Connection._transport`` — GOAWAY and RST_STREAM frames written as they are
* ``grpclib.protocol.Connection.close`` — the mock cuts a connection
* ``grpclib.protocol.Connection.data_send_process`` — after a direct stream's DATA
* ``grpclib.protocol.Connection.feed`` — frames handed to h2
* ``grpclib.protocol.Connection.flush`` — what h2 queued written
* ``grpclib.protocol.Connection.headers_send_process`` — after a direct stream's HEADERS
* ``grpclib.protocol.Connection.is_closing`` — nothing written to a closing connection
* ``grpclib.protocol.Connection.stream_close_waiter`` — replaced on GOAWAY; set when a slot frees
* ``grpclib.protocol.Connection.streams_failed`` — counted for direct streams
* ``grpclib.protocol.Connection.streams_started`` — counted for direct streams
* ``grpclib.protocol.Connection.streams_succeeded`` — counted for direct streams
* ``grpclib.protocol.Connection.write_ready`` — waited on before a direct stream writes
* ``grpclib.protocol.Event`` — replaced by the lean-streams tuning
* ``grpclib.protocol.EventsProcessor.close`` — overridden: the first close reason is kept
* ``grpclib.protocol.EventsProcessor.connection`` — the processor's connection
* ``grpclib.protocol.EventsProcessor.handler`` — the processor's handler
* ``grpclib.protocol.EventsProcessor.process`` — events handed to the processor
* ``grpclib.protocol.EventsProcessor.process_connection_terminated`` — overridden: the GOAWAY policy
* ``grpclib.protocol.EventsProcessor.process_data_received`` — overridden for direct streams
* ``grpclib.protocol.EventsProcessor.process_response_received`` — overridden for direct streams
* ``grpclib.protocol.EventsProcessor.process_stream_ended`` — overridden for direct streams
* ``grpclib.protocol.EventsProcessor.process_stream_reset`` — overridden for direct streams
* ``grpclib.protocol.EventsProcessor.process_trailers_received`` — overridden for direct streams
* ``grpclib.protocol.EventsProcessor.streams`` — direct streams registered; open streams counted
* ``grpclib.protocol.H2Protocol.config`` — our protocols built from grpclib's
* ``grpclib.protocol.H2Protocol.connection`` — the protocol's connection
* ``grpclib.protocol.H2Protocol.connection_lost`` — overridden: the reason streams fail with
* ``grpclib.protocol.H2Protocol.connection_made`` — overridden: our processor, h2's GOAWAY handler
* ``grpclib.protocol.H2Protocol.data_received`` — overridden: first bytes; the frame splitter
* ``grpclib.protocol.H2Protocol.h2_config`` — our protocols built from grpclib's
* ``grpclib.protocol.H2Protocol.handler`` — our protocols built from grpclib's
* ``grpclib.protocol.H2Protocol.processor`` — replaced by ours
* ``grpclib.protocol.Queue`` — replaced by the lean-streams tuning
* ``grpclib.protocol.Stream.__terminated__`` — fails a stream above a GOAWAY's last stream id
* ``grpclib.protocol.Stream._transport`` — the mock drops a connection under a stream
* ``grpclib.protocol.deque`` — replaced by the lean-streams tuning
* ``grpclib.server.Handler._tasks`` — the mock's running handlers
* ``grpclib.server.Server._handlers`` — the mock's running handlers
* ``grpclib.server.Server._protocol_factory`` — overridden: the mock's server protocol
* ``grpclib.server.Server._server`` — the mock's listener
* ``grpclib.server.Stream._stream`` — the mock drops a connection under a stream
* ``h2.connection.H2Connection._frame_dispatch_table`` — GOAWAY received without closing h2
* ``h2.connection.H2Connection._inbound_flow_control_window_manager`` — a skipped DATA frame accounted
* ``h2.connection.H2Connection._receive_frame`` — formats every frame it receives (why the repr tuning) [repr]
* ``h2.connection.H2Connection.get_next_available_stream_id`` — replaced per connection after GOAWAY
* ``h2.connection.H2Connection.incoming_buffer._headers_buffer`` — no frame skips h2 inside a header block
* ``h2.connection.H2Connection.state_machine`` — a DATA frame skips h2 only on an open connection
* ``h2.connection.H2Connection.streams`` — a DATA frame skips h2 only on a receiving stream
* ``h2.stream.H2Stream._actual_content_length`` — a skipped DATA frame accounted
* ``h2.stream.H2Stream._expected_content_length`` — no frame skips h2 under a content-length
* ``h2.stream.H2Stream._inbound_window_manager`` — a skipped DATA frame accounted
* ``h2.stream.H2Stream.state_machine`` — a DATA frame skips h2 only on a receiving stream; the mock's cut sends
  trailers-only where no headers went out
* ``hyperframe.frame.Frame.__repr__`` — replaced by the frame-repr tuning

``[repr]``: its canary is ``test_frame_repr.py::test_h2_still_formats_every_received_frame_with_the_original_repr``
(when it fails, the tuning no longer pays). Why the layer is needed at all:
``test_canaries.py::test_h2_still_closes_the_connection_on_goaway`` and
``tests/engine/test_goaway.py::test_stock_grpclib_still_fails_every_stream_on_goaway`` fail once the libraries
drain on GOAWAY themselves.
"""

from ._client import MAX_STREAM_ID as MAX_STREAM_ID
from ._client import ClientProtocol as ClientProtocol
from ._client import DirectSink as DirectSink
from ._client import Goaway as Goaway
from ._client import GoawayPolicy as GoawayPolicy
from ._client import GoawayRefused as GoawayRefused
from ._client import Http2Channel as Http2Channel
from ._client import StreamLink as StreamLink
from ._client import grpc_request_headers as grpc_request_headers
from ._client import grpc_status_of_http as grpc_status_of_http
from ._config import grpclib_configuration as grpclib_configuration
from ._config import h2_configuration as h2_configuration
from ._server import NO_STREAM_LIMIT as NO_STREAM_LIMIT
from ._server import GrpcCoreServer as GrpcCoreServer
from ._server import drop_connection as drop_connection
from ._tunings import HYPERFRAME_REPR as HYPERFRAME_REPR
from ._tunings import LeanDeque as LeanDeque
from ._tunings import LeanEvent as LeanEvent
from ._tunings import LeanQueue as LeanQueue
from ._tunings import apply_tunings as apply_tunings
from ._tunings import cheap_frame_repr as cheap_frame_repr
from ._tunings import tunings_in_effect as tunings_in_effect
from ._tunings import undo_tunings as undo_tunings

__all__ = [
    "HYPERFRAME_REPR",
    "MAX_STREAM_ID",
    "NO_STREAM_LIMIT",
    "ClientProtocol",
    "DirectSink",
    "Goaway",
    "GoawayPolicy",
    "GoawayRefused",
    "GrpcCoreServer",
    "Http2Channel",
    "LeanDeque",
    "LeanEvent",
    "LeanQueue",
    "StreamLink",
    "apply_tunings",
    "cheap_frame_repr",
    "drop_connection",
    "grpc_request_headers",
    "grpc_status_of_http",
    "grpclib_configuration",
    "h2_configuration",
    "tunings_in_effect",
    "undo_tunings",
]
