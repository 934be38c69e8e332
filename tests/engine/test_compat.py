"""check_server_compat: revisions, schema release forms, expected release/engine."""

from __future__ import annotations

import pytest

from openengine_bp.openengine.v1 import ServerInfo
from sidecar.engine import (
    CLIENT_REVISION,
    PINNED_SCHEMA_RELEASE,
    SchemaIncompatible,
    check_server_compat,
    release_matches,
)

FULL = "768a93c7b44e40f28c692ad0b471a8f2"
OTHER = "0123456789abcdef0123456789abcdef"


def info(release: str = FULL, revision: int = 1, minimum: int = 1, engine: str = "tensorrt_llm") -> ServerInfo:
    return ServerInfo(
        engine_name=engine, schema_revision=revision, minimum_client_revision=minimum, schema_release=release
    )


def test_constants() -> None:
    assert PINNED_SCHEMA_RELEASE == FULL
    assert CLIENT_REVISION == 1


@pytest.mark.parametrize("release", [FULL, FULL[:12], FULL[:20], FULL.upper(), FULL + "0000"])
def test_pinned_forms_accepted(release: str) -> None:
    assert check_server_compat(info(release)) == []


def test_empty_release_warns() -> None:
    (warning,) = check_server_compat(info(""))
    assert "empty schema_release" in warning


@pytest.mark.parametrize("release", ["main", "v0.2.0", "768a93c", "768a93c7b44", "768a93c7b44g", "latest-768a93c7b44e"])
def test_moving_or_short_names_refused(release: str) -> None:
    with pytest.raises(SchemaIncompatible, match="not an immutable release id"):
        check_server_compat(info(release))


def test_other_immutable_id_refused_unless_expected() -> None:
    with pytest.raises(SchemaIncompatible, match="not the pinned"):
        check_server_compat(info(OTHER))
    (warning,) = check_server_compat(info(OTHER), expected_release=OTHER[:12])
    assert "differs" in warning
    assert check_server_compat(info(OTHER[:12]), expected_release=OTHER) != []


def test_expected_release_is_an_assertion() -> None:
    with pytest.raises(SchemaIncompatible, match="does not match the expected"):
        check_server_compat(info(FULL), expected_release=OTHER)
    assert check_server_compat(info(FULL[:12]), expected_release=FULL) == []
    with pytest.raises(ValueError, match="expected_release"):
        check_server_compat(info(FULL), expected_release="main")


@pytest.mark.parametrize(
    ("revision", "minimum", "match"),
    [(0, 0, "schema_revision 0"), (1, 2, "client revision >= 2"), (3, 2, "client revision >= 2")],
)
def test_revisions_refused(revision: int, minimum: int, match: str) -> None:
    with pytest.raises(SchemaIncompatible, match=match):
        check_server_compat(info(revision=revision, minimum=minimum))


def test_newer_additive_revision_warns() -> None:
    (warning,) = check_server_compat(info(revision=2, minimum=1))
    assert "newer" in warning


def test_expected_engine() -> None:
    assert check_server_compat(info(engine="tensorrt_llm"), expected_engine="tensorrt_llm") == []
    with pytest.raises(SchemaIncompatible, match="expected 'vllm'"):
        check_server_compat(info(engine="tensorrt_llm"), expected_engine="vllm")
    assert "empty engine_name" in check_server_compat(info(engine=""))[0]


def test_refusal_is_one_line() -> None:
    with pytest.raises(SchemaIncompatible) as caught:
        check_server_compat(info("main"))
    assert "\n" not in str(caught.value)
    assert issubclass(SchemaIncompatible, ValueError)


def test_release_matches() -> None:
    assert release_matches(FULL[:12], FULL)
    assert release_matches(FULL, FULL[:12])
    assert not release_matches(FULL[:11], FULL)
    assert not release_matches(OTHER, FULL)
    assert not release_matches("", FULL)
