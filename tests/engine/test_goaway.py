"""The engine's graceful stop is honoured: a GOAWAY drains its connection instead of failing every stream on it.

The engine here is a grpcio server in this process (``grpcio_engine.py``): its ``stop(grace)`` is grpc-core's, the
two-phase GOAWAY TensorRT-LLM sends on SIGTERM. Every test ends with nothing lost: each stream either has all its
tokens and its ``finished`` event, or a typed, migratable error.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpclib.client
import grpclib.protocol
import pytest
import trio
from grpclib.const import Cardinality
from grpclib.exceptions import StreamTerminatedError

from bench._chaos_net import ProxyLink
from openengine.v1 import generation_pb2
from sidecar.engine import EngineClient, EngineClientConfig, open_engine_client, parse_endpoint
from sidecar.errors import DynamoErrorKind, EngineRpcError, GrpcCode
from tests.helpers.waits import wait_until

from .conftest import connected_client
from .grpcio_engine import GrpcioEngine, grpcio_engine

if TYPE_CHECKING:
    from sidecar.edge import Edge

GENERATE = "/openengine.v1.Inference/Generate"


@dataclass
class Outcome:
    """What one Generate stream delivered."""

    tokens: int = 0
    finish_reason: int | None = None
    error: EngineRpcError | None = None
    tokens_at: list[float] = field(default_factory=list)


def request(rid: str, max_tokens: int) -> generation_pb2.GenerateRequest:
    message = generation_pb2.GenerateRequest(request_id=rid, model="m")
    message.stopping.max_tokens = max_tokens
    return message


async def stream(client: EngineClient, rid: str, max_tokens: int, outcome: Outcome) -> None:
    try:
        async with client.generate(request(rid, max_tokens)) as batches:
            async for batch in batches:
                for message in batch:
                    if message.HasField("token"):
                        outcome.tokens += 1
                        outcome.tokens_at.append(time.monotonic())
                    elif message.HasField("finished"):
                        outcome.finish_reason = message.finished.reason
    except EngineRpcError as exc:
        outcome.error = exc


def episode(client: EngineClient) -> tuple[str | None, int]:
    """Why the engine is going away, and how many connections still drain."""
    return client.going_away, client.draining_connections


async def run_streams_and_stop(
    client: EngineClient, engine: GrpcioEngine, *, streams: int, tokens: int, stop_after: int, grace_s: float
) -> tuple[dict[str, Outcome], float]:
    """``streams`` concurrent streams; once each has ``stop_after`` tokens the engine stops with ``grace_s``."""
    outcomes = {f"r{i}": Outcome() for i in range(streams)}
    async with trio.open_nursery() as nursery:
        for rid, outcome in outcomes.items():
            nursery.start_soon(stream, client, rid, tokens, outcome)
        await wait_until(lambda: all(o.tokens >= stop_after for o in outcomes.values()))
        stopped_at = time.monotonic()
        engine.stop(grace_s)
    return outcomes, stopped_at


@pytest.mark.parametrize("transport", ["tcp", "unix"])
async def test_open_streams_finish_across_the_engines_graceful_stop(edge: Edge, tmp_path: Path, transport: str) -> None:
    # Issue 14 item 3: 8 streams of 40 tokens at 20 ms/token, the engine stopped (grace 5 s) after 10 tokens each.
    address = f"unix:{tmp_path / 'engine.sock'}" if transport == "unix" else "127.0.0.1:0"
    with grpcio_engine(token_s=0.02, address=address) as engine, trio.fail_after(60):
        async with connected_client(edge, parse_endpoint(engine.target)) as client:
            outcomes, stopped_at = await run_streams_and_stop(
                client, engine, streams=8, tokens=40, stop_after=10, grace_s=5.0
            )
            assert {rid: (o.tokens, o.finish_reason, o.error) for rid, o in outcomes.items()} == {
                rid: (40, generation_pb2.FINISH_REASON_LENGTH, None) for rid in outcomes
            }
            assert engine.finished == set(outcomes)
            after = sum(sum(t > stopped_at for t in o.tokens_at) for o in outcomes.values())
            assert after >= 8 * 20, f"only {after} tokens arrived after the engine's SIGTERM"
            assert client.going_away is not None
            assert client.going_away.startswith("GOAWAY NO_ERROR")
            await client.wait_drained()
            assert episode(client) == (None, 0)


async def test_streams_cut_at_the_end_of_the_grace_get_a_clean_migratable_error(edge: Edge) -> None:
    with grpcio_engine(token_s=0.02) as engine, trio.fail_after(60):
        async with connected_client(edge, parse_endpoint(engine.target)) as client:
            outcomes, stopped_at = await run_streams_and_stop(
                client, engine, streams=4, tokens=400, stop_after=5, grace_s=0.5
            )
            for outcome in outcomes.values():
                assert outcome.finish_reason is None
                assert outcome.error is not None
                assert outcome.error.code is GrpcCode.UNAVAILABLE
                assert outcome.error.kind is DynamoErrorKind.DISCONNECTED  # the frontend migrates it
                # Streamed on through the grace, then cut: not failed at the GOAWAY.
                assert max(outcome.tokens_at) - stopped_at > 0.2
            await client.wait_drained()
            assert client.draining_connections == 0


async def test_new_calls_go_to_a_fresh_connection_while_the_old_one_drains(edge: Edge) -> None:
    # grpc-core rotates connections with the same two-phase GOAWAY (max_connection_age) while it keeps listening.
    with grpcio_engine(token_s=0.05, max_connection_age_s=0.5) as engine, trio.fail_after(60):
        async with connected_client(edge, parse_endpoint(engine.target), connections=1) as client:
            old = Outcome()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream, client, "old", 60, old)
                await wait_until(lambda: client.going_away is not None)
                assert old.error is None
                assert old.tokens < 60
                fresh = [Outcome() for _ in range(3)]
                for i, outcome in enumerate(fresh):
                    nursery.start_soon(stream, client, f"new{i}", 5, outcome)
            assert (old.tokens, old.finish_reason, old.error) == (60, generation_pb2.FINISH_REASON_LENGTH, None)
            for outcome in fresh:
                assert (outcome.tokens, outcome.error) == (5, None)
            stats = await client.channel_stats()
            assert stats[0].calls_failed == 0
            assert (await client.health()).state


async def test_a_call_parked_at_the_stream_limit_is_retried_on_a_fresh_connection(edge: Edge) -> None:
    # One stream slot per connection: the second call waits in grpclib for the first to end. The GOAWAY wakes it;
    # it is refused before anything was sent, and retried on a new connection.
    with grpcio_engine(token_s=0.05, max_connection_age_s=1.0, max_concurrent_streams=1) as engine:
        with trio.fail_after(60):
            async with connected_client(edge, parse_endpoint(engine.target), connections=1) as client:
                first, parked = Outcome(), Outcome()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(stream, client, "first", 60, first)
                    await wait_until(lambda: first.tokens >= 1)
                    nursery.start_soon(stream, client, "parked", 3, parked)
                    await trio.sleep(0.2)  # not a synchronisation: a negative check, time for a wrong start to show
                    assert parked.tokens == 0, "the second stream should wait for a slot"
                    await wait_until(lambda: parked.tokens == 3, timeout=30)
                    # ... long before the first stream ends: it did not wait for the slot on the old connection.
                    assert first.finish_reason is None
                assert (first.tokens, first.error, parked.error) == (60, None, None)


async def test_idle_connections_close_at_once_on_goaway(edge: Edge) -> None:
    with grpcio_engine() as engine, trio.fail_after(30):
        async with connected_client(edge, parse_endpoint(engine.target), connections=2) as client:
            heard: list[str] = []
            client.on_going_away(heard.append)
            engine.stop(5.0)
            await wait_until(lambda: client.going_away is not None)
            await trio.sleep(0.2)  # not a synchronisation: a negative check, the other connections' GOAWAYs arrive
            assert len(heard) == 1, "one episode, however many of the 3 connections heard it"
            start = trio.current_time()
            await client.wait_drained()
            # Nothing to deliver: not held open for the engine's grace.
            assert trio.current_time() - start < 3.0
            with pytest.raises(EngineRpcError) as refused:
                await client.health(timeout_s=2)
            assert refused.value.code is GrpcCode.UNAVAILABLE


async def test_wait_drained_closes_connections_the_engine_keeps_open(edge: Edge) -> None:
    with grpcio_engine(token_s=0.05) as engine, trio.fail_after(30):
        async with connected_client(edge, parse_endpoint(engine.target), connections=1) as client:
            outcome = Outcome()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream, client, "long", 10_000, outcome)
                await wait_until(lambda: outcome.tokens >= 1)
                engine.stop(60.0)  # a grace far longer than we are prepared to wait
                await wait_until(lambda: client.going_away is not None)
                # The GOAWAY of the stream's connection, sent with the Control one.
                await wait_until(lambda: client.draining_connections >= 1, timeout=10)
                start = trio.current_time()
                await client.wait_drained(timeout_s=0.5)
                assert trio.current_time() - start < 5
            assert client.going_away is None
            assert client.draining_connections == 0
            assert outcome.error is not None
            assert outcome.error.code is GrpcCode.UNAVAILABLE
            assert "GOAWAY" in outcome.error.details


@pytest.mark.parametrize("direct", [False, True], ids=["grpclib-receive", "direct-receive"])
async def test_a_stream_that_reaches_the_engine_between_its_goaways_fails_migratable(edge: Edge, direct: bool) -> None:
    """A request racing the engine's stop: sent before our client heard the first GOAWAY, it reaches grpc-core between
    its two GOAWAYs and is answered trailers-only CANCELLED. That is the engine going away, not a cancel of ours:
    the error is migratable (the frontend moves the request), where before it was a client cancel (HTTP 499).

    A proxy holds every byte 300 ms in each direction, so the GOAWAY reaches the client 300 ms after the engine sent
    it, and a stream opened meanwhile reaches the engine before our PING ACK lets it send the second GOAWAY."""
    with grpcio_engine(token_s=0.05) as engine, trio.fail_after(60):
        host, port = engine.target.rsplit(":", 1)
        link = ProxyLink("127.0.0.1", 0, lambda: (host, int(port)))
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            endpoint = parse_endpoint(f"127.0.0.1:{link.port}")
            async with connected_client(edge, endpoint, connections=1, direct_receive=direct) as client:
                running, racing = Outcome(), Outcome()
                nursery.start_soon(stream, client, "running", 40, running)
                await wait_until(lambda: running.tokens >= 2)
                link.delay(300, 0)
                engine.stop(5.0)
                await trio.sleep(0.05)  # the engine has sent its first GOAWAY; it is 250 ms away from us
                assert client.going_away is None
                await stream(client, "racing", 5, racing)
                await wait_until(lambda: running.finish_reason is not None or running.error is not None)
            nursery.cancel_scope.cancel()
    assert (racing.tokens, racing.finish_reason) == (0, None)
    error = racing.error
    assert error is not None
    assert error.code is GrpcCode.CANCELLED, error
    assert error.kind is DynamoErrorKind.DISCONNECTED, error
    assert error.migratable
    assert error.after_goaway
    assert (running.tokens, running.error) == (40, None), "the stream open at the stop still ran to its end"


# ---------------------------------------------------------------------------------------------- the patch's premises


async def _stock_grpclib_stream(target: str, engine: GrpcioEngine) -> tuple[int, BaseException | None, float]:
    """A plain grpclib channel (none of our transport) streaming 40 tokens while the engine stops gracefully."""
    host, port = target.rsplit(":", 1)
    channel = grpclib.client.Channel(host, int(port))
    tokens, error, stopped_at = 0, None, 0.0
    try:
        async with channel.request(
            GENERATE, Cardinality.UNARY_STREAM, generation_pb2.GenerateRequest, generation_pb2.GenerateResponse
        ) as call:
            await call.send_message(request("stock", 40), end=True)
            while (message := await call.recv_message()) is not None:
                tokens += message.HasField("token")
                if tokens == 10 and not stopped_at:
                    stopped_at = time.monotonic()
                    engine.stop(5.0)
    except (StreamTerminatedError, OSError) as exc:
        error = exc
    finally:
        channel.close()
    return tokens, error, time.monotonic() - stopped_at


async def test_stock_grpclib_still_fails_every_stream_on_goaway(edge: Edge) -> None:
    # If this fails, grpclib learnt to drain on GOAWAY and sidecar/http2 can shrink.
    with grpcio_engine(token_s=0.02) as engine, trio.fail_after(30):
        tokens, error, failed_after_s = await edge.run(_stock_grpclib_stream, engine.target, engine)
    assert isinstance(error, StreamTerminatedError), error
    assert tokens < 40
    assert failed_after_s < 2.5, "stock grpclib kept the stream through the engine's 5 s grace"


# ---------------------------------------------------------------------------------------------- Unix sockets


@pytest.mark.parametrize("kind", ["missing", "regular-file", "stale-socket", "no-permission"])
async def test_a_bad_unix_socket_path_fails_fast_with_its_reason(edge: Edge, tmp_path: Path, kind: str) -> None:
    path = tmp_path / "engine.sock"
    if kind == "regular-file":
        path.write_text("")
    elif kind in ("stale-socket", "no-permission"):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(path))
        if kind == "no-permission":
            if os.geteuid() == 0:
                pytest.skip("root connects to any socket whatever its mode")
            path.chmod(0)
    expected = {
        "missing": "no Unix socket at",
        "regular-file": "is a regular file, not a Unix socket",
        "stale-socket": "nothing listens on the Unix socket",
        "no-permission": "permission denied on the Unix socket",
    }[kind]
    config = EngineClientConfig(parse_endpoint(f"unix:{path}"), connections=1, retry_interval_s=0.1)
    with trio.fail_after(30):
        async with open_engine_client(edge, config) as client:
            with pytest.raises(EngineRpcError) as refused:
                await client.wait_connected(trio.current_time() + 1.0)
    assert refused.value.code is GrpcCode.UNAVAILABLE
    assert expected in refused.value.details, refused.value.details
    assert str(path) in refused.value.details
