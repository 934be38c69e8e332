"""``open_dynamo`` and :class:`DynamoWorker`: the trio-facing face of one Dynamo runtime and endpoint."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import trio

from . import _bindings as b
from ._handler import make_handler

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

    from sidecar.edge import Edge

    _Control = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]

    from ._types import DynamoSettings, Registration, RequestHandler

__all__ = [
    "CLOSE_TIMEOUT",
    "SERVE_READY_TIMEOUT",
    "DynamoWorker",
    "file_discovery_keys",
    "lora_card_key",
    "lora_slug",
    "open_dynamo",
]


def _name_of(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


logger: Final = logging.getLogger("sidecar.dynamo")

#: Bound on ``open_dynamo``'s exit: runtime shutdown, serve task end, discovery files gone.
CLOSE_TIMEOUT: Final = 10.0
#: Bound on ``serve()`` waiting for our instance to show up in discovery (observed: ~5 ms with file discovery).
SERVE_READY_TIMEOUT: Final = 30.0
#: File discovery's hard-coded lease (``lib/runtime/src/storage/kv/file.rs``): files older than this are expired.
FILE_TTL: Final = 10.0
_POLL: Final = 0.01


def file_discovery_root() -> Path:
    """The file-discovery store: ``$DYN_FILE_KV``, else ``$TMPDIR/dynamo_store_kv`` (Dynamo's default)."""
    root = os.environ.get("DYN_FILE_KV")
    return Path(root) if root else Path(tempfile.gettempdir()) / "dynamo_store_kv"


def file_discovery_keys(settings: DynamoSettings, instance_id: int, root: Path | None = None) -> tuple[Path, Path]:
    """Our two files in the file-discovery store (layout observed with ai-dynamo-runtime 1.6.1)::

        $DYN_FILE_KV/v1/instances/<ns>%2F<component>%2F<endpoint>%2F<instance id, lower hex>   written by serve_endpoint
        $DYN_FILE_KV/v1/mdc/<ns>%2F<component>%2F<endpoint>%2F<instance id, lower hex>         written by register_model

    The instance file is JSON (``instance_id``, ``transport.tcp`` = ``host:port/<hex id>/<ns>/<component>/<endpoint>``);
    the mdc file holds the model card. Each is refreshed (mtime) every 3.3 s, expires after 10 s, and is removed on
    a clean shutdown, on ``unregister_endpoint_instance`` / ``unregister_model`` respectively.
    """
    name = _dynamo_key(f"{settings.namespace}/{settings.component}/{settings.endpoint}/{instance_id:x}")
    v1 = (root or file_discovery_root()) / "v1"
    return v1 / "instances" / name, v1 / "mdc" / name


def lora_card_key(base_card: Path, lora_name: str) -> Path:
    """A LoRA card's file next to the base card's: ``<base key>%2F<slug>``, the slug being Dynamo's (lower case,
    every character but ASCII letters, digits, ``-`` and ``_`` as ``_``; observed with 1.6.1)."""
    return base_card.with_name(base_card.name + _dynamo_key("/" + lora_slug(lora_name)))


def lora_slug(lora_name: str) -> str:
    """Dynamo's slug of a LoRA name (its card key): two names with one slug would overwrite each other's card."""
    return "".join(c if (c.isascii() and c.isalnum()) or c in "-_" else "_" for c in lora_name.lower())


def _dynamo_key(text: str) -> str:
    """Dynamo's file-store key encoding: every byte but ASCII letters and digits as ``%XX`` (``-`` is ``%2D``,
    ``_`` is ``%5F``; ``urllib.parse.quote`` would leave those two alone and miss the file)."""
    return "".join(chr(b) if chr(b).isascii() and chr(b).isalnum() else f"%{b:02X}" for b in text.encode())


async def _poll_until(condition: Callable[[], Awaitable[bool]]) -> None:
    """Poll a condition that lives outside this process (discovery state): no event can announce it."""
    while True:
        if await condition():
            return
        await trio.sleep(_POLL)


#: Bound on one TCP probe of an etcd endpoint.
_ETCD_PROBE_TIMEOUT: Final = 2.0


async def _etcd_answers() -> bool:
    """Does any of ``ETCD_ENDPOINTS`` (Dynamo's default: localhost:2379) accept a TCP connection right now?"""
    for url in (os.environ.get("ETCD_ENDPOINTS") or "http://localhost:2379").split(","):
        parsed = urlsplit(url.strip() if "://" in url else f"http://{url.strip()}")
        if not parsed.hostname:
            continue
        with trio.move_on_after(_ETCD_PROBE_TIMEOUT):
            try:
                stream = await trio.open_tcp_stream(parsed.hostname, parsed.port or 2379)
            except OSError:
                continue
            await stream.aclose()
            return True
    return False


def _fresh(path: Path) -> bool:
    try:
        return time.time() - path.stat().st_mtime < FILE_TTL
    except FileNotFoundError:
        return False


class DynamoWorker:
    """One Dynamo runtime with one endpoint. Every method is called from trio; every Dynamo call runs on the edge.

    Lifecycle: ``register`` (model card) and ``serve`` (endpoint instance) in either order; ``withdraw``/``restore``
    take the instance out of routing and back (degraded ↔ serving); ``shutdown`` drains; leaving ``open_dynamo``
    shuts down whatever is left, bounded by :data:`CLOSE_TIMEOUT`.
    """

    def __init__(
        self, edge: Edge, settings: DynamoSettings, runtime: b.DistributedRuntime, endpoint: b.Endpoint, iid: int
    ):
        self._edge: Final = edge
        self._settings: Final = settings
        self._runtime: Final = runtime
        self._endpoint: Final = endpoint
        self._instance_id: Final = iid
        self._registration: Registration | None = None
        self._withdrawn = False
        self._serving = False
        self._served = trio.Event()
        self._shutdown_sent = False
        self._lost = False
        self._clients: dict[str, Any] = {}
        # LoRA cards published next to the base card (names), re-published and removed with it.
        self._loras: set[str] = set()

    @property
    def settings(self) -> DynamoSettings:
        return self._settings

    @property
    def instance_id(self) -> int:
        """Our instance id in discovery (``Endpoint.connection_id()``)."""
        return self._instance_id

    @property
    def registration(self) -> Registration | None:
        """The registration last published (``None`` before ``register`` and after ``unregister``)."""
        return self._registration

    async def register(self, reg: Registration) -> None:
        """Publish the model card. Idempotent: registering again (same or changed card) rewrites it in place."""
        await self._edge.run(b.register, self._endpoint, reg)
        self._registration = reg

    async def register_lora(self, lora_name: str) -> None:
        """Publish a LoRA model card for ``lora_name`` on top of the base card (which must be registered)."""
        if self._registration is None:
            raise RuntimeError("the base model is not registered (draining or withdrawn)")
        await self._edge.run(b.register, self._endpoint, self._registration, lora_name)
        self._loras.add(lora_name)

    async def unregister_lora(self, lora_name: str) -> None:
        """Remove ``lora_name``'s card: the frontend answers 404 for it within ~0.1 s."""
        await self._edge.run(b.unregister_lora, self._endpoint, lora_name)
        self._loras.discard(lora_name)

    @property
    def lora_cards(self) -> frozenset[str]:
        """The LoRA cards currently published."""
        return frozenset(self._loras)

    @staticmethod
    def lora_id(lora_name: str) -> int:
        """Dynamo's deterministic adapter id for ``lora_name`` (``lora_name_to_id``)."""
        return b.lora_id(lora_name)

    async def fetch_lora(self, uri: str, cache_dir: Path) -> Path:
        """Download an adapter from a remote URI into ``cache_dir`` with Dynamo's downloader; its local directory."""
        return Path(await self._edge.run(b.fetch_lora, uri, str(cache_dir)))

    async def serve_controls(
        self, nursery: trio.Nursery, routes: Mapping[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]]
    ) -> None:
        """Serve each ``route(body) -> answer`` (a trio coroutine function) both ways Dynamo workers expose controls:
        as the endpoint ``<namespace>.<component>.<name>`` (what Dynamo's Python backends serve ``load_lora`` on) and
        as ``POST /engine/<name>`` on the system port (``DYN_SYSTEM_PORT``) for operators with curl.

        Each call runs as a trio task in ``nursery``; an exception escaping ``route`` is answered as
        ``{"status": "error", "message": …}`` rather than dropped, so a caller always gets an answer.
        """
        edge = self._edge

        def bridged(route: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> _Control:
            async def call(body: dict[str, Any]) -> dict[str, Any]:
                try:
                    return await edge.trio_call(nursery, route, dict(body or {}))
                except Exception as exc:
                    logger.exception("control %s failed", _name_of(route))
                    return {"status": "error", "code": "internal", "message": f"{type(exc).__name__}: {exc}"}

            return call

        for name, route in routes.items():
            call = bridged(route)
            await edge.run(b.add_engine_route, self._runtime, name, call)
            path = f"{self._settings.namespace}.{self._settings.component}.{name}"
            nursery.start_soon(self._serve_control, path, call)

    async def _serve_control(self, path: str, call: _Control) -> None:
        # Dynamo passes the request context only to a parameter *named* ``context``; any other name gets a TypeError.
        async def handler(request: dict[str, Any], context: b.Context) -> AsyncIterator[dict[str, Any]]:
            del context
            yield await call(request if isinstance(request, dict) else {})

        try:
            await self._edge.run(b.serve_control_endpoint, self._runtime, path, handler)
        except Exception as exc:
            # A control endpoint is a convenience next to the system port's route: its loss must not end the worker.
            logger.warning("dynamo: control endpoint %s stopped: %s", path, exc)

    async def unregister(self) -> None:
        """Remove the model cards (LoRA cards first) and withdraw the instance: the models leave the frontend (404)
        in ~0.1 s."""
        for lora_name in sorted(self._loras):
            try:
                await self.unregister_lora(lora_name)
            except Exception as exc:
                # The runtime's own teardown removes the card later; the base card must go now regardless.
                logger.warning("dynamo: removing the LoRA card %r failed: %s", lora_name, exc)
        await self._edge.run(b.unregister, self._endpoint)
        self._registration = None
        await self.withdraw()

    async def withdraw(self) -> None:
        """Take the instance out of discovery: no new requests are routed here; in-flight requests go on."""
        await self._edge.run(b.withdraw, self._endpoint)
        self._withdrawn = True

    async def restore(self) -> None:
        """Put the instance back into discovery after :meth:`withdraw` (or after its file was lost)."""
        await self._edge.run(b.restore, self._endpoint)
        self._withdrawn = False

    async def republish(self) -> None:
        """Re-publish what should be in discovery (instance unless withdrawn, card if registered).

        The recovery for a lost registration: file discovery never re-creates an expired or deleted file by itself
        (``dynamo-runtime.md`` §12.2). While the control plane is unreachable (etcd down) the writes fail, which is
        logged; the next check tries again. With etcd, a write refused while etcd answers means our lease is gone
        (etcd restarted without its data): that raises :class:`ControlPlaneLost` at once instead of waiting for
        Dynamo's keep-alive to give up (~20 s).
        """
        try:
            if self._serving and not self._withdrawn:
                await self._edge.run(b.restore, self._endpoint)
            if self._registration is not None:
                await self._edge.run(b.register, self._endpoint, self._registration)
                for lora_name in sorted(self._loras):
                    await self._edge.run(b.register, self._endpoint, self._registration, lora_name)
        except Exception as exc:
            where = b.control_plane(self._settings) or f"{self._settings.discovery_backend} discovery"
            if self._settings.discovery_backend == "etcd" and await _etcd_answers():
                self._lost = True
                raise b.ControlPlaneLost(
                    f"control plane lost ({where}): etcd answers but refuses our registration, so our lease is gone "
                    "(etcd restarted without its data?); exiting so a supervisor restarts this worker"
                ) from None
            logger.warning("dynamo: re-publishing our registration failed (%s): %s; retrying later", where, exc)

    async def serve(
        self, nursery: trio.Nursery, handler: RequestHandler, *, health_check_payload: dict[str, Any] | None = None
    ) -> None:
        """Start serving requests with ``handler`` (a trio async generator function) and return once the instance
        is listed in discovery. Requests run as tasks in ``nursery``; so does the serving task, whose failure
        propagates there. It ends when the runtime shuts down (:meth:`shutdown`)."""
        if self._serving:
            raise RuntimeError("already serving")
        self._serving = True
        await nursery.start(self._serve, nursery, handler, health_check_payload)

    async def _serve(
        self,
        nursery: trio.Nursery,
        handler: RequestHandler,
        payload: dict[str, Any] | None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        generate = make_handler(self._edge, nursery, handler)
        try:
            async with trio.open_nursery() as inner:

                async def ready() -> None:
                    with trio.fail_after(SERVE_READY_TIMEOUT):
                        await _poll_until(self._instance_listed)
                    task_status.started()

                inner.start_soon(ready)
                await self._edge.run(b.serve_endpoint, self._endpoint, generate, payload)
                inner.cancel_scope.cancel(reason="serve_endpoint returned")
        finally:
            self._served.set()
        if not self._shutdown_sent:
            # Nobody asked the runtime to stop: it shut itself down, which Dynamo does when its etcd lease cannot be
            # kept (etcd away longer than the lease) or is gone (etcd restarted without its data). The endpoint and
            # lease are dead; only a fresh process can register again.
            self._lost = True
            where = b.control_plane(self._settings) or f"{self._settings.discovery_backend} discovery"
            raise b.ControlPlaneLost(
                f"control plane lost ({where}): the Dynamo runtime shut itself down (etcd lease expired or gone); "
                "exiting so a supervisor restarts this worker"
            )

    async def shutdown(self) -> None:
        """Graceful shutdown: deregister (no new requests), wait for in-flight requests, tear down.

        Returns when ``serve_endpoint`` has returned. Unbounded by design — in-flight requests decide; bound it
        from outside (a drain deadline that cancels the request nursery ends the wait too).
        """
        await self._send_shutdown()
        if self._serving:
            await self._served.wait()

    async def _send_shutdown(self) -> None:
        if not self._shutdown_sent:
            self._shutdown_sent = True
            await self._edge.run(b.shutdown, self._runtime)

    async def export_metrics(self, exposition: Callable[[], str], typed: Callable[[], list[Any]]) -> None:
        """Serve our Prometheus metrics on the worker's system port ``/metrics``, next to Dynamo's own.

        ``exposition`` returns Prometheus text and ``typed`` the families for Dynamo's OTLP export; both are called
        by Dynamo on one of its runtime threads at every scrape, so they must be thread-safe and quick.
        """
        await self._edge.run(b.export_metrics, self._endpoint, exposition, typed)

    def set_health(self, ready: bool) -> None:
        """The worker's own ``/health`` (system port): 200 ``ready`` or 503 ``notready``. Does not affect routing.

        Synchronous and non-blocking (it posts to the edge loop), so a state-machine observer may call it; a no-op
        once the runtime is shutting down. Only while no endpoint is served with a ``health_check_payload`` and
        ``DYN_HEALTH_CHECK_ENABLED`` is off: otherwise Dynamo 1.6.1 derives ``/health`` from its canary and endpoint
        registration and ignores this flag (``False`` still answers 200).
        """
        if self._shutdown_sent:
            return
        with suppress(RuntimeError):  # the edge loop has closed: so has the runtime and its port
            self._edge.loop.call_soon_threadsafe(b.set_health, self._runtime, ready)

    async def add_system_route(self, name: str, route: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
        """``GET``/``POST /engine/<name>`` on the system port: ``route(body)`` (an asyncio coroutine function, run on
        the edge loop -- it must not block) answers with a JSON object, 200."""
        await self._edge.run(b.add_engine_route, self._runtime, name, route)

    async def registration_present(self) -> bool:
        """Best effort: is everything we publish still in discovery?

        "Everything" = the instance (while serving and not withdrawn) and the model card (while registered). With
        file discovery this reads the files (see :func:`file_discovery_keys`); a file older than the 10 s TTL counts
        as lost. With other backends only the instance is checked, through a discovery-watching client.

        etcd: our keys live on the runtime's lease, so they go only when the lease goes (and then the runtime shuts
        itself down: :class:`ControlPlaneLost`, raised here too) or when someone deletes them (republish helps).
        While etcd is unreachable the watching client keeps its last view, so an outage alone never looks like a
        lost registration; a view that cannot be read counts as present (nothing to republish into).
        """
        if self._lost:
            raise b.ControlPlaneLost("control plane lost: the Dynamo runtime shut itself down")
        if self._settings.discovery_backend == "file":
            instance, card = file_discovery_keys(self._settings, self._instance_id)
            if self._serving and not self._withdrawn and not await trio.to_thread.run_sync(_fresh, instance):
                return False
            if self._registration is None:
                return True
            cards = [card, *(lora_card_key(card, name) for name in self._loras)]
            return await trio.to_thread.run_sync(lambda: all(map(_fresh, cards)))
        if self._serving and not self._withdrawn:
            try:
                return await self._instance_listed()
            except Exception as exc:
                logger.warning("dynamo: cannot read discovery (%s): %s", b.control_plane(self._settings), exc)
        return True

    async def _instance_listed(self) -> bool:
        if self._settings.discovery_backend == "file":
            instance, _ = file_discovery_keys(self._settings, self._instance_id)
            return await trio.to_thread.run_sync(instance.exists)
        return self._instance_id in await self._edge.run(b.instance_ids, self._endpoint, self._clients)

    async def _close(self) -> None:
        await self._send_shutdown()
        if self._serving:
            await self._served.wait()
        if self._settings.discovery_backend == "file":
            # Teardown runs on after serve_endpoint has returned (or when it was cancelled and never will): give it
            # a moment to remove our files, or the frontend keeps routing here until the 10 s TTL runs out.
            instance, card = file_discovery_keys(self._settings, self._instance_id)

            async def files_gone() -> bool:
                return not await trio.to_thread.run_sync(lambda: instance.exists() or card.exists())

            with trio.move_on_after(2.0):
                await _poll_until(files_gone)


@asynccontextmanager
async def open_dynamo(edge: Edge, settings: DynamoSettings) -> AsyncIterator[DynamoWorker]:
    """Create the ``DistributedRuntime`` on the edge loop; shut it down on exit (bounded by :data:`CLOSE_TIMEOUT`)."""
    runtime, endpoint, iid = await edge.run(b.create_runtime, settings)
    worker = DynamoWorker(edge, settings, runtime, endpoint, iid)
    try:
        yield worker
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT) as scope:
            try:
                await worker._close()
            except Exception:
                logger.exception("dynamo: runtime shutdown failed")
        if scope.cancelled_caught:
            logger.warning("dynamo: runtime shutdown did not finish within %.0f s", CLOSE_TIMEOUT)
