"""The lean-streams tuning (``sidecar.http2.apply_tunings``): once applied, grpclib's streams use the lean classes, and
those behave as the asyncio ones do for the way grpclib uses them."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import grpclib.protocol
import pytest

from sidecar.http2 import LeanDeque, LeanEvent, LeanQueue, apply_tunings, tunings_in_effect, undo_tunings
from sidecar.http2._tunings import _COMPACT_AFTER


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


@pytest.fixture
def lean() -> Iterator[None]:
    apply_tunings(frame_repr=False)
    try:
        yield
    finally:
        undo_tunings()


@pytest.mark.usefixtures("lean")
def test_once_applied_grpclib_builds_its_streams_from_the_lean_classes() -> None:
    protocol: Any = grpclib.protocol  # the replaced names are not part of its typed interface
    assert (protocol.Event, protocol.Queue, protocol.deque) == (LeanEvent, LeanQueue, LeanDeque)
    assert tunings_in_effect() == {"frame_repr": False, "lean_streams": True}

    async def build() -> None:
        buffer: Any = protocol.Buffer(lambda size: None)
        assert (type(buffer._unacked), type(buffer._acked)) == (LeanQueue, LeanDeque)
        connection: Any = protocol.Connection(None, None, config=None)
        assert type(connection.write_ready) is LeanEvent
        stream: Any = protocol.Stream(connection, None, None)
        assert {type(e) for e in (stream.window_updated, stream.headers_received, stream.trailers_received)} == {
            LeanEvent
        }

    run(build)


def test_the_lean_containers_are_small() -> None:
    event, queue, chunks = LeanEvent(), LeanQueue[int](), LeanDeque[int]()
    deque_size = sys.getsizeof(asyncio.Event()._waiters)
    assert sys.getsizeof(event._waiters) * 5 < deque_size
    assert sys.getsizeof(queue._items) * 5 < deque_size
    assert sys.getsizeof(chunks) * 5 < deque_size


def test_event_wakes_every_waiter_and_forgets_cancelled_ones() -> None:
    async def body() -> None:
        event = LeanEvent()
        assert not event.is_set()
        woken: list[int] = []

        async def waiter(i: int) -> None:
            assert await event.wait()
            woken.append(i)

        tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
        cancelled = asyncio.create_task(event.wait())
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.sleep(0)
        assert len(event._waiters) == 3
        event.set()
        await asyncio.gather(*tasks)
        assert sorted(woken) == [0, 1, 2]
        assert event._waiters == []
        assert await event.wait()  # set: returns at once
        event.clear()
        assert not event.is_set()
        assert "unset" in repr(event)

    run(body)


def test_queue_hands_out_items_in_order_and_waits_when_empty() -> None:
    async def body() -> None:
        queue: LeanQueue[int] = LeanQueue()
        assert queue.empty()
        assert queue.qsize() == 0
        with pytest.raises(asyncio.QueueEmpty):
            queue.get_nowait()
        getter = asyncio.create_task(queue.get())
        await asyncio.sleep(0)
        assert not getter.done()
        queue.put_nowait(1)
        assert await getter == 1
        for i in range(10 * _COMPACT_AFTER):
            queue.put_nowait(i)
        out = [queue.get_nowait() for _ in range(5 * _COMPACT_AFTER)]
        assert len(queue._items) == 5 * _COMPACT_AFTER  # half consumed: the consumed prefix was dropped
        assert queue._head == 0
        queue.put_nowait(-1)
        while not queue.empty():
            out.append(await queue.get())
        assert out == [*range(10 * _COMPACT_AFTER), -1]
        assert queue._items == []
        assert queue._head == 0

    run(body)


def test_a_cancelled_get_leaves_the_queue_usable() -> None:
    async def body() -> None:
        queue: LeanQueue[str] = LeanQueue()
        getter = asyncio.create_task(queue.get())
        await asyncio.sleep(0)
        getter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await getter
        assert queue._getter is None
        queue.put_nowait("a")
        assert queue.qsize() == 1
        assert await asyncio.wait_for(queue.get(), 1) == "a"

    run(body)


@pytest.mark.usefixtures("lean")
def test_grpclib_buffer_reads_messages_across_chunks_as_before() -> None:
    """``Buffer.read`` over the lean queue and deque: sizes that split, join and end exactly on chunk boundaries."""

    async def body() -> None:
        acked: list[int] = []
        buffer = grpclib.protocol.Buffer(acked.append)
        for chunk in (b"abc", b"defgh", b"ij"):
            buffer.add(chunk, len(chunk))
        reads = [await buffer.read(n) for n in (2, 4, 4)]
        assert reads == [b"ab", b"cdef", b"ghij"]
        assert acked == [3, 5, 2]
        late: asyncio.Task[bytes] = asyncio.create_task(buffer.read(3))
        await asyncio.sleep(0)
        assert not late.done()
        buffer.add(b"xyz", 3)
        assert await late == b"xyz"
        buffer.eof()
        assert await buffer.read(1) == b""

    run(body)
