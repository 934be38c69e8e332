"""``open_dynamo`` and :class:`DynamoWorker`: the trio-facing face of one Dynamo runtime and endpoint."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import quote

import trio

from . import _bindings as b
from ._handler import make_handler

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from sidecar.edge import Edge

    from ._types import DynamoSettings, Registration, RequestHandler

__all__ = ["CLOSE_TIMEOUT", "SERVE_READY_TIMEOUT", "DynamoWorker", "file_discovery_keys", "open_dynamo"]

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
    name = quote(f"{settings.namespace}/{settings.component}/{settings.endpoint}/{instance_id:x}", safe="")
    v1 = (root or file_discovery_root()) / "v1"
    return v1 / "instances" / name, v1 / "mdc" / name


async def _poll_until(condition: Callable[[], Awaitable[bool]]) -> None:
    """Poll a condition that lives outside this process (discovery state): no event can announce it."""
    while True:
        if await condition():
            return
        await trio.sleep(_POLL)


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
        self._clients: dict[str, Any] = {}

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

    async def unregister(self) -> None:
        """Remove the model card and withdraw the instance: the model leaves the frontend (404) in ~0.1 s."""
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
        (``dynamo-runtime.md`` §12.2).
        """
        if self._serving and not self._withdrawn:
            await self._edge.run(b.restore, self._endpoint)
        if self._registration is not None:
            await self._edge.run(b.register, self._endpoint, self._registration)

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

        Only while no endpoint is served with a ``health_check_payload``: once one is, Dynamo 1.6.1 derives
        ``/health`` from that endpoint's canary health and ignores this flag (``False`` still answers 200).
        """
        self._edge.loop.call_soon_threadsafe(b.set_health, self._runtime, ready)

    async def registration_present(self) -> bool:
        """Best effort: is everything we publish still in discovery?

        "Everything" = the instance (while serving and not withdrawn) and the model card (while registered). With
        file discovery this reads the files (see :func:`file_discovery_keys`); a file older than the 10 s TTL counts
        as lost. With other backends only the instance is checked, through a discovery-watching client.
        """
        if self._settings.discovery_backend == "file":
            instance, card = file_discovery_keys(self._settings, self._instance_id)
            if self._serving and not self._withdrawn and not await trio.to_thread.run_sync(_fresh, instance):
                return False
            return self._registration is None or await trio.to_thread.run_sync(_fresh, card)
        if self._serving and not self._withdrawn:
            return await self._instance_listed()
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
