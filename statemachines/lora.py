"""The LoRA adapter lifecycle: one per adapter name, from the operator's ``load_lora`` to ``unload_lora``."""

# Theory of operation
# ===================
#
# An adapter is served when two things hold at once: the engine has it loaded (`Control.LoadLora`) and Dynamo lists
# a model card for it (`register_model(lora_name=…, base_model_path=…)`), so the frontend routes `model=<adapter>` to
# this worker with `routing.lora_name`.  Either half alone is a fault: a card without the engine adapter fails every
# request routed to it; an engine adapter without a card holds an engine slot (`max_loras`) nobody can use.  So the
# two halves are always changed in one direction and undone in reverse when the second step fails:
#
#   new -load-> loading -loaded-> publishing -published-> serving                          (load_lora)
#   new -adopt-> publishing                   (the engine already holds it: sidecar restarted, engine start-up flags)
#   serving -unload-> unpublishing -unpublished-> unloading -unloaded-> unloaded           (unload_lora)
#   serving -engine_restarted-> reloading -loaded-> serving       (the engine came back empty; its card stays listed)
#
# * Card first off, engine second on unload: once the card is gone no new request can name the adapter, so the
#   engine's unload cannot pull it from under a request that was still being routed.
# * `restore`: the second step of an unload failed (card could not be removed, or the engine refused `UnloadLora`);
#   the first is undone (card published again) and the adapter is served as before, the caller gets the error.
# * `fail`: a load step failed and what the first step did was undone (engine `UnloadLora` after a failed card
#   publication), or a reload after an engine restart was refused (its card is then withdrawn).  The name is free to
#   be loaded again.
# * `detach`: the worker shut down; Dynamo's runtime removes every card with it, the engine keeps its adapters (a
#   sidecar started again adopts them).
#
# Idempotence (NO_OPS): `detach` after the end.  Anything else outside TRANSITIONS raises IllegalTransition.  A repeated
# `load_lora` of a served adapter with the same source fires nothing: it answers `already_loaded`.

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from ._base import Lifecycle, MachineKind, StateDoc

if TYPE_CHECKING:
    from transitions.core import TransitionConfigDict

__all__ = [
    "LORA",
    "NO_OPS",
    "STATES",
    "STATE_DOCS",
    "TERMINAL",
    "TRANSITIONS",
    "LoraEvent",
    "LoraLifecycle",
    "LoraObserver",
    "LoraState",
]

LoraState = Literal[
    "new", "loading", "publishing", "serving", "unpublishing", "unloading", "reloading", "unloaded", "failed",
    "detached",
]  # fmt: skip
LoraEvent = Literal[
    "load", "adopt", "loaded", "published", "unload", "unpublished", "unloaded", "restore", "engine_restarted", "fail",
    "detach",
]  # fmt: skip

STATES: tuple[LoraState, ...] = (
    "new",
    "loading",
    "publishing",
    "serving",
    "unpublishing",
    "unloading",
    "reloading",
    "unloaded",
    "failed",
    "detached",
)

TERMINAL: frozenset[LoraState] = frozenset({"unloaded", "failed", "detached"})

_ACTIVE: list[LoraState] = [state for state in STATES if state not in TERMINAL]

TRANSITIONS: list[TransitionConfigDict] = [
    # load_lora accepted (name, source and id checked): Control.LoadLora is in flight.
    {"trigger": "load", "source": "new", "dest": "loading"},
    # At start-up or after an engine restart, ListLoras shows an adapter this worker has no card for.
    {"trigger": "adopt", "source": "new", "dest": "publishing"},
    # The engine holds the adapter: publish its card (first load), or serve on (reload after an engine restart).
    {"trigger": "loaded", "source": "loading", "dest": "publishing"},
    {"trigger": "loaded", "source": "reloading", "dest": "serving"},
    # Dynamo lists the card: `model=<adapter>` reaches this worker.
    {"trigger": "published", "source": "publishing", "dest": "serving"},
    # unload_lora accepted: the card is being withdrawn.
    {"trigger": "unload", "source": "serving", "dest": "unpublishing"},
    # The card is gone (new requests for the adapter now get 404): Control.UnloadLora is in flight.
    {"trigger": "unpublished", "source": "unpublishing", "dest": "unloading"},
    {"trigger": "unloaded", "source": "unloading", "dest": "unloaded"},
    # An unload step failed; the card is published again and the adapter served as before.
    {"trigger": "restore", "source": ["unpublishing", "unloading"], "dest": "serving"},
    # The engine restarted (it holds no adapters any more): load it again, the card stays listed meanwhile.
    {"trigger": "engine_restarted", "source": "serving", "dest": "reloading"},
    # A load or reload step failed and the other step was undone; or a bug.
    {"trigger": "fail", "source": _ACTIVE, "dest": "failed"},
    # Worker shutdown: the runtime removes the cards, the engine keeps the adapters.
    {"trigger": "detach", "source": _ACTIVE, "dest": "detached"},
]

NO_OPS: dict[tuple[LoraState, LoraEvent], str] = {
    ("unloaded", "detach"): "worker shutdown after the adapter was unloaded",
    ("failed", "detach"): "worker shutdown after the adapter failed: the failure stands",
    ("detached", "detach"): "a repeated shutdown",
}

STATE_DOCS: dict[LoraState, StateDoc] = {
    "new": StateDoc(
        meaning="A load_lora request was accepted (name, source and adapter id checked) or an engine-held adapter "
        "was found; nothing has changed yet.",
        operator_sees="Nothing; a moment later a log line for the load.",
        action="Nothing.",
    ),
    "loading": StateDoc(
        meaning="Control.LoadLora is in flight; the adapter is not listed by Dynamo yet.",
        operator_sees="A log line naming the adapter and its source path.",
        action="Nothing. A load that stays here is bounded by --lora-load-timeout-secs.",
    ),
    "publishing": StateDoc(
        meaning="The engine holds the adapter; its Dynamo model card is being registered.",
        operator_sees="Counted in the live state view for a moment.",
        action="Nothing.",
    ),
    "serving": StateDoc(
        meaning="The engine holds the adapter and Dynamo lists it: /v1/models shows it and requests with "
        "model=<adapter> run on the engine with lora_name set.",
        operator_sees="The adapter in list_loras and in the frontend's /v1/models; openengine_sidecar_lora_adapters.",
        action="Nothing.",
    ),
    "unpublishing": StateDoc(
        meaning="unload_lora accepted: the model card is being removed so no new request names the adapter.",
        operator_sees="A log line for the unload.",
        action="Nothing.",
    ),
    "unloading": StateDoc(
        meaning="The card is gone (requests for the adapter get 404); Control.UnloadLora is in flight.",
        operator_sees="Counted in the live state view for a moment.",
        action="Nothing.",
    ),
    "reloading": StateDoc(
        meaning="The engine restarted without the adapter; it is being loaded again. The worker is withdrawn from "
        "routing while it reconnects, so no request reaches the engine meanwhile.",
        operator_sees="A log line per adapter reloaded after an engine reconnect.",
        action="Nothing. If the reload fails the adapter ends in failed and its card is withdrawn.",
    ),
    "unloaded": StateDoc(
        meaning="unload_lora finished: neither Dynamo nor the engine holds the adapter.",
        operator_sees="Total of unloaded adapters; the name may be loaded again.",
        action="Nothing.",
    ),
    "failed": StateDoc(
        meaning="A load or reload step failed and the other step was undone: the adapter is not served.",
        operator_sees="The load_lora answer (status error, with the engine's or Dynamo's reason) and a warning log.",
        action="Read the reason: a bad adapter directory, the engine's max_loras reached, or the control plane. Fix "
        "it and load again.",
    ),
    "detached": StateDoc(
        meaning="The worker shut down. Its cards went with the Dynamo runtime; the engine keeps the adapter, and a "
        "worker started again on the same engine adopts it.",
        operator_sees="Total of detached adapters.",
        action="Nothing.",
    ),
}

LORA: MachineKind[LoraLifecycle, LoraState, LoraEvent] = MachineKind(
    "lora",
    states=STATES,
    transitions=TRANSITIONS,
    initial="new",
    terminal=TERMINAL,
    no_ops=NO_OPS,
    docs=STATE_DOCS,
    summary=__doc__ or "",
)
"""The LoRA adapter machine kind: the shared machine, observers and live counts."""

LoraObserver = Callable[["LoraLifecycle", LoraEvent, LoraState, LoraState], None]
"""An observer of adapter state changes: ``observer(model, event, source, dest)``."""


class LoraLifecycle(Lifecycle[LoraState, LoraEvent]):
    """One adapter's state; fire events with :meth:`fire`."""

    __slots__ = ("name",)

    _kind = LORA

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__()

    def __repr__(self) -> str:
        return f"<LoraLifecycle {self.name!r} {self.state}>"
