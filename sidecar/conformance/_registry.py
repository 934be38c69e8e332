"""The list of checks, in run order (each check module registers its checks when imported by ``_runner``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ._context import Context
from ._model import Outcome

__all__ = ["CHECKS", "Check", "check"]


@dataclass(frozen=True, slots=True)
class Check:
    """One protocol check: an id (``group.name``), the rule it tests with its citation, and the coroutine that runs it.

    ``rule`` cites topics of the OpenEngine v0.1.0 contract (``wire §…``) and of TensorRT-LLM's server behaviour
    (``trtllm §…``), listed in ``docs/conformance.md``.
    """

    id: str
    rule: str
    cites: str
    run: Callable[[Context], Awaitable[Outcome]]
    destructive: bool = False

    @property
    def group(self) -> str:
        return self.id.partition(".")[0]


CHECKS: list[Check] = []

_CheckFn = Callable[[Context], Awaitable[Outcome]]


def check(check_id: str, rule: str, cites: str, *, destructive: bool = False) -> Callable[[_CheckFn], _CheckFn]:
    """Register the decorated coroutine as check ``check_id`` testing ``rule`` (cited as ``cites``)."""

    def register(fn: _CheckFn) -> _CheckFn:
        if any(c.id == check_id for c in CHECKS):
            raise ValueError(f"duplicate check id {check_id!r}")
        CHECKS.append(Check(check_id, rule, cites, fn, destructive))
        return fn

    return register
