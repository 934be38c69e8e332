"""``docs/operator-guide.md``: its flag tables are generated from the parsers and must not drift."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sidecar.cli import build_parser
from sidecar.ops import guide
from sidecar.ops.cli import build_parser as build_ops_parser

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "operator-guide.md"


def test_the_committed_flag_tables_are_current() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    assert guide.update_guide(text) == text, "docs/operator-guide.md is stale: run `python scripts/gen_state_docs.py`"


def test_every_flag_and_environment_twin_is_documented() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    parsers = [build_parser(), build_ops_parser()]
    sub = next(a for a in parsers[1]._actions if isinstance(a, argparse._SubParsersAction))
    parsers += list(sub.choices.values())
    for parser in parsers:
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in text, option
    for env in ("DYN_SIDECAR_OPS_PORT", "DYN_SIDECAR_OPS_HOST", "DYN_SIDECAR_LOG_FORMAT", "DYN_SIDECAR_GRPC_ENDPOINT"):
        assert f"`{env}`" in text


def test_tables_do_not_depend_on_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    clean = guide.flag_tables()
    monkeypatch.setenv("DYN_NAMESPACE", "from-the-environment")
    monkeypatch.setenv("DYN_SIDECAR_OPS_PORT", "1234")
    assert guide.flag_tables() == clean


def test_a_new_flag_makes_the_guide_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    text = GUIDE.read_text(encoding="utf-8")

    def extended() -> argparse.ArgumentParser:
        parser = build_parser()
        parser.add_argument("--brand-new", help="a flag nobody documented [env DYN_BRAND_NEW]")
        return parser

    monkeypatch.setattr("sidecar.cli.build_parser", extended)
    assert "`--brand-new` | `DYN_BRAND_NEW`" in guide.update_guide(text)


def test_every_exported_metric_family_is_in_the_guide() -> None:
    """With the whole worker imported (every module that registers a family), each family has a row."""
    import sidecar.worker  # noqa: F401
    from sidecar.ops import metrics

    text = GUIDE.read_text(encoding="utf-8")
    table = text[text.index(guide.METRICS_BEGIN) : text.index(guide.METRICS_END)]
    documented = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    assert documented == {doc.name for doc in metrics.catalogue()}


def test_a_new_metric_makes_the_guide_stale() -> None:
    from prometheus_client import Counter

    from sidecar.ops import metrics

    text = GUIDE.read_text(encoding="utf-8")
    extra = Counter("openengine_sidecar_brand_new", "a family nobody documented", ["why"], registry=metrics.REGISTRY)
    try:
        assert "| `openengine_sidecar_brand_new_total` | counter | `why` |" in guide.update_guide(text)
        assert guide.update_guide(text) != text
    finally:
        metrics.REGISTRY.unregister(extra)
