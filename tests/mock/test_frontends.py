"""``--frontends N``: N server processes on one port around one engine, as TensorRT-LLM's ``--num_serve_frontends``
(``docs/mock.md``, *Serve frontends*), and the other behaviours of its newer server files the ``trtllm-newer``
profile holds a client to: the request-id limit, the trailing ``UNAVAILABLE``, the stopping group's refusal, DP-rank
targeting, ``GetKvEventSources``' empty list.

The kernel hashes each new connection to one listener, so a test that needs two connections on two frontends opens
connections until it has them (bounded: each lands on a given one of two frontends with probability ½).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from grpclib.client import Channel
from grpclib.const import Status

from openengine.v1 import generation_pb2, kv_pb2, lifecycle_pb2, openengine_grpc, server_pb2
from sidecar.testing.mock.structs import struct_to_dict
from tests.helpers.processes import free_low_port
from tests.helpers.waits import wait_until

from ._client import abort, generate, get_load, make_request, split_address, status_of, wait_for_load
from .conftest import MockProcess, StartMock

T = TypeVar("T")
NEWER = ("--profile", "trtllm-newer")
#: Connections opened to find one on each of two frontends (a miss has probability 2^-n).
_ATTEMPTS = 40


def run(fn: Callable[[], Awaitable[T]], timeout: float = 60.0) -> T:
    return asyncio.run(asyncio.wait_for(fn(), timeout))


def group(start_mock: StartMock, *args: str, frontends: int = 2) -> MockProcess:
    return start_mock(*NEWER, "--frontends", str(frontends), "--port", str(free_low_port()), *args)


async def stats(channel: Channel) -> dict[str, Any]:
    info = await openengine_grpc.ControlStub(channel).GetServerInfo(server_pb2.GetServerInfoRequest())
    found = struct_to_dict(info.extra)["mock_stats"]
    assert isinstance(found, dict)
    return found


def peers(found: dict[str, Any]) -> dict[str, str]:
    """Client connection → the frontend it landed on."""
    return {peer: index for index, f in found["frontends"].items() for peer in f["connections"]}


async def connection_on_each(address: str, count: int = 2) -> dict[str, Channel]:
    """Fresh connections until ``count`` frontends each hold one: frontend → its channel (the rest closed)."""
    host, port = split_address(address)
    held: dict[str, Channel] = {}
    seen: set[str] = set()
    for _ in range(_ATTEMPTS):
        channel = Channel(host, port)
        now = peers(await stats(channel))  # this very call is counted on its connection
        (mine,) = set(now) - seen
        seen = set(now)
        frontend = now[mine]
        if frontend in held:
            channel.close()
        else:
            held[frontend] = channel
        if len(held) == count:
            return held
    raise AssertionError(f"{_ATTEMPTS} connections did not reach {count} frontends")


def test_n_processes_share_the_port_and_one_engine(start_mock: StartMock) -> None:
    mock = group(start_mock, frontends=2)
    host, port = split_address(mock.address)

    async def main() -> dict[str, Any]:
        for i in range(24):  # 24 connections: all on one frontend with probability 2^-23
            channel = Channel(host, port)
            try:
                outcome = await generate(channel, make_request(f"spread-{i}", max_tokens=3))
                assert (outcome.status, outcome.events[-1]) == (Status.OK, "finished")
            finally:
                channel.close()
        channel = Channel(host, port)
        try:
            return await stats(channel)
        finally:
            channel.close()

    found = run(main)
    frontends = found["frontends"]
    assert set(frontends) == {"0", "1"}
    pids = {f["pid"] for f in frontends.values()}
    assert len(pids) == 2, "two processes"
    assert float(mock.proc.pid) in pids, "the launcher is one of them"
    assert all(f["generate_streams"] >= 1 for f in frontends.values()), "the kernel spread the connections"
    assert sum(f["generate_streams"] for f in frontends.values()) == 24
    assert found["requests"] == 24, "one engine served every request, whichever process took its connection"
    assert {found["served_by"][f"spread-{i}"]["frontend"] for i in range(24)} == {0.0, 1.0}
    assert (found["live_requests"], found["used_kv_blocks"]) == (0, 0)
    assert mock.stop() == 0
    assert "frontend 1 stopped" in mock.log()


def test_abort_and_get_load_reach_the_engine_from_any_frontend(start_mock: StartMock) -> None:
    mock = group(start_mock, frontends=2)

    async def main() -> tuple[Any, ...]:
        channels = await connection_on_each(mock.address)
        (a, on_a), (b, on_b) = sorted(channels.items())
        try:
            hung = asyncio.create_task(
                generate(on_a, make_request("hung", max_tokens=40, mock={"hang_after_tokens": 1}))
            )
            await wait_for_load(on_b, lambda load: load.running_requests == 1)  # asked on the other frontend
            answer = await abort(on_b, "hung")
            outcome = await hung
            after = await stats(on_b)
            load = await get_load(on_a)
            return a, b, answer, outcome, after, load
        finally:
            for channel in channels.values():
                channel.close()

    a, b, answer, outcome, after, load = run(main)
    assert a != b
    assert after["served_by"]["hung"]["frontend"] == float(a), "the stream came in on one frontend"
    assert answer.status == lifecycle_pb2.ABORT_STATUS_ABORTED, "the Abort on the other reached it"
    assert (outcome.status, outcome.finished()[0].reason) == (Status.OK, generation_pb2.FINISH_REASON_CANCELLED)
    assert (after["requests_aborted"], after["live_requests"], after["used_kv_blocks"]) == (1, 0, 0)
    assert load.running_requests == 0


def test_get_load_counts_every_frontends_requests(start_mock: StartMock) -> None:
    mock = group(start_mock, frontends=2)

    async def main() -> list[int]:
        channels = await connection_on_each(mock.address)
        try:
            hung = [
                asyncio.create_task(
                    generate(ch, make_request(f"load-{i}", max_tokens=40, mock={"hang_after_tokens": 1}))
                )
                for i, ch in enumerate(channels.values())
            ]
            counts = [
                (await wait_for_load(ch, lambda load: load.running_requests == 2)).running_requests
                for ch in channels.values()
            ]
            await abort(next(iter(channels.values())), all_requests=True)
            await asyncio.gather(*hung)
            return counts
        finally:
            for channel in channels.values():
                channel.close()

    assert run(main) == [2, 2], "each frontend reports both requests, its own and the other's"


def test_request_ids_above_1024_bytes_are_refused_only_with_several_frontends(start_mock: StartMock) -> None:
    several = group(start_mock, frontends=2)
    one = start_mock(*NEWER)
    longest, too_long = "é" * 512, "é" * 513  # 1024 and 1026 UTF-8 bytes

    async def on(address: str) -> tuple[Any, ...]:
        host, port = split_address(address)
        channel = Channel(host, port)
        try:
            ok = await generate(channel, make_request(longest, max_tokens=2))
            refused = await generate(channel, make_request(too_long, max_tokens=2))
            aborted = await status_of(abort(channel, too_long))
            return ok.status, (refused.status, refused.messages, refused.details), aborted[0]
        finally:
            channel.close()

    ok, refused, aborted = run(lambda: on(several.address))
    assert ok == Status.OK
    assert refused == (
        Status.INVALID_ARGUMENT,
        [],
        "request_id must not exceed 1024 UTF-8 bytes with multiple frontends",
    )
    assert aborted == Status.INVALID_ARGUMENT
    ok, refused, aborted = run(lambda: on(one.address))
    assert (ok, refused[0], aborted) == (Status.OK, Status.OK, Status.OK), "one frontend: no coordinator, no limit"


@pytest.mark.parametrize("frontends", [1, 2])
def test_a_trailing_unavailable_follows_every_response(start_mock: StartMock, frontends: int) -> None:
    mock = group(start_mock, frontends=frontends) if frontends > 1 else start_mock(*NEWER)

    async def main() -> Any:
        host, port = split_address(mock.address)
        channel = Channel(host, port)
        try:
            return await generate(
                channel, make_request(max_tokens=4, ignore_eos=True, mock={"trailing_unavailable": True})
            )
        finally:
            channel.close()

    outcome = run(main)
    assert outcome.events == ["token"] * 4 + ["finished"], "every response, the terminal one included"
    assert outcome.final.HasField("usage")
    assert outcome.status == Status.UNAVAILABLE
    assert outcome.transport_error is None, "a status, not a lost connection"


def test_a_dropped_connection_through_another_frontend_drops_the_clients(start_mock: StartMock) -> None:
    mock = group(start_mock, frontends=2)

    async def main() -> tuple[Any, Any, Any]:
        channels = await connection_on_each(mock.address)
        try:
            dropped = await generate(channels["1"], make_request(max_tokens=8, mock={"drop_after_tokens": 2}))
            other = await generate(channels["0"], make_request(max_tokens=2))
            again = await generate(channels["1"], make_request(max_tokens=2))  # grpclib reconnects
            return dropped, other, again
        finally:
            for channel in channels.values():
                channel.close()

    dropped, other, again = run(main)
    assert dropped.transport_error is not None, "the client's connection went, no status"
    assert dropped.events == ["token", "token"]
    assert other.status == again.status == Status.OK


def test_a_stopping_group_refuses_new_requests_unavailable(start_mock: StartMock) -> None:
    """The launcher got SIGTERM and is in its grace (a request hangs): an attached frontend that has not heard yet
    (its heartbeat is far off) forwards a new ``Generate``, which the engine refuses as TensorRT-LLM's coordinator
    refuses a reservation once the group stops. Both requests go through frontend 1: the launcher's GOAWAY would
    make grpclib's client drop its connection to frontend 0."""
    mock = group(start_mock, "--frontend-heartbeat-secs", "60", "--stop-grace-secs", "20", frontends=2)

    async def main() -> Any:
        channels = await connection_on_each(mock.address)
        attached = channels["1"]
        try:
            request = make_request("held", max_tokens=40, mock={"hang_after_tokens": 1})
            hung = asyncio.create_task(generate(attached, request))
            await wait_for_load(attached, lambda load: load.running_requests == 1)
            os.kill(mock.proc.pid, signal.SIGTERM)
            await wait_until(lambda: "stop signal: GOAWAY sent" in mock.log(), timeout=10, what="the launcher stopping")
            refused = await generate(attached, make_request(max_tokens=2))
            hung.cancel()  # a reset stream ends the grace at once (an Abort's answer could meet frontend 1's GOAWAY)
            return refused
        finally:
            for channel in channels.values():
                channel.close()

    refused = run(main)
    assert (refused.status, refused.messages, refused.details) == (
        Status.UNAVAILABLE,
        [],
        "Frontend group is not ready",
    )
    assert mock.proc.wait(30) == 0
    assert "frontend 1 stopped" in mock.log()


def test_the_group_stops_when_a_frontend_dies(start_mock: StartMock) -> None:
    mock = group(start_mock, frontends=2)

    async def main() -> dict[str, Any]:
        host, port = split_address(mock.address)
        channel = Channel(host, port)
        try:
            return await stats(channel)
        finally:
            channel.close()

    child = int(run(main)["frontends"]["1"]["pid"])
    os.kill(child, signal.SIGKILL)
    assert mock.proc.wait(30) == 1
    assert "frontend 1 exited with status -9; stopping the serving group" in mock.log()


def test_frontends_are_refused_where_the_server_has_one(start_mock: StartMock) -> None:
    for args, reason in [
        (("--frontends", "2", "--port", "4000"), "the trtllm profile serves one frontend"),
        ((*NEWER, "--frontends", "2"), "--frontends needs a fixed --port"),
        (("--data-parallel-size", "2"), "the trtllm profile reports no data_parallel_size"),
    ]:
        mock = start_mock(*args, wait=False)
        assert mock.proc.wait(30) == 2
        assert reason in mock.log(), mock.log()


def test_newer_targets_dp_ranks_within_its_size_and_lists_no_kv_event_sources(start_mock: StartMock) -> None:
    mock = start_mock(*NEWER, "--data-parallel-size", "2")

    async def main() -> tuple[Any, ...]:
        host, port = split_address(mock.address)
        channel = Channel(host, port)
        try:
            control = openengine_grpc.ControlStub(channel)
            info = await control.GetServerInfo(server_pb2.GetServerInfoRequest())
            ranks = [
                (
                    await generate(channel, make_request(max_tokens=2), metadata=[("openengine-target-dp-rank", r)])
                ).status
                for r in ("0", "1", "2")
            ]
            sources = await control.GetKvEventSources(kv_pb2.GetKvEventSourcesRequest())
            subscribe = await status_of(_subscribe(control))
            return info, ranks, sources, subscribe, await stats(channel)
        finally:
            channel.close()

    info, ranks, sources, subscribe, found = run(main)
    assert info.parallelism.data_parallel_size == 2
    assert struct_to_dict(info.extra)["trtllm_supports_dp_rank_targeting"] is True
    assert ranks == [Status.OK, Status.OK, Status.INVALID_ARGUMENT]
    assert found["target_dp_ranks"] == {"0": 1, "1": 1}, "the mock records the ranks it was asked for"
    assert list(sources.sources) == [], "KV events not configured: an empty list"
    assert subscribe[0] == Status.UNIMPLEMENTED


async def _subscribe(control: openengine_grpc.ControlStub) -> None:
    async with control.SubscribeKvEvents.open() as stream:
        await stream.send_message(kv_pb2.SubscribeKvEventsRequest(), end=True)
        await stream.recv_message()
