"""``open_dynamo`` and :class:`DynamoWorker`: the trio-facing face of one Dynamo runtime and endpoint."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from contextlib import asynccontextmanager, suppress
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import trio

from . import _bindings as b
from ._entries import (
    Buckets,
    Entry,
    RestoreReport,
    dynamo_key,
    fresh,
    instance_key,
    listening_ports,
    read_bucket,
    write_back,
    zmq_port,
)
from ._handler import make_handler

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping

    from sidecar.edge import Edge

    _Control = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]

    from ._types import DynamoSettings, Registration, RequestHandler

__all__ = [
    "CLOSE_TIMEOUT",
    "SERVE_READY_TIMEOUT",
    "DynamoWorker",
    "RestoreReport",
    "file_discovery_keys",
    "lora_card_key",
    "lora_slug",
    "open_dynamo",
    "rl_answer",
]


def _name_of(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


logger: Final = logging.getLogger("sidecar.dynamo")

#: Bound on ``open_dynamo``'s exit: runtime shutdown, serve task end, discovery files gone.
CLOSE_TIMEOUT: Final = 10.0
#: Bound on ``serve()`` waiting for our instance to show up in discovery (observed: ~5 ms with file discovery).
SERVE_READY_TIMEOUT: Final = 30.0
#: Bound on finding the discovery files a publisher or control endpoint wrote (observed: a few ms).
TRACK_TIMEOUT: Final = 5.0
_POLL: Final = 0.01
#: How long a replaced model card's key stays empty before the new card is written under it (see ``register``):
#: every frontend's file watcher must see the removal while the key is absent (observed: within 0.4-3 ms).
CARD_ABSENCE_S: Final = 0.25
#: Publications of a replaced card before the worker gives up confirming it (then the registration watchdog has it).
_CARD_TRIES: Final = 3


def rl_answer(request: object, routes: list[str], system_url: str) -> dict[str, Any]:
    """What the RL discovery endpoint answers (``--enable-rl``), as Dynamo's workers answer it (1.6.1): only
    ``{"method": "routes"}``, with the system port's ``/engine`` routes and its URL."""
    method = request.get("method") if isinstance(request, dict) else None
    if not isinstance(method, str) or not method:
        return {"status": "error", "message": "rl_dispatch: missing 'method' (str)"}
    if method != "routes":
        return {
            "status": "error",
            "method": method,
            "message": "rl request-plane endpoint only supports method='routes'",
        }
    return {"status": "ok", "routes": routes, "system_url": system_url}


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
    name = dynamo_key(f"{settings.namespace}/{settings.component}/{settings.endpoint}/{instance_id:x}")
    v1 = (root or file_discovery_root()) / "v1"
    return v1 / "instances" / name, v1 / "mdc" / name


def lora_card_key(base_card: Path, lora_name: str) -> Path:
    """A LoRA card's file next to the base card's: ``<base key>%2F<slug>``, the slug being Dynamo's (lower case,
    every character but ASCII letters, digits, ``-`` and ``_`` as ``_``; observed with 1.6.1)."""
    return base_card.with_name(base_card.name + dynamo_key("/" + lora_slug(lora_name)))


def lora_slug(lora_name: str) -> str:
    """Dynamo's slug of a LoRA name (its card key): two names with one slug would overwrite each other's card."""
    return "".join(c if (c.isascii() and c.isalnum()) or c in "-_" else "_" for c in lora_name.lower())


def _card_changes(old: Registration, new: Registration) -> str:
    """What differs between two model cards, for one log line: ``context_length 2048 -> 1024, …``."""
    changes = [
        f"{name} {getattr(old, name)!r} -> {getattr(new, name)!r}"
        for name in (f.name for f in fields(new))
        if getattr(old, name) != getattr(new, name)
    ]
    return ", ".join(changes) or "nothing"


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


class DynamoWorker:
    """One Dynamo runtime with one endpoint. Every method is called from trio; every Dynamo call runs on the edge.

    Lifecycle: ``register`` (model card) and ``serve`` (endpoint instance) in either order; ``withdraw``/``restore``
    take the instance out of routing and back (degraded ↔ serving); ``shutdown`` drains; leaving ``open_dynamo``
    shuts down whatever is left, bounded by :data:`CLOSE_TIMEOUT`.
    """

    def __init__(
        self,
        edge: Edge,
        settings: DynamoSettings,
        runtime: b.DistributedRuntime,
        endpoint: b.Endpoint,
        iid: int,
        controls: Mapping[str, b.Endpoint] | None = None,
    ):
        self._edge: Final = edge
        self._settings: Final = settings
        self._runtime: Final = runtime
        self._endpoint: Final = endpoint
        # Built with the runtime (``open_dynamo(controls=...)``): building one later can deadlock (b.create_runtime).
        self._controls: Final[Mapping[str, b.Endpoint]] = dict(controls or {})
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
        # File discovery: the other files we published (KV event and load channels, event sources, instances of
        # other endpoints), by path; each restored as its Entry says until its owner untracks it.
        self._root: Path | None = file_discovery_root() if settings.discovery_backend == "file" else None
        self._tracked: dict[Path, Entry] = {}
        self._buckets = Buckets()
        # The /engine routes registered on the system server, for the RL discovery endpoint's answer.
        self._engine_routes: set[str] = set()

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
        """Publish the model card. Idempotent for the same card; a changed card replaces the old one whole.

        Dynamo 1.6.1 refuses to rewrite a published card in place ("model update can only change
        runtime_config.taints": only its taints may change), so a card that differs (an engine restarted with other
        limits or capabilities) is removed first, LoRA cards with it, and published again: the frontend drops the
        model and adds it back with the new card, as it would for a fresh worker. Once the old card is gone the new
        one is what this worker publishes, even when writing it fails: the registration watchdog writes it then.

        The key stays empty for :data:`CARD_ABSENCE_S` in between. Dynamo's file store reads a removal when its
        watcher gets to it and drops it when the key exists again by then ("Suppressing stale FileStore remove event
        for a recreated key"); the new card then reached the frontend as a change of the old one, which it refused
        ("Rejecting immutable discovery model-card mutation"), keeping the old card until the next removal -- 3 of 53
        restarts against TensorRT-LLM's server, when the card was written back a millisecond after its removal. With
        file discovery the card is then read back from the store and published again until it is the new one.
        """
        old = self._registration
        if old is None or old == reg:
            await self._edge.run(b.register, self._endpoint, reg)
            self._registration = reg
        else:
            logger.info(
                "dynamo: the model card changed (%s): publishing it again in place of the old one",
                _card_changes(old, reg),
            )
            self._registration = reg
            for attempt in range(1, _CARD_TRIES + 1):
                await self._replace_card()
                found = await self._card_on_file(reg)
                if found is None:
                    break
                logger.warning(
                    "dynamo: the store holds another model card than the one just published (%s; attempt %d of %d)",
                    found,
                    attempt,
                    _CARD_TRIES,
                )
            else:
                raise RuntimeError(f"the model card on file is not the one published ({found})")
        await self._hold()

    async def _replace_card(self) -> None:
        """Remove the base card (LoRA cards first), keep its key empty, publish the current one (LoRA cards after)."""
        reg = self._registration
        assert reg is not None
        for lora_name in sorted(self._loras):
            await self._edge.run(b.unregister_lora, self._endpoint, lora_name)
        await self._edge.run(b.unregister, self._endpoint)
        await trio.sleep(CARD_ABSENCE_S)
        await self._edge.run(b.register, self._endpoint, reg)
        for lora_name in sorted(self._loras):
            await self._edge.run(b.register, self._endpoint, reg, lora_name)

    async def _card_on_file(self, reg: Registration) -> str | None:
        """File discovery: what differs between the card the store holds and ``reg`` (None: nothing, or nothing to
        read: other backends are not read back)."""
        if self._root is None:
            return None
        _, path = file_discovery_keys(self._settings, self._instance_id, self._root)
        try:
            stored = await trio.to_thread.run_sync(path.read_bytes)
            card = json.loads(stored).get("card_json") or {}
        except (OSError, ValueError) as exc:
            return f"unreadable: {exc}"
        runtime = card.get("runtime_config") or {}
        expected = {
            "context_length": reg.context_length,
            "max_num_seqs": reg.max_num_seqs,
            "max_num_batched_tokens": reg.max_num_batched_tokens,
            "total_kv_blocks": reg.total_kv_blocks,
        }
        wrong = [
            f"{name} {runtime.get(name)!r}, not {value!r}"
            for name, value in expected.items()
            if value is not None and runtime.get(name) != value
        ]
        return ", ".join(wrong) or None

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
        ``{"status": "error", "message": …}`` rather than dropped, so a caller always gets an answer. Every name must
        have been given to :func:`open_dynamo` (``controls``); :class:`ValueError` names the ones that were not.
        """
        edge = self._edge
        unprepared = sorted(set(routes) - set(self._controls))
        if unprepared:
            raise ValueError(f"control endpoints {unprepared} were not given to open_dynamo(controls=...)")

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
            self._engine_routes.add(name)
            nursery.start_soon(self._serve_control, name, call)
            nursery.start_soon(self.track_endpoint, name)

    async def serve_rl(self, nursery: trio.Nursery, name: str, system_url: str) -> None:
        """Dynamo's RL discovery endpoint ``<namespace>.<component>.<name>`` (``--enable-rl``): it answers
        :func:`rl_answer` with the routes registered so far (on the edge loop: nothing to decide, nothing to wait
        for). ``name`` must have been given to :func:`open_dynamo` (``controls``)."""
        if name not in self._controls:
            raise ValueError(f"control endpoint {name!r} was not given to open_dynamo(controls=...)")
        routes = self._engine_routes

        async def describe(request: dict[str, Any]) -> dict[str, Any]:
            return rl_answer(request, sorted(routes), system_url)

        nursery.start_soon(self._serve_control, name, describe)
        nursery.start_soon(self.track_endpoint, name)

    async def _serve_control(self, name: str, call: _Control) -> None:
        # Dynamo passes the request context only to a parameter *named* ``context``; any other name gets a TypeError.
        async def handler(request: dict[str, Any], context: b.Context) -> AsyncIterator[dict[str, Any]]:
            del context
            yield await call(request if isinstance(request, dict) else {})

        try:
            await self._edge.run(b.serve_control_endpoint, self._controls[name], handler)
        except Exception as exc:
            # A control endpoint is a convenience next to the system port's route: its loss must not end the worker.
            logger.warning("dynamo: control endpoint %s stopped: %s", name, exc)

    async def unregister(self) -> None:
        """Remove the model cards (LoRA cards first) and withdraw the instance (unless it is withdrawn already): the
        models leave the frontend (404) in ~0.1 s."""
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
        """Take the instance out of discovery: no new requests are routed here; in-flight requests go on.

        Once per withdrawal: an instance already withdrawn is left alone (Dynamo would log an ERROR for a key that
        is gone, and the second call would fail).
        """
        if self._withdrawn:
            return
        started = trio.current_time()
        await self._edge.run(b.withdraw, self._endpoint)
        self._withdrawn = True
        # Dynamo's own line for this is held down with its endpoint teardown's noise (sidecar.ops.logs.DYNAMO_QUIET).
        logger.info(
            "dynamo: instance %x out of discovery (%.0f ms): routers stop sending requests here as their view updates",
            self._instance_id,
            (trio.current_time() - started) * 1000,
        )

    async def restore(self) -> None:
        """Put the instance back into discovery after :meth:`withdraw` (or after its file was lost)."""
        await self._edge.run(b.restore, self._endpoint)
        if self._withdrawn:
            logger.info("dynamo: instance %x back in discovery", self._instance_id)
        self._withdrawn = False

    async def republish(self, *, restore_instance: bool = False) -> RestoreReport:
        """Put back whatever we published that discovery lost; what was lost, restored and not (with why).

        The recovery for a lost registration: file discovery never re-creates an expired or deleted file by itself
        (ai-dynamo-runtime 1.6.1). With file discovery every entry is checked (see :mod:`._entries` for how each
        comes back), bucket directories deleted with it are created again first, and each entry is restored on its
        own: one failure does not stop the others. ``restore_instance`` also puts back a withdrawn instance (the
        watchdog withdraws it while something cannot be restored, and ends that by restoring everything).

        Other backends: the instance and the cards are published again. While the control plane is unreachable
        (etcd down) the writes fail and are reported; the next check tries again. With etcd, a write refused while
        etcd answers means our lease is gone (etcd restarted without its data): that raises
        :class:`ControlPlaneLost` at once instead of waiting for Dynamo's keep-alive to give up (~20 s).
        """
        if self._lost:
            raise b.ControlPlaneLost("control plane lost: the Dynamo runtime shut itself down")
        started = trio.current_time()
        report = RestoreReport()
        if self._root is not None:
            report.lost = await self.missing_entries(include_instance=restore_instance)
            unmade: dict[Path, str] = {}
            if report.lost:
                buckets = [entry.path.parent for entry in report.lost]
                report.recreated, unmade = await trio.to_thread.run_sync(self._buckets.ensure, self._root, buckets)
            for entry in report.lost:
                if entry.path.parent in unmade:
                    report.failed.append((entry, unmade[entry.path.parent]))
                    continue
                try:
                    await self._restore(entry)
                except Exception as exc:
                    report.failed.append((entry, " ".join(str(exc).split()) or type(exc).__name__))
                    continue
                # Dynamo reports success when something else already holds the key (a create-if-absent write).
                if await trio.to_thread.run_sync(fresh, entry.path):
                    report.restored.append(entry)
                else:
                    report.failed.append((entry, "still not there after writing it: is its path taken?"))
        elif restore_instance or not await self.registration_present():
            report.lost = self._api_entries(restore_instance)
            try:
                for entry in report.lost:
                    await self._restore(entry)
                    report.restored.append(entry)
            except Exception as exc:
                where = b.control_plane(self._settings) or f"{self._settings.discovery_backend} discovery"
                if self._settings.discovery_backend == "etcd" and await _etcd_answers():
                    self._lost = True
                    raise b.ControlPlaneLost(
                        f"control plane lost ({where}): etcd answers but refuses our registration, so our lease is "
                        "gone (etcd restarted without its data?); exiting so a supervisor restarts this worker"
                    ) from None
                done = len(report.restored)
                report.failed = [(entry, f"{where}: {exc}") for entry in report.lost[done:]]
        report.seconds = trio.current_time() - started
        return report

    def _api_entries(self, restore_instance: bool) -> list[Entry]:
        """What Dynamo's own calls publish: the instance (unless withdrawn), the base card, the LoRA cards."""
        root = self._root or Path()
        instance, card = file_discovery_keys(self._settings, self._instance_id, root)
        entries: list[Entry] = []
        if self._serving and (restore_instance or not self._withdrawn):
            entries.append(Entry("instance", instance, f"instance {self._settings.endpoint}"))
        if self._registration is not None:
            entries.append(Entry("card", card, f"model card {self._registration.served_model_name!r}"))
            for name in sorted(self._loras):
                entries.append(Entry("lora_card", lora_card_key(card, name), f"LoRA card {name!r}", lora=name))
        return entries

    async def missing_entries(self, *, include_instance: bool = False) -> list[Entry]:
        """File discovery: every entry we published whose file is gone or expired (older than the 10 s TTL)."""
        expected = [*self._api_entries(include_instance), *self._tracked.values()]
        return await trio.to_thread.run_sync(lambda: [entry for entry in expected if not fresh(entry.path)])

    async def _restore(self, entry: Entry) -> None:
        if entry.kind == "instance" and entry.endpoint is None:
            await self._edge.run(b.restore, self._endpoint)
            self._withdrawn = False
        elif entry.kind == "card":
            assert self._registration is not None
            await self._edge.run(b.register, self._endpoint, self._registration)
        elif entry.kind == "lora_card":
            assert self._registration is not None
            await self._edge.run(b.register, self._endpoint, self._registration, entry.lora)
        elif entry.endpoint is not None:
            control = self._controls.get(entry.endpoint.rsplit(".", 1)[-1])
            if control is not None:
                await self._edge.run(b.restore, control)
            else:  # the KV recovery endpoint, built by its publisher; tracked (so restored) with file discovery only
                await self._edge.run(b.restore_endpoint, self._runtime, entry.endpoint)
        else:
            assert entry.data is not None
            await trio.to_thread.run_sync(write_back, entry.path, entry.data)

    # -- what else we published (file discovery) ----------------------------------------------------------------

    def untrack(self, owner: str) -> None:
        """Stop expecting ``owner``'s entries (its publisher is closing: the runtime removes them)."""
        for path in [path for path, entry in self._tracked.items() if entry.owner == owner]:
            del self._tracked[path]

    async def track_kv_publisher(self, rank: int) -> str:
        """Find and remember the files a new ``KvEventPublisher`` of ``rank`` wrote: its event source (which names
        it by worker id and rank), its event channel (keyed by the same publisher id) and its recovery target's
        instance. Returns the owner tag for :meth:`untrack`. A no-op except with file discovery."""
        owner = f"kv-events rank {rank}"
        root = self._root
        if root is None:
            return owner
        iid = self._instance_id
        tracked = set(self._tracked)

        def find() -> list[Entry] | None:
            for path, (data, source) in read_bucket(root / "v1" / "event_sources").items():
                metadata = source.get("metadata") or {}
                worker = metadata.get("worker") or {}
                if path in tracked or worker.get("worker_id") != iid or worker.get("dp_rank", 0) != rank:
                    continue
                entries = [Entry("event_source", path, f"KV event source (rank {rank})", owner, data=data)]
                for channel, (channel_data, value) in read_bucket(root / "v1" / "event_channels").items():
                    if value.get("topic") == "kv-events" and value.get("instance_id") == source.get("publisher_id"):
                        what = f"KV event channel (rank {rank})"
                        entries.append(Entry("event_channel", channel, what, owner, data=channel_data))
                target = metadata.get("recovery_target") or {}
                ns, component, name = target.get("namespace"), target.get("component"), target.get("endpoint")
                if isinstance(ns, str) and isinstance(component, str) and isinstance(name, str):
                    key = instance_key(root, ns, component, name, iid)
                    if key.exists():
                        what = f"KV recovery endpoint (rank {rank})"
                        entries.append(Entry("instance", key, what, owner, endpoint=f"{ns}.{component}.{name}"))
                # All three are written while the publisher starts; until then, look again.
                return entries if len(entries) == 3 else None
            return None

        entries = await self._find(find)
        if entries is None:
            logger.warning(
                "dynamo: the discovery files of rank %d's KV event publisher were not found: their loss "
                "would go unnoticed",
                rank,
            )
        else:
            await self._track(entries)
        return owner

    async def kv_metrics_channels(self) -> set[Path]:
        """The load (``kv_metrics``) event channels of our endpoint now: what :meth:`track_load_publisher` compares."""
        root = self._root
        if root is None:
            return set()
        return await trio.to_thread.run_sync(lambda: set(self._load_channels(root)))

    async def track_load_publisher(self, before: set[Path]) -> str:
        """Remember the ``kv_metrics`` channel ``WorkerMetricsPublisher.create_endpoint`` wrote. It carries no id of
        ours: it is the one that appeared during the call, and the one whose ZMQ port this process listens on."""
        owner = "load"
        root = self._root
        if root is None:
            return owner
        skip = before | set(self._tracked)

        def find() -> list[Entry] | None:
            ports = listening_ports()
            new = [
                (path, data)
                for path, (data, value) in self._load_channels(root).items()
                if path not in skip and (ports is None or zmq_port(value) in (*ports, None))
            ]
            if len(new) != 1:
                return None
            [(path, data)] = new
            return [Entry("event_channel", path, "load (kv_metrics) channel", owner, data=data)]

        entries = await self._find(find)
        if entries is None:
            logger.warning("dynamo: our load (kv_metrics) channel was not found for sure: its loss would go unnoticed")
        else:
            await self._track(entries)
        return owner

    async def track_endpoint(self, name: str) -> None:
        """Remember the instance of our endpoint ``name`` (a control endpoint) once ``serve_endpoint`` wrote it."""
        root = self._root
        if root is None:
            return
        ns, component = self._settings.namespace, self._settings.component
        key = instance_key(root, ns, component, name, self._instance_id)

        def find() -> list[Entry] | None:
            if not key.exists():
                return None
            return [Entry("instance", key, f"instance {name}", f"endpoint {name}", endpoint=f"{ns}.{component}.{name}")]

        entries = await self._find(find)
        if entries is None:
            logger.warning("dynamo: the instance of endpoint %s did not appear: its loss would go unnoticed", name)
        else:
            await self._track(entries)

    def _load_channels(self, root: Path) -> dict[Path, tuple[bytes, dict[str, Any]]]:
        scope = {
            "namespace": self._settings.namespace,
            "component": self._settings.component,
            "name": self._settings.endpoint,
        }
        return {
            path: (data, value)
            for path, (data, value) in read_bucket(root / "v1" / "event_channels").items()
            if value.get("topic") == "kv_metrics" and (value.get("scope") or {}).get("endpoint") == scope
        }

    async def _find(self, find: Callable[[], list[Entry] | None]) -> list[Entry] | None:
        with trio.move_on_after(TRACK_TIMEOUT):
            while True:
                entries = await trio.to_thread.run_sync(find)
                if entries is not None:
                    return entries
                await trio.sleep(_POLL)
        return None

    async def _track(self, entries: list[Entry]) -> None:
        for entry in entries:
            self._tracked[entry.path] = entry
        await self._hold()
        logger.info(
            "dynamo: watching our discovery entries of %s: %s", entries[0].owner, RestoreReport.describe(entries)
        )

    async def _hold(self) -> None:
        """Hold the bucket directories of what we publish now, to tell later whether they were deleted."""
        if self._root is not None:
            buckets = {entry.path.parent for entry in [*self._api_entries(False), *self._tracked.values()]}
            await trio.to_thread.run_sync(self._buckets.hold, buckets)

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
        await self._hold()
        # The id names every discovery entry of this worker: an operator finds them (and a test picks them) by it.
        logger.info("dynamo: serving %s as instance %x", self._settings.endpoint_path, self._instance_id)

    async def _serve(
        self,
        nursery: trio.Nursery,
        handler: RequestHandler,
        payload: dict[str, Any] | None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        generate, egress = make_handler(self._edge, nursery, handler, push=self._settings.egress == "push")
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
            egress.close()
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

    async def system_server_port(self) -> int | None:
        """The port Dynamo's own system server bound (one the OS picked for ``DYN_SYSTEM_PORT=0``); ``None``: none."""
        url = await self._edge.run(b.system_server_url, self._runtime)
        return urlsplit(url).port if url else None

    async def add_system_route(self, name: str, route: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
        """``GET``/``POST /engine/<name>`` on the system port: ``route(body)`` (an asyncio coroutine function, run on
        the edge loop -- it must not block) answers with a JSON object, 200."""
        await self._edge.run(b.add_engine_route, self._runtime, name, route)
        self._engine_routes.add(name)

    async def registration_present(self) -> bool:
        """Best effort: is everything we publish still in discovery?

        File discovery: every entry (:meth:`missing_entries`): the instance (while serving and not withdrawn), the
        model cards (while registered), and the other files we wrote (KV event and load channels, event sources,
        instances of our other endpoints). A file older than the 10 s TTL counts as lost.

        Other backends: only the instance is checked, through a discovery-watching client. etcd: our keys live on
        the runtime's lease, so they go only when the lease goes (and then the runtime shuts itself down:
        :class:`ControlPlaneLost`, raised here too) or when someone deletes them (republish helps). While etcd is
        unreachable the watching client keeps its last view, so an outage alone never looks like a lost
        registration; a view that cannot be read counts as present (nothing to republish into).
        """
        if self._lost:
            raise b.ControlPlaneLost("control plane lost: the Dynamo runtime shut itself down")
        if self._root is not None:
            return not await self.missing_entries()
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
        self._buckets.close()
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
async def open_dynamo(
    edge: Edge, settings: DynamoSettings, *, controls: Collection[str] = ()
) -> AsyncIterator[DynamoWorker]:
    """Create the ``DistributedRuntime`` on the edge loop; shut it down on exit (bounded by :data:`CLOSE_TIMEOUT`).

    ``controls``: the names :meth:`DynamoWorker.serve_controls` will serve; their endpoints are built now, with the
    runtime, because building one once the runtime calls into Python can deadlock (``b.create_runtime``).
    """
    runtime, endpoint, iid, built = await edge.run(b.create_runtime, settings, tuple(controls))
    worker = DynamoWorker(edge, settings, runtime, endpoint, iid, built)
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
