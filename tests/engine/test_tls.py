"""TLS towards the engine in operation: bad server certificates refused (never served), failures said in one line
naming the flag to check, and rotated files used without a restart.

The engine is the in-process fake over TLS (``fake_engine.py``); its recorder proves what it served.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio
import trustme

from sidecar.engine import Endpoint, EngineClient, EngineClientConfig, open_engine_client
from sidecar.errors import EngineRpcError, GrpcCode
from tests.helpers.pki import Pki, ago, ahead

from .fake_engine import fake_engine

if TYPE_CHECKING:
    from sidecar.edge import Edge


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki.create(tmp_path)


def client_config(endpoint: Endpoint, pki: Pki | None, *, mutual: bool = False, **extra: object) -> EngineClientConfig:
    tls: dict[str, object] = {}
    if pki is not None:
        endpoint = Endpoint(endpoint.host, endpoint.port, tls=True)
        tls["tls_ca"] = pki.ca_pem
        if mutual:
            tls.update(tls_cert=pki.client_crt, tls_key=pki.client_key)
    settings: dict[str, object] = {"connections": 1, "retry_interval_s": 0.1, "rpc_timeout_s": 5.0, **tls, **extra}
    return EngineClientConfig(endpoint, **settings)  # type: ignore[arg-type]


@asynccontextmanager
async def client_for(edge: Edge, config: EngineClientConfig) -> AsyncIterator[EngineClient]:
    async with open_engine_client(edge, config) as client:
        yield client


async def refused(client: EngineClient, within_s: float = 1.5) -> str:
    """``wait_connected`` fails: the reason the client gives."""
    with pytest.raises(EngineRpcError) as failed:
        await client.wait_connected(trio.current_time() + within_s)
    assert failed.value.code is GrpcCode.UNAVAILABLE
    return failed.value.details


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sidecar.engine" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
async def test_tls_and_mutual_tls_serve(edge: Edge, pki: Pki, mutual: bool) -> None:
    server = pki.server_context(client_ca=pki.ca if mutual else None)
    with trio.fail_after(30):
        async with (
            fake_engine(edge, tls=server) as (endpoint, recorder),
            client_for(edge, client_config(endpoint, pki, mutual=mutual)) as client,
        ):
            await client.wait_connected(trio.current_time() + 10)
            assert (await client.health()).state
    assert {call.method for call in recorder.calls} == {"GetServerInfo", "Health"}


@pytest.mark.parametrize(
    ("certificate", "expected"),
    [
        ("expired", "the engine's certificate has expired"),
        ("not-yet-valid", "the engine's certificate is not valid yet"),
        ("wrong-host", "the engine's certificate does not name 127.0.0.1 (the host in --grpc-endpoint)"),
        ("other-ca", "the engine's certificate is not signed by the CA in --grpc-tls-ca"),
    ],
)
async def test_a_bad_server_certificate_is_refused_and_never_served(
    edge: Edge, pki: Pki, certificate: str, expected: str, caplog: pytest.LogCaptureFixture
) -> None:
    if certificate == "expired":
        pki.write_server(not_before=ago(days=2), not_after=ago(days=1))
    elif certificate == "not-yet-valid":
        pki.write_server(not_before=ahead(days=1), not_after=ahead(days=2))
    elif certificate == "wrong-host":
        pki.write_server("engine.example")
    else:
        pki.write_server(ca=trustme.CA())
    with trio.fail_after(30), caplog.at_level(logging.WARNING, logger="sidecar.engine"):
        async with (
            fake_engine(edge, tls=pki.server_context()) as (endpoint, recorder),
            client_for(edge, client_config(endpoint, pki)) as client,
        ):
            reason = await refused(client)
    assert expected in reason, reason
    assert recorder.calls == [], "a refused engine must never be sent an RPC"
    tls_lines = [line for line in warnings_of(caplog) if expected in line]
    assert len(tls_lines) == 1, warnings_of(caplog)  # once, however many attempts


@pytest.mark.parametrize(
    ("client_cert", "expected"),
    [
        ("none", "pass --grpc-tls-cert and --grpc-tls-key"),
        ("other-ca", "rejected our client certificate; check --grpc-tls-cert ({crt})"),
        ("expired", "rejected our client certificate; check --grpc-tls-cert ({crt})"),
    ],
)
async def test_a_missing_or_rejected_client_certificate_is_said_naming_the_flag(
    edge: Edge, pki: Pki, client_cert: str, expected: str, caplog: pytest.LogCaptureFixture
) -> None:
    if client_cert == "other-ca":
        pki.write_client(ca=trustme.CA())
    elif client_cert == "expired":
        pki.write_client(not_after=ago(hours=1))
    expected = expected.format(crt=pki.client_crt)
    config = client_config(Endpoint("127.0.0.1", 1), pki, mutual=client_cert != "none")
    with trio.fail_after(30), caplog.at_level(logging.WARNING, logger="sidecar.engine"):
        async with fake_engine(edge, tls=pki.server_context(client_ca=pki.ca)) as (endpoint, recorder):
            config = client_config(endpoint, pki, mutual=client_cert != "none")
            async with client_for(edge, config) as client:
                reason = await refused(client)
    assert expected in reason, reason
    assert "Connection lost" not in reason
    assert recorder.calls == []
    assert any(expected in line for line in warnings_of(caplog)), warnings_of(caplog)


async def test_a_plaintext_client_against_a_tls_engine_is_told_to_configure_tls(
    edge: Edge, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(30), caplog.at_level(logging.WARNING, logger="sidecar.engine"):
        async with fake_engine(edge, tls=pki.server_context()) as (endpoint, recorder):
            plain = Endpoint(endpoint.host, endpoint.port)
            async with client_for(edge, client_config(plain, None)) as client:
                reason = await refused(client)
    assert "pass --grpc-tls-ca" in reason, reason
    assert recorder.calls == []
    assert any("pass --grpc-tls-ca" in line for line in warnings_of(caplog))


async def test_a_tls_client_against_a_plaintext_engine_is_told_it_does_not_speak_tls(edge: Edge, pki: Pki) -> None:
    with trio.fail_after(30):
        async with (
            fake_engine(edge) as (endpoint, recorder),
            client_for(edge, client_config(endpoint, pki)) as client,
        ):
            reason = await refused(client)
    assert "drop --grpc-tls-ca and use http://host:port" in reason, reason
    assert recorder.calls == []


async def test_rotated_client_certificate_and_ca_are_used_on_the_next_connection(edge: Edge, pki: Pki) -> None:
    # cert-manager / Vault agent / a Kubernetes secret replace the files while the client runs; the engine restarts
    # trusting only the new client CA. The next connection must present the new certificate, without our restart.
    with trio.fail_after(60):
        first = fake_engine(edge, tls=pki.server_context(client_ca=pki.ca))
        endpoint, _ = await first.__aenter__()
        async with client_for(edge, client_config(endpoint, pki, mutual=True)) as client:
            try:
                await client.wait_connected(trio.current_time() + 10)
            finally:
                await first.__aexit__(None, None, None)  # the engine stops; its connections go
            new_ca = trustme.CA()
            pki.write_client(ca=new_ca)
            restarted = fake_engine(edge, tls=pki.server_context(client_ca=new_ca), port=endpoint.port)
            async with restarted as (_, recorder):
                await client.wait_connected(trio.current_time() + 10)
                assert (await client.health()).state
    assert "Health" in {call.method for call in recorder.calls}
