"""LoRA adapters: the ``load_lora`` / ``unload_lora`` / ``list_loras`` controls and each adapter's lifecycle.

An adapter is served when the engine holds it (``Control.LoadLora``) *and* Dynamo lists a model card for it; the
two halves are changed in one order and undone in reverse when the second fails (``statemachines/lora.py`` has the
table and the reasons). Every operation runs to its end once accepted: it is shielded from the caller going away and
each step has its own deadline, so an adapter is never left half-loaded.

Where adapters come from:

* a local directory — ``{"lora_name": …, "source_path": "/abs/dir"}`` or ``{"source": {"uri": "file:///abs/dir"}}``:
  it must lie inside the configured LoRA root (``--lora-root``) *after* resolving symlinks, contain
  ``adapter_config.json``, and is sent to the engine by its resolved path (Kubernetes: one RWX volume mounted at the
  same path in sidecar and engine);
* a remote URI — ``{"source": {"uri": "s3://…" | "hf://…"}}``: fetched into the LoRA root by Dynamo's own
  downloader (``LoRADownloader``, what its vLLM and SGLang workers use), then checked like a local directory.

Adapter ids are Dynamo's ``lora_name_to_id`` (deterministic), so every worker and every restart gives one name the
same id. The engine is the source of truth for what it holds: at start-up and after an engine restart
:meth:`LoraManager.sync` adopts adapters the engine holds without a card and reloads those it lost.
"""

from __future__ import annotations

import logging
import os
import re
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol
from urllib.parse import unquote, urlsplit

import trio

from sidecar.dynamo import lora_slug
from sidecar.errors import EngineRpcError, GrpcCode, LoraErrorCode, LoraRefused
from sidecar.ops import metrics
from statemachines import LORA, LoraLifecycle

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

    from sidecar.engine import EngineClient
    from statemachines import LoraEvent, LoraState

__all__ = ["CONTROLS", "LoraCards", "LoraManager", "LoraSettings", "observe_lora", "resolve_local_adapter"]

log: Final = logging.getLogger("sidecar.lora")

#: Names become model names in ``/v1/models`` and card keys in discovery: printable, no spaces, bounded.
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")
_REMOTE_SCHEMES: Final = frozenset({"s3", "hf", "gs", "http", "https"})
#: The controls a LoRA-capable worker serves (``LoraManager.routes``), known before Dynamo's runtime is created.
CONTROLS: Final = ("load_lora", "unload_lora", "list_loras")
_BODY_KEYS: Final = {
    "load_lora": frozenset({"lora_name", "source", "source_path"}),
    "unload_lora": frozenset({"lora_name"}),
    "list_loras": frozenset(),
}
#: Bound on each Dynamo card step (a local file write with file discovery, an etcd put otherwise).
_CARD_TIMEOUT_S: Final = 10.0


class LoraCards(Protocol):
    """What the adapter lifecycle needs from Dynamo (``sidecar.dynamo.DynamoWorker`` provides it)."""

    async def register_lora(self, lora_name: str) -> None: ...
    async def unregister_lora(self, lora_name: str) -> None: ...
    def lora_id(self, lora_name: str) -> int: ...
    async def fetch_lora(self, uri: str, cache_dir: Path) -> Path: ...


@dataclass(frozen=True, slots=True)
class LoraSettings:
    root: Path | None
    """Where adapters may come from and remote ones are fetched to; ``None`` refuses every load."""
    load_timeout_s: float = 120.0
    """Bound on ``Control.LoadLora`` / ``UnloadLora`` (an engine reads the adapter's weights)."""
    fetch_timeout_s: float = 600.0
    """Bound on fetching a remote adapter."""
    reserved_names: frozenset[str] = frozenset()
    """The base model's served name and aliases: an adapter may not shadow them."""


@dataclass(slots=True)
class _Adapter:
    life: LoraLifecycle
    lora_id: int
    source_path: str
    adopted: bool = False
    """The engine held it before this worker asked (``already_loaded``): a failed card is not undone on the engine."""

    def describe(self) -> dict[str, Any]:
        return {
            "lora_name": self.life.name,
            "lora_id": self.lora_id,
            "source_path": self.source_path,
            "state": self.life.state,
        }


def observe_lora(model: LoraLifecycle, event: LoraEvent, source: LoraState, dest: LoraState) -> None:
    """Log line and gauge for every adapter state change."""
    reason = f": {model.reason}" if model.reason else ""
    level = logging.WARNING if dest == "failed" else logging.INFO
    log.log(level, "LoRA %r %s -> %s (%s)%s", model.name, source, dest, event, reason)
    counts = LORA.counts()
    metrics.LORA_ADAPTERS.set(counts["serving"] + counts["reloading"])


def resolve_local_adapter(path: str | os.PathLike[str], root: Path) -> Path:
    """The adapter directory ``path`` resolved, or :class:`LoraRefused` naming why it may not be loaded.

    Blocking (file system). ``..`` components are refused outright (a path that climbs is a mistake or an attack even
    when it lands inside the root); symlinks are followed and the *result* must lie inside ``root``, so a link inside
    the root pointing elsewhere is refused too.
    """
    given = Path(path)
    if not given.is_absolute():
        raise LoraRefused(LoraErrorCode.INVALID_ARGUMENT, f"source path {str(path)!r} is not absolute")
    if ".." in given.parts:
        raise LoraRefused(LoraErrorCode.INVALID_ARGUMENT, f"source path {str(path)!r} contains '..' (path traversal)")
    real_root = root.resolve()
    real = given.resolve()
    if not real.is_relative_to(real_root):
        raise LoraRefused(
            LoraErrorCode.INVALID_ARGUMENT,
            f"source path {str(path)!r} resolves to {str(real)!r}, outside the LoRA root {str(real_root)!r} "
            "(symlinks are followed)",
        )
    if not real.is_dir():
        raise LoraRefused(LoraErrorCode.NOT_FOUND, f"source path {str(path)!r} is not a directory")
    config = real / "adapter_config.json"
    if not config.resolve().is_relative_to(real_root) or not config.resolve().is_file():
        raise LoraRefused(
            LoraErrorCode.INVALID_ARGUMENT, f"source path {str(path)!r} has no adapter_config.json inside the LoRA root"
        )
    return real


def _body(method: str, body: Mapping[str, Any]) -> None:
    unknown = sorted(set(body) - _BODY_KEYS[method])
    if unknown:
        allowed = ", ".join(sorted(_BODY_KEYS[method])) or "nothing"
        raise LoraRefused(
            LoraErrorCode.INVALID_ARGUMENT, f"{method}: unknown field(s) {', '.join(unknown)} (allowed: {allowed})"
        )


def _error(exc: LoraRefused, lora_name: object = None) -> dict[str, Any]:
    answer: dict[str, Any] = {"status": "error", "code": exc.code.value, "message": exc.message}
    if isinstance(lora_name, str) and lora_name:
        answer["lora_name"] = lora_name
    return answer


class LoraManager:
    """The adapters of one worker. Every public coroutine is a control endpoint's body: it takes the JSON request and
    returns the JSON answer, never raising for anything a caller can get wrong."""

    def __init__(self, client: EngineClient, cards: LoraCards, settings: LoraSettings) -> None:
        self._client = client
        self._cards = cards
        self._settings = settings
        self._adapters: dict[str, _Adapter] = {}
        # One operation at a time: loads are rare, and a reload after an engine restart must not interleave with them.
        self._lock = trio.Lock()
        self._closed: str | None = None

    def routes(self) -> dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]]:
        return dict(zip(CONTROLS, (self.load, self.unload, self.list), strict=True))

    @property
    def adapters(self) -> dict[str, dict[str, Any]]:
        """Every adapter this worker knows, by name (a copy)."""
        return {name: adapter.describe() for name, adapter in self._adapters.items()}

    # ------------------------------------------------------------------ controls

    async def list(self, body: dict[str, Any]) -> dict[str, Any]:
        """``{"status": "ok", "loras": [{lora_name, lora_id, source_path, state}], "count": n}``."""
        try:
            _body("list_loras", body)
        except LoraRefused as exc:
            return _error(exc)
        loras = [adapter.describe() for adapter in sorted(self._adapters.values(), key=lambda a: a.life.name)]
        return {"status": "ok", "loras": loras, "count": len(loras)}

    async def load(self, body: dict[str, Any]) -> dict[str, Any]:
        """Load an adapter and publish its card; the answer names it (``already_loaded`` for a repeated load)."""
        name = body.get("lora_name")
        try:
            _body("load_lora", body)
            name = self._check_name(name)
            source = await self._local_source(body)
            answer: dict[str, Any] | None = None
            async with self._turn():
                answer = await self._load(name, source)
            return self._finished(answer, f"load_lora {name!r}")
        except LoraRefused as exc:
            metrics.LORA_OPERATIONS.labels(operation="load", outcome=exc.code.value).inc()
            return _error(exc, name)

    async def unload(self, body: dict[str, Any]) -> dict[str, Any]:
        """Withdraw the adapter's card, then unload it from the engine."""
        name = body.get("lora_name")
        try:
            _body("unload_lora", body)
            if not isinstance(name, str) or not name:
                raise LoraRefused(LoraErrorCode.INVALID_ARGUMENT, "unload_lora: lora_name is required")
            answer: dict[str, Any] | None = None
            async with self._turn():
                answer = await self._unload(name)
            return self._finished(answer, f"unload_lora {name!r}")
        except LoraRefused as exc:
            metrics.LORA_OPERATIONS.labels(operation="unload", outcome=exc.code.value).inc()
            return _error(exc, name)

    # ------------------------------------------------------------------ worker hooks

    async def sync(self, *, engine_restarted: bool) -> None:
        """Make Dynamo's cards match the engine: reload what a restarted engine lost, adopt what it holds unasked.

        Called at start-up (after the base card is registered) and after an engine reconnect. An engine without the
        LoRA RPCs (UNIMPLEMENTED) has nothing to sync.
        """
        steps = 1 + len(self._adapters)
        async with self._turn(steps) as turn:
            await self._sync(engine_restarted)
        if turn.cancelled_caught:
            log.warning("LoRA: syncing with the engine took longer than %gs; left as it stood", self._bound(steps))

    async def _sync(self, engine_restarted: bool) -> None:
        """What :meth:`sync` does, in its turn."""
        try:
            held = {a.lora_name: a for a in (await self._client.list_loras()).adapters}
        except EngineRpcError as exc:
            if exc.code is GrpcCode.UNIMPLEMENTED and engine_restarted:
                # The engine came back without LoRA support: nothing routed to an adapter can be served.
                for adapter in list(self._adapters.values()):
                    del self._adapters[adapter.life.name]
                    await self._forget_card(adapter.life.name)
                    adapter.life.fire("fail", reason="the restarted engine does not implement LoRA")
            elif exc.code is not GrpcCode.UNIMPLEMENTED:
                log.warning("LoRA: cannot list the engine's adapters (%s); nothing adopted or reloaded", exc)
            return
        for name, adapter in list(self._adapters.items()):
            if adapter.life.state != "serving":
                continue
            if name in held:
                continue
            if engine_restarted:
                await self._reload(adapter)
        for name, engine_adapter in held.items():
            if name not in self._adapters:
                await self._adopt(name, engine_adapter.lora_id, engine_adapter.source_path)

    def detach_all(self, reason: str) -> None:
        """The worker is shutting down: refuse new operations; the runtime takes the cards with it."""
        self._closed = reason
        for adapter in self._adapters.values():
            adapter.life.fire("detach", reason=reason)
        self._adapters.clear()

    # ------------------------------------------------------------------ one operation at a time

    @asynccontextmanager
    async def _turn(self, steps: int = 1) -> AsyncIterator[trio.CancelScope]:
        """One operation at a time. Waiting for the turn is cancellable: a drain (or a caller that gave up) leaves
        the queue behind a slow load at once. The operation itself, once it runs, is shielded -- so it is never left
        half done (an adapter loaded without its card, a card without its adapter) -- and bounded: each step has a
        deadline of its own, the whole at most ``steps`` times the longest load with its card and undo
        (:meth:`_bound`); the scope yielded tells whether that bound cut it short."""
        async with self._lock:
            with trio.CancelScope(shield=True), trio.move_on_after(self._bound(steps)) as bound:
                yield bound

    def _bound(self, steps: int) -> float:
        # A load's worst case: LoadLora times out, the undo's UnloadLora too, the card and its removal time out.
        return steps * (2 * self._settings.load_timeout_s + 2 * _CARD_TIMEOUT_S)

    def _finished(self, answer: dict[str, Any] | None, what: str) -> dict[str, Any]:
        if answer is None:  # the bound of _turn ran out (every step has its own deadline: not seen in practice)
            raise LoraRefused(LoraErrorCode.UNAVAILABLE, f"{what} did not finish within {self._bound(1):g}s")
        return answer

    # ------------------------------------------------------------------ steps

    def _check_name(self, name: object) -> str:
        if not isinstance(name, str) or not name:
            raise LoraRefused(LoraErrorCode.INVALID_ARGUMENT, "load_lora: lora_name is required")
        if not _NAME.fullmatch(name):
            raise LoraRefused(
                LoraErrorCode.INVALID_ARGUMENT,
                f"lora_name {name!r}: use 1-128 characters from letters, digits and ._:/@+- (starting with a letter "
                "or digit)",
            )
        if name in self._settings.reserved_names:
            raise LoraRefused(LoraErrorCode.CONFLICT, f"lora_name {name!r} is the base model's name")
        return name

    async def _local_source(self, body: Mapping[str, Any]) -> Path:
        """The adapter's resolved local directory (fetching a remote one first)."""
        root = self._settings.root
        path = body.get("source_path")
        source = body.get("source")
        if (path is None) == (source is None):
            raise LoraRefused(
                LoraErrorCode.INVALID_ARGUMENT, "load_lora: give exactly one of source_path and source.uri"
            )
        if source is not None:
            if not isinstance(source, dict) or set(source) != {"uri"} or not isinstance(source["uri"], str):
                raise LoraRefused(LoraErrorCode.INVALID_ARGUMENT, 'load_lora: source must be {"uri": "<URI>"}')
            uri = source["uri"]
            parts = urlsplit(uri)
            if parts.scheme == "file":
                if parts.netloc not in ("", "localhost"):
                    raise LoraRefused(LoraErrorCode.INVALID_ARGUMENT, f"source.uri {uri!r}: file URIs must be local")
                path = unquote(parts.path)
            elif parts.scheme in _REMOTE_SCHEMES:
                if root is None:
                    raise self._no_root()
                path = await self._fetch(uri, root)
            else:
                raise LoraRefused(
                    LoraErrorCode.INVALID_ARGUMENT,
                    f"source.uri {uri!r}: unsupported scheme (file, {', '.join(sorted(_REMOTE_SCHEMES))})",
                )
        if not isinstance(path, str | Path) or not str(path):
            raise LoraRefused(LoraErrorCode.INVALID_ARGUMENT, "load_lora: source_path must be a non-empty string")
        if root is None:
            raise self._no_root()
        return await trio.to_thread.run_sync(resolve_local_adapter, path, root)

    @staticmethod
    def _no_root() -> LoraRefused:
        return LoraRefused(
            LoraErrorCode.UNSUPPORTED, "LoRA loading is disabled: start the worker with --lora-root (or DYN_LORA_PATH)"
        )

    async def _fetch(self, uri: str, root: Path) -> Path:
        with trio.move_on_after(self._settings.fetch_timeout_s) as bound:
            try:
                return await self._cards.fetch_lora(uri, root)
            except Exception as exc:
                raise LoraRefused(LoraErrorCode.NOT_FOUND, f"fetching {uri!r} failed: {exc}") from None
        assert bound.cancelled_caught
        raise LoraRefused(
            LoraErrorCode.UNAVAILABLE, f"fetching {uri!r} took longer than {self._settings.fetch_timeout_s:g}s"
        )

    def _refuse_closed(self) -> None:
        if self._closed is not None:
            raise LoraRefused(LoraErrorCode.UNAVAILABLE, f"the worker is {self._closed}")

    async def _load(self, name: str, source: Path) -> dict[str, Any]:
        self._refuse_closed()
        existing = self._adapters.get(name)
        if existing is not None:
            if existing.source_path == str(source) and existing.life.state == "serving":
                metrics.LORA_OPERATIONS.labels(operation="load", outcome="already_loaded").inc()
                return {"status": "ok", **existing.describe(), "already_loaded": True}
            raise LoraRefused(
                LoraErrorCode.CONFLICT,
                f"LoRA {name!r} is already {existing.life.state} from {existing.source_path!r}; unload it first",
            )
        lora_id = self._cards.lora_id(name)
        self._check_unique(name, lora_id)
        adapter = _Adapter(LoraLifecycle(name), lora_id, str(source))
        life = adapter.life
        life.fire("load", reason=f"from {source}")
        try:
            response = await self._client.load_lora(name, str(source), lora_id, timeout_s=self._settings.load_timeout_s)
        except EngineRpcError as exc:
            if exc.code is GrpcCode.DEADLINE_EXCEEDED:
                # The engine may have loaded it after all: leave it holding nothing this worker does not list.
                await self._engine_unload(name)
            life.fire("fail", reason=str(exc))
            raise LoraRefused.from_rpc(exc, f"loading LoRA {name!r}") from None
        adapter.adopted = response.already_loaded
        life.fire("loaded")
        self._adapters[name] = adapter
        try:
            with trio.fail_after(_CARD_TIMEOUT_S):
                await self._cards.register_lora(name)
        except (Exception, trio.TooSlowError) as exc:
            del self._adapters[name]
            if not adapter.adopted:
                await self._engine_unload(name)
            await self._forget_card(name)
            life.fire("fail", reason=f"publishing the card failed: {exc}")
            raise LoraRefused(
                LoraErrorCode.CONTROL_PLANE, f"LoRA {name!r}: publishing its model card failed ({exc}); load undone"
            ) from None
        life.fire("published")
        metrics.LORA_OPERATIONS.labels(operation="load", outcome="ok").inc()
        return {"status": "ok", **adapter.describe(), "already_loaded": False}

    def _check_unique(self, name: str, lora_id: int) -> None:
        if lora_id <= 0:
            raise LoraRefused(LoraErrorCode.INVALID_ARGUMENT, f"lora_name {name!r} maps to a non-positive id")
        slug = lora_slug(name)
        for other in self._adapters.values():
            if other.lora_id == lora_id:
                raise LoraRefused(LoraErrorCode.CONFLICT, f"lora_name {name!r} has the id of {other.life.name!r}")
            if lora_slug(other.life.name) == slug:
                raise LoraRefused(
                    LoraErrorCode.CONFLICT,
                    f"lora_name {name!r} and the loaded {other.life.name!r} share Dynamo's card key {slug!r}",
                )

    async def _unload(self, name: str) -> dict[str, Any]:
        self._refuse_closed()
        adapter = self._adapters.get(name)
        if adapter is None:
            raise LoraRefused(LoraErrorCode.NOT_FOUND, f"LoRA {name!r} is not loaded")
        if adapter.life.state != "serving":
            raise LoraRefused(LoraErrorCode.CONFLICT, f"LoRA {name!r} is {adapter.life.state}; try again")
        life = adapter.life
        life.fire("unload")
        try:
            with trio.fail_after(_CARD_TIMEOUT_S):
                await self._cards.unregister_lora(name)
        except (Exception, trio.TooSlowError) as exc:
            life.fire("restore", reason=f"removing the card failed: {exc}")
            raise LoraRefused(
                LoraErrorCode.CONTROL_PLANE, f"LoRA {name!r}: removing its model card failed ({exc}); still served"
            ) from None
        life.fire("unpublished")
        try:
            await self._client.unload_lora(name, timeout_s=self._settings.load_timeout_s)
        except EngineRpcError as exc:
            if exc.code is not GrpcCode.NOT_FOUND:  # NOT_FOUND: the engine lost it already, which is what we want
                await self._republish(adapter, f"the engine refused UnloadLora: {exc}")
                raise LoraRefused.from_rpc(exc, f"unloading LoRA {name!r} (still served)") from None
        del self._adapters[name]
        life.fire("unloaded")
        metrics.LORA_OPERATIONS.labels(operation="unload", outcome="ok").inc()
        return {"status": "ok", **adapter.describe(), "already_loaded": False}

    async def _republish(self, adapter: _Adapter, why: str) -> None:
        """Undo a card removal: the adapter is served again, or fails if even that is impossible."""
        try:
            with trio.fail_after(_CARD_TIMEOUT_S):
                await self._cards.register_lora(adapter.life.name)
        except (Exception, trio.TooSlowError) as exc:
            del self._adapters[adapter.life.name]
            adapter.life.fire("fail", reason=f"{why}; publishing the card again failed too: {exc}")
            return
        adapter.life.fire("restore", reason=why)

    async def _reload(self, adapter: _Adapter) -> None:
        name = adapter.life.name
        adapter.life.fire("engine_restarted")
        try:
            await self._client.load_lora(
                name, adapter.source_path, adapter.lora_id, timeout_s=self._settings.load_timeout_s
            )
        except EngineRpcError as exc:
            del self._adapters[name]
            await self._forget_card(name)
            adapter.life.fire("fail", reason=f"reload after the engine restart failed: {exc}; card withdrawn")
            return
        adapter.life.fire("loaded", reason="reloaded after the engine restart")

    async def _adopt(self, name: str, lora_id: int, source_path: str) -> None:
        if not _NAME.fullmatch(name) or name in self._settings.reserved_names:
            log.warning("LoRA: the engine holds %r, whose name cannot be a Dynamo model; not adopted", name)
            return
        adapter = _Adapter(LoraLifecycle(name), lora_id, source_path, adopted=True)
        adapter.life.fire("adopt", reason="held by the engine")
        try:
            with trio.fail_after(_CARD_TIMEOUT_S):
                await self._cards.register_lora(name)
        except (Exception, trio.TooSlowError) as exc:
            await self._forget_card(name)
            adapter.life.fire("fail", reason=f"publishing the card failed: {exc}")
            return
        self._adapters[name] = adapter
        adapter.life.fire("published")

    async def _engine_unload(self, name: str) -> None:
        """Best effort, bounded: the engine should not keep an adapter nobody can reach."""
        try:
            await self._client.unload_lora(name, timeout_s=self._settings.load_timeout_s)
        except EngineRpcError as exc:
            if exc.code is not GrpcCode.NOT_FOUND:
                log.warning("LoRA %r: undoing the engine load failed: %s", name, exc)

    async def _forget_card(self, name: str) -> None:
        """Best effort, bounded: a card whose registration failed half-way must not linger."""
        with trio.move_on_after(_CARD_TIMEOUT_S):
            try:
                await self._cards.unregister_lora(name)
            except Exception as exc:
                log.debug("LoRA %r: removing a card that may not exist: %s", name, exc)
