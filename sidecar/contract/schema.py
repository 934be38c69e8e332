"""Schema compatibility of a discovered server (wire contract §7.1; TensorRT-LLM checklist item 2).

The client is generated from OpenEngine v0.1.0 (Buf commit ``768a93c7b44e40f28c692ad0b471a8f2``). A server must
report an *immutable* release id: TensorRT-LLM's baseline sends the 12-hex prefix ``768a93c7b44e``, newer builds the
full 32-hex id, and an empty string when its bindings metadata is missing — all accepted (the last with a warning),
unless the operator asserts a release (``--expected-schema-release``): an engine that names none cannot be shown to
match it, so it is refused. A moving name (``main``, ``v0.2.0``) is refused: it says nothing about the bytes on the
wire.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from openengine_bp.openengine.v1 import ServerInfo

__all__ = [
    "CLIENT_REVISION",
    "MIN_SERVER_REVISION",
    "PINNED_SCHEMA_RELEASE",
    "SchemaIncompatible",
    "check_server_compat",
    "expected_release_problem",
    "release_matches",
]

#: The OpenEngine schema revision this client implements (``ServerInfo.minimum_client_revision`` must not exceed it).
CLIENT_REVISION: Final = 1
#: Oldest ``ServerInfo.schema_revision`` accepted; 0 is invalid by contract.
MIN_SERVER_REVISION: Final = 1
#: The Buf module commit the bindings were generated from (OpenEngine v0.1.0, git b5f2bd9).
PINNED_SCHEMA_RELEASE: Final = "768a93c7b44e40f28c692ad0b471a8f2"
# Shorter hex strings are too ambiguous to name a release (and look like abbreviated moving refs).
_MIN_RELEASE_HEX: Final = 12
_HEX_RE: Final = re.compile(r"^[0-9a-f]+$")


class SchemaIncompatible(ValueError):
    """The server's schema cannot be driven by this client; the message is one line saying why."""


def release_matches(a: str, b: str) -> bool:
    """True if two immutable release ids name the same release: one is a prefix of the other, both ≥ 12 hex."""
    a, b = a.lower(), b.lower()
    if not (_is_release_id(a) and _is_release_id(b)):
        return False
    return a.startswith(b) or b.startswith(a)


def expected_release_problem(text: str) -> str | None:
    """Why ``text`` cannot be an expected release (``--expected-schema-release``), or ``None`` if it can."""
    if _is_release_id(text.strip().lower()):
        return None
    return (
        f"{text!r} is not an immutable release id (hex, at least {_MIN_RELEASE_HEX} digits, "
        f"e.g. {PINNED_SCHEMA_RELEASE})"
    )


def check_server_compat(
    server_info: ServerInfo,
    *,
    expected_release: str | None = None,
    expected_engine: str | None = None,
) -> list[str]:
    """Check ``server_info`` against this client; return warnings or raise :class:`SchemaIncompatible`.

    * ``schema_revision`` must be ≥ 1 (a newer, additive revision is accepted with a warning) and
      ``minimum_client_revision`` ≤ :data:`CLIENT_REVISION`.
    * ``schema_release`` must be :data:`PINNED_SCHEMA_RELEASE` or a hex prefix of it (≥ 12 hex); empty is accepted
      with a warning. A different immutable id is refused unless it matches ``expected_release``.
    * ``expected_release``, when given, is an assertion: the server release must match it (by prefix); an empty one
      is refused (nothing shows that the engine speaks the expected release).
    * ``expected_engine``, when given, must equal ``ServerInfo.engine_name``.
    """
    warnings: list[str] = []
    if expected_release is not None and (problem := expected_release_problem(expected_release)) is not None:
        raise ValueError(f"expected_release {problem}")
    revision = server_info.schema_revision
    if revision < MIN_SERVER_REVISION:
        raise SchemaIncompatible(
            f"server reports schema_revision {revision}; this client needs at least {MIN_SERVER_REVISION}"
        )
    if server_info.minimum_client_revision > CLIENT_REVISION:
        raise SchemaIncompatible(
            f"server requires client revision >= {server_info.minimum_client_revision};"
            f" this client implements revision {CLIENT_REVISION}"
        )
    if revision > CLIENT_REVISION:
        warnings.append(
            f"server schema_revision {revision} is newer than this client's {CLIENT_REVISION};"
            " newer revisions are additive, continuing"
        )

    release = server_info.schema_release.strip().lower()
    if not release and expected_release is not None:
        raise SchemaIncompatible(
            f"server reports an empty schema_release, so it cannot be shown to match the expected "
            f"{expected_release.strip().lower()} (TensorRT-LLM without its bindings metadata?); drop the expected "
            "schema release to accept it"
        )
    if not release:
        warnings.append(
            "server reports an empty schema_release (TensorRT-LLM without its bindings metadata?);"
            f" assuming the pinned {PINNED_SCHEMA_RELEASE}"
        )
    elif not _is_release_id(release):
        raise SchemaIncompatible(
            f"server schema_release {server_info.schema_release!r} is not an immutable release id"
            f" (need at least {_MIN_RELEASE_HEX} hex digits, e.g. {PINNED_SCHEMA_RELEASE})"
        )
    elif expected_release is not None:
        if not release_matches(release, expected_release.strip()):
            raise SchemaIncompatible(
                f"server schema_release {release} does not match the expected {expected_release.lower()}"
            )
        if not release_matches(release, PINNED_SCHEMA_RELEASE):
            warnings.append(
                f"server schema_release {release} differs from this client's {PINNED_SCHEMA_RELEASE};"
                " accepted because it matches the expected release"
            )
    elif not release_matches(release, PINNED_SCHEMA_RELEASE):
        raise SchemaIncompatible(
            f"server schema_release {release} is not the pinned {PINNED_SCHEMA_RELEASE} (OpenEngine v0.1.0);"
            " set the expected schema release to accept it"
        )

    if expected_engine is not None and server_info.engine_name != expected_engine:
        raise SchemaIncompatible(
            f"server engine_name {server_info.engine_name!r} is not the expected {expected_engine!r}"
        )
    if not server_info.engine_name:
        warnings.append("server reports an empty engine_name")
    return warnings


def _is_release_id(text: str) -> bool:
    return len(text) >= _MIN_RELEASE_HEX and _HEX_RE.match(text) is not None
