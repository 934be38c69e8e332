"""Lenient enum reads and ``optional`` presence, for both generated message families.

OpenEngine enums only grow by appending, and a newer engine may send a value this build does not
know. The contract (wire reference §7.1) says such a value reads as the enum's ``UNSPECIFIED`` (0)
— never an exception. Both runtimes keep the unknown number (upb as a plain ``int``, betterproto2
as a ``~UNKNOWN`` pseudo-member), so every read of an enum field that decides something goes
through :func:`pb_enum` or :func:`bp_enum`.

Presence: a proto3 ``optional`` scalar distinguishes "absent" from an explicit 0 / ``false`` /
``""``, and discovery relies on it (absent = cannot report, present 0 = a real value).

* upb: ``HasField`` tells; :func:`pb_optional` returns the value or ``None``.
* betterproto2: ``None`` is absent, anything else is a value. The trap is ``x or default``, which
  replaces an explicit 0 / ``false``; use :func:`bp_or` instead.
"""

from __future__ import annotations

import enum
import functools
from typing import Any, TypeVar

__all__ = ["bp_enum", "bp_or", "known_enum", "pb_enum", "pb_optional"]

_E = TypeVar("_E", bound=enum.IntEnum)
_T = TypeVar("_T")


def pb_enum(value: int, enum_type: Any) -> int:
    """Return a upb enum field's number if ``enum_type`` (e.g. ``generation_pb2.FinishReason``) knows it, else 0.

    ``enum_type`` is typed ``Any`` because upb enum types get their ``DESCRIPTOR`` from an untyped
    metaclass.
    """
    known: bool = value in enum_type.DESCRIPTOR.values_by_number
    return value if known else 0


@functools.cache
def _known_numbers(cls: type[enum.IntEnum]) -> frozenset[int]:
    # Pseudo-members for unknown numbers are never listed in __members__.
    return frozenset(int(member) for member in cls.__members__.values())


def bp_enum(value: _E) -> _E:
    """Return a betterproto2 enum value if it is a declared member, else the type's 0 member."""
    cls = type(value)
    return value if int(value) in _known_numbers(cls) else cls(0)


def known_enum(cls: type[_E], value: int) -> _E:
    """Read a raw number as a member of ``cls`` (any ``IntEnum``, betterproto2's included); unknown → 0."""
    return cls(value) if value in _known_numbers(cls) else cls(0)


def pb_optional(message: Any, field: str) -> Any:
    """Value of a upb ``optional`` (or message) field, or ``None`` when it is absent on the wire."""
    return getattr(message, field) if message.HasField(field) else None


def bp_or(value: _T | None, default: _T) -> _T:
    """A betterproto2 ``optional`` read with a default that applies only when the field is absent."""
    return default if value is None else value
