"""The grpclib services ``Inference`` and ``Control`` over upb messages; every failure becomes a status + message."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from grpclib.const import Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError

from openengine.v1 import (
    generation_pb2,
    kv_pb2,
    lifecycle_pb2,
    lora_pb2,
    model_pb2,
    openengine_grpc,
    server_pb2,
)
from sidecar.http2 import drop_connection

from .kvcache import BLOCK_HASH_ALGO
from .kvevents import KvEventFeed, KvFault, Subscription
from .ledger import DROP_KEY, Origin, private_origin, public_origin
from .structs import fill_struct
from .validate import Rejection, check_request_id_length

if TYPE_CHECKING:
    from grpclib._typing import IProtoMessage
    from grpclib.server import Stream

    from .engine import Engine

__all__ = ["MAX_MESSAGE_BYTES", "ControlService", "InferenceService", "LimitedProtoCodec", "recv_request"]

log = logging.getLogger("openengine_mock")

#: Message size limit in both directions, as TensorRT-LLM's server sets it.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

_ROLES = {
    "aggregated": server_pb2.ENGINE_ROLE_AGGREGATED,
    "prefill": server_pb2.ENGINE_ROLE_PREFILL,
    "decode": server_pb2.ENGINE_ROLE_DECODE,
    "unspecified": server_pb2.ENGINE_ROLE_UNSPECIFIED,
}

#: ``GuidedDecoding`` guide names → ``GuidedDecodingMode`` numbers.
_GUIDED_MODE_NUMBERS = {
    "json_schema": model_pb2.GUIDED_DECODING_MODE_JSON_SCHEMA,
    "regex": model_pb2.GUIDED_DECODING_MODE_REGEX,
    "ebnf_grammar": model_pb2.GUIDED_DECODING_MODE_EBNF_GRAMMAR,
    "structural_tag": model_pb2.GUIDED_DECODING_MODE_STRUCTURAL_TAG,
    "json_object": model_pb2.GUIDED_DECODING_MODE_JSON_OBJECT,
    "choice": model_pb2.GUIDED_DECODING_MODE_CHOICE,
}


class LimitedProtoCodec(ProtoCodec):
    """grpclib's protobuf codec with grpcio's message size limit (``RESOURCE_EXHAUSTED`` beyond it)."""

    def encode(self, message: IProtoMessage, message_type: type[IProtoMessage]) -> bytes:
        data = super().encode(message, message_type)
        if len(data) > MAX_MESSAGE_BYTES:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED, f"Sent message larger than max ({len(data)} vs. {MAX_MESSAGE_BYTES})"
            )
        return data

    def decode(self, data: bytes, message_type: type[IProtoMessage]) -> IProtoMessage:
        if len(data) > MAX_MESSAGE_BYTES:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED, f"Received message larger than max ({len(data)} vs. {MAX_MESSAGE_BYTES})"
            )
        return super().decode(data, message_type)


async def recv_request(stream: Stream[_Req, _Resp], method: str) -> _Req:
    """The single request message; undecodable bytes → ``INTERNAL`` as grpcio answers them."""
    try:
        message = await stream.recv_message()
    except GRPCError as exc:
        log.warning("%s: %s %s", method, exc.status.name, exc.message)
        raise
    except Exception as exc:
        log.warning("%s: undecodable request: %r", method, exc)
        raise GRPCError(Status.INTERNAL, "Exception deserializing request!") from None
    if message is None:
        raise GRPCError(Status.INTERNAL, "request message missing")
    return message


def _fail(method: str, exc: Exception) -> GRPCError:
    if isinstance(exc, GRPCError):
        return exc
    if isinstance(exc, Rejection):
        log.warning("%s: %s %s", method, exc.status.name, exc.message)
        return GRPCError(exc.status, exc.message)
    log.exception("%s failed", method)
    return GRPCError(Status.INTERNAL, f"openengine-mock internal error in {method}: {exc!r}")


async def _unary(stream: Stream[_Req, _Resp], method: str, handle: Callable[[_Req], Awaitable[_Resp]]) -> None:
    request = await recv_request(stream, method)
    try:
        response = await handle(request)
    except Exception as exc:
        raise _fail(method, exc) from None
    await stream.send_message(response)


def _drop_connection(stream: Stream[generation_pb2.GenerateRequest, generation_pb2.GenerateResponse]) -> None:
    """Close the whole HTTP/2 connection under ``stream`` (the client sees a transport loss)."""
    drop_connection(stream)


def _check_adapter(adapter: lora_pb2.LoraAdapter) -> None:
    if adapter.lora_id <= 0:
        raise Rejection(Status.INVALID_ARGUMENT, f"lora_id must be positive, got {adapter.lora_id}")
    if not adapter.lora_name:
        raise Rejection(Status.INVALID_ARGUMENT, "lora_name must not be empty")
    if not os.path.isabs(adapter.source_path) or not os.path.isdir(adapter.source_path):
        raise Rejection(
            Status.INVALID_ARGUMENT, f"source_path must be an absolute directory, got {adapter.source_path!r}"
        )


def _origin(stream: Stream[Any, Any], private: bool) -> Origin:
    return private_origin(stream.metadata) if private else public_origin(stream)


class InferenceService(openengine_grpc.InferenceBase):
    """``openengine.v1.Inference``. ``private``: served on the launcher's private socket to the attached frontends,
    which say in private metadata where a request came from (``frontends.py``)."""

    def __init__(self, engine: Engine, *, private: bool = False) -> None:
        self._engine = engine
        self._private = private

    async def Generate(self, stream: Stream[generation_pb2.GenerateRequest, generation_pb2.GenerateResponse]) -> None:
        request = await recv_request(stream, "Generate")
        engine = self._engine
        if engine.draining and engine.config.frontends > 1:
            # TensorRT-LLM's coordinator refuses a reservation once the group is stopping (CoordinationError).
            raise GRPCError(Status.UNAVAILABLE, "Frontend group is not ready")
        try:
            req = engine.accept(request, stream.metadata)
        except Exception as exc:
            raise _fail("Generate", exc) from None
        origin = _origin(stream, self._private)
        engine.ledger.note_generate(req.plan, origin)
        if engine.config.frontends > 1:
            log.info("request %r came in on frontend %d from %s", req.plan.request_id, origin.frontend, origin.peer)
        dropped = False

        def drop() -> None:
            nonlocal dropped
            dropped = True
            if not self._private:
                _drop_connection(stream)

        await engine.generate(req, stream.send_message, drop)
        if dropped and self._private:
            # The attached frontend closes its client's connection (the fault is about that one, not this socket).
            await stream.send_trailing_metadata(metadata={DROP_KEY: "1"})
        elif req.plan.faults.trailing_unavailable and req.terminal_sent:
            engine.served["trailing_unavailable"] += 1
            log.warning("request %r: all sent; ending with UNAVAILABLE (trailing_unavailable)", request.request_id)
            raise GRPCError(Status.UNAVAILABLE, "OpenEngine coordinator unavailable during request cleanup")


class ControlService(openengine_grpc.ControlBase):
    """``openengine.v1.Control`` (``private``: as :class:`InferenceService`)."""

    def __init__(self, engine: Engine, *, kv_feed: KvEventFeed | None = None, private: bool = False) -> None:
        self._engine = engine
        self._config = engine.config
        self._private = private
        #: The KV event stream over the engine's block pool (``kvevents.py``); faults from ``--kv-fault``. One per
        #: engine: the private socket's service shares the public one's.
        self.kv_feed = kv_feed or KvEventFeed(
            engine.pool,
            faults=[(seq, cast("KvFault", kind)) for seq, kind in engine.config.kv_faults],
            lora_id_of=lambda name: adapter.lora_id if (adapter := engine.loras.get(name)) is not None else 0,
            enabled=engine.config.kv_events in ("grpc", "zmq"),
        )

    async def _unary(
        self, stream: Stream[_Req, _Resp], method: str, handle: Callable[[_Req], Awaitable[_Resp]]
    ) -> None:
        self._engine.ledger.note_control(_origin(stream, self._private))
        await _unary(stream, method, handle)

    # -- discovery ---------------------------------------------------------------------------------------------------

    async def _server_info(self, _: server_pb2.GetServerInfoRequest) -> server_pb2.ServerInfo:
        cfg = self._config
        info = server_pb2.ServerInfo(
            engine_name=cfg.engine_name,
            engine_version=cfg.engine_version,
            engine_role=_ROLES[cfg.role],
            instance_id=cfg.instance_id,
            supported_models=list(cfg.model_names),
            schema_revision=1,
            minimum_client_revision=1,
            schema_release=cfg.schema_release,
        )
        engine = cfg.engine
        for size in engine.parallelism:  # one engine: every size the profile reports is 1, but attention DP's
            setattr(info.parallelism, size, cfg.data_parallel_size if size == "data_parallel_size" else 1)
        capacity = info.capacity
        capacity.kv_block_size = cfg.kv_block_size
        if engine.reports_total_kv_blocks:
            capacity.total_kv_blocks = cfg.total_kv_blocks
        capacity.max_running_requests = cfg.max_running_requests
        capacity.max_batched_tokens = cfg.max_batched_tokens
        if cfg.capabilities.lora:
            capacity.max_loras = cfg.max_loras
        if cfg.reports_kv_connector:
            kvc = info.kv_connector
            kvc.enabled = True
            kvc.transfer_backend = cfg.kv_transfer_backend
            kvc.supports_remote_prefill = True
            kvc.supports_decode_pull = False
            kvc.supports_abort_cleanup = False
            kvc.schema_version = 1
            if engine.kv_connector_shape == "mock":  # TensorRT-LLM lists neither protocols nor endpoints
                kvc.supported_protocols.append("tcp")
                kvc.local_endpoints.add(
                    host=self._engine.listen_host, port=self._engine.kv_sessions.port, protocol="tcp"
                )
        # TensorRT-LLM's baseline sends no extra; the mock keeps its own keys (mock_stats is how tests see what the
        # engine served), which clients ignore.
        extra: dict[str, object] = {"mock": True, "mock_kv_block_hash_algo": BLOCK_HASH_ALGO}
        if engine.trtllm_extra_flags:
            extra.update(trtllm_supports_dp_rank_targeting=True, trtllm_supports_subagent_affinity=False)
        fill_struct(info.extra, extra)
        # Cumulative counters of what this engine served (disaggregation tests check which engine did which leg).
        served = self._engine
        stats = {
            **served.served,
            **served.kv_sessions.stats,
            "last_media": served.last_media,
            "last_prompt_token_ids": served.last_prompt_token_ids,
            "last_model": served.last_model,
            # Gauges, whatever --load-report hides from GetLoad (TensorRT-LLM's shows neither): leak checks.
            "live_requests": len(served.live),
            "prefilling_requests": served.prefilling,
            "active_kv_sessions": served.kv_sessions.active,
            "used_kv_blocks": served.pool.used_blocks,
            **served.ledger.stats(),
        }
        fill_struct(info.extra, {"mock_stats": stats})
        return info

    async def _model_info(self, request: model_pb2.GetModelInfoRequest) -> model_pb2.ModelInfo:
        cfg = self._config
        caps = cfg.capabilities
        # TensorRT-LLM serves one model and resolves any name to it; the full engine knows its names.
        if request.model and request.model not in cfg.model_names and not cfg.engine.serves_unknown_models:
            raise Rejection(Status.NOT_FOUND, f"model {request.model!r} is not served here")
        info = model_pb2.ModelInfo(
            model_id=cfg.served_model_name,
            served_model_name=cfg.served_model_name,
            served_model_aliases=list(cfg.model_aliases),
            max_context_length=cfg.max_context_length,
            supports_text_input=caps.text_input,
            supports_token_ids_input=True,
            supports_lora=caps.lora,
            supports_multimodal=caps.multimodal,
        )
        if cfg.max_output_tokens is not None:
            info.max_output_tokens = cfg.max_output_tokens
        gen = info.generation
        for caps_msg, supported in (
            (gen.prompt_logprobs, caps.prompt_logprobs),
            (gen.output_logprobs, caps.output_logprobs),
        ):
            caps_msg.supported = supported
            if supported:
                caps_msg.candidate_selection_modes.append(model_pb2.CANDIDATE_TOKEN_SELECTION_MODE_TOP_N)
                caps_msg.max_top_n = cfg.max_top_n
        gen.guided_decoding.supported = caps.guided
        if caps.guided:
            gen.guided_decoding.modes.extend(_GUIDED_MODE_NUMBERS[mode] for mode in cfg.engine.guided_modes)
        if cfg.max_num_sequences is not None:
            gen.max_num_sequences = cfg.max_num_sequences
        gen.supports_priority = caps.priority
        gen.supports_stop_in_output = caps.stop_in_output
        gen.supports_cache_salt = caps.cache_salt
        gen.supports_prefix_cache_bypass = caps.prefix_cache_bypass
        return info

    async def GetServerInfo(self, stream: Stream[server_pb2.GetServerInfoRequest, server_pb2.ServerInfo]) -> None:
        await self._unary(stream, "GetServerInfo", self._server_info)

    async def GetModelInfo(self, stream: Stream[model_pb2.GetModelInfoRequest, model_pb2.ModelInfo]) -> None:
        await self._unary(stream, "GetModelInfo", self._model_info)

    # -- load, health, abort -----------------------------------------------------------------------------------------

    async def _load(self, request: server_pb2.GetLoadRequest) -> server_pb2.LoadInfo:
        return self._engine.load(request)

    async def _abort(self, request: lifecycle_pb2.AbortRequest) -> lifecycle_pb2.AbortResponse:
        if request.WhichOneof("target") == "request_id":
            check_request_id_length(request.request_id, self._config)  # refused before the coordinator
        response = self._engine.abort(request)
        log.info("Abort(%s): %s", request.WhichOneof("target"), lifecycle_pb2.AbortStatus.Name(response.status))
        return response

    async def GetLoad(self, stream: Stream[server_pb2.GetLoadRequest, server_pb2.LoadInfo]) -> None:
        await self._unary(stream, "GetLoad", self._load)

    async def Health(self, stream: Stream[lifecycle_pb2.HealthRequest, lifecycle_pb2.HealthResponse]) -> None:
        await self._unary(stream, "Health", self._engine.health)

    async def Abort(self, stream: Stream[lifecycle_pb2.AbortRequest, lifecycle_pb2.AbortResponse]) -> None:
        origin = _origin(stream, self._private)

        async def abort(request: lifecycle_pb2.AbortRequest) -> lifecycle_pb2.AbortResponse:
            response = await self._abort(request)  # a refused one (an id too long) is not noted
            if request.WhichOneof("target") == "request_id":
                self._engine.ledger.note_abort(request.request_id, origin)
            return response

        await self._unary(stream, "Abort", abort)

    # -- LoRA (wire §7.9; UNIMPLEMENTED unless --capability lora=true, as TensorRT-LLM) -------------------------------

    def _require_lora(self, method: str) -> None:
        if not self._config.capabilities.lora:
            raise Rejection(Status.UNIMPLEMENTED, f"{method} is not supported (supports_lora=false)")

    async def _load_lora(self, request: lora_pb2.LoadLoraRequest) -> lora_pb2.LoadLoraResponse:
        self._require_lora("LoadLora")
        if not request.HasField("adapter"):
            raise Rejection(Status.INVALID_ARGUMENT, "adapter is required")
        adapter = request.adapter
        _check_adapter(adapter)
        loras = self._engine.loras
        same = loras.get(adapter.lora_name)
        if same is not None:
            if same.lora_id == adapter.lora_id and same.source_path == adapter.source_path:
                return lora_pb2.LoadLoraResponse(adapter=same, already_loaded=True)
            raise Rejection(Status.ALREADY_EXISTS, f"LoRA {adapter.lora_name!r} is loaded with another id or path")
        for other in loras.values():
            if other.lora_id == adapter.lora_id or other.source_path == adapter.source_path:
                raise Rejection(Status.ALREADY_EXISTS, f"lora_id/source_path already used by LoRA {other.lora_name!r}")
        if len(loras) >= self._config.max_loras:
            raise Rejection(Status.RESOURCE_EXHAUSTED, f"max_loras={self._config.max_loras} adapters already loaded")
        stored = lora_pb2.LoraAdapter()
        stored.CopyFrom(adapter)
        loras[adapter.lora_name] = stored
        log.info("loaded LoRA %r (id %d)", adapter.lora_name, adapter.lora_id)
        return lora_pb2.LoadLoraResponse(adapter=stored, already_loaded=False)

    async def _unload_lora(self, request: lora_pb2.UnloadLoraRequest) -> lora_pb2.UnloadLoraResponse:
        self._require_lora("UnloadLora")
        if not request.lora_name:
            raise Rejection(Status.INVALID_ARGUMENT, "lora_name must not be empty")
        adapter = self._engine.loras.pop(request.lora_name, None)
        if adapter is None:
            raise Rejection(Status.NOT_FOUND, f"LoRA {request.lora_name!r} is not loaded")
        log.info("unloaded LoRA %r", request.lora_name)
        return lora_pb2.UnloadLoraResponse(adapter=adapter)

    async def _list_loras(self, _: lora_pb2.ListLorasRequest) -> lora_pb2.ListLorasResponse:
        self._require_lora("ListLoras")
        adapters = sorted(self._engine.loras.values(), key=lambda a: a.lora_id)
        return lora_pb2.ListLorasResponse(adapters=adapters)

    async def LoadLora(self, stream: Stream[lora_pb2.LoadLoraRequest, lora_pb2.LoadLoraResponse]) -> None:
        await self._unary(stream, "LoadLora", self._load_lora)

    async def UnloadLora(self, stream: Stream[lora_pb2.UnloadLoraRequest, lora_pb2.UnloadLoraResponse]) -> None:
        await self._unary(stream, "UnloadLora", self._unload_lora)

    async def ListLoras(self, stream: Stream[lora_pb2.ListLorasRequest, lora_pb2.ListLorasResponse]) -> None:
        await self._unary(stream, "ListLoras", self._list_loras)

    # -- KV events (kvevents.py; --kv-events, --kv-snapshot, --kv-fault) --------------------------------------------

    async def _kv_sources(self, request: kv_pb2.GetKvEventSourcesRequest) -> kv_pb2.GetKvEventSourcesResponse:
        mode = self._config.kv_events
        if mode == "unimplemented":
            raise Rejection(Status.UNIMPLEMENTED, "GetKvEventSources is not supported")
        if mode == "disabled":
            return kv_pb2.GetKvEventSourcesResponse()
        if mode == "zmq":
            await self.kv_feed.start_zmq(self._engine.listen_host)
            return self.kv_feed.zmq_sources(request)
        return self.kv_feed.sources(request)

    async def GetKvEventSources(
        self, stream: Stream[kv_pb2.GetKvEventSourcesRequest, kv_pb2.GetKvEventSourcesResponse]
    ) -> None:
        await self._unary(stream, "GetKvEventSources", self._kv_sources)

    def _kv_subscribe(self, request: kv_pb2.SubscribeKvEventsRequest) -> Subscription:
        mode = self._config.kv_events
        if mode == "unimplemented":
            raise Rejection(Status.UNIMPLEMENTED, "SubscribeKvEvents is not supported")
        if mode == "disabled":
            if self._config.engine.subscribe_unimplemented_without_grpc:
                raise Rejection(Status.UNIMPLEMENTED, "SubscribeKvEvents is not supported (KV events are off)")
            raise Rejection(Status.FAILED_PRECONDITION, "KV events are disabled on this engine")
        if mode == "zmq":
            raise Rejection(Status.UNIMPLEMENTED, "SubscribeKvEvents is not supported (KV events are published on ZMQ)")
        if self._engine.draining:
            raise Rejection(Status.UNAVAILABLE, "openengine-mock is shutting down")
        if request.include_snapshot and not self._config.kv_snapshot:
            raise Rejection(Status.UNIMPLEMENTED, "KV event snapshots are not offered (--no-kv-snapshot)")
        return self.kv_feed.subscribe(request)

    async def SubscribeKvEvents(
        self, stream: Stream[kv_pb2.SubscribeKvEventsRequest, kv_pb2.SubscribeKvEventsResponse]
    ) -> None:
        request = await recv_request(stream, "SubscribeKvEvents")
        self._engine.ledger.note_control(_origin(stream, self._private))
        try:
            sub = self._kv_subscribe(request)
        except Exception as exc:
            raise _fail("SubscribeKvEvents", exc) from None
        log.info("SubscribeKvEvents: subscribed (snapshot=%s)", request.include_snapshot)
        task = asyncio.current_task()
        if task is not None:
            self._engine.endless_tasks.add(task)
        try:
            while True:
                try:
                    response = KvEventFeed.response(await sub.get())
                except Rejection as exc:
                    raise _fail("SubscribeKvEvents", exc) from None
                if response is None:
                    return
                await stream.send_message(response)
                if response.HasField("error"):
                    return
        finally:
            self.kv_feed.unsubscribe(sub)
            if task is not None:
                self._engine.endless_tasks.discard(task)
