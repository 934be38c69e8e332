"""The request's data path on its own (``sidecar.datapath``), on a trio stand-in for the edge loop, in virtual time.

Rules: ``autojump_clock`` everywhere; the path's loop is :class:`~tests.helpers.scripted_engine.TrioLoop`; what the path
reports to its request is recorded in order; the outbox is :class:`~tests.helpers.scripted_engine.TrioSink`.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from openengine.v1 import generation_pb2 as pb
from sidecar.convert import ResponseMapper
from sidecar.datapath import ENDED, FIRST, IDLE, IDLE_SWEEP_MARGIN_S, STOPPED, VERDICT, DataPath, DataPaths
from tests.helpers.scripted_engine import RID, TrioLoop, TrioSink, finished, token

Clock = trio.testing.MockClock


class Reported:
    """What a path reports to its request, with the virtual time of each report."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, Any]] = []

    def __call__(self, owner: Any, kind: str, value: Any) -> None:
        owner(kind, value)

    def record(self, kind: str, value: Any) -> None:
        self.events.append((trio.current_time(), kind, value))

    def kinds(self) -> list[str]:
        return [kind for _, kind, _ in self.events]


def path(
    paths: DataPaths, sink: TrioSink, reported: Reported, *, idle: float = 60.0, stop_texts: bool = False, **kw: Any
) -> DataPath:
    mapper = ResponseMapper(RID, n=1, logprobs=None, prompt_tokens=3, **kw)
    return DataPath(
        paths, sink, mapper, reported, reported.record, idle_timeout_s=idle, stop_texts=stop_texts, sent=lambda _: None
    )


class NoEngine:
    """An engine client that opens nothing (the test pushes into the path itself)."""

    def start_generate(self, request: pb.GenerateRequest, sink: Any, *, metadata: Any = ()) -> None:
        pass


class CountingLoop(TrioLoop):
    """Counts the idle sweeps scheduled."""

    def __init__(self) -> None:
        self.sweeps = 0

    def call_at(self, when: float, callback: Any, *args: Any) -> Any:
        if getattr(callback, "__name__", "") == "_sweep":
            self.sweeps += 1
        return super().call_at(when, callback, *args)


def open_(p: DataPath) -> None:
    p.open(NoEngine(), pb.GenerateRequest(request_id=RID), [])


# ------------------------------------------------------------------------------- issue 27 item 9: the idle watch


async def test_a_silent_stream_is_reported_within_the_margin_of_its_timeout_while_others_flow(
    autojump_clock: Clock,
) -> None:
    """Failed before (as measured): the sweep ran every timeout/8, so a 60 s timeout fired up to 67.5 s after the
    engine's last message (67.3 s seen). Now within ``IDLE_SWEEP_MARGIN_S`` of it, with the sweep waking about once
    per timeout while the other streams flow."""
    loop = CountingLoop()
    paths = DataPaths(loop)
    silent, flowing = Reported(), Reported()
    quiet = path(paths, TrioSink(), silent, idle=60.0)
    busy = path(paths, TrioSink(), flowing, idle=60.0)
    open_(quiet)
    open_(busy)
    quiet.push([token(0, 1)])
    last = trio.current_time()
    for i in range(1, 9000):  # 90 s of tokens every 10 ms on the other stream
        await trio.sleep(0.01)
        busy.push([token(0, i)])
    idle = [(at, value) for at, kind, value in silent.events if kind == IDLE]
    assert len(idle) == 1, silent.events
    assert last + 60.0 <= idle[0][0] <= last + 60.0 + IDLE_SWEEP_MARGIN_S
    assert IDLE not in flowing.kinds()
    assert loop.sweeps <= 3, "the sweep wakes about once per timeout while the engine produces"


async def test_a_path_whose_stream_ended_is_not_watched(autojump_clock: Clock) -> None:
    paths = DataPaths(TrioLoop())
    reported = Reported()
    p = path(paths, TrioSink(), reported, idle=1.0)
    open_(p)
    p.push([token(0, 1), finished(0, pb.FINISH_REASON_LENGTH)])
    p.end()
    await trio.sleep(5)
    assert reported.kinds() == [FIRST, ENDED]


# ------------------------------------------------------------------------------- the terminal hold and the stop


async def test_a_chunk_the_terminal_follows_waits_for_it_at_most_one_hold(autojump_clock: Clock) -> None:
    paths = DataPaths(TrioLoop())
    sink, reported = TrioSink(), Reported()
    p = path(paths, sink, reported, max_tokens=2)
    open_(p)
    p.push([token(0, 1)])
    p.push([token(0, 2)])  # the max_tokens-th token: held for the finish
    assert [c["token_ids"] for b in sink._batches for c in b] == [[1]]
    await trio.sleep(0.249)
    assert [c["token_ids"] for b in sink._batches for c in b] == [[1]]
    await trio.sleep(0.002)
    assert [c["token_ids"] for b in sink._batches for c in b] == [[1], [2]], "released as it is after one hold"


async def test_a_stop_after_the_terminal_arrived_is_a_complete_answer_at_once(autojump_clock: Clock) -> None:
    """Found by the stop-string-inside-a-token runs (issue 27 item 4(c)): the engine's terminal had arrived (its chunk
    waiting for the end of the stream) when the frontend closed; the close then read past the end of the stream and
    counted the complete answer `cancelled`, with an Abort."""
    paths = DataPaths(TrioLoop())
    sink, reported = TrioSink(), Reported()
    p = path(paths, sink, reported, stop_texts=True)
    open_(p)
    p.push([token(0, 1)])
    p.push([token(0, 2), finished(0, pb.FINISH_REASON_STOP)])
    sink.stop()
    await trio.testing.wait_all_tasks_blocked()
    stops = [value for _, kind, value in reported.events if kind == STOPPED]
    assert stops == [(True, True)], "may be complete, and complete now"
    assert VERDICT not in reported.kinds()


async def test_after_a_stop_the_engines_next_event_is_the_verdict(autojump_clock: Clock) -> None:
    paths = DataPaths(TrioLoop())
    for next_event, verdict in (([finished(0, pb.FINISH_REASON_STOP)], True), ([token(0, 9)], False)):
        sink, reported = TrioSink(), Reported()
        p = path(paths, sink, reported, stop_texts=True)
        open_(p)
        p.push([token(0, 1)])
        sink.stop()
        p.push(next_event)
        assert [value for _, kind, value in reported.events if kind == VERDICT] == [verdict]
        assert sink._batches == [[{"token_ids": [1], "index": 0}]], "nothing is delivered after the stop"


@pytest.mark.parametrize("how", ["end", "fail"])
async def test_held_chunks_reach_the_client_before_the_end_or_the_failure(autojump_clock: Clock, how: str) -> None:
    paths = DataPaths(TrioLoop())
    sink, reported = TrioSink(), Reported()
    p = path(paths, sink, reported, max_tokens=1)
    open_(p)
    p.push([token(0, 7)])  # held: the terminal is due
    if how == "end":
        p.end()
    else:
        p.fail(RuntimeError("connection lost"))
    assert [c["token_ids"] for b in sink._batches for c in b] == [[7]]
    assert reported.kinds()[-1] == ENDED
