"""KV events over ZMQ are plaintext: with a TLS engine, a non-loopback ZMQ source is refused unless allowed."""

from __future__ import annotations

import logging

import pytest

from openengine_bp.openengine.v1 import KvEventSource
from sidecar.kv import GrpcSource, RoutingConfig, ZmqSource, discover_routing

from .factories import grpc_source, zmq_source
from .fakes import FakeClient
from .test_signals import Caps


async def plan_for(config: RoutingConfig, *sources: KvEventSource) -> dict[int, object]:
    client = FakeClient()
    client.set_sources(*sources)
    plan = await discover_routing(client, Caps(dp_size=2, dp_start=0), config)  # type: ignore[arg-type]
    return dict(plan.sources)


async def test_a_tls_engine_with_a_remote_zmq_source_gets_no_kv_events(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="sidecar.kv"):
        sources = await plan_for(RoutingConfig(engine_tls=True), grpc_source(0), zmq_source(1, host="10.0.0.7"))
    assert sources == {}, "half a cache view (or a readable one) must not be used"
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "tcp://10.0.0.7:5557" in errors[0].getMessage()
    assert "--kv-events-allow-plaintext" in errors[0].getMessage()


async def test_the_operator_may_allow_it_and_is_warned(caplog: pytest.LogCaptureFixture) -> None:
    config = RoutingConfig(engine_tls=True, allow_plaintext_zmq=True)
    with caplog.at_level(logging.WARNING, logger="sidecar.kv"):
        sources = await plan_for(config, grpc_source(0), zmq_source(1, host="10.0.0.7"))
    assert sources == {0: GrpcSource(0), 1: ZmqSource(1, "tcp://10.0.0.7:5557", "")}
    assert any("plaintext ZMQ" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


@pytest.mark.parametrize(
    ("engine_tls", "host"),
    [(True, "127.0.0.1"), (True, "::1"), (True, "localhost"), (False, "10.0.0.7")],
    ids=["tls-loopback-v4", "tls-loopback-v6", "tls-localhost", "plaintext-engine"],
)
async def test_loopback_sources_and_plaintext_engines_are_unaffected(
    engine_tls: bool, host: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="sidecar.kv"):
        sources = await plan_for(RoutingConfig(engine_tls=engine_tls), grpc_source(0), zmq_source(1, host=host))
    assert set(sources) == {0, 1}
    assert not [r for r in caplog.records if "plaintext" in r.getMessage()]
