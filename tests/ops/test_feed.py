"""The live state feed and the ops port, in process: real loopback sockets, a real trio-websocket client."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from sidecar.ops.feed import StateFeed
from sidecar.ops.server import serve_ops
from statemachines import KINDS, REQUEST, WORKER, RequestLifecycle, WorkerLifecycle

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from trio_websocket import WebSocketConnection

TIMEOUT = 10


@asynccontextmanager
async def ops_server(feed: StateFeed) -> AsyncIterator[str]:
    """The feed (observers installed) served on an OS-picked loopback port; yields ``host:port``."""
    feed.install()
    try:
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(serve_ops, feed, "127.0.0.1", 0)
            assert host == "127.0.0.1"
            yield f"{host}:{port}"
            nursery.cancel_scope.cancel(reason="test done")
    finally:
        feed.uninstall()


async def next_json(ws: WebSocketConnection) -> dict[str, Any]:
    message = json.loads(await ws.get_message())
    assert isinstance(message, dict)
    return message


def finish(request: RequestLifecycle) -> None:
    request.fire("submit")
    request.fire("first_token")
    request.fire("finish")


async def test_snapshot_then_every_transition_in_order() -> None:
    worker = WorkerLifecycle()
    feed = StateFeed(worker=worker, interval_s=0.01)
    with trio.fail_after(TIMEOUT):
        async with ops_server(feed) as address, open_websocket_url(f"ws://{address}/ws") as ws:
            snapshot = await next_json(ws)
            assert snapshot["type"] == "snapshot"
            assert snapshot["worker"] == {"state": "starting", "reason": None}
            assert [m["name"] for m in snapshot["machines"]] == [kind.name for kind in KINDS]
            assert snapshot["machines"][1]["terminal"] == ["finished", "rejected", "cancelled", "failed"]
            assert snapshot["counts"]["request"] == REQUEST.counts()
            finished_before = snapshot["counts"]["request"]["finished"]

            worker.fire("connect", reason="engine:1")
            requests = [RequestLifecycle(f"feed-{i}") for i in range(3)]
            for request in requests:
                finish(request)
            rejected = RequestLifecycle("feed-rejected")
            rejected.fire("reject", reason="bad option")
            expected = [("worker", "connect", "starting", "connecting")]
            expected += [
                (f"feed-{i}", event, source, dest)
                for i in range(3)
                for event, source, dest in (
                    ("submit", "received", "submitted"),
                    ("first_token", "submitted", "streaming"),
                    ("finish", "streaming", "finished"),
                )
            ]
            expected.append(("feed-rejected", "reject", "received", "rejected"))

            events: list[dict[str, Any]] = []
            last: dict[str, Any] = {}
            while len(events) < len(expected):
                last = await next_json(ws)
                assert last["type"] == "events"
                assert last["lost"] == 0
                events += last["events"]
            assert [(e["id"], e["event"], e["from"], e["to"]) for e in events] == expected
            seqs = [e["seq"] for e in events]
            assert seqs == list(range(snapshot["seq"] + 1, snapshot["seq"] + 1 + len(expected)))
            assert events[0]["reason"] == "engine:1"
            assert events[-1]["reason"] == "bad option"
            assert last["counts"]["request"]["finished"] == finished_before + 3
            assert last["worker"]["state"] == "connecting"
    worker.forget()


async def test_a_new_subscriber_gets_only_what_follows_its_snapshot() -> None:
    feed = StateFeed(interval_s=3600)  # flushed by hand below
    with trio.fail_after(TIMEOUT):
        async with ops_server(feed) as address:
            async with open_websocket_url(f"ws://{address}/ws") as first:
                await next_json(first)
                early = RequestLifecycle("early")
                early.fire("submit")  # pending, not yet flushed
                async with open_websocket_url(f"ws://{address}/ws") as second:
                    snapshot = await next_json(second)
                    assert snapshot["counts"]["request"]["submitted"] >= 1
                    early.fire("fail", reason="boom")
                    feed.flush()
                    one = await next_json(first)
                    two = await next_json(second)
            assert [(e["id"], e["event"]) for e in one["events"]] == [("early", "submit"), ("early", "fail")]
            assert [(e["id"], e["event"]) for e in two["events"]] == [("early", "fail")]
            assert two["first_seq"] == snapshot["seq"] + 1


async def test_a_slow_consumer_is_dropped_not_waited_for() -> None:
    feed = StateFeed(interval_s=3600, client_queue=2)
    feed.install()
    try:
        with feed.subscribe() as slow, feed.subscribe(queue_size=100) as fast:
            for i in range(3):
                RequestLifecycle(f"slow-{i}").fire("reject")
                assert feed.flush() == 1  # never blocks, whoever does not read
            assert slow.dropped is not None
            assert "slow consumer" in slow.dropped
            assert fast.dropped is None
            assert feed.subscribers == 1
            received = [json.loads(m) async for m in _drain(slow)]
            assert [m["events"][0]["id"] for m in received] == ["slow-0", "slow-1"]  # then the queue ended
    finally:
        feed.uninstall()


async def _drain(sub: Any) -> AsyncIterator[str]:
    with trio.fail_after(TIMEOUT):
        async for message in sub.messages:
            yield message


async def test_the_server_closes_a_dropped_subscriber_with_try_again_later() -> None:
    feed = StateFeed(interval_s=0.01)
    with trio.fail_after(TIMEOUT):
        async with ops_server(feed) as address, open_websocket_url(f"ws://{address}/ws") as ws:
            await next_json(ws)
            (sub,) = list(feed._subscribers)
            feed._drop(sub, "slow consumer: test")
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
            reason = closed.value.reason
            assert reason is not None
            assert reason.code == 1013
            assert reason.reason == "slow consumer: test"


async def test_more_events_than_the_buffer_holds_are_counted_as_lost_and_counts_stay_exact() -> None:
    feed = StateFeed(interval_s=3600, max_pending=4)
    feed.install()
    try:
        with feed.subscribe() as sub:
            for i in range(5):
                RequestLifecycle(f"lost-{i}").fire("reject")
            feed.flush()
            message = json.loads(sub.messages.receive_nowait())
        assert message["lost"] == 1
        assert [e["id"] for e in message["events"]] == [f"lost-{i}" for i in range(1, 5)]
        assert message["counts"]["request"] == REQUEST.counts()
    finally:
        feed.uninstall()


def test_observers_buffer_nothing_while_nobody_listens() -> None:
    feed = StateFeed()
    feed.install()
    try:
        before = feed.seq
        RequestLifecycle("unwatched").fire("reject")
        assert feed.seq == before + 1
        assert not feed._pending
        assert feed.flush() == 0
    finally:
        feed.uninstall()
    assert all(o not in WORKER.observers for _, o in feed._observers)


async def test_plain_http_routes_on_the_same_port() -> None:
    feed = StateFeed()
    with trio.fail_after(TIMEOUT):
        async with ops_server(feed) as address, httpx.AsyncClient(base_url=f"http://{address}", timeout=5) as http:
            page = await http.get("/")
            assert page.status_code == 200
            assert page.headers["content-type"].startswith("text/html")
            assert "default-src 'none'" in page.headers["content-security-policy"]
            for kind in KINDS:
                for state in kind.states:
                    assert f'id="state-{kind.name}-{state}"' in page.text
                    assert f'id="count-{kind.name}-{state}"' in page.text
            assert "stateDiagram-v2" in page.text
            assert "http://" not in page.text.replace('xmlns="http://www.w3.org/2000/svg"', "")  # nothing external

            snapshot = (await http.get("/snapshot")).json()
            assert snapshot["type"] == "snapshot"
            assert snapshot["counts"]["request"] == REQUEST.counts()
            assert (await http.get("/nothing")).status_code == 404
            assert (await http.post("/", content=b"x")).status_code == 405
            assert (await http.get("/ws")).status_code == 426
            assert (await http.get("/favicon.ico")).status_code == 204


async def test_garbage_and_silence_are_answered_or_dropped() -> None:
    feed = StateFeed()
    with trio.fail_after(TIMEOUT):
        async with ops_server(feed) as address:
            host, port = address.split(":")
            stream = await trio.open_tcp_stream(host, int(port))
            await stream.send_all(b"NOT HTTP AT ALL\r\n\r\n")
            reply = await stream.receive_some()
            assert reply.startswith(b"HTTP/1.1 400")
            await stream.aclose()
            # A head larger than the limit is cut off without an answer.
            stream = await trio.open_tcp_stream(host, int(port))
            await stream.send_all(b"GET / HTTP/1.1\r\nx: " + b"a" * 20_000)
            assert await stream.receive_some() == b""
            await stream.aclose()
