"""An engine that closes connections before HTTP/2 begins: the TLS hint only where TLS is the likely cause.

A plaintext engine that answered a moment ago and now accepts connections and closes them (its port going down while
it restarts) is restarting, not serving TLS (issue 31 item 4): no hint, no warning. A never-answering one still gets
the hint.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING

import pytest
import trio

from sidecar.engine import Endpoint, EngineClientConfig, open_engine_client
from sidecar.errors import EngineRpcError, GrpcCode

from .conftest import free_port
from .fake_engine import fake_engine

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from sidecar.edge import Edge

TLS_HINT = "if it serves TLS, pass --grpc-tls-ca"


@asynccontextmanager
async def closing_listener(port: int) -> AsyncIterator[None]:
    """Accept on ``port`` and close every connection at once, saying nothing (an engine's port going down)."""

    async def close(stream: trio.SocketStream) -> None:
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        await nursery.start(partial(trio.serve_tcp, close, port, host="127.0.0.1"))
        yield
        nursery.cancel_scope.cancel()


async def failure(edge: Edge, endpoint: Endpoint, config: EngineClientConfig | None = None) -> str:
    config = config or EngineClientConfig(endpoint, connections=1, retry_interval_s=0.1, rpc_timeout_s=5.0)
    async with open_engine_client(edge, config) as client:
        with pytest.raises(EngineRpcError) as failed:
            await client.get_server_info(timeout_s=2.0)
    assert failed.value.code is GrpcCode.UNAVAILABLE
    return failed.value.details


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sidecar.engine" and r.levelno >= logging.WARNING]


async def test_an_engine_that_answered_before_and_now_closes_early_is_restarting_not_tls(
    edge: Edge, caplog: pytest.LogCaptureFixture
) -> None:
    """Failed before: every reconnect attempt during an engine restart warned "the engine closed the connection
    before HTTP/2 began; if it serves TLS, pass --grpc-tls-ca" about an engine that served plaintext a moment ago."""
    port = free_port()
    endpoint = Endpoint("127.0.0.1", port)
    config = EngineClientConfig(endpoint, connections=1, retry_interval_s=0.1, rpc_timeout_s=5.0)
    with trio.fail_after(30), caplog.at_level(logging.INFO, logger="sidecar.engine"):
        async with open_engine_client(edge, config) as client:
            async with fake_engine(edge, port=port):
                await client.get_server_info(timeout_s=5.0)
            # The engine restarts: its port accepts connections and closes them before a byte of HTTP/2.
            async with closing_listener(port):
                with pytest.raises(EngineRpcError) as failed:
                    await client.get_server_info(timeout_s=2.0)
    assert failed.value.code is GrpcCode.UNAVAILABLE
    reason = failed.value.details
    assert "closed the connection before HTTP/2 began" in reason, reason
    assert "TLS" not in reason, reason
    assert warnings_of(caplog) == []


async def test_a_never_answering_engine_that_closes_early_still_gets_the_tls_hint(edge: Edge) -> None:
    port = free_port()
    with trio.fail_after(30):
        async with closing_listener(port):
            reason = await failure(edge, Endpoint("127.0.0.1", port))
    assert TLS_HINT in reason, reason
