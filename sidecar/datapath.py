"""One request's data path on the edge loop: the engine's ``Generate`` stream → ``ResponseMapper`` → Dynamo's outbox.

Theory of operation
-------------------
Per token nothing leaves the edge loop's thread. The engine's messages are received there (``sidecar.engine``), handed
to the request's :class:`DataPath` as they arrive, mapped to Dynamo chunks there (``sidecar.convert``), and put into
the request's outbox (``sidecar.dynamo``), from which Dynamo's reader takes them. The request's **trio** task
(``sidecar.requests``) owns everything that decides: admission, the request machine, the client's stop, the drain
deadline, the Abort, the end. It opens the path (:meth:`DataPath.open`), hears what happens as a handful of events
per request, and closes the path with the outcome it decided (:meth:`DataPath.close`). A thread crossing per batch
cost ~27-29 µs of CPU per round trip on two cores (loop → trio → loop); here a request crosses a few times in all:

* trio → loop: ``open`` (start the engine stream), ``close`` (the outcome: the final chunks, an error, or nothing
  after a client stop; the engine stream is reset if it is still open);
* loop → trio (``ActiveRequest.on_path_event``): ``FIRST`` (the engine's first response: the request machine's
  ``first_token``, and the point where a decode leg's deferred stop takes effect), ``STOPPED`` (Dynamo stopped
  reading), ``VERDICT`` (after such a stop: did the engine's next event end the answer?), ``IDLE`` (nothing from
  the engine for the inactivity timeout), ``STOP_STRING`` (the answer ends at a stop string the frontend matches in
  the engine's text, and the engine went on: trio aborts it, and its terminal brings the usage), ``ENDED`` (the
  engine stream is over: complete, or how it failed).

What the path does on its own is mechanical, never a lifecycle decision: it maps; it holds a chunk that ends with a
token the engine's terminal follows (EOS, a stop token, the ``max_tokens``-th token, a stop string the engine's text
holds back), at most :data:`TERMINAL_HOLD_S`, so that the frontend gets the last token with its ``finish_reason`` and
usage in one chunk; it keeps the final chunk until the engine closes the stream (an event after the terminal still
fails the request); it stops delivering when the client is gone but keeps reading the engine until trio closes it;
and it watches the engine's silence (:class:`DataPaths`: one timer for every path).

Coalescing needs no timer and no gate: the outbox merges what is pending when Dynamo's reader comes back for the next
chunk, so a reader that keeps up gets every chunk alone, at once, and a busy one fewer, larger chunks.

Threads: a path is built in trio and from then on touched on the loop only (its ``mapper`` is read by trio for the
load estimate, and after ``ENDED`` for its final flags; ints and bools, read whole under the GIL). Nothing here
imports trio or asyncio: the loop comes in as an object (:class:`Loop`), and so do the crossings, so that the
request tests run the same code in trio's virtual time.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Final, Protocol

from sidecar.errors import EngineRpcError, GrpcCode

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from openengine.v1 import generation_pb2
    from sidecar.convert import ResponseMapper
    from sidecar.dynamo import ChunkSink

__all__ = [
    "ENDED",
    "EOF_GRACE_S",
    "FIRST",
    "IDLE",
    "IDLE_SWEEP_MARGIN_S",
    "STOPPED",
    "STOP_STRING",
    "TERMINAL_HOLD_S",
    "VERDICT",
    "DataPath",
    "DataPaths",
    "GenerateStarter",
    "Loop",
    "PathEvent",
]

log: Final = logging.getLogger("sidecar.datapath")

Chunk = dict[str, Any]

#: How long a chunk ending with a token the engine's terminal follows waits for that terminal (the engine sends it
#: with the last token, in the same step: a gap is transport framing, far below one inter-token interval; an engine
#: that stalls right after such a token costs the whole bound). The request task bounds its wait for the engine's
#: next event after the frontend closed the stream by the same figure.
TERMINAL_HOLD_S: Final = 0.25
#: After the terminal event the engine closes the stream at once (TensorRT-LLM does); one that does not is
#: tolerated, but not waited for longer than this.
EOF_GRACE_S: Final = 2.0
#: The idle sweep runs at the earliest moment a watched path can have been silent for its timeout, but never sooner
#: than this after the previous sweep: a hang is reported between the timeout and the timeout plus this margin after
#: the engine's last message (docs/faults.md).
IDLE_SWEEP_MARGIN_S: Final = 0.001

# The events a path reports to its request's trio task: (kind, value).
FIRST: Final = "first"  # value: True if the first response already ended the stream (nothing to stream)
STOPPED: Final = "stopped"  # value: (may_be_complete, complete_now): see DataPath._client_stopped
VERDICT: Final = "verdict"  # value: True when the engine's terminal followed a stop, False when it went on
IDLE: Final = "idle"  # value: seconds since any path got anything from the engine
STOP_STRING: Final = "stop_string"  # value: the stop string the frontend ends the answer at; the engine went on
ENDED: Final = "ended"  # value: (error or None, lingered): see DataPath.end / fail

PathEvent = tuple[str, Any]


class Handle(Protocol):
    """A timer of the loop (``asyncio.TimerHandle``)."""

    def cancel(self) -> None: ...


class Loop(Protocol):
    """What a path uses of its thread's event loop (an asyncio loop; a trio stand-in in the request tests)."""

    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> Handle: ...


class GenerateStarter(Protocol):
    """The engine client's loop-side ``Generate`` (``EngineClient.start_generate``)."""

    def start_generate(
        self,
        request: generation_pb2.GenerateRequest,
        sink: DataPath,
        *,
        metadata: Sequence[tuple[str, str]],
    ) -> None: ...


class DataPaths:
    """What the paths of one worker share, on the loop: the sweep over their silences, and the engine's progress.

    One timer for every watched path (a timer per path would cost ~0.6 KiB each): the sweep reports each path silent
    for its timeout and is due again at the earliest moment another can be (pushes only move that later), so it
    wakes about once per timeout while the engine produces and exactly when a path goes silent for it.
    """

    __slots__ = ("_timer", "_timer_at", "_watched", "last_batch_at", "loop", "progress")

    def __init__(self, loop: Loop) -> None:
        self.loop: Final = loop
        #: Engine batches received by any path so far (the health watch tells a busy engine from a lost one by it).
        self.progress = 0
        #: When any path last got a batch from the engine (``loop.time()``).
        self.last_batch_at = -math.inf
        self._watched: set[DataPath] = set()
        self._timer: Handle | None = None
        self._timer_at = math.inf

    def watch(self, path: DataPath) -> None:
        self._watched.add(path)
        self._due(path._quiet_since + path._idle_s)

    def unwatch(self, path: DataPath) -> None:
        self._watched.discard(path)

    def _due(self, when: float) -> None:
        if when < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = when
            self._timer = self.loop.call_at(when, self._sweep)

    def _sweep(self) -> None:
        self._timer, self._timer_at = None, math.inf
        now = self.loop.time()
        earliest = math.inf
        for path in list(self._watched):
            due = path._quiet_since + path._idle_s
            if due <= now:
                self._watched.discard(path)
                path._went_idle(now - self.last_batch_at)
            elif due < earliest:
                earliest = due
        if earliest < math.inf:
            self._due(max(earliest, now + IDLE_SWEEP_MARGIN_S))


class DataPath:
    """One request's engine stream, mapped into its outbox (loop thread; see the module docstring).

    To the engine client it is the stream's sink (``push``/``end``/``fail``/``has_room``/``hold``/``after_round``/
    ``fail_cancelled``, and ``on_cancel``, which the producer sets to reset its stream); to the outbox, the producer
    (``_client_stopped``, ``_room``); to the request's trio task, ``open`` and ``close``.
    """

    __slots__ = ("_closed", "_ended", "_eof_timer", "_final", "_first_seen", "_held", "_hold_timer", "_idle_s",
                 "_loop", "_may_be_complete", "_on_room", "_owner", "_paths", "_quiet_since", "_sent", "_sink",
                 "_stop_string_reported", "_stop_texts", "_stopped", "_to_trio", "_verdict_sent", "mapper",
                 "on_cancel")  # fmt: skip

    def __init__(
        self,
        paths: DataPaths,
        sink: ChunkSink,
        mapper: ResponseMapper,
        post: Callable[[Callable[[str, Any], None], str, Any], object],
        owner: Callable[[str, Any], None],
        *,
        idle_timeout_s: float,
        stop_texts: bool,
        sent: Callable[[list[Chunk]], None],
    ) -> None:
        self._paths: Final = paths
        self._loop: Final = paths.loop
        self._sink: Final = sink
        self.mapper: Final = mapper
        # post(owner, kind, value) runs owner(kind, value) in the request's trio task (Edge.to_trio); never raises.
        self._to_trio: Final = post
        self._owner: Final = owner
        self._idle_s: Final = idle_timeout_s
        # The request has stop strings: the frontend matches them on its own text, so any chunk may be its last.
        self._stop_texts: Final = stop_texts
        self._sent: Final = sent  # counts what goes to the outbox (tokens, TTFT)
        self._held: list[Chunk] = []  # waiting (bounded) for the engine's terminal
        self._hold_timer: Handle | None = None
        self._final: list[Chunk] = []  # the terminal's chunks, waiting for the end of the stream and trio's close
        self._eof_timer: Handle | None = None
        self._quiet_since = 0.0
        self._first_seen = False
        self._may_be_complete = False  # the last chunk sent may have completed the answer
        self._stopped = False  # Dynamo stopped reading
        self._verdict_sent = False
        self._stop_string_reported = False
        self._ended = False  # the engine stream is over (its end, a failure, or reset by close)
        self._closed = False
        self._on_room: Callable[[], None] | None = None
        #: Set by the stream's producer: resets the engine stream (RST_STREAM) while it is open.
        self.on_cancel: Callable[[], object] | None = None

    # ------------------------------------------------------------------------------------------ trio's commands

    def open(
        self, client: GenerateStarter, request: generation_pb2.GenerateRequest, metadata: Sequence[tuple[str, str]]
    ) -> None:
        """Start the engine stream (posted by trio once the request is submitted)."""
        if self._closed:
            return
        self._sink.on_stop = self._client_stopped
        self._quiet_since = self._loop.time()
        if self._idle_s > 0:
            self._paths.watch(self)
        if self._sink.stopped:
            self._client_stopped()  # Dynamo stopped the request while trio was admitting it
        client.start_generate(request, self, metadata=metadata)

    def close(self, outcome: BaseException | list[Chunk] | None) -> None:
        """Trio decided how the request ends: ``outcome`` is the final chunks (a finished request; ``[]`` for none),
        the error for the client, or None (the client is gone). An engine stream still open is reset."""
        if self._closed:
            return
        self._closed = True
        self._settle_engine()
        still_open, self._ended = not self._ended, True
        cancel, self.on_cancel = self.on_cancel, None
        if still_open and cancel is not None:
            try:
                cancel()
            except Exception:
                log.exception("resetting the engine stream failed")
        sink = self._sink
        if isinstance(outcome, BaseException):
            sink.fail(outcome)
        elif outcome is not None:
            if outcome:
                sink.deliver(outcome)
            sink.end()
        else:
            sink.end()

    @property
    def final(self) -> list[Chunk]:
        """The chunks of the engine's terminal, kept until trio closes the path (read by trio after ``ENDED``)."""
        return self._final

    # ------------------------------------------------------------------------------------------ the engine's side

    def push(self, items: list[generation_pb2.GenerateResponse]) -> bool:
        """A batch of the engine's messages, in order; returns whether the outbox has room for more."""
        if self._ended:
            return False
        paths = self._paths
        now = self._loop.time()
        self._quiet_since = paths.last_batch_at = now
        paths.progress += 1
        held = self._held
        if held:
            self._held = []
            self._cancel_hold()
        mapper = self.mapper
        try:
            chunks = mapper.map(items, held)
        except Exception as exc:  # the engine's terminal error, a breach of the stream contract, or a mapper bug
            self._report_first(terminal=True)
            self._engine_ended(exc)
            return False
        self._report_first(terminal=mapper.done and mapper.failure is None)
        stopped = self._stopped
        if mapper.failure is not None:
            # Tokens, then the engine's terminal error: the tokens are the client's, the error follows.
            if not stopped:
                self._send(chunks)
            self._engine_ended(mapper.failure)
            return False
        if stopped:
            self._after_stop(chunks)
        if mapper.done:
            if not stopped:
                self._final.extend(chunks)
            self._paths.unwatch(self)
            self._eof_timer = self._loop.call_at(now + EOF_GRACE_S, self._lingered)
        elif chunks and not stopped:
            if held and mapper.ends_at_stop_string:
                self._held = chunks  # the engine's next event came and was no terminal: it goes on past the stop
                self._engine_went_on()
            elif mapper.awaits_terminal(chunks):
                self._held = chunks
                self._hold_timer = self._loop.call_at(now + TERMINAL_HOLD_S, self._release_held)
            else:
                self._send(chunks)
                self._may_be_complete = self._stop_texts
        return self._sink.has_room

    @property
    def has_room(self) -> bool:
        """Whether the outbox takes more (the producer holds back the engine's flow control otherwise)."""
        return self._sink.has_room

    def hold(self, on_room: Callable[[], None]) -> None:
        """Call ``on_room`` once the outbox has room again (at once if it has now)."""
        self._on_room = on_room
        self._sink.when_room(self._room)

    def after_round(self, callback: Callable[[], None]) -> None:
        """The producer may hand over more at once: nothing is waited for between two batches on this path."""
        callback()

    def end(self) -> None:
        """The engine closed the stream (status OK)."""
        if self._ended:
            return
        self._release_held_as_is()
        try:
            self.mapper.end_of_stream()
        except Exception as exc:
            self._engine_ended(exc)
        else:
            self._engine_ended(None)

    def fail(self, error: BaseException) -> None:
        """The stream failed (a status, a lost connection, a deadline): ``error`` reaches trio after what came first.

        After the engine's terminal event the answer is complete whatever the stream's status says: TensorRT-LLM's
        multi-frontend server can end a fully delivered stream with ``UNAVAILABLE`` when its coordinator fails during
        the request's final cleanup. Such an answer is finished, never failed (a retry would repeat completed work)."""
        if self._ended:
            return
        mapper = self.mapper
        if mapper.done and mapper.failure is None:
            log.warning("the engine ended a complete answer with %s; the answer stands", error)
            self.end()
            return
        self._release_held_as_is()
        self._engine_ended(error)

    def fail_cancelled(self) -> None:
        """The producer's own task was cancelled by someone else: the edge loop is shutting down."""
        self.fail(EngineRpcError("Generate", GrpcCode.UNAVAILABLE, "the edge loop shut down under this stream"))

    # ------------------------------------------------------------------------------------------ internals

    def _post(self, kind: str, value: Any) -> None:
        self._to_trio(self._owner, kind, value)

    def _send(self, chunks: list[Chunk]) -> None:
        self._sent(chunks)
        self._sink.deliver(chunks)

    def _report_first(self, *, terminal: bool) -> None:
        if not self._first_seen:
            self._first_seen = True
            self._post(FIRST, terminal)

    def _engine_ended(self, error: BaseException | None, *, lingered: bool = False) -> None:
        self._ended = True
        self._paths.unwatch(self)
        self._cancel_hold()
        if self._eof_timer is not None:
            self._eof_timer.cancel()
            self._eof_timer = None
        if self._stopped and not self._verdict_sent:
            self._verdict(error is None and self.mapper.done and not self.mapper.handed_off)
        self._post(ENDED, (error, lingered))

    def _lingered(self) -> None:
        # The engine kept the stream open after its terminal: the answer is complete; trio closes the stream.
        self._eof_timer = None
        if not self._ended:
            self._engine_ended(None, lingered=True)

    def _release_held(self) -> None:
        # No terminal within the hold: the chunks go out as they are (and the client may now have its whole answer),
        # unless they end at the frontend's stop string: then the engine is generating past the answer.
        self._hold_timer = None
        if self._held and self.mapper.ends_at_stop_string:
            self._engine_went_on()
        else:
            self._send_held()

    def _send_held(self) -> None:
        held, self._held = self._held, []
        if held and not self._stopped:
            self._send(held)
            self._may_be_complete = True

    def _engine_went_on(self) -> None:
        """The held chunks end at the frontend's stop string and the engine goes on: trio aborts the request, and
        the engine's terminal (``cancelled``, with its usage) closes the held answer (``stop``, the client's tokens,
        the engine's cached tokens). Held until then, bounded by the inactivity timeout."""
        if not self._stop_string_reported:
            self._stop_string_reported = True
            self._post(STOP_STRING, self.mapper.stop_string)

    def _release_held_as_is(self) -> None:
        # The stream ends (or fails) right after held chunks: they are the client's before whatever follows.
        self._cancel_hold()
        self._send_held()

    def _cancel_hold(self) -> None:
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None

    def _settle_engine(self) -> None:
        self._paths.unwatch(self)
        self._cancel_hold()
        self._held = []
        if self._eof_timer is not None:
            self._eof_timer.cancel()
            self._eof_timer = None

    def _went_idle(self, silent_s: float) -> None:
        """The sweep: nothing from the engine for this path's inactivity timeout (reported once)."""
        if not self._ended:
            self._post(IDLE, silent_s)

    def _client_stopped(self) -> None:
        """The outbox's stop: Dynamo stopped reading (the client left, or the frontend ended the stream itself).

        Reported with ``may_be_complete`` (the last chunk sent may have completed the answer: the frontend ends the
        stream at EOS, stop tokens and stop strings) and ``complete_now``: when the engine's terminal has already
        arrived (its chunk waiting for the end of the stream), whether that makes the answer complete; else None.
        The engine stream keeps being read (not delivered) until trio closes the path.
        """
        if self._stopped or self._closed:
            return
        self._stopped = True
        self._cancel_hold()
        self._held = []
        mapper = self.mapper
        complete_now = (not mapper.handed_off) if mapper.done and mapper.failure is None else None
        if complete_now is not None:
            self._verdict_sent = True
        self._post(STOPPED, (self._may_be_complete, complete_now))
        self._room()  # nothing is delivered any more: a producer holding back may go on

    def _after_stop(self, chunks: list[Chunk]) -> None:
        # After a stop the engine's next events tell a complete answer (its terminal) from a stop (more tokens).
        if self._verdict_sent:
            return
        mapper = self.mapper
        if mapper.done:
            self._verdict(not mapper.handed_off)
        elif any(chunk["token_ids"] for chunk in chunks):
            self._verdict(False)

    def _verdict(self, complete: bool) -> None:
        self._verdict_sent = True
        self._post(VERDICT, complete)

    def _room(self) -> None:
        on_room, self._on_room = self._on_room, None
        if on_room is not None and not self._closed:
            on_room()
