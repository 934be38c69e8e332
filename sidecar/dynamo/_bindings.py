"""Small wrappers around the ``dynamo`` bindings (typed by their ``_core.pyi``). Each runs on the edge loop thread.

Binding facts these wrappers encode (ai-dynamo-runtime 1.6.1):

* ``register_model``, ``unregister_model`` and ``Endpoint.serve_endpoint`` return asyncio *futures*, not coroutines,
  created on the calling thread's running loop: call them only inside a coroutine running on the edge loop.
* ``ModelRuntimeConfig.set_engine_specific(key, value)`` parses ``value`` as JSON text ("expected value at line 1
  column 1" for a bare string); ``runtime_data`` is read-only.
* ``DistributedRuntime.shutdown()`` only triggers the runtime's cancellation token; deregistration, the wait for
  in-flight requests and teardown follow asynchronously and end with ``serve_endpoint`` returning.
* ``DistributedRuntime.endpoint(path)`` blocks on the runtime with the GIL held: with etcd and NATS, only before any
  Python callback is registered (``create_runtime``), or the process deadlocks.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import TYPE_CHECKING, Any

import dynamo.llm
import dynamo.llm.exceptions
from dynamo.llm import ModelRuntimeConfig, ModelType, WorkerType
from dynamo.runtime import Context, DistributedRuntime, Endpoint

from sidecar.errors import SidecarError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Collection

    from ._types import DynamoSettings, Registration, WorkerRole

__all__ = [
    "Context",
    "ControlPlaneError",
    "ControlPlaneLost",
    "ControlPlaneUnreachable",
    "DistributedRuntime",
    "Endpoint",
    "RegistrationRefused",
    "control_plane",
    "create_runtime",
    "dynamo_exception",
    "export_metrics",
    "register",
    "restore",
    "restore_endpoint",
    "serve_endpoint",
    "set_health",
    "shutdown",
    "unregister",
    "withdraw",
]


_WORKER_TYPES: dict[WorkerRole, WorkerType] = {
    "aggregated": WorkerType.Aggregated,
    "prefill": WorkerType.Prefill,
    "decode": WorkerType.Decode,
    "encode": WorkerType.Encode,
}


class ControlPlaneError(RuntimeError):
    """Dynamo's control plane (etcd discovery, NATS planes) failed this worker; the message is one operator line."""


class ControlPlaneUnreachable(ControlPlaneError):
    """Start-up: etcd or NATS did not answer within its startup-connect deadline (``ETCD_``/``NATS_STARTUP_CONNECT_
    TIMEOUT_SECONDS``, set from ``--control-plane-deadline-secs``)."""


class RegistrationRefused(RuntimeError):
    """Dynamo refused this worker's model card: another model is registered on the same endpoint, or the model path
    is a Hugging Face id Dynamo could not fetch; the message is one operator line naming what to change."""


class ControlPlaneLost(ControlPlaneError):
    """While serving, the Dynamo runtime shut itself down (its etcd lease could not be kept or was gone): nothing can
    be served or re-registered any more, so the worker exits and its supervisor starts a fresh one."""


#: Dynamo's defaults when the variables are unset (``lib/runtime`` transports, ai-dynamo-runtime 1.6.1).
_DEFAULT_ETCD = "http://localhost:2379"
_DEFAULT_NATS = "nats://localhost:4222"


def control_plane(settings: DynamoSettings) -> str:
    """What this worker's runtime connects to, for log lines: ``etcd at …, NATS at …`` (empty for file/mem + TCP)."""
    parts = []
    if settings.discovery_backend == "etcd":
        parts.append(f"etcd at {os.environ.get('ETCD_ENDPOINTS') or _DEFAULT_ETCD}")
    if "nats" in (settings.request_plane, settings.event_plane):
        parts.append(f"NATS at {os.environ.get('NATS_SERVER') or _DEFAULT_NATS}")
    return ", ".join(parts)


async def create_runtime(
    settings: DynamoSettings, controls: Collection[str] = ()
) -> tuple[DistributedRuntime, Endpoint, int, dict[str, Endpoint]]:
    """Create the ``DistributedRuntime`` on the running (edge) loop; returns it, our endpoint, our instance id and the
    endpoints of ``controls`` (names in our namespace and component, served later by ``serve_control_endpoint``).

    Every ``Endpoint`` is built here, before any Python callback is registered with the runtime. Building one
    (``runtime.endpoint(path)``) blocks the calling thread on the runtime *with the GIL held*; with etcd and NATS the
    build waits for I/O that only the runtime's worker threads (two on two cores) drive. Once the runtime calls into
    Python (a request handler, a ``/metrics`` scrape, a finished future), those threads queue for the GIL: a build
    then deadlocks the whole process (a LoRA worker hung after ``serving ... as instance`` in 1 of 120 start-ups;
    ``tests/cluster/test_busy_runtime.py`` shows it in seconds). With file discovery the build needs no I/O
    (``restore_endpoint`` relies on it).

    The constructor connects to etcd and NATS synchronously, retrying with backoff until its startup-connect deadline
    (it blocks the edge loop meanwhile); then it raises a plain ``Exception``, re-raised here as
    :class:`ControlPlaneUnreachable` with one line naming what was unreachable.
    """
    loop = asyncio.get_running_loop()
    try:
        runtime = DistributedRuntime(
            loop,
            settings.discovery_backend,
            settings.request_plane,
            event_plane=settings.event_plane,
            response_plane=settings.response_plane,
        )
    except Exception as exc:
        text = " ".join(str(exc).split())
        if "etcd" in text.lower() or "nats" in text.lower():
            raise ControlPlaneUnreachable(f"control plane unreachable ({control_plane(settings)}): {text}") from None
        raise
    endpoint = runtime.endpoint(settings.endpoint_path)
    prefix = f"{settings.namespace}.{settings.component}"
    built = {name: runtime.endpoint(f"{prefix}.{name}") for name in controls}
    return runtime, endpoint, int(endpoint.connection_id()), built


def _model_type(reg: Registration) -> ModelType:
    if reg.worker_type == "prefill":
        return ModelType.Prefill
    kinds = {"chat": ModelType.Chat, "completions": ModelType.Completions}
    model_type = kinds[reg.endpoint_types[0]]
    for kind in reg.endpoint_types[1:]:
        model_type = model_type | kinds[kind]
    return model_type


def _runtime_config(reg: Registration) -> ModelRuntimeConfig:
    config = ModelRuntimeConfig()
    config.data_parallel_size = reg.data_parallel_size
    config.data_parallel_start_rank = reg.data_parallel_start_rank
    # The integer setters refuse None (TypeError): leave unknown limits unset.
    if reg.context_length is not None:
        config.context_length = reg.context_length
    if reg.total_kv_blocks is not None:
        config.total_kv_blocks = reg.total_kv_blocks
    if reg.max_num_seqs is not None:
        config.max_num_seqs = reg.max_num_seqs
    if reg.max_num_batched_tokens is not None:
        config.max_num_batched_tokens = reg.max_num_batched_tokens
    if reg.reasoning_parser is not None:
        config.reasoning_parser = reg.reasoning_parser
    if reg.tool_call_parser is not None:
        config.tool_call_parser = reg.tool_call_parser
    config.exclude_tools_when_tool_choice_none = reg.exclude_tools_when_tool_choice_none
    if reg.kv_events:
        config.kv_event_publishing_enabled = True
        config.enable_local_indexer = True
    for key, value in reg.runtime_data.items():
        config.set_engine_specific(key, json.dumps(value))
    return config


async def register(endpoint: Endpoint, reg: Registration, lora_name: str | None = None) -> None:
    """``register_model`` with everything ``reg`` carries. Calling it again with the same card is a no-op rewrite.

    With ``lora_name``: a LoRA model card on our endpoint, next to the base card (same routing and runtime config):
    the frontend lists ``lora_name`` in ``/v1/models`` and routes ``model=lora_name`` here with ``routing.lora_name``
    (ai-dynamo-runtime 1.6.1). Its key in discovery is the base card's plus ``/<slug of lora_name>``.
    """
    model_input = dynamo.llm.ModelInput.Tokens if reg.model_input == "tokens" else dynamo.llm.ModelInput.Text
    router_config = dynamo.llm.RouterConfig(dynamo.llm.RouterMode.KV) if reg.router_mode == "kv" else None
    needs = [[_WORKER_TYPES[role] for role in group] for group in reg.needs] or None
    if lora_name is None:
        identity: dict[str, Any] = {"model_aliases": list(reg.aliases) or None, "max_gpu_lora_count": reg.max_loras}
    else:
        identity = {"lora_name": lora_name, "base_model_path": reg.model_path}
    try:
        await dynamo.llm.register_model(
            model_input,
            _model_type(reg),
            endpoint,
            reg.model_path,
            lora_name or reg.served_model_name,
            worker_type=_WORKER_TYPES[reg.worker_type],
            kv_cache_block_size=reg.kv_block_size,
            router_config=router_config,
            runtime_config=_runtime_config(reg),
            needs=needs,
            custom_template_path=reg.custom_template_path,
            # The worker never loads weights: a model fetched from the hub needs its tokenizer and config only.
            ignore_weights=True,
            **identity,
        )
    except Exception as exc:
        text = " ".join(str(exc).split())
        if "a different model" in text and "is already registered there" in text:
            # One model per endpoint: workers with other model names -- or aliases: the engine's own model name is
            # one when the served name differs -- on one namespace and component collide.
            raise RegistrationRefused(
                f"{text}: every worker on one endpoint must serve the same model; give this one its own --namespace "
                "(DYN_NAMESPACE) or --component (DYN_COMPONENT), or the --served-model-name (DYN_SERVED_MODEL_NAME) "
                "of the workers there"
            ) from None
        # A local directory reaches here as an absolute path (sidecar.cli resolves it); a Hugging Face id never does,
        # and what fails with one is its fetch (not in the cache, the hub unreachable or offline, no access).
        if not os.path.isabs(reg.model_path):
            raise RegistrationRefused(
                f"--model-path {reg.model_path!r} is not a local directory, and Dynamo could not fetch it as a "
                f"Hugging Face model ({text}); check HF_HOME, HF_TOKEN and HF_HUB_OFFLINE, or give a directory"
            ) from None
        raise


async def unregister_lora(endpoint: Endpoint, lora_name: str) -> None:
    await dynamo.llm.unregister_model(endpoint, lora_name=lora_name)


def lora_id(lora_name: str) -> int:
    """Dynamo's deterministic adapter id for a name (blake3-derived): the same on every worker and every restart."""
    return int(dynamo.llm.lora_name_to_id(lora_name))


async def fetch_lora(uri: str, cache_dir: str) -> str:
    """Download a LoRA adapter (``s3://``, ``hf://``, …) into ``cache_dir`` unless it is there already; its local path.

    Dynamo's own downloader (the one its vLLM and SGLang workers use): retries, cache validation and credentials
    (``AWS_*``, ``HF_TOKEN``) are its business.
    """
    return str(await dynamo.llm.LoRADownloader(cache_dir).download_if_needed(uri))


async def add_engine_route(
    runtime: DistributedRuntime, name: str, callback: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
) -> None:
    """``/engine/<name>`` on the worker's system port (``DYN_SYSTEM_PORT``): the JSON body in, a JSON object out. The
    callback runs on the edge loop (observed: the loop the runtime was created on)."""
    runtime.register_engine_route(name, callback)


async def serve_control_endpoint(
    endpoint: Endpoint, handler: Callable[[dict[str, Any], Context], AsyncIterator[dict[str, Any]]]
) -> None:
    """Serve a control endpoint (``namespace.component.load_lora`` …, built by ``create_runtime``) the way Dynamo's
    Python workers do, until the runtime shuts down."""
    await endpoint.serve_endpoint(handler, graceful_shutdown=True)


async def unregister(endpoint: Endpoint) -> None:
    await dynamo.llm.unregister_model(endpoint)


async def withdraw(endpoint: Endpoint) -> None:
    await endpoint.unregister_endpoint_instance()


async def restore(endpoint: Endpoint) -> None:
    await endpoint.register_endpoint_instance()


async def restore_endpoint(runtime: DistributedRuntime, path: str) -> None:
    """Write the discovery instance of our endpoint ``path`` (``ns.component.name``) again: the same entry its
    ``serve_endpoint`` (or a KV publisher's recovery endpoint) wrote, as the runtime still serves it.

    File discovery only: it builds an ``Endpoint`` while the runtime serves, which deadlocks with etcd and NATS (see
    ``create_runtime``) and needs no I/O with files."""
    await runtime.endpoint(path).register_endpoint_instance()


async def serve_endpoint(
    endpoint: Endpoint,
    handler: Callable[[dict[str, Any], Context], AsyncIterator[dict[str, Any]]],
    health_check_payload: dict[str, Any] | None,
) -> None:
    """Serve until the runtime shuts down (graceful: in-flight requests finish first)."""
    await endpoint.serve_endpoint(handler, graceful_shutdown=True, health_check_payload=health_check_payload)


async def shutdown(runtime: DistributedRuntime) -> None:
    runtime.shutdown()


def set_health(runtime: DistributedRuntime, ready: bool) -> None:
    runtime.set_health_status(ready)


async def system_server_url(runtime: DistributedRuntime) -> str | None:
    """``http://host:port`` of the runtime's system server (the port it bound, an OS-picked one for
    ``DYN_SYSTEM_PORT=0``), ``None`` when it started none. In Dynamo 1.6.1's binding, not in its ``_core.pyi``."""
    url = runtime.system_status_server_url()  # type: ignore[attr-defined]
    return str(url) if url else None


async def export_metrics(endpoint: Endpoint, exposition: Callable[[], str], typed: Callable[[], list[Any]]) -> None:
    """Add our metrics to the system port: ``exposition`` is appended to ``/metrics`` at every scrape (called on a
    runtime thread, with the GIL), ``typed`` feeds Dynamo's OTLP export (``dynamo/prometheus_metrics.pyi``)."""
    endpoint.metrics.register_prometheus_expfmt_callback(exposition)
    endpoint.metrics.register_prometheus_typed_callback(typed)


async def instance_ids(endpoint: Endpoint, clients: dict[str, Any]) -> list[int]:
    """The instance ids discovery currently lists for our endpoint (a watching client, created once)."""
    client = clients.get("client")
    if client is None:
        client = clients["client"] = await endpoint.client()
    return [int(i) for i in client.instance_ids()]


def dynamo_exception(error: BaseException) -> Exception:
    """The ``dynamo.llm.exceptions`` instance a failure becomes when raised from the Dynamo handler.

    A :class:`SidecarError` becomes the class its ``kind`` names, carrying its message (only ``InvalidArgument``'s
    reaches the client). Anything else becomes ``Unknown`` (500): a stray ``TimeoutError`` or ``ConnectionError``
    raised as is would be migrated by the frontend (504/503), ``ValueError`` would read as a 400.
    """
    if isinstance(error, SidecarError):
        cls: type[Exception] = getattr(dynamo.llm.exceptions, error.kind.value, dynamo.llm.exceptions.Unknown)
        return cls(error.message)
    return dynamo.llm.exceptions.Unknown(f"{type(error).__name__}: {error}")
