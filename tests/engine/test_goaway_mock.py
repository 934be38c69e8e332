"""The engine client against an engine stopping like grpc-core (TensorRT-LLM's SIGTERM): GOAWAY, then the open
streams keep running until they end (the mock's grace, ``--stop-grace-secs``)."""

from __future__ import annotations

import os
import signal

import pytest
import trio

from openengine.v1 import generation_pb2
from sidecar.edge import Edge
from sidecar.engine import EngineClientConfig, open_engine_client
from tests.helpers.waits import wait_until

from .conftest import start_mock
from .test_client_mock import collect, flat, make_request

pytestmark = pytest.mark.e2e

STREAMS = 4
TOKENS = 40


async def test_open_streams_run_to_their_end_after_the_engines_goaway(edge: Edge) -> None:
    results: list[list[generation_pb2.GenerateResponse]] = []
    with trio.fail_after(60):
        async with (
            start_mock("--speedup", "1", "--decode-ms-per-token", "20") as mock,
            open_engine_client(edge, EngineClientConfig(endpoint=mock.endpoint, connections=1)) as client,
        ):
            await client.wait_connected(trio.current_time() + 20)
            async with trio.open_nursery() as nursery:

                async def one(batches: list[list[generation_pb2.GenerateResponse]]) -> None:
                    results.append(flat(await collect(client, make_request(max_tokens=TOKENS), into=batches)))

                progress: list[list[list[generation_pb2.GenerateResponse]]] = [[] for _ in range(STREAMS)]
                for batches in progress:
                    nursery.start_soon(one, batches)
                # The engine stops with every stream ~10 tokens in.
                await wait_until(lambda: all(_tokens(flat(b)) >= 10 for b in progress), timeout=20)
                os.kill(mock.process.pid, signal.SIGTERM)
    assert len(results) == STREAMS
    for messages in results:
        assert _tokens(messages) == TOKENS
        assert messages[-1].finished.reason == generation_pb2.FINISH_REASON_LENGTH


def _tokens(messages: list[generation_pb2.GenerateResponse]) -> int:
    return sum(len(m.token.tokens) for m in messages if m.WhichOneof("event") == "token")
