"""``--step-clock engine``: one engine-wide decode step, as TensorRT-LLM's executor runs one iteration for every
request at once -- the tokens of concurrent streams fall on common steps, and one step's messages for the streams of
one connection leave in one write (so they arrive in one read). ``--step-clock per-request`` (the default) is the
control: each request paces itself, and the same streams' tokens arrive scattered.

The streams start out of phase on purpose: their prompts differ in length, so their prefills (at 1,000 prompt tokens
per second) end 4, 10, 16 and 22 ms after they were sent, inside a 20 ms decode step.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections import defaultdict

from grpclib.client import Channel
from grpclib.const import Status
from hyperframe.frame import DataFrame, HeadersFrame

from openengine.v1 import generation_pb2, lifecycle_pb2

from ._client import Outcome, abort, call, generate, make_request, new_id, wait_for_load
from ._h2 import RawH2
from .conftest import StartMock

STREAMS = 4
MAX_TOKENS = 10
PACED = ("--speedup", "1", "--decode-ms-per-token", "20", "--prefill-tokens-per-s", "1000")


def token_reads(mock_address: str) -> dict[int, list[int]]:
    """Open ``STREAMS`` streams at once on one connection; for each stream, the read that brought each of its token
    messages (every stream checked complete: ``MAX_TOKENS`` tokens, then its finish)."""
    h2 = RawH2(mock_address)
    try:
        for i in range(STREAMS):
            prompt = [5 + (k % 50) for k in range(4 + 6 * i)]
            h2.generate(1 + 2 * i, make_request(new_id(), token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True))
        deadline = time.monotonic() + 20
        ended: set[int] = set()
        while len(ended) < STREAMS and time.monotonic() < deadline:
            received = h2.read()
            assert received is not None, "the mock closed the connection"
            frame = received.frame
            if isinstance(frame, HeadersFrame) and "END_STREAM" in frame.flags:
                ended.add(frame.stream_id)
        assert len(ended) == STREAMS, f"only streams {sorted(ended)} ended"
    finally:
        h2.close()
    reads: dict[int, list[int]] = defaultdict(list)
    tokens: dict[int, int] = defaultdict(int)
    finished: set[int] = set()
    for received in h2.frames:
        frame = received.frame
        if not isinstance(frame, DataFrame) or not frame.data:
            continue
        data = bytes(frame.data)
        while data:
            (size,) = struct.unpack(">I", data[1:5])
            message = generation_pb2.GenerateResponse.FromString(data[5 : 5 + size])
            data = data[5 + size :]
            if message.HasField("token") and message.token.tokens:
                reads[frame.stream_id].append(received.read)
                tokens[frame.stream_id] += len(message.token.tokens)
            if message.HasField("finished"):
                finished.add(frame.stream_id)
    assert all(tokens[1 + 2 * i] == MAX_TOKENS for i in range(STREAMS)), dict(tokens)
    assert len(finished) == STREAMS
    return reads


def misaligned(reads: dict[int, list[int]]) -> list[tuple[int, int, int]]:
    """Every ``(stream, read, other stream)`` where ``stream`` got a token in ``read`` while ``other`` was decoding
    (it had tokens before and after that read) but got none in the same read."""
    out = []
    for stream, mine in reads.items():
        for other, theirs in reads.items():
            if other == stream:
                continue
            for read in mine:
                if theirs[0] < read < theirs[-1] and read not in theirs:
                    out.append((stream, read, other))
    return out


def test_engine_step_clock_puts_concurrent_tokens_on_common_steps_written_together(start_mock: StartMock) -> None:
    mock = start_mock(*PACED, "--step-clock", "engine")
    reads = token_reads(mock.address)
    assert misaligned(reads) == [], dict(reads)
    # The streams overlapped (else the check above is empty): every pair shared reads.
    first, *others = reads.values()
    assert all(set(first) & set(other) for other in others), dict(reads)


def test_per_request_timers_scatter_the_tokens_of_concurrent_streams(start_mock: StartMock) -> None:
    mock = start_mock(*PACED)  # --step-clock per-request, the default
    reads = token_reads(mock.address)
    # Out of phase by 6 ms in a 20 ms step, their writes meet in one read only where the client was paused that long.
    assert misaligned(reads), dict(reads)


def test_abort_and_cancel_on_the_engine_clock_free_the_request_and_the_others_run_on(start_mock: StartMock) -> None:
    """A request waiting for the engine's next step ends at once when aborted (``CANCELLED``, with usage) or when its
    client cancels the call; the step goes on for the others, which finish complete, and nothing stays live."""
    mock = start_mock(*PACED, "--step-clock", "engine")
    aborted_id = new_id("aborted")

    async def run(ch: Channel) -> tuple[Outcome, Outcome, int]:
        aborted = asyncio.create_task(generate(ch, make_request(aborted_id, max_tokens=200, ignore_eos=True)))
        cancelled = asyncio.create_task(generate(ch, make_request(max_tokens=200, ignore_eos=True)))
        finishing = asyncio.create_task(generate(ch, make_request(max_tokens=20, ignore_eos=True)))
        await wait_for_load(ch, lambda load: load.running_requests == 3)
        assert (await abort(ch, aborted_id)).status == lifecycle_pb2.ABORT_STATUS_ABORTED
        cancelled.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await cancelled
        done, rest = await aborted, await finishing
        idle = await wait_for_load(ch, lambda load: load.running_requests == 0 and not load.queued_requests)
        return done, rest, idle.running_requests

    aborted, finished, running = call(mock.address, run)
    assert aborted.status == Status.OK
    assert aborted.final.finished.reason == generation_pb2.FINISH_REASON_CANCELLED
    assert aborted.final.usage.completion_tokens == len(aborted.tokens()) < 200
    assert finished.status == Status.OK
    assert finished.final.finished.reason == generation_pb2.FINISH_REASON_LENGTH
    assert len(finished.tokens()) == finished.final.usage.completion_tokens == 20
    assert running == 0
