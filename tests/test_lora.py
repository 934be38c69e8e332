"""The LoRA lifecycle against in-memory fakes: every step's failure is undone in reverse, nothing is left half-done.

The rulebook (``statemachines/lora.py``):

* load = engine ``LoadLora``, then the Dynamo card; a refused ``LoadLora`` publishes nothing; a failed card unloads
  the engine adapter again (unless the engine held it before we asked).
* unload = card off, then engine ``UnloadLora``; a failed card removal keeps serving; a refused ``UnloadLora``
  publishes the card again; ``NOT_FOUND`` from the engine means the adapter is already gone (success).
* An operation runs to its end even when its caller goes away (shielded), and each step is bounded; an operation
  still waiting for its turn is cancelled with its caller (a drain does not wait for the queue).
* ``sync`` adopts what the engine holds unasked and reloads what a restarted engine lost (withdrawing the card of an
  adapter that cannot be reloaded).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.errors import EngineRpcError, GrpcCode, LoraRefused
from sidecar.lora import LoraManager, LoraSettings, resolve_local_adapter
from statemachines import LORA
from tests.helpers.waits import wait_until


@dataclass
class Adapter:
    lora_name: str
    lora_id: int
    source_path: str


@dataclass
class LoadResponse:
    adapter: Adapter
    already_loaded: bool


@dataclass
class Listing:
    adapters: list[Adapter]


@dataclass
class FakeEngine:
    """``EngineClient``'s LoRA RPCs over a dict; ``fail`` maps an RPC name to the status it answers next."""

    held: dict[str, Adapter] = field(default_factory=dict)
    fail: dict[str, GrpcCode] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    hang: set[str] = field(default_factory=set)
    slow: set[str] = field(default_factory=set)

    async def _enter(self, rpc: str, timeout_s: float | None) -> None:
        self.calls.append(rpc)
        if rpc in self.slow:
            await trio.sleep(0.2)  # not a synchronisation: a slow engine, in virtual time in every test using it
        if rpc in self.hang:
            with trio.move_on_after(timeout_s or 1.0):
                await trio.sleep_forever()
            raise EngineRpcError(rpc, GrpcCode.DEADLINE_EXCEEDED, "deadline")
        code = self.fail.pop(rpc, None)
        if code is not None:
            raise EngineRpcError(rpc, code, "refused by the fake")
        await trio.lowlevel.checkpoint()

    async def load_lora(
        self, lora_name: str, source_path: str, lora_id: int, *, timeout_s: float | None = None
    ) -> LoadResponse:
        await self._enter("LoadLora", timeout_s)
        if lora_name in self.held:
            return LoadResponse(self.held[lora_name], already_loaded=True)
        self.held[lora_name] = Adapter(lora_name, lora_id, source_path)
        return LoadResponse(self.held[lora_name], already_loaded=False)

    async def unload_lora(self, lora_name: str, *, timeout_s: float | None = None) -> None:
        await self._enter("UnloadLora", timeout_s)
        if self.held.pop(lora_name, None) is None:
            raise EngineRpcError("UnloadLora", GrpcCode.NOT_FOUND, "not loaded")

    async def list_loras(self, *, timeout_s: float | None = None) -> Listing:
        await self._enter("ListLoras", timeout_s)
        return Listing(list(self.held.values()))


@dataclass
class FakeCards:
    """``DynamoWorker``'s card methods over a set; ``fail`` holds the methods that raise next."""

    cards: set[str] = field(default_factory=set)
    fail: list[str] = field(default_factory=list)
    hang: bool = False

    async def register_lora(self, lora_name: str) -> None:
        await self._step("register")
        self.cards.add(lora_name)

    async def unregister_lora(self, lora_name: str) -> None:
        await self._step("unregister")
        self.cards.discard(lora_name)

    async def _step(self, name: str) -> None:
        if self.hang:
            await trio.sleep_forever()
        if name in self.fail:
            self.fail.remove(name)
            raise RuntimeError(f"{name} failed in the fake control plane")
        await trio.lowlevel.checkpoint()

    def lora_id(self, lora_name: str) -> int:
        return 1000 + sum(map(ord, lora_name))

    async def fetch_lora(self, uri: str, cache_dir: Path) -> Path:
        raise RuntimeError(f"no network for {uri}")


def adapter_dir(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "loras"
    for name in ("a", "b"):
        adapter_dir(root, name)
    return root


def manager(engine: FakeEngine, cards: FakeCards, root: Path | None) -> LoraManager:
    settings = LoraSettings(root=root, load_timeout_s=0.5, reserved_names=frozenset({"base"}))
    return LoraManager(engine, cards, settings)  # type: ignore[arg-type]


def load_body(root: Path, name: str = "a") -> dict[str, Any]:
    return {"lora_name": name, "source_path": str(root / name)}


async def test_load_publishes_after_the_engine_and_is_idempotent(root: Path) -> None:
    engine, cards = FakeEngine(), FakeCards()
    loras = manager(engine, cards, root)
    answer = await loras.load(load_body(root))
    assert answer["status"] == "ok", answer
    assert answer["already_loaded"] is False, answer
    assert answer["source_path"] == str((root / "a").resolve())
    assert set(engine.held) == {"a"}
    assert cards.cards == {"a"}
    again = await loras.load(load_body(root))
    assert again["already_loaded"] is True
    assert engine.calls == ["LoadLora"], "an idempotent reload costs no RPC"


async def test_a_refused_load_publishes_nothing(root: Path) -> None:
    engine, cards = FakeEngine(fail={"LoadLora": GrpcCode.RESOURCE_EXHAUSTED}), FakeCards()
    before = LORA.counts()["failed"]
    answer = await manager(engine, cards, root).load(load_body(root))
    assert answer["status"] == "error", answer
    assert answer["code"] == "capacity", answer
    assert "RESOURCE_EXHAUSTED" in answer["message"]
    assert engine.held == {}
    assert cards.cards == set()
    assert LORA.counts()["failed"] == before + 1


async def test_a_failed_card_unloads_the_engine_adapter_again(root: Path) -> None:
    engine, cards = FakeEngine(), FakeCards(fail=["register"])
    loras = manager(engine, cards, root)
    answer = await loras.load(load_body(root))
    assert answer["code"] == "control_plane", answer
    assert "load undone" in answer["message"], answer
    assert engine.held == {}
    assert engine.calls == ["LoadLora", "UnloadLora"]
    assert loras.adapters == {}
    assert (await loras.load(load_body(root)))["status"] == "ok", "the name is free again"


async def test_a_failed_card_keeps_an_adapter_the_engine_held_before(root: Path) -> None:
    """``already_loaded`` from the engine: it was not ours to unload (another client, engine start-up flags)."""
    engine = FakeEngine(held={"a": Adapter("a", 1097, str((root / "a").resolve()))})
    cards = FakeCards(fail=["register"])
    answer = await manager(engine, cards, root).load(load_body(root))
    assert answer["status"] == "error"
    assert "a" in engine.held
    assert "UnloadLora" not in engine.calls


async def test_a_load_timeout_undoes_a_load_the_engine_may_have_done(root: Path) -> None:
    engine, cards = FakeEngine(hang={"LoadLora"}), FakeCards()
    answer = await manager(engine, cards, root).load(load_body(root))
    assert answer["code"] == "unavailable", answer
    assert engine.calls == ["LoadLora", "UnloadLora"]


async def test_a_hung_control_plane_is_bounded_and_undone(root: Path, autojump_clock: trio.abc.Clock) -> None:
    engine, cards = FakeEngine(), FakeCards(hang=True)
    answer = await manager(engine, cards, root).load(load_body(root))
    assert answer["code"] == "control_plane", answer
    assert engine.held == {}


async def test_the_caller_going_away_does_not_leave_a_half_load(root: Path, autojump_clock: trio.abc.Clock) -> None:
    engine, cards = FakeEngine(slow={"LoadLora"}), FakeCards()
    loras = manager(engine, cards, root)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(loras.load, load_body(root))
        await wait_until(lambda: "LoadLora" in engine.calls)
        nursery.cancel_scope.cancel(reason="caller disconnected")
    assert set(engine.held) == {"a"}, "the accepted load ran to its end"
    assert cards.cards == {"a"}


async def test_a_drain_cancels_the_operations_waiting_for_their_turn(
    root: Path, autojump_clock: trio.abc.Clock
) -> None:
    """Failed before: the wait for the turn (the lock) was inside the shield, so a cancelled caller -- a drain --
    still waited for every operation ahead of it, then ran its own."""
    engine, cards = FakeEngine(hang={"LoadLora"}), FakeCards()  # the first load holds the turn until its deadline
    loras = manager(engine, cards, root)
    ended: list[float] = []

    async def queued(scope: trio.CancelScope) -> None:
        with scope:
            await loras.load(load_body(root, "b"))
        ended.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(loras.load, load_body(root, "a"))
        while "LoadLora" not in engine.calls:
            await trio.sleep(0.01)
        drain = trio.CancelScope()
        nursery.start_soon(queued, drain)
        while loras._lock.statistics().tasks_waiting == 0:
            await trio.sleep(0.01)
        drained_at = trio.current_time()
        drain.cancel(reason="drain deadline")
    assert drain.cancelled_caught, "the queued operation was cancelled"
    assert ended == [pytest.approx(drained_at)], "at once, not after the operation ahead of it"
    assert engine.calls.count("LoadLora") == 1, "the cancelled load never reached the engine"
    assert "b" not in engine.held


async def test_unload_removes_the_card_first_and_rolls_back_a_refused_engine_unload(root: Path) -> None:
    engine, cards = FakeEngine(), FakeCards()
    loras = manager(engine, cards, root)
    await loras.load(load_body(root))
    engine.fail["UnloadLora"] = GrpcCode.INTERNAL
    refused = await loras.unload({"lora_name": "a"})
    assert refused["code"] == "engine_error", refused
    assert "still served" in refused["message"], refused
    assert cards.cards == {"a"}
    assert loras.adapters["a"]["state"] == "serving"
    assert (await loras.unload({"lora_name": "a"}))["status"] == "ok"
    assert engine.held == {}
    assert cards.cards == set()
    assert loras.adapters == {}


async def test_a_failed_card_removal_keeps_serving(root: Path) -> None:
    engine, cards = FakeEngine(), FakeCards()
    loras = manager(engine, cards, root)
    await loras.load(load_body(root))
    cards.fail.append("unregister")
    answer = await loras.unload({"lora_name": "a"})
    assert answer["code"] == "control_plane", answer
    assert "UnloadLora" not in engine.calls
    assert loras.adapters["a"]["state"] == "serving"


async def test_an_engine_that_lost_the_adapter_unloads_cleanly(root: Path) -> None:
    engine, cards = FakeEngine(), FakeCards()
    loras = manager(engine, cards, root)
    await loras.load(load_body(root))
    engine.held.clear()
    assert (await loras.unload({"lora_name": "a"}))["status"] == "ok"
    assert cards.cards == set()


async def test_conflicts_are_refused_before_any_rpc(root: Path) -> None:
    engine, cards = FakeEngine(), FakeCards()
    loras = manager(engine, cards, root)
    await loras.load(load_body(root))
    other = await loras.load({"lora_name": "a", "source_path": str(root / "b")})
    assert other["code"] == "conflict", other
    slug = await loras.load({"lora_name": "A", "source_path": str(root / "b")})
    assert slug["code"] == "conflict", slug
    assert "card key" in slug["message"], slug
    base = await loras.load({"lora_name": "base", "source_path": str(root / "b")})
    assert base["code"] == "conflict", base
    assert engine.calls == ["LoadLora"]


async def test_without_a_root_every_load_is_refused(root: Path) -> None:
    answer = await manager(FakeEngine(), FakeCards(), None).load(load_body(root))
    assert answer["code"] == "unsupported", answer
    assert "--lora-root" in answer["message"], answer


async def test_a_remote_fetch_failure_is_reported(root: Path) -> None:
    answer = await manager(FakeEngine(), FakeCards(), root).load({"lora_name": "r", "source": {"uri": "s3://b/k"}})
    assert answer["code"] == "not_found", answer
    assert "no network" in answer["message"], answer


async def test_sync_adopts_and_reloads(root: Path) -> None:
    engine, cards = FakeEngine(), FakeCards()
    loras = manager(engine, cards, root)
    await loras.load(load_body(root))
    engine.held = {"x": Adapter("x", 7, "/elsewhere/x")}  # a restarted engine configured with another adapter
    await loras.sync(engine_restarted=True)
    assert set(engine.held) == {"a", "x"}
    assert cards.cards == {"a", "x"}
    assert {name: entry["state"] for name, entry in loras.adapters.items()} == {"a": "serving", "x": "serving"}


async def test_sync_withdraws_an_adapter_the_restarted_engine_refuses(root: Path) -> None:
    engine, cards = FakeEngine(), FakeCards()
    loras = manager(engine, cards, root)
    await loras.load(load_body(root))
    engine.held.clear()
    engine.fail["LoadLora"] = GrpcCode.INVALID_ARGUMENT
    await loras.sync(engine_restarted=True)
    assert cards.cards == set()
    assert loras.adapters == {}


async def test_after_detach_operations_are_refused(root: Path) -> None:
    engine, cards = FakeEngine(), FakeCards()
    loras = manager(engine, cards, root)
    await loras.load(load_body(root))
    loras.detach_all("draining")
    assert (await loras.load(load_body(root, "b")))["code"] == "unavailable"
    assert loras.adapters == {}


@pytest.mark.parametrize(
    ("given", "needle"),
    [
        ("relative/a", "not absolute"),
        ("{root}/../outside", "'..'"),
        ("{root}/link", "outside the LoRA root"),
        # A sibling whose name extends the root's: inside it by string prefix, outside it as a path.
        ("{root}-evil/adapter", "outside the LoRA root"),
        ("{root}/evil-link", "outside the LoRA root"),
        ("{root}/missing", "not a directory"),
        ("{root}/empty", "adapter_config.json"),
        ("{root}/config-link", "adapter_config.json"),
    ],
)
def test_resolve_local_adapter_confines_to_the_root(tmp_path: Path, root: Path, given: str, needle: str) -> None:
    outside = adapter_dir(tmp_path, "outside")
    (root / "link").symlink_to(outside)
    sibling = adapter_dir(root.with_name(f"{root.name}-evil"), "adapter")
    (root / "evil-link").symlink_to(sibling)
    (root / "empty").mkdir()
    (root / "config-link").mkdir()
    (root / "config-link" / "adapter_config.json").symlink_to(outside / "adapter_config.json")
    with pytest.raises(LoraRefused, match=needle):
        resolve_local_adapter(given.format(root=root), root)


def test_a_symlink_inside_the_root_is_followed(root: Path) -> None:
    (root / "alias").symlink_to(root / "a")
    assert resolve_local_adapter(root / "alias", root) == (root / "a").resolve()
