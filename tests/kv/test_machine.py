"""The KV subscription machine's own tables (the generic checks run over every kind in tests/statemachines)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import get_args

from statemachines import KV_SUBSCRIPTION, KvSubscriptionLifecycle, kv_subscription

ROOT = Path(__file__).resolve().parents[2]


def test_literals_match_the_machine() -> None:
    assert set(get_args(kv_subscription.KvSubscriptionEvent)) == set(KV_SUBSCRIPTION.events)
    assert get_args(kv_subscription.KvSubscriptionState) == KV_SUBSCRIPTION.states


def test_a_resync_goes_back_through_subscribing() -> None:
    model = KvSubscriptionLifecycle(3)
    for event in ("subscribe", "synced", "resync", "subscribe", "resync", "subscribe", "synced", "stop"):
        assert model.fire(event)
    assert model.state == "stopped"
    assert not model.fire("stop"), "a repeated stop is a documented no-op"
    assert repr(model) == "<KvSubscriptionLifecycle rank 3 stopped>"


def test_no_ops_are_only_repeated_stops() -> None:
    assert {event for _, event in KV_SUBSCRIPTION.no_ops} == {"stop"}
    assert set(KV_SUBSCRIPTION.terminal) == {"stopped", "failed"}


def test_the_diagram_in_kv_events_doc_matches_the_tables() -> None:
    spec = importlib.util.spec_from_file_location("gen_state_docs", ROOT / "scripts" / "gen_state_docs.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = (ROOT / "docs" / "kv-events.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```mermaid\n(.*?)\n```", doc, re.DOTALL)
    assert module.mermaid(KV_SUBSCRIPTION) in blocks, "docs/kv-events.md: refresh the diagram from the tables"
