"""Plain data crossing the adapter's boundary: settings, what registration carries, what a request handler gets."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeAlias

__all__ = [
    "ChunkSink",
    "DiscoveryBackend",
    "DynamoSettings",
    "EndpointType",
    "Registration",
    "RequestContext",
    "RequestHandler",
    "WorkerRole",
]

#: ``mem`` works only inside one process (tests).
DiscoveryBackend: TypeAlias = Literal["file", "etcd", "kubernetes", "mem"]
EndpointType: TypeAlias = Literal["chat", "completions"]
WorkerRole: TypeAlias = Literal["aggregated", "prefill", "decode", "encode"]

_ROLES: frozenset[str] = frozenset({"aggregated", "prefill", "decode", "encode"})
_ENDPOINT_TYPES: frozenset[str] = frozenset({"chat", "completions"})


@dataclass(frozen=True, slots=True)
class DynamoSettings:
    """Where this worker lives in Dynamo: discovery backend, planes, and its ``namespace.component.endpoint``."""

    discovery_backend: DiscoveryBackend = "file"
    request_plane: Literal["tcp", "nats"] = "tcp"
    event_plane: Literal["zmq", "nats"] = "zmq"
    response_plane: Literal["tcp", "quic"] = "tcp"
    #: push: chunks through Dynamo's ResponseSender (sidecar.dynamo._egress); pull: Dynamo takes them from the
    #: iterator the handler returns.
    egress: Literal["push", "pull"] = "push"
    namespace: str = "dynamo"
    component: str = "backend"
    endpoint: str = "generate"

    def __post_init__(self) -> None:
        for part in (self.namespace, self.component, self.endpoint):
            if not part or "." in part or "/" in part:
                raise ValueError(f"invalid Dynamo endpoint part {part!r}")

    @property
    def endpoint_path(self) -> str:
        """``namespace.component.endpoint``, the form ``DistributedRuntime.endpoint`` takes."""
        return f"{self.namespace}.{self.component}.{self.endpoint}"


@dataclass(frozen=True, slots=True)
class Registration:
    """Everything the model card (MDC) and runtime config carry (what Dynamo's Rust sidecars register as the engine
    config).

    ``runtime_data`` values must be JSON-serialisable: each becomes ``ModelRuntimeConfig.set_engine_specific(key,
    json.dumps(value))``. ``needs`` is a DNF: a list of AND-sets of worker roles (``(("decode",),)`` for a prefill
    worker). A prefill worker registers ``ModelType.Prefill`` whatever ``endpoint_types`` says.
    """

    model_path: str
    served_model_name: str
    model_input: Literal["tokens", "text"] = "tokens"
    endpoint_types: tuple[EndpointType, ...] = ("chat", "completions")
    worker_type: WorkerRole = "aggregated"
    context_length: int | None = None
    kv_block_size: int | None = None
    total_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    data_parallel_size: int = 1
    data_parallel_start_rank: int = 0
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    aliases: tuple[str, ...] = ()
    router_mode: Literal["kv"] | None = None
    #: The worker publishes KV events (and keeps a worker-side index the router can recover from).
    kv_events: bool = False
    runtime_data: Mapping[str, Any] = field(default_factory=dict)
    #: Adapters the engine can hold at once (``DeploymentCapacity.max_loras``), for the router's LoRA accounting.
    max_loras: int | None = None
    needs: tuple[tuple[WorkerRole, ...], ...] = ()
    #: A chat template file the frontend uses instead of the model's own (``--custom-jinja-template``).
    custom_template_path: str | None = None
    #: The frontend leaves tools out of the chat template when a request's ``tool_choice`` is ``none``.
    exclude_tools_when_tool_choice_none: bool = True

    def __post_init__(self) -> None:
        if not self.model_path or not self.served_model_name:
            raise ValueError("model_path and served_model_name are required")
        if self.worker_type not in _ROLES:
            raise ValueError(f"unknown worker_type {self.worker_type!r}")
        for role in (r for group in self.needs for r in group):
            if role not in _ROLES:
                raise ValueError(f"unknown worker role {role!r} in needs")
        if self.worker_type != "prefill":
            if not self.endpoint_types:
                raise ValueError("endpoint_types must not be empty")
            for kind in self.endpoint_types:
                if kind not in _ENDPOINT_TYPES:
                    raise ValueError(f"unknown endpoint type {kind!r}")
        if self.data_parallel_size < 1 or self.data_parallel_start_rank < 0:
            raise ValueError("data_parallel_size must be >= 1 and data_parallel_start_rank >= 0")


@dataclass(slots=True)
class RequestContext:
    """What the trio request handler learns about a request besides its body.

    ``request_id`` is Dynamo's ``context.id()`` (the same id on both legs of a disaggregated request).
    ``trace_headers`` holds ``traceparent``/``tracestate`` when the request carries trace context.
    ``annotations`` are the request's ``nvext.annotations`` strings (``"key:value"``).
    """

    request_id: str
    trace_headers: dict[str, str] = field(default_factory=dict)
    annotations: tuple[str, ...] = ()


class ChunkSink(Protocol):
    """Where one request's chunks go: the outbox Dynamo reads them from. **Edge loop thread only.**

    The producer (the request's data path) hands it ``LLMEngineOutput`` chunk dicts as they come (``deliver``; they
    are merged while Dynamo is busy with the previous chunk), then ends it (``end``) or fails it (``fail``: the
    exception Dynamo is given, mapped by its ``SidecarError.kind``); the first of the two counts. ``on_stop``, set by
    the producer, is called once if Dynamo stops reading first (the client left, the frontend ended the stream, or
    Dynamo dropped the iterator); ``stopped`` says so afterwards, for good (a stop can come before the producer
    looks, and Dynamo may have read the stream's last chunk by then). Backpressure: ``has_room`` is False while too many
    tokens wait for a reader that stopped reading; ``when_room(callback)`` calls back once there is room again.
    """

    on_stop: Callable[[], None] | None

    @property
    def stopped(self) -> bool: ...

    @property
    def has_room(self) -> bool: ...

    def deliver(self, chunks: list[dict[str, Any]]) -> None: ...

    def when_room(self, callback: Callable[[], None]) -> None: ...

    def end(self) -> None: ...

    def fail(self, error: BaseException) -> None: ...


#: A trio coroutine function: ``await handler(request, ctx, outbox)`` serves one request, run as a task of the
#: worker's request nursery. It must settle ``outbox`` (``end`` or ``fail``, on the edge loop) before it returns;
#: if it raises, or is cancelled from outside (worker teardown), the adapter fails the outbox itself (a
#: ``SidecarError`` becomes the Dynamo error its ``kind`` names; a teardown becomes ``EngineShutdown``, migrated).
RequestHandler: TypeAlias = Callable[[dict[str, Any], RequestContext, ChunkSink], Awaitable[None]]
