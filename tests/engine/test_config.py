"""EngineClientConfig: defaults and refused values."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from sidecar.engine import EngineClientConfig, parse_endpoint

ENDPOINT = parse_endpoint("127.0.0.1:50051")


def test_defaults() -> None:
    config = EngineClientConfig(ENDPOINT)
    assert config.connections == 8
    assert config.max_message_bytes == 64 * 2**20
    assert config.keepalive_interval_s == 30.0
    assert config.rpc_timeout_s == 30.0
    assert config.connect_attempt_timeout_s == 30.0
    assert config.retry_interval_s == 1.0
    assert config.startup_deadline_s == 1800.0
    assert config.stream_window_bytes == 2**20
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.connections = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("connections", 0, "connections"),
        ("keepalive_interval_s", 9.9, "too_many_pings"),
        ("keepalive_interval_s", float("nan"), "too_many_pings"),
        ("rpc_timeout_s", 0, "rpc_timeout_s"),
        ("retry_interval_s", -1, "retry_interval_s"),
        ("startup_deadline_s", float("inf"), "startup_deadline_s"),
        ("stream_window_bytes", 1024, "stream_window_bytes"),
        ("connection_window_bytes", 2**31, "connection_window_bytes"),
        ("max_message_bytes", 10, "max_message_bytes"),
    ],
)
def test_refused(field: str, value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineClientConfig(ENDPOINT, **{field: value})


def test_endpoint_must_be_parsed() -> None:
    with pytest.raises(TypeError, match="parse_endpoint"):
        EngineClientConfig("127.0.0.1:1")  # type: ignore[arg-type]
