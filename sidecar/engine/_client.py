"""The OpenEngine client: a pool of grpclib channels on the edge loop, driven from trio.

Theory of operation
-------------------
grpclib is asyncio-only, so every channel is created, used and closed **on the edge's asyncio thread**; trio code
reaches it only through ``edge.run`` (unary RPCs) and ``edge.open_stream`` (server streams, delivered in batches).
The functions prefixed ``_aio_`` below run on that thread and nowhere else. Each of them translates transport
failures into :class:`~sidecar.errors.EngineRpcError` before the exception crosses the bridge, so trio code only
ever sees our error type (or a cancellation).

Rules kept here, each learnt the hard way:

* never ``break`` out of ``async with channel.request()`` (its ``__aexit__`` then waits for trailers while the server
  keeps streaming); streams end by exhaustion, by an exception, or by cancellation, which resets the HTTP/2 stream;
* every unary RPC carries a deadline (sent as ``grpc-timeout``), plus a slightly later trio backstop in case the
  edge loop itself is wedged;
* HTTP/2 windows are bounded, because grpclib's ``recv_message`` does not yield while data is buffered;
* keepalive PINGs no faster than every 10 s (gRPC servers answer faster ones with GOAWAY ``too_many_pings``);
* Control RPCs (and KV-event subscriptions) have a connection of their own, so that ``Health``, ``GetLoad`` and
  ``Abort`` never wait behind ``Generate`` streams for a stream slot when a connection reaches the engine's
  ``MAX_CONCURRENT_STREAMS`` (grpclib then parks new streams until one ends); hitting that limit is logged;
* a GOAWAY drains its connection rather than killing it (``sidecar.http2``): open streams run to their end, new calls
  go to a fresh connection (a call refused before it was sent is retried there once), and the client tells its owner
  that the engine is going away (:attr:`EngineClient.going_away`, :meth:`EngineClient.on_going_away`); a status the
  engine sends on a connection that heard its GOAWAY says so (``EngineRpcError.after_goaway``);
* importing this module changes no library: the HTTP/2 tunings are the worker's explicit call
  (``sidecar.http2.apply_tunings``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

import trio
from grpclib.const import Cardinality, Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError

from openengine.v1 import generation_pb2
from openengine_bp.openengine.v1 import (
    AbortRequest,
    AbortResponse,
    AllRequests,
    ControlStub,
    EngineRole,
    GetKvEventSourcesRequest,
    GetKvEventSourcesResponse,
    GetLoadRequest,
    GetModelInfoRequest,
    GetServerInfoRequest,
    HealthRequest,
    HealthResponse,
    KvSessionRef,
    ListLorasRequest,
    ListLorasResponse,
    LoadInfo,
    LoadLoraRequest,
    LoadLoraResponse,
    LoraAdapter,
    ModelInfo,
    ServerInfo,
    SubscribeKvEventsRequest,
    SubscribeKvEventsResponse,
    UnloadLoraRequest,
    UnloadLoraResponse,
)
from sidecar.contract import CLIENT_REVISION, PINNED_SCHEMA_RELEASE
from sidecar.edge import EdgeError
from sidecar.errors import EngineRpcError, GrpcCode
from sidecar.http2 import GoawayRefused, grpclib_configuration

from ._direct import start_direct_stream
from ._metadata import TraceContext, check_metadata
from ._status import to_engine_rpc_error
from ._transport import PooledChannel, TlsFiles, TlsSource

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

    from sidecar.edge import BatchStream, Edge, Feed, FeedStream

    from ._config import EngineClientConfig
    from ._sink import GenerateSink

__all__ = ["BatchIterator", "ChannelStats", "EngineClient", "open_engine_client", "tls_files"]

log = logging.getLogger("sidecar.engine")

_T = TypeVar("_T")
_R = TypeVar("_R")

GENERATE_PATH: Final = "/openengine.v1.Inference/Generate"
SUBSCRIBE_KV_EVENTS_PATH: Final = "/openengine.v1.Control/SubscribeKvEvents"
# How much later than the gRPC deadline the trio side gives up on a unary RPC by itself: enough for the deadline to
# fire on the edge loop and its error to cross the bridge, short enough to bound a wedged loop.
_BACKSTOP_S: Final = 2.0
# Bound of closing the pool (closing transports is synchronous on the loop; this only guards a wedged loop).
_CLOSE_GRACE_S: Final = 5.0
# Default deadline of Health with the inference probe (TensorRT-LLM's probe is bounded to 30 s server-side).
_PROBE_TIMEOUT_S: Final = 35.0
# wait_connected logs a repeated failure at most this often (and whenever the error text changes).
_LOG_EVERY_S: Final = 30.0
# A connection at the engine's MAX_CONCURRENT_STREAMS is logged at most this often.
_STREAM_LIMIT_LOG_EVERY_S: Final = 60.0
# A stream read flat out is handed over at least every this many messages (the loop runs in between).
_MAX_BATCH: Final = 1024
# Statuses that mean "not reachable yet": wait_connected keeps trying on these and fails fast on anything else
# (an engine that answers UNIMPLEMENTED to GetServerInfo will not change its mind within the startup deadline).
_RETRY_CODES: Final = frozenset(
    {GrpcCode.UNAVAILABLE, GrpcCode.DEADLINE_EXCEEDED, GrpcCode.RESOURCE_EXHAUSTED, GrpcCode.CANCELLED}
)


@dataclass(frozen=True, slots=True)
class ChannelStats:
    """Counters of one pooled ``Generate`` connection (grpclib's own), for tests and metrics."""

    index: int
    connected: bool
    calls_started: int
    calls_succeeded: int
    calls_failed: int


class BatchIterator(Generic[_T]):
    """The batches of one server stream: an async context manager (entering it opens the stream, leaving it ends or
    cancels it), and a trio async iterator of non-empty lists of messages.

    Each batch is what the edge loop received since the last one was taken (at most 1024 messages): handle a batch at
    a time. After the last batch, a failure is raised as :class:`~sidecar.errors.EngineRpcError`.
    """

    __slots__ = ("_batches", "_rpc")

    def __init__(self, rpc: str, batches: BatchStream[_T] | FeedStream[_T]) -> None:
        self._rpc = rpc
        self._batches = batches

    async def __aenter__(self) -> BatchIterator[_T]:
        try:
            await self._batches.__aenter__()
        except EdgeError as exc:
            raise EngineRpcError(self._rpc, GrpcCode.UNAVAILABLE, f"the edge loop is gone: {exc}") from exc
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._batches.__aexit__(*exc_info)

    def __aiter__(self) -> BatchIterator[_T]:
        return self

    async def __anext__(self) -> list[_T]:
        try:
            return await self._batches.__anext__()
        except EdgeError as exc:
            raise EngineRpcError(self._rpc, GrpcCode.UNAVAILABLE, f"the edge loop is gone: {exc}") from exc


class _BoundedProtoCodec(ProtoCodec):
    """grpclib's proto codec plus the message-size limit grpclib lacks (grpcio enforces one; we match it)."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes

    def encode(self, message: Any, message_type: Any) -> bytes:
        data = super().encode(message, message_type)
        if len(data) > self._max_bytes:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED, f"request of {len(data)} bytes exceeds the {self._max_bytes}-byte limit"
            )
        return data

    def decode(self, data: bytes, message_type: Any) -> Any:
        if len(data) > self._max_bytes:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED, f"response of {len(data)} bytes exceeds the {self._max_bytes}-byte limit"
            )
        return message_type.FromString(data)


class _GoawayRelay:
    """The pool's GOAWAY news, carried from the edge loop into trio (the pool's ``PoolListener``).

    ``going_away``/``drained`` run on the edge loop and only post to trio; the ``_note_*`` callbacks run in trio
    (``run_sync_soon``: they must not raise).
    """

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token
        self.reason: str | None = None
        self.draining = 0
        self.drained_event = trio.Event()
        self.drained_event.set()
        self.listeners: list[Callable[[str], None]] = []

    def going_away(self, reason: str) -> None:
        self._post(self._note_going_away, reason)

    def drained(self) -> None:
        self._post(self._note_drained)

    def _post(self, fn: Callable[..., None], *args: object) -> None:
        with suppress(trio.RunFinishedError):  # trio is gone: nobody is left to tell
            self._token.run_sync_soon(fn, *args)

    def _note_going_away(self, reason: str) -> None:
        self.draining += 1
        if self.drained_event.is_set():
            self.drained_event = trio.Event()
        if self.reason is not None:
            return  # the same episode: every connection of the pool hears the GOAWAY
        self.reason = reason
        # NO_ERROR is an engine stopping gracefully (or recycling a connection): expected, so not a warning.
        log.log(
            logging.INFO if "NO_ERROR" in reason else logging.WARNING,
            "the engine is going away (%s): no new streams on its connections; open streams run until they end or "
            "the engine closes the connection",
            reason,
        )
        for listener in self.listeners:
            try:
                listener(reason)
            except Exception:
                log.exception("a going-away listener failed")

    def _note_drained(self) -> None:
        self.draining -= 1
        if self.draining <= 0:
            self.draining = 0
            self.drained_event.set()


class EngineClient:
    """One RPC method per OpenEngine RPC; use it through :func:`open_engine_client`.

    Unary methods return betterproto2 messages and raise :class:`~sidecar.errors.EngineRpcError` for every failure
    (non-OK status, deadline, transport loss). Each accepts ``trace`` (propagated as ``traceparent``/``tracestate``)
    and ``timeout_s`` (defaults to ``config.rpc_timeout_s``).
    """

    def __init__(
        self,
        edge: Edge,
        config: EngineClientConfig,
        channels: list[PooledChannel],
        control: PooledChannel,
        relay: _GoawayRelay | None = None,
    ) -> None:
        self._edge = edge
        self._config = config
        self._channels = channels  # Generate, round-robin
        self._control_channel = control  # every unary RPC and SubscribeKvEvents
        self._control = ControlStub(control)
        self._next_index = itertools.cycle(range(len(channels))).__next__
        self._closed = False
        self._relay = relay if relay is not None else _GoawayRelay(trio.lowlevel.current_trio_token())

    @property
    def config(self) -> EngineClientConfig:
        """The configuration the client was opened with."""
        return self._config

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` has run."""
        return self._closed

    @property
    def edge(self) -> Edge:
        """The edge whose loop carries this client's connections (where :meth:`start_generate` is called)."""
        return self._edge

    # ------------------------------------------------------------------ the engine going away (GOAWAY)

    @property
    def going_away(self) -> str | None:
        """Why the engine said it is going away (a GOAWAY on one of the pool's connections), or None.

        Set at the first GOAWAY; stays set until :meth:`wait_drained` has seen every such connection closed.
        """
        return self._relay.reason

    @property
    def draining_connections(self) -> int:
        """Connections that had a GOAWAY and are still open, delivering the streams that were running on them."""
        return self._relay.draining

    def on_going_away(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(reason)`` (in trio, synchronously: it must not block) at the first GOAWAY of each episode."""
        self._relay.listeners.append(listener)

    async def wait_drained(self, timeout_s: float = math.inf) -> None:
        """Return once no connection that had a GOAWAY is open (its streams ended, or the engine closed it); then
        :attr:`going_away` is cleared, and the next GOAWAY starts a new episode.

        After ``timeout_s`` the connections still draining are closed by us (their streams fail UNAVAILABLE).
        """
        relay = self._relay
        with trio.move_on_after(timeout_s):
            while relay.draining:
                await relay.drained_event.wait()
        if relay.draining:
            log.warning("connections still draining %gs after the engine's GOAWAY: closing them", timeout_s)
            with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_GRACE_S):
                try:
                    await self._edge.run(_aio_close_draining, [self._control_channel, *self._channels])
                except EdgeError:
                    log.debug("edge loop already closed; the draining connections went with it")
        relay.reason = None

    # ------------------------------------------------------------------ connection

    async def wait_connected(self, deadline: float | None = None) -> ServerInfo:
        """Retry ``GetServerInfo`` until the engine answers on every connection (Control's and each of the
        ``Generate`` pool); return its ``ServerInfo``.

        :param deadline: absolute ``trio.current_time()``; default now + ``config.startup_deadline_s``.

        One attempt every ``retry_interval_s``, each bounded by ``min(connect_attempt_timeout_s, remaining)``.
        Failures are logged on the first occurrence, then at most every 30 s or when the error changes. Raises
        ``EngineRpcError(GetServerInfo, UNAVAILABLE, "could not reach OpenEngine at host:port within Ns: …")`` at the
        deadline, or the engine's error at once if it answers with a status that retrying cannot change.
        """
        cfg = self._config
        start = trio.current_time()
        if deadline is None:
            deadline = start + cfg.startup_deadline_s
        last_error = "no attempt made"
        last_logged_error: str | None = None
        last_logged_at = -math.inf
        failures = 0
        while True:
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                break
            bound = min(cfg.connect_attempt_timeout_s, remaining)
            try:
                with trio.fail_after(bound):
                    return await self._probe_pool(bound)
            except trio.TooSlowError:
                # An attempt cut short by the overall deadline says less than the failure before it (a TLS refusal).
                if bound >= cfg.connect_attempt_timeout_s or failures == 0:
                    last_error = f"attempt timed out after {bound:g}s"
            except EngineRpcError as exc:
                if exc.code not in _RETRY_CODES:
                    raise
                last_error = f"{exc.code.name}: {exc.details}" if exc.details else exc.code.name
            failures += 1
            now = trio.current_time()
            if last_error != last_logged_error or now - last_logged_at >= _LOG_EVERY_S:
                log.info(
                    "OpenEngine at %s not reachable yet (attempt %d, %.0fs left): %s",
                    cfg.endpoint,
                    failures,
                    max(0.0, deadline - now),
                    last_error,
                )
                last_logged_error, last_logged_at = last_error, now
            await trio.sleep_until(min(deadline, now + cfg.retry_interval_s))
        waited = round(max(0.0, deadline - start), 1)
        raise EngineRpcError(
            "GetServerInfo",
            GrpcCode.UNAVAILABLE,
            f"could not reach OpenEngine at {cfg.endpoint} within {waited:g}s: {last_error}",
        )

    async def _probe_pool(self, attempt_s: float) -> ServerInfo:
        # The Control connection first, then the Generate pool in parallel, so every connection is up before traffic
        # and a refused pool slot is seen at startup rather than on the first request routed to it.
        info = await self._unary(
            "GetServerInfo", self._control.get_server_info, GetServerInfoRequest(), None, attempt_s
        )
        errors: list[EngineRpcError] = []

        async def probe(index: int) -> None:
            try:
                channel = self._channels[index]
                stub = ControlStub(channel)
                await self._unary(
                    "GetServerInfo", stub.get_server_info, GetServerInfoRequest(), None, attempt_s, channel
                )
            except EngineRpcError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for index in range(len(self._channels)):
                nursery.start_soon(probe, index)
        if errors:
            raise errors[0]
        return info

    async def channel_stats(self) -> list[ChannelStats]:
        """Call counters of each ``Generate`` connection (read on the edge loop, where grpclib updates them)."""
        return await self._edge.run(_aio_channel_stats, self._channels)

    async def aclose(self) -> None:
        """Close every pooled connection; open streams fail with UNAVAILABLE. Idempotent."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_GRACE_S) as scope:
            try:
                await self._edge.run(_aio_close_channels, [self._control_channel, *self._channels])
            except EdgeError:
                # The loop is already gone, and its transports with it: nothing left to close.
                log.debug("edge loop already closed; OpenEngine connections went with it")
        if scope.cancelled_caught:
            log.warning("closing the OpenEngine connections took more than %gs; abandoned", _CLOSE_GRACE_S)

    # ------------------------------------------------------------------ Inference

    def generate(
        self,
        request: generation_pb2.GenerateRequest,
        *,
        metadata: Sequence[tuple[str, str]] = (),
        trace: TraceContext | None = None,
        timeout_s: float | None = None,
    ) -> BatchIterator[generation_pb2.GenerateResponse]:
        """A ``Generate`` stream: ``async with client.generate(request) as batches: async for batch in batches: ...``
        yields non-empty batches of upb ``GenerateResponse``.

        :param metadata: request metadata pairs, e.g. ``RequestMetadata(...).pairs()``; checked locally
            (:class:`~sidecar.engine.MetadataError`) before any RPC.
        :param trace: W3C trace context, appended to ``metadata``.
        :param timeout_s: optional deadline of the whole stream (none by default: generations are long).

        A non-OK status or a transport loss is raised as :class:`~sidecar.errors.EngineRpcError` after the batches
        received before it. Leaving the context early cancels the gRPC stream (RST_STREAM), which makes the engine
        abort the request. A terminal in-band ``EngineError`` is data at this layer, not an exception.
        """
        pairs = list(metadata)
        if trace is not None:
            pairs.extend(trace.pairs())
        check_metadata(pairs)
        channel = self._pick_channel("Generate")
        if not self._config.direct_receive:
            return self._server_stream(
                "Generate", channel, GENERATE_PATH, request, generation_pb2.GenerateRequest,
                generation_pb2.GenerateResponse, pairs, timeout_s,
            )  # fmt: skip
        # Received straight from the HTTP/2 events (_direct.py): no grpclib stream, buffer or task per message.
        try:
            feed = self._edge.open_feed(
                _aio_start_generate, channel, request, pairs, timeout_s, self._config.max_message_bytes
            )
        except EdgeError as exc:
            raise EngineRpcError("Generate", GrpcCode.UNAVAILABLE, f"the edge loop is gone: {exc}") from exc
        return BatchIterator("Generate", feed)

    def start_generate(
        self,
        request: generation_pb2.GenerateRequest,
        sink: GenerateSink,
        *,
        metadata: Sequence[tuple[str, str]] = (),
        timeout_s: float | None = None,
    ) -> None:
        """**On the edge loop thread**: open a ``Generate`` stream whose messages go to ``sink`` on that thread as they
        arrive, with no trio in between (a request's data path, ``sidecar.datapath``). Never raises: every failure,
        bad metadata included, ends in ``sink.fail``. ``sink.on_cancel`` resets the stream (RST_STREAM).

        Received straight from the HTTP/2 events (``_direct.py``) with ``direct_receive``, else through grpclib's
        streams (a task per stream).
        """
        try:
            pairs = list(metadata)
            check_metadata(pairs)
            channel = self._pick_channel("Generate")
        except Exception as exc:
            sink.fail(exc)
            return
        if self._config.direct_receive:
            start_direct_stream(
                sink, "Generate", channel, GENERATE_PATH, request, generation_pb2.GenerateResponse, pairs, timeout_s,
                self._config.max_message_bytes, _note_stream_limit,
            )  # fmt: skip
        else:
            _SinkPump(sink, channel, request, pairs, timeout_s).start()

    # ------------------------------------------------------------------ Control

    async def get_server_info(self, *, trace: TraceContext | None = None, timeout_s: float | None = None) -> ServerInfo:
        """``Control.GetServerInfo``: engine identity, schema, role, models, capacity."""
        return await self._unary(
            "GetServerInfo", self._control.get_server_info, GetServerInfoRequest(), trace, timeout_s
        )

    async def get_model_info(
        self, model: str, *, trace: TraceContext | None = None, timeout_s: float | None = None
    ) -> ModelInfo:
        """``Control.GetModelInfo`` for one of ``ServerInfo.supported_models`` (unknown → NOT_FOUND)."""
        return await self._unary(
            "GetModelInfo", self._control.get_model_info, GetModelInfoRequest(model=model), trace, timeout_s
        )

    async def get_load(
        self, include_per_rank: bool = False, *, trace: TraceContext | None = None, timeout_s: float | None = None
    ) -> LoadInfo:
        """``Control.GetLoad``: live load (running requests, KV usage, optionally per DP rank)."""
        return await self._unary(
            "GetLoad", self._control.get_load, GetLoadRequest(include_per_rank=include_per_rank), trace, timeout_s
        )

    async def health(
        self,
        include_inference_probe: bool = False,
        model: str = "",
        role: EngineRole = EngineRole.UNSPECIFIED,
        *,
        trace: TraceContext | None = None,
        timeout_s: float | None = None,
    ) -> HealthResponse:
        """``Control.Health``; ``model`` and ``role`` only label the inference probe.

        With ``include_inference_probe`` the default deadline is at least 35 s: TensorRT-LLM bounds its one-token probe
        to 30 s, and the answer (DEGRADED) is worth more than our own DEADLINE_EXCEEDED.
        """
        request = HealthRequest(include_inference_probe=include_inference_probe, model=model, role=role)
        if timeout_s is None and include_inference_probe:
            timeout_s = max(self._config.rpc_timeout_s, _PROBE_TIMEOUT_S)
        return await self._unary("Health", self._control.health, request, trace, timeout_s)

    async def abort(
        self,
        request_id: str | None = None,
        *,
        all_requests: bool = False,
        kv_session: KvSessionRef | None = None,
        trace: TraceContext | None = None,
        timeout_s: float | None = None,
    ) -> AbortResponse:
        """``Control.Abort`` of exactly one target: a ``request_id``, ``all_requests=True``, or a ``kv_session``.

        ``ABORT_STATUS_ALREADY_FINISHED`` is a success. Raises ``ValueError`` (before any RPC) unless exactly one
        target is given — betterproto2 would put two oneof members on the wire without complaint.
        """
        targets = (request_id is not None) + bool(all_requests) + (kv_session is not None)
        if targets != 1:
            raise ValueError("abort needs exactly one target: request_id, all_requests=True or kv_session")
        if request_id is not None:
            request = AbortRequest(request_id=request_id)
        elif kv_session is not None:
            request = AbortRequest(kv_session=kv_session)
        else:
            request = AbortRequest(all_requests=AllRequests())
        return await self._unary("Abort", self._control.abort, request, trace, timeout_s)

    async def load_lora(
        self,
        lora_name: str,
        source_path: str,
        lora_id: int,
        *,
        trace: TraceContext | None = None,
        timeout_s: float | None = None,
    ) -> LoadLoraResponse:
        """``Control.LoadLora`` (UNIMPLEMENTED on engines without LoRA, e.g. TensorRT-LLM's baseline)."""
        request = LoadLoraRequest(adapter=LoraAdapter(lora_id=lora_id, lora_name=lora_name, source_path=source_path))
        return await self._unary("LoadLora", self._control.load_lora, request, trace, timeout_s)

    async def unload_lora(
        self, lora_name: str, *, trace: TraceContext | None = None, timeout_s: float | None = None
    ) -> UnloadLoraResponse:
        """``Control.UnloadLora``."""
        return await self._unary(
            "UnloadLora", self._control.unload_lora, UnloadLoraRequest(lora_name=lora_name), trace, timeout_s
        )

    async def list_loras(
        self, *, trace: TraceContext | None = None, timeout_s: float | None = None
    ) -> ListLorasResponse:
        """``Control.ListLoras``."""
        return await self._unary("ListLoras", self._control.list_loras, ListLorasRequest(), trace, timeout_s)

    async def get_kv_event_sources(
        self, ranks: Sequence[int] = (), *, trace: TraceContext | None = None, timeout_s: float | None = None
    ) -> GetKvEventSourcesResponse:
        """``Control.GetKvEventSources`` for the given data-parallel ranks (empty = all)."""
        request = GetKvEventSourcesRequest(data_parallel_ranks=list(ranks))
        return await self._unary("GetKvEventSources", self._control.get_kv_event_sources, request, trace, timeout_s)

    @asynccontextmanager
    async def subscribe_kv_events(
        self,
        request: SubscribeKvEventsRequest,
        *,
        trace: TraceContext | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[BatchIterator[SubscribeKvEventsResponse]]:
        """``Control.SubscribeKvEvents`` as batches, like :meth:`generate` (a failure ends with a final ``error``
        event and status OK; that event is data here)."""
        pairs = trace.pairs() if trace is not None else []
        self._check_open("SubscribeKvEvents")
        async with self._server_stream(
            "SubscribeKvEvents",
            self._control_channel,
            SUBSCRIBE_KV_EVENTS_PATH,
            request,
            SubscribeKvEventsRequest,
            SubscribeKvEventsResponse,
            pairs,
            timeout_s,
        ) as batches:
            yield batches

    # ------------------------------------------------------------------ internals

    def _check_open(self, rpc: str) -> None:
        if self._closed:
            # UNAVAILABLE, not a local error: during shutdown a request that races the close can go elsewhere.
            raise EngineRpcError(rpc, GrpcCode.UNAVAILABLE, "the engine client is closed")

    def _pick_channel(self, rpc: str) -> PooledChannel:
        self._check_open(rpc)
        return self._channels[self._next_index()]

    def _server_stream(
        self,
        rpc: str,
        channel: PooledChannel,
        path: str,
        request: Any,
        request_type: type[Any],
        response_type: type[_T],
        metadata: list[tuple[str, str]],
        timeout_s: float | None,
    ) -> BatchIterator[_T]:
        # Plain objects rather than generator-based context managers or an exit stack: this runs once per request,
        # and each of those layers cost ~0.5-1 KiB per request in flight (bench/inflight_memory.py).
        try:
            batches = self._edge.open_stream(
                _aio_server_stream, rpc, channel, path, request, request_type, response_type, metadata, timeout_s
            )
        except EdgeError as exc:
            raise EngineRpcError(rpc, GrpcCode.UNAVAILABLE, f"the edge loop is gone: {exc}") from exc
        return BatchIterator(rpc, batches)

    async def _unary(
        self,
        rpc: str,
        method: Callable[..., Awaitable[_R]],
        request: Any,
        trace: TraceContext | None,
        timeout_s: float | None,
        channel: PooledChannel | None = None,
    ) -> _R:
        """``method`` (a stub method bound to ``channel``; default: the Control connection's) under a deadline."""
        self._check_open(rpc)
        timeout = self._config.rpc_timeout_s if timeout_s is None else timeout_s
        pairs = trace.pairs() if trace is not None else None
        if channel is None:
            channel = self._control_channel
        with trio.move_on_after(timeout + _BACKSTOP_S) as scope:
            try:
                return await self._edge.run(_aio_unary, rpc, method, request, timeout, pairs, channel)
            except EdgeError as exc:
                # The loop carrying the connections shut down (or cancelled the call) under us: for the caller that
                # is the engine becoming unreachable.
                raise EngineRpcError(rpc, GrpcCode.UNAVAILABLE, f"the edge loop is gone: {exc}") from exc
        assert scope.cancelled_caught
        raise EngineRpcError(rpc, GrpcCode.DEADLINE_EXCEEDED, f"no answer within {timeout:g}s (client backstop)")


@asynccontextmanager
async def open_engine_client(edge: Edge, config: EngineClientConfig) -> AsyncIterator[EngineClient]:
    """Open the connection pool on ``edge``'s loop; close it on exit (idempotent, also via ``client.aclose()``).

    Connections are made lazily by grpclib; call :meth:`EngineClient.wait_connected` to wait for the engine.
    """
    log.info(
        "OpenEngine client for %s: %d Generate connection(s) + 1 for Control, schema release %s, client revision %d",
        config.endpoint,
        config.connections,
        PINNED_SCHEMA_RELEASE,
        CLIENT_REVISION,
    )
    relay = _GoawayRelay(trio.lowlevel.current_trio_token())
    tls = TlsSource(tls_files(config)) if config.endpoint.tls else None
    control, *channels = await edge.run(_aio_open_channels, config, tls, relay)
    client = EngineClient(edge, config, channels, control, relay)
    try:
        yield client
    finally:
        await client.aclose()


# ---------------------------------------------------------------------- edge-loop side (asyncio)


async def _aio_open_channels(
    config: EngineClientConfig, tls: TlsSource | None, relay: _GoawayRelay
) -> list[PooledChannel]:
    """The Control connection, then ``config.connections`` for ``Generate``."""
    # Channel() binds to the running loop (asyncio.get_event_loop()), hence created here, on the edge thread.
    grpc_config = grpclib_configuration(
        keepalive_s=config.keepalive_interval_s,
        keepalive_timeout_s=config.keepalive_timeout_s,
        # Ping only while streams are open; the engine is local, idle connections need no probing.
        keepalive_without_calls=False,
        # grpclib counts pings "without data" by what *we* send; a long receive-only Generate stream would stop
        # being probed after 2 pings. The interval (>= 10 s) already keeps gRPC servers' ping policy happy.
        max_pings_without_data=0,
        # grpclib's default (300 s) would silently stretch the configured interval.
        min_ping_interval_without_data_s=config.keepalive_interval_s,
        stream_window_bytes=config.stream_window_bytes,
        connection_window_bytes=config.connection_window_bytes,
    )
    codec = _BoundedProtoCodec(config.max_message_bytes)
    control = PooledChannel(config.endpoint, codec=codec, config=grpc_config, tls=tls, listener=relay)
    # Only the Generate connections carry direct streams, and only then does the layer's frame splitter run.
    return [control] + [
        PooledChannel(
            config.endpoint, codec=codec, config=grpc_config, tls=tls, listener=relay, direct=config.direct_receive
        )
        for _ in range(config.connections)
    ]


def tls_files(config: EngineClientConfig) -> TlsFiles:
    """The TLS files of ``config`` (which must have ``tls_ca``)."""
    if config.tls_ca is None:
        raise ValueError("a TLS endpoint needs tls_ca (the CA that signed the engine's certificate)")
    return TlsFiles(config.tls_ca, config.tls_cert, config.tls_key, config.tls_key_password_file)


async def _aio_close_channels(channels: list[PooledChannel]) -> None:
    for channel in channels:
        channel.close()  # idempotent in grpclib: closes the transport if there is one


async def _aio_close_draining(channels: list[PooledChannel]) -> None:
    for channel in channels:
        channel.close_draining()


async def _aio_channel_stats(channels: list[PooledChannel]) -> list[ChannelStats]:
    return [ChannelStats(i, ch.connected, *ch.counters()) for i, ch in enumerate(channels)]


_stream_limit_logged_at = -math.inf  # edge loop only


def _note_stream_limit(rpc: str, channel: PooledChannel) -> None:
    """Log (at most once a minute) when ``channel`` is at the engine's MAX_CONCURRENT_STREAMS: the new stream waits."""
    global _stream_limit_logged_at
    use = channel.stream_limit()
    if use is None:  # not connected yet: the engine's SETTINGS are unknown
        return
    in_use, limit = use
    if in_use < limit:
        return
    now = time.monotonic()
    if now - _stream_limit_logged_at >= _STREAM_LIMIT_LOG_EVERY_S:
        _stream_limit_logged_at = now
        log.warning(
            "an OpenEngine connection is at the engine's limit of %d concurrent streams (HTTP/2 "
            "MAX_CONCURRENT_STREAMS): new %s calls on it wait for a stream to end; more connections "
            "(--grpc-connections) or a higher limit on the engine avoid the wait (logged at most once a minute)",
            limit,
            rpc,
        )


def _aio_start_generate(
    feed: Feed[generation_pb2.GenerateResponse],
    channel: PooledChannel,
    request: generation_pb2.GenerateRequest,
    metadata: list[tuple[str, str]],
    timeout_s: float | None,
    max_bytes: int,
) -> None:
    start_direct_stream(
        feed, "Generate", channel, GENERATE_PATH, request, generation_pb2.GenerateResponse, metadata, timeout_s,
        max_bytes, _note_stream_limit,
    )  # fmt: skip


class _SinkPump:
    """grpclib's receive path for a loop-side :class:`GenerateSink`: a task iterates the stream and pushes what one
    loop iteration received as one batch (grpclib returns queued messages without suspending; the flush runs once
    the task suspends). Pushing past the sink's room parks the task until :meth:`GenerateSink.hold` calls back, which
    leaves the engine's data unread in grpclib's buffer (HTTP/2 flow control then stops the engine)."""

    __slots__ = ("_batch", "_cancelled", "_room", "_sink", "_stream", "_task")

    def __init__(
        self,
        sink: GenerateSink,
        channel: PooledChannel,
        request: generation_pb2.GenerateRequest,
        metadata: list[tuple[str, str]],
        timeout_s: float | None,
    ) -> None:
        self._sink = sink
        self._stream = _aio_server_stream(
            "Generate", channel, GENERATE_PATH, request, generation_pb2.GenerateRequest,
            generation_pb2.GenerateResponse, metadata, timeout_s,
        )  # fmt: skip
        self._batch: list[generation_pb2.GenerateResponse] = []
        self._room: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._cancelled = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())
        self._sink.on_cancel = self._cancel

    def _cancel(self) -> None:
        self._cancelled = True
        if self._task is not None:
            self._task.cancel(msg="the request's data path closed the stream")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for message in self._stream:
                if not self._batch:
                    loop.call_soon(self._flush)
                self._batch.append(message)
                if len(self._batch) >= _MAX_BATCH:
                    self._flush()
                    await asyncio.sleep(0)  # a stream that never suspends must still let the loop run
                if self._room is not None:
                    await self._room
        except asyncio.CancelledError:
            if not self._cancelled:  # the loop is shutting down under the stream
                self._flush()
                self._sink.fail_cancelled()
            raise
        except Exception as exc:
            self._flush()
            self._sink.fail(exc)
        else:
            self._flush()
            self._sink.end()

    def _flush(self) -> None:
        if self._batch and not self._cancelled:
            items, self._batch = self._batch, []
            if not self._sink.push(items) and self._room is None:
                self._room = asyncio.get_running_loop().create_future()
                self._sink.hold(self._resume)

    def _resume(self) -> None:
        room, self._room = self._room, None
        if room is not None and not room.done():
            room.set_result(None)


async def _aio_unary(
    rpc: str,
    method: Callable[..., Awaitable[_R]],
    request: Any,
    grpc_timeout_s: float,
    metadata: list[tuple[str, str]] | None,
    channel: PooledChannel,
) -> _R:
    _note_stream_limit(rpc, channel)
    goaways = channel.goaways_heard
    try:
        try:
            return await method(request, timeout=grpc_timeout_s, metadata=metadata)
        except GoawayRefused:
            # Nothing was sent; the channel has already dropped the draining connection and connects anew.
            goaways = channel.goaways_heard
            return await method(request, timeout=grpc_timeout_s, metadata=metadata)
    except Exception as exc:
        # A GOAWAY heard by this channel during the call came on the call's connection: it was the current one.
        error = to_engine_rpc_error(rpc, exc, after_goaway=channel.goaways_heard != goaways)
        if error is None:
            raise
        raise error from exc


async def _aio_server_stream(
    rpc: str,
    channel: PooledChannel,
    path: str,
    request: Any,
    request_type: type[Any],
    response_type: type[Any],
    metadata: list[tuple[str, str]],
    grpc_timeout_s: float | None,
) -> AsyncIterator[Any]:
    _note_stream_limit(rpc, channel)
    goaways = channel.goaways_heard
    try:
        retry = True
        while True:
            try:
                goaways = channel.goaways_heard
                async with channel.request(
                    path,
                    Cardinality.UNARY_STREAM,
                    request_type,
                    response_type,
                    metadata=metadata,
                    timeout=grpc_timeout_s,
                ) as stream:
                    await stream.send_message(request, end=True)
                    recv = stream.recv_message
                    # Ends by exhaustion only (never `break` in here): __aexit__ then reads the trailers and raises a
                    # non-OK status. Cancellation (consumer left) unwinds through __aexit__, which resets the stream.
                    while (message := await recv()) is not None:
                        yield message
                return
            except GoawayRefused:
                # Raised only while opening the stream, before anything was sent or yielded: retry once on the
                # fresh connection the channel makes now.
                if not retry:
                    raise
                retry = False
    except Exception as exc:
        # A GOAWAY heard by this channel during the call came on the call's connection: it was the current one.
        error = to_engine_rpc_error(rpc, exc, after_goaway=channel.goaways_heard != goaways)
        if error is None:
            raise
        raise error from exc
    # asyncio.CancelledError and GeneratorExit are BaseExceptions: they pass through `except Exception` untouched.
