"""One trio task per request: its lifecycle (the request machine), its engine stream, cancellation, abort.

The Dynamo adapter runs :meth:`RequestServer.handle` for every request Dynamo hands the worker, as a task of the
worker's request nursery. The request's tokens never pass through this task: they flow from the engine stream to
Dynamo's outbox on the edge loop (``sidecar.datapath``). This task owns everything that decides, as an
:class:`ActiveRequest` whose phases are the states of its machine (``statemachines/request.py``)::

    received                    open:   admission, conversion (or reject), submit; the data path starts the stream
    submitted / decoding /      stream: one event from the data path at a time -- the engine's first response
    streaming / cancel_deferred /       (first_token), the client's stop (cancel, or defer on a decode leg, or close
    prefill_ready                       after a chunk that may have completed the answer), the engine's silence
                                        (HungEngine), the end of the engine stream (finish, or the error)
    stopping                    hold:   after the frontend closed the stream, wait (at most one hold) for the engine's
                                        next event: its terminal means a complete answer (finish, no Abort),
                                        anything else a stop (cancel, Abort)
    a terminal state            finish: metrics, the outcome to the outbox (the final chunks or the error), the
                                        Abort (shielded, time-bounded) while the engine holds the request, one line

The guarantees, each tested in ``tests/test_requests.py`` and ``tests/disagg/test_deferral.py``:

* validation and conversion before any RPC (``reject`` → HTTP 400, the engine never hears of the request);
* exactly one terminal state per request; from ``submit`` on, every exit that is not the engine's own end sends
  ``Control.Abort(request_id)`` -- shielded and time-bounded -- besides resetting the stream (RST_STREAM);
* the final chunk is held until the engine closes the stream, so an event after the terminal still fails the
  request instead of slipping out after a success;
* the chunk with an output's last token carries its ``finish_reason`` and usage: a chunk ending with a token the
  engine's terminal follows waits, bounded, for it (``sidecar.datapath``). The frontend ends the stream at EOS, stop
  tokens and stop strings itself; when it closes the stream after a chunk that may have completed the answer, the
  engine's next event decides;
* tokens the engine sent before a terminal ``EngineError`` reach the client before the error;
* one INFO line per request at its end (id, outcome, reason, tokens in/out, TTFT, duration); expected failures are
  that one line, at WARNING, never a traceback;
* the worker ends a request with :meth:`ActiveRequest.cancel` and a reason (drain deadline, engine lost), which
  becomes the matching migratable error.

Disaggregated legs (``docs/disaggregation.md``): the worker's role decides the leg (``convert`` maps it). A prefill
leg's ``PrefillReady`` is its final chunk (``handoff`` → ``prefill_ready`` → ``finished``). A decode leg carrying a
handoff (``submit_decode``) **defers a client stop until the engine's first response** -- the KV transfer has landed
then, so the prefill engine's blocks are not stranded: the stop is recorded as ``defer`` and takes effect at the
first response (``first_token`` → ``cancelled``, then ``Abort``). The worker's own cancellation (drain deadline,
engine lost) is never deferred; the inactivity timeout still bounds the wait.

An inactivity timeout while no request got anything from the engine for as long means the engine is not producing:
``RequestServer.on_stall`` (the worker's withdrawal) runs before the error reaches the frontend, so the frontend's
migration goes to another worker instead of back to this one.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import trio

from openengine_bp.openengine.v1 import HealthState
from sidecar.convert import HEALTH_CANARY_PAYLOAD, build_generate_request
from sidecar.convert.enums import bp_enum
from sidecar.convert.request import role_of_engine
from sidecar.datapath import (
    ENDED,
    FIRST,
    IDLE,
    STOP_STRING,
    STOPPED,
    TERMINAL_HOLD_S,
    VERDICT,
    DataPath,
    DataPaths,
)
from sidecar.errors import (
    EngineFailure,
    EngineGone,
    EngineRpcError,
    GrpcCode,
    ProtocolViolation,
    RequestRejected,
    SidecarError,
    WorkerDraining,
)
from sidecar.ops import logs, metrics
from statemachines import RequestLifecycle

if TYPE_CHECKING:
    from statemachines.request import RequestEvent

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from sidecar.convert import Capabilities, ResponseMapper
    from sidecar.convert.request import Role
    from sidecar.dynamo import ChunkSink, RequestContext
    from sidecar.edge import Edge
    from sidecar.engine import EngineClient

log: Final = logging.getLogger("sidecar.requests")

# How long a request arriving while the engine is being rediscovered waits for the new serving context.
_PAUSE_WAIT_S: Final = 10.0
# Bound on the worker's withdrawal when a request finds the engine not producing.
_STALL_REPORT_S: Final = 5.0


class HungEngine(EngineGone):
    """The engine sent nothing for the request for longer than the inactivity timeout."""


@dataclass(frozen=True, slots=True)
class ServingContext:
    """What every request needs, fixed once discovery is done (replaced when the engine is rediscovered)."""

    client: EngineClient
    caps: Capabilities
    model: str
    context_length: int
    abort_timeout_s: float
    inactivity_timeout_s: float
    #: The worker's role as resolved at start-up (``Discovery.role``); None = the engine's reported role
    #: (``caps.engine_role``; aggregated when it reports none, as TensorRT-LLM does).
    role: Role | None = None
    #: False: ask the engine not to detokenize (``extra.detokenize = false``) where the sidecar needs no engine text
    #: (``--engine-detokenize``; the frontend detokenizes from the token ids).
    engine_detokenize: bool = True

    @property
    def worker_role(self) -> Role:
        """The role that decides each request's leg: aggregated, prefill or decode."""
        return self.role if self.role is not None else role_of_engine(self.caps.engine_role)


class ActiveRequest:
    """A request between its arrival and its terminal state; the worker ends it early with :meth:`cancel`.

    :meth:`run` drives it phase by phase, each phase the method its machine state names (:data:`_PHASES`); the data
    path's events arrive through :meth:`on_path_event` (posted from the edge loop) and are taken one at a time.
    """

    __slots__ = ("_end", "_error", "_events", "_holds_engine", "_outbox", "_outcome", "_path", "_request", "_result",
                 "_server", "_serving", "_stats", "_wake", "ctx", "lifecycle", "mapper", "prompt_tokens",
                 "worker_error")  # fmt: skip

    def __init__(
        self,
        server: RequestServer,
        serving: ServingContext,
        request: dict[str, Any],
        ctx: RequestContext,
        outbox: ChunkSink,
    ) -> None:
        self._server = server
        self._serving = serving
        self._request = request
        self._outbox = outbox
        self.ctx = ctx
        self.lifecycle = RequestLifecycle(ctx.request_id)
        #: Prompt tokens, and the response mapper once the request is sent (its completion count): the load estimate.
        self.prompt_tokens = 0
        self.mapper: ResponseMapper | None = None
        #: Set when the worker ends the request; it is what the client is told (a migratable error).
        self.worker_error: SidecarError | None = None
        self._path: DataPath | None = None
        self._events: list[tuple[str, Any]] = []
        self._wake: trio.Event | None = None
        self._end = _RequestEnd(ctx.request_id, len(request.get("token_ids") or ()))
        self._stats: metrics.RequestStats | None = None
        # How the request ends: the outcome's name, what the outbox gets (the final chunks, an error, or None after
        # a client stop), the error that ended it (for the RPC code), and whether the engine still holds it (Abort).
        self._outcome = "failed"
        self._result: list[dict[str, Any]] | BaseException | None = None
        self._error: BaseException | None = None
        self._holds_engine = False

    # ---------------------------------------------------------------------------------------------- the worker's side

    def cancel(self, error: SidecarError) -> None:
        """End the request from the worker's side (drain deadline, engine lost) with ``error`` for the client."""
        if self.worker_error is None:
            self.worker_error = error
        self._wake_up()

    def on_path_event(self, kind: str, value: Any) -> None:
        """trio thread (posted by the data path on the edge loop): one of ``sidecar.datapath``'s events."""
        self._events.append((kind, value))
        self._wake_up()

    def _wake_up(self) -> None:
        if self._wake is not None:
            self._wake.set()
            self._wake = None

    async def _next_event(self) -> tuple[str, Any]:
        """The next event of the data path; the worker's cancellation comes first (raised as its error)."""
        while True:
            if self.worker_error is not None:
                raise self.worker_error
            if self._events:
                return self._events.pop(0)
            wake = self._wake = trio.Event()
            await wake.wait()

    # ---------------------------------------------------------------------------------------------- the phases

    async def run(self) -> None:
        """Serve the request to its terminal state, then finish it (never raises but for trio's own cancellation)."""
        try:
            while (phase := _PHASES.get(self.lifecycle.state)) is not None:
                await phase(self)
        except trio.Cancelled:
            # Cancelled from outside (worker teardown): the request goes elsewhere.
            self._ended("cancel", "cancelled", WorkerDraining("request ended by worker shutdown"), "worker shutdown")
            raise
        except Exception as exc:
            self._failed(exc)
        finally:
            await self._finish()  # its one await, the Abort, is shielded and time-bounded

    async def _open(self) -> None:
        """``received``: convert the request (or reject it: HTTP 400 before any RPC), submit it, start the stream."""
        serving, ctx, lifecycle, end = self._serving, self.ctx, self.lifecycle, self._end
        logs.REQUEST_ID.set(ctx.request_id)  # every log line of this request's task names it
        metrics.REQUESTS_RECEIVED.inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s: %s", ctx.request_id, request_shape(self._request))
        try:
            call = build_generate_request(
                self._request,
                request_id=ctx.request_id,
                model=serving.model,
                caps=serving.caps,
                context_length=serving.context_length,
                trace=dict(ctx.trace_headers),
                role=serving.worker_role,
                engine_detokenize=serving.engine_detokenize,
            )
            self._server._admit(self)
        except RequestRejected as exc:
            self._ended("reject", "rejected", exc, str(exc))
            return
        mapper = self.mapper = call.response_mapper(eos_token_ids=_eos_token_ids(self._request))
        self.prompt_tokens = call.prompt_tokens
        self._stats = end.stats = metrics.RequestStats(end.input_tokens)
        edge = serving.client.edge
        path = self._path = DataPath(
            self._server._paths_on(edge),
            self._outbox,
            mapper,
            edge.to_trio,
            self.on_path_event,
            idle_timeout_s=serving.inactivity_timeout_s,
            stop_texts=bool(call.stop_texts),
            sent=end.sent,
        )
        self._holds_engine = True
        lifecycle.fire("submit_decode" if call.handoff else "submit")
        if not edge.to_loop(path.open, serving.client, call.request, call.metadata):
            raise EngineRpcError("Generate", GrpcCode.UNAVAILABLE, "the edge loop is gone")

    async def _follow(self) -> None:
        """A live state: take the data path's next event and act on it."""
        kind, value = await self._next_event()
        await _ON_EVENT[kind](self, value)

    async def _hold(self) -> None:
        """``stopping``: the frontend closed the stream after a chunk that may have completed the answer. The engine's
        next event decides, waited for one hold at most: its terminal means a complete answer (``finish``, nothing
        to abort), anything else -- more tokens, an error, silence -- that the client stopped it (``cancel``)."""
        complete = False
        with trio.move_on_after(TERMINAL_HOLD_S):
            while True:
                kind, value = await self._next_event()
                if kind == VERDICT:
                    complete = value
                    break
                if kind == ENDED:
                    self._note_error_after_stop(value[0])
                    break
                if kind == IDLE:
                    break
        if complete:
            self._ended_downstream()
        else:
            self._stopped_by_client()

    async def _finish(self) -> None:
        """A terminal state: count it, hand the outcome to the outbox, Abort what the engine still holds, log it."""
        self.lifecycle.fire("cancel", reason="request task ended")  # a no-op once terminal
        metrics.REQUESTS_ENDED.labels(outcome=self._outcome).inc()
        if self._stats is not None:
            code = "CANCELLED" if self._outcome == "cancelled" else metrics.rpc_code(self._error)
            self._stats.end(code=code)
        edge = self._serving.client.edge
        if self._path is not None:
            edge.to_loop(self._path.close, self._result)
        elif isinstance(self._result, BaseException):
            edge.to_loop(self._outbox.fail, self._result)
        if self._holds_engine:
            await _abort(self._serving, self.ctx.request_id)
        self._end.log(self._outcome)
        self._server._forget(self)

    # ---------------------------------------------------------------------------------------------- the events

    async def _on_first(self, terminal: bool) -> None:
        """The engine's first response (the KV transfer of a decode leg has landed)."""
        state = self.lifecycle.state
        if state == "cancel_deferred":
            self.lifecycle.fire("first_token", reason="KV transfer landed: the deferred client stop takes effect")
            self._stopped_by_client()
        elif not terminal and state in ("submitted", "decoding"):
            self.lifecycle.fire("first_token")

    async def _on_stopped(self, value: tuple[bool, bool | None]) -> None:
        """Dynamo stopped reading: the client left, or the frontend ended the stream itself."""
        may_be_complete, complete_now = value
        state = self.lifecycle.state
        if state == "decoding":
            self.lifecycle.fire(
                "defer", reason="client stopped while the KV cache was in flight; deferred until the first token"
            )
            log.info("request %s: client stop deferred until the KV transfer lands", self.ctx.request_id)
        elif may_be_complete and state == "streaming" and complete_now is None:
            self.lifecycle.fire("close", reason="the frontend closed the stream after a chunk that may end the answer")
        elif may_be_complete and state == "streaming" and complete_now:
            self._ended_downstream()
        else:
            self._stopped_by_client()

    async def _on_idle(self, silent_s: float) -> None:
        """Nothing from the engine for the inactivity timeout."""
        serving = self._serving
        error = HungEngine(f"engine sent nothing for {serving.inactivity_timeout_s:g}s (request {self.ctx.request_id})")
        await self._server._report_stall(serving, silent_s, error)
        raise error

    async def _on_stop_string(self, stop: str) -> None:
        """The answer ends at a stop string the frontend matches in the engine's text (inside a token, say), and the
        engine goes on: it is aborted, and its terminal closes the answer (``stop``, with the engine's usage)."""
        self._end.reason = f"stop string {stop!r}, matched by the frontend; the engine went on and was aborted"
        await _abort(self._serving, self.ctx.request_id)

    async def _on_ended(self, value: tuple[BaseException | None, bool]) -> None:
        """The engine stream is over: complete (its final chunks wait in the path), or failed."""
        error, lingered = value
        if error is not None:
            raise error
        assert self.mapper is not None
        assert self._path is not None
        if lingered:
            log.warning("request %s: engine kept the stream open after its terminal", self.ctx.request_id)
        if self.mapper.handed_off:
            self.lifecycle.fire("handoff")
        final = self._path.final
        if not self._end.reason:
            self._end.finished(final)
        self._end.sent(final)
        self._holds_engine = False  # the stream ended on its own: the engine no longer holds the request
        self.lifecycle.fire("finish")
        self._outcome, self._result = "finished", final

    async def _ignore(self, value: object) -> None:
        """An event with nothing to do in this state (a verdict nobody waits for)."""

    # ---------------------------------------------------------------------------------------------- endings

    def _ended(self, event: RequestEvent, outcome: str, result: BaseException | None, reason: str) -> None:
        self.lifecycle.fire(event, reason=reason)
        self._outcome, self._result, self._error = outcome, result, result
        self._end.reason = self._end.reason or reason

    def _stopped_by_client(self) -> None:
        if self.mapper is not None and self.mapper.handed_off:
            log.warning(
                "request %s: stopped before its prefill handoff was delivered; the prefill engine holds that KV "
                "session until it expires",
                self.ctx.request_id,
            )
        self._ended("cancel", "cancelled", None, "stopped by the client")

    def _ended_downstream(self) -> None:
        # The frontend ended the stream at the answer's last token (EOS, stop token or string) and the engine's
        # terminal followed: a complete answer, nothing to abort.
        self._holds_engine = False
        self.lifecycle.fire("finish", reason="the frontend ended the stream at the answer's last token")
        self._outcome, self._result = "finished", None
        self._end.reason = "ended by the frontend at the answer's last token"

    def _note_error_after_stop(self, error: BaseException | None) -> None:
        # After the client left, an engine error or a breach only means the answer was not complete; a bug in the
        # mapping is still a bug, and says so.
        if error is not None and not isinstance(error, SidecarError):
            log.error("request %s: mapping the engine's events after the stop failed", self.ctx.request_id,
                      exc_info=error)  # fmt: skip

    def _failed(self, exc: Exception) -> None:
        """Classify what ended the request (the one boundary between an exception and the request's outcome)."""
        if exc is self.worker_error:
            # Ended by the worker (drain deadline, engine lost): cancelled, and the client migrates.
            self._ended("cancel", "cancelled", exc, str(exc))
            return
        level = logging.WARNING
        reason = str(exc)
        if isinstance(exc, ProtocolViolation):
            metrics.PROTOCOL_VIOLATIONS.labels(violation=exc.violation.value).inc()
            level = logging.ERROR
        elif isinstance(exc, EngineRpcError | EngineFailure):
            # An engine that broke off the stream, refused the request or ended it with a terminal error no longer
            # holds it: nothing to abort.
            self._holds_engine = False
            if isinstance(exc, EngineRpcError) and exc.code is GrpcCode.UNAVAILABLE:
                self._server.engine_trouble.set()
                self._server.connection_lost.set()
        elif not isinstance(exc, SidecarError):
            reason = f"{type(exc).__name__}: {exc}"
            level = logging.ERROR
            log.error("request %s failed", self.ctx.request_id, exc_info=exc)
        self._ended("fail", "failed", exc, reason)
        self._end.failed(reason, level)


#: The phase each non-terminal state runs (a terminal state ends :meth:`ActiveRequest.run`).
_PHASES: Final[dict[str, Callable[[ActiveRequest], Awaitable[None]]]] = {
    "received": ActiveRequest._open,
    "submitted": ActiveRequest._follow,
    "decoding": ActiveRequest._follow,
    "cancel_deferred": ActiveRequest._follow,
    "streaming": ActiveRequest._follow,
    "prefill_ready": ActiveRequest._follow,
    "stopping": ActiveRequest._hold,
}

#: What the stream phase does with each event of the data path.
_ON_EVENT: Final[dict[str, Callable[[ActiveRequest, Any], Awaitable[None]]]] = {
    FIRST: ActiveRequest._on_first,
    STOPPED: ActiveRequest._on_stopped,
    IDLE: ActiveRequest._on_idle,
    STOP_STRING: ActiveRequest._on_stop_string,
    ENDED: ActiveRequest._on_ended,
    VERDICT: ActiveRequest._ignore,
}


class RequestServer:
    """Serves requests against the current :class:`ServingContext` and tracks the ones in flight."""

    def __init__(self) -> None:
        self._serving: ServingContext | None = None
        self._active: dict[str, ActiveRequest] = {}
        self._idle = trio.Event()
        self._idle.set()
        #: Set when a request saw the engine unreachable, so the worker's health watch looks at once instead of at
        #: its next poll; the watch replaces it after each look.
        self.engine_trouble = trio.Event()
        #: Set when a request lost its stream to a transport failure: whatever answers next may be another engine
        #: (a quick restart), so the worker checks its identity. The worker replaces it after each look.
        self.connection_lost = trio.Event()
        #: Called (awaited, bounded) when a request's inactivity timeout finds the engine not producing, before
        #: the error goes to the frontend: the worker withdraws from routing there.
        self.on_stall: Callable[[str], Awaitable[None]] | None = None
        # pause(): new requests wait for the next attach() instead of being sent elsewhere.
        self._paused = False
        self._resumed = trio.Event()
        # What the data paths share on the edge loop (the idle sweep, the progress counters); made on first use.
        self._paths: DataPaths | None = None

    @property
    def serving(self) -> ServingContext | None:
        return self._serving

    @property
    def progress(self) -> int:
        """Batches received from the engine so far: lets the health watch tell a busy engine (Health slow, tokens
        flowing) from a lost one."""
        return self._paths.progress if self._paths is not None else 0

    def attach(self, serving: ServingContext | None) -> None:
        """Start (or, with None, stop) serving: without a context new requests get a migratable error."""
        self._serving = serving
        self._paused = False
        self._resumed.set()
        self._resumed = trio.Event()

    def pause(self) -> None:
        """Stop admitting until the next :meth:`attach`: new requests wait for it (up to 10 s) instead of being sent
        elsewhere. For a rediscovery, whose new context arrives within moments."""
        self._serving = None
        self._paused = True

    @property
    def in_flight(self) -> int:
        return len(self._active)

    def tokens_in_flight(self) -> list[int]:
        """Prompt + generated tokens of each request in flight (the load estimate for an engine without KV usage)."""
        return [
            r.prompt_tokens + (r.mapper.completion_tokens if r.mapper is not None else 0) for r in self._active.values()
        ]

    async def wait_idle(self) -> None:
        """Return once no request is in flight."""
        while self._active:
            await self._idle.wait()

    def cancel_all(self, error: SidecarError) -> int:
        """Cancel every in-flight request with ``error`` as what its client is told; returns how many."""
        active = list(self._active.values())
        for request in active:
            request.cancel(error)
        return len(active)

    async def handle(self, request: dict[str, Any], ctx: RequestContext, outbox: ChunkSink) -> None:
        """The trio request handler given to the Dynamo adapter: serve one request into ``outbox``.

        Raises only :class:`WorkerDraining` when the worker is not serving (nothing was started: the adapter fails the
        outbox with it, and the frontend sends the request elsewhere); every other ending is the request's own.
        """
        serving = self._serving
        if serving is None and self._paused:
            # The engine is being rediscovered (a restart was noticed): admit the request under the new context.
            with trio.move_on_after(_PAUSE_WAIT_S):
                await self._resumed.wait()
            serving = self._serving
        if serving is None:
            raise WorkerDraining("worker is not serving (starting, degraded or draining); retry on another worker")
        await ActiveRequest(self, serving, request, ctx, outbox).run()

    def _admit(self, active: ActiveRequest) -> None:
        request_id = active.ctx.request_id
        if request_id in self._active:
            raise RequestRejected("request_id", f"{request_id!r} is already in flight on this worker")
        self._active[request_id] = active
        self._idle = trio.Event()

    def _forget(self, active: ActiveRequest) -> None:
        if self._active.get(active.ctx.request_id) is active:
            del self._active[active.ctx.request_id]
            if not self._active:
                self._idle.set()

    def _paths_on(self, edge: Edge) -> DataPaths:
        loop = edge.loop
        if self._paths is None or self._paths.loop is not loop:
            self._paths = DataPaths(loop)
        return self._paths

    async def _report_stall(self, serving: ServingContext, silent_s: float, error: HungEngine) -> None:
        """An inactivity timeout: when no request got anything from the engine for as long, the engine is not
        producing, and the worker withdraws (``on_stall``) before the error reaches the frontend, so that its
        migration lands on another worker instead of this wedged one."""
        if self.on_stall is None or silent_s < serving.inactivity_timeout_s:
            return  # other requests got tokens meanwhile: this request is stuck, not the engine
        # Before the first token the silence has no start (-inf): say that, not "for infs".
        if math.isfinite(silent_s):
            silence = f"nothing from the engine for {silent_s:.3g}s"
        else:
            silence = "no token ever received from the engine"
        with trio.CancelScope(shield=True), trio.move_on_after(_STALL_REPORT_S):
            await self.on_stall(f"engine not producing: {silence} ({error})")


@dataclass(slots=True)
class _RequestEnd:
    """The one line logged when a request ends: id, outcome, reason, tokens in/out, TTFT, duration.

    Expected endings (finished, rejected, cancelled, an engine error, a lost engine, a drain deadline) are one line
    each, never a traceback; a bug gets its traceback from ``log.exception`` besides this line.
    """

    request_id: str
    input_tokens: int
    started: float = field(default_factory=time.monotonic)
    stats: metrics.RequestStats | None = None
    reason: str = ""
    level: int = logging.INFO

    first_token_at: float | None = None

    def sent(self, chunks: list[dict[str, Any]]) -> None:
        """Chunks about to be handed to Dynamo: counted (``RequestStats``), the first token stamps the TTFT."""
        assert self.stats is not None
        self.stats.chunks(chunks)
        if self.first_token_at is None and self.stats.output_tokens:
            self.first_token_at = time.monotonic()

    def finished(self, final: list[dict[str, Any]]) -> None:
        reasons = [str(c["finish_reason"]) for c in final if "finish_reason" in c]
        self.reason = ", ".join(dict.fromkeys(reasons)) or "end of stream"

    def failed(self, reason: str, level: int) -> None:
        self.reason = reason
        self.level = level

    def log(self, outcome: str, reason: str | None = None) -> None:
        if not log.isEnabledFor(self.level):
            return
        output = self.stats.output_tokens if self.stats is not None else 0
        ttft = None if self.first_token_at is None else self.first_token_at - self.started
        log.log(
            self.level,
            "request %s %s (%s): %d in / %d out tokens, TTFT %s, %.0f ms",
            self.request_id,
            outcome,
            reason if reason is not None else (self.reason or "-"),
            self.input_tokens,
            output,
            "-" if ttft is None else f"{ttft * 1000:.0f} ms",
            (time.monotonic() - self.started) * 1000,
        )


def request_shape(request: dict[str, Any]) -> str:
    """What a debug line says of a request: its lengths, sampling and stop conditions, never its content.

    Prompts are never dumped (not as text, not as token ids: ids decode back to the prompt), nor stop strings or
    guides (client text); numbers and flags are shown as they came.
    """

    def section(name: str) -> dict[str, Any]:
        value = request.get(name)
        return value if isinstance(value, dict) else {}

    def scalars(values: dict[str, Any]) -> list[str]:
        return [f"{k}={v}" for k, v in values.items() if v is not None and isinstance(v, bool | int | float)]

    def count(value: Any) -> int:
        if isinstance(value, str):
            return 1 if value else 0  # one stop string given bare
        return len(value) if isinstance(value, list | tuple) else 0

    parts = [f"prompt {count(request.get('token_ids'))} tokens"]
    media = request.get("multi_modal_data")
    if isinstance(media, dict) and media:
        parts.append("media " + ", ".join(f"{kind} {count(items)}" for kind, items in media.items()))
    sampling = section("sampling_options")
    shown = scalars(sampling)
    guided = sampling.get("guided_decoding")
    if isinstance(guided, dict) and (kinds := [k for k, v in guided.items() if v not in (None, "", [], {})]):
        shown.append(f"guided {'/'.join(kinds)}")
    parts.append(f"sampling {{{', '.join(shown)}}}")
    stop = section("stop_conditions")
    shown = scalars(stop)
    for key in ("stop", "stop_token_ids_hidden", "stop_token_ids_visible"):
        if number := count(stop.get(key)):
            shown.append(f"{key} ×{number}")
    parts.append(f"stop {{{', '.join(shown)}}}")
    if shown := scalars(section("output_options")):
        parts.append(f"output {{{', '.join(shown)}}}")
    if request.get("prefill_result") is not None:
        parts.append("with a prefill result")
    return "; ".join(parts)


def _eos_token_ids(request: dict[str, Any]) -> list[int]:
    """``PreprocessedRequest.eos_token_ids`` as far as they are token ids (the engine is not sent them: only the
    terminal hold reads them, so a malformed list is ignored rather than refused)."""
    raw = request.get("eos_token_ids")
    if not isinstance(raw, list | tuple):
        return []
    return [i for i in raw if isinstance(i, int) and not isinstance(i, bool) and i >= 0]


async def _abort(serving: ServingContext, request_id: str) -> None:
    # Cancelling the stream already makes a well-behaved engine abort; the explicit Abort covers engines that keep
    # going, and is idempotent (ALREADY_FINISHED). Shielded so a cancelled task still sends it, bounded so a hung
    # engine cannot hold the task.
    with trio.CancelScope(shield=True), trio.move_on_after(serving.abort_timeout_s) as bound:
        started = trio.current_time()
        try:
            await serving.client.abort(request_id, timeout_s=serving.abort_timeout_s)
            metrics.ABORTS.labels(result="sent").inc()
            code = "OK"
        except EngineRpcError as exc:
            metrics.ABORTS.labels(result="failed").inc()
            log.warning("abort of %s failed: %s", request_id, exc)
            code = exc.code.name
        metrics.ABORT_LATENCY.observe(trio.current_time() - started)
        metrics.observe_rpc("Abort", code, trio.current_time() - started)
    if bound.cancelled_caught:
        metrics.ABORTS.labels(result="timeout").inc()
        log.warning("abort of %s did not complete within %gs", request_id, serving.abort_timeout_s)


async def probe_generation(serving: ServingContext, request_id: str, timeout_s: float) -> str | None:
    """One real one-token generation (the canary a stalled engine must pass to be served again); None when the
    engine answered it to its terminal within ``timeout_s``, else why not. A probe left unfinished is aborted.

    An engine that reports the prefill or decode role refuses a plain generation (a prefill leg would leave a KV
    session pinned; a decode leg needs one): there the canary is Health's inference probe, which the schema makes
    role-appropriate (OpenEngine v0.1.0's ``Health`` rules)."""
    if role_of_engine(serving.caps.engine_role) != "aggregated":
        with trio.move_on_after(timeout_s):
            try:
                health = await serving.client.health(include_inference_probe=True, role=serving.caps.engine_role)
            except EngineRpcError as exc:
                return str(exc)
            state = bp_enum(health.state)
            return None if state is HealthState.READY else f"inference probe: health {state.name}"
        return f"no answer within {timeout_s:g}s"
    call = build_generate_request(
        dict(HEALTH_CANARY_PAYLOAD),
        request_id=request_id,
        model=serving.model,
        caps=serving.caps,
        context_length=serving.context_length,
        role="aggregated",
        engine_detokenize=serving.engine_detokenize,
    )
    mapper = call.response_mapper()
    done = False
    try:
        with trio.move_on_after(timeout_s):
            async with serving.client.generate(call.request, metadata=call.metadata) as batches:
                async for batch in batches:
                    mapper.map(batch)
                    if mapper.done:
                        break
            mapper.end_of_stream()
            done = True
    except (EngineRpcError, EngineFailure, ProtocolViolation) as exc:
        return str(exc)
    finally:
        if not done:
            await _abort(serving, request_id)
    return None if done else f"no answer within {timeout_s:g}s"
