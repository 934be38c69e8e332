"""Distributed settings: the same flags and variables Dynamo's workers use, checked before anything starts."""

from __future__ import annotations

import pytest

from sidecar.cli import CONTROL_PLANE_TIMEOUT_VARIABLES, apply_control_plane_deadline, parse_config
from sidecar.dynamo import DynamoSettings
from sidecar.dynamo._bindings import control_plane
from tests.helpers.cli import assert_refused, base_argv


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "DYN_DISCOVERY_BACKEND",
        "DYN_REQUEST_PLANE",
        "DYN_EVENT_PLANE",
        "DYN_SIDECAR_CONTROL_PLANE_DEADLINE_SECS",
        "ETCD_ENDPOINTS",
        "NATS_SERVER",
        *CONTROL_PLANE_TIMEOUT_VARIABLES,
    ):
        monkeypatch.delenv(name, raising=False)


def test_planes_come_from_dynamos_variables_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_DISCOVERY_BACKEND", "etcd")
    monkeypatch.setenv("DYN_REQUEST_PLANE", "nats")
    monkeypatch.setenv("DYN_EVENT_PLANE", "nats")
    config = parse_config(base_argv())
    assert (config.discovery_backend, config.request_plane, config.event_plane) == ("etcd", "nats", "nats")
    config = parse_config(base_argv("--request-plane", "tcp", "--event-plane", "zmq"))
    assert (config.request_plane, config.event_plane) == ("tcp", "zmq")


def test_control_plane_deadline_flag_and_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_config(base_argv()).control_plane_deadline_s == 60.0
    monkeypatch.setenv("DYN_SIDECAR_CONTROL_PLANE_DEADLINE_SECS", "7.5")
    assert parse_config(base_argv()).control_plane_deadline_s == 7.5
    assert parse_config(base_argv("--control-plane-deadline-secs", "3")).control_plane_deadline_s == 3.0


def test_the_deadline_becomes_dynamos_startup_timeouts_unless_the_operator_set_them() -> None:
    config = parse_config(base_argv("--control-plane-deadline-secs", "2.5"))
    environ: dict[str, str] = {}
    assert apply_control_plane_deadline(config, environ) == list(CONTROL_PLANE_TIMEOUT_VARIABLES)
    assert environ == dict.fromkeys(CONTROL_PLANE_TIMEOUT_VARIABLES, "3")
    environ = {"ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS": "90"}
    assert apply_control_plane_deadline(config, environ) == ["NATS_STARTUP_CONNECT_TIMEOUT_SECONDS"]
    assert environ["ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS"] == "90"


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (base_argv("--request-plane", "nats"), {"NATS_SERVER": "http://cp:4222"}, "NATS_SERVER"),
        (base_argv("--event-plane", "nats"), {"NATS_SERVER": "cp:4222"}, "NATS_SERVER"),
        (base_argv("--discovery-backend", "etcd"), {"ETCD_ENDPOINTS": "http://cp:2379,,"}, "ETCD_ENDPOINTS"),
        (base_argv("--control-plane-deadline-secs", "0"), {}, "--control-plane-deadline-secs"),
    ],
)
def test_bad_control_plane_settings_fail_fast(
    argv: list[str],
    env: dict[str, str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert_refused(argv, env, message, monkeypatch, capsys)


def test_unused_plane_variables_are_not_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_SERVER", "not-a-url")
    monkeypatch.setenv("ETCD_ENDPOINTS", ",")
    config = parse_config([*base_argv(), "--discovery-backend", "file"])  # neither etcd nor NATS in use
    assert config.request_plane == "tcp"


def test_log_lines_name_what_the_runtime_connects_to(monkeypatch: pytest.MonkeyPatch) -> None:
    assert control_plane(DynamoSettings()) == ""
    distributed = DynamoSettings(discovery_backend="etcd", request_plane="nats", event_plane="zmq")
    assert control_plane(distributed) == "etcd at http://localhost:2379, NATS at nats://localhost:4222"
    monkeypatch.setenv("ETCD_ENDPOINTS", "http://10.0.0.1:2379,http://10.0.0.2:2379")
    monkeypatch.setenv("NATS_SERVER", "nats://10.0.0.1:4222")
    assert (
        control_plane(distributed) == "etcd at http://10.0.0.1:2379,http://10.0.0.2:2379, NATS at nats://10.0.0.1:4222"
    )
