"""One trio task per request: request machine, engine stream, cancellation, abort.

The Dynamo adapter runs :meth:`RequestServer.handle` (a trio async generator) for every request Dynamo hands the
worker, inside the worker's request nursery. The shape that guarantees exactly one terminal state per request:

* validation and conversion before any RPC (``reject`` → HTTP 400, the engine never hears of the request);
* ``submit`` when the Generate stream is opened; from then on every exit that is not the engine's own end sends
  ``Control.Abort(request_id)`` — shielded and time-bounded — besides cancelling the stream (RST_STREAM);
* the final chunk is held until the engine closes the stream, so an event after the terminal still fails the
  request instead of slipping out after a success;
* the chunk with an output's last token carries its ``finish_reason`` and usage: a chunk ending with a token the
  engine's terminal follows (EOS / stop token id, the ``max_tokens``-th token) waits, bounded, for the next engine
  event and the ``finished`` joins it. The frontend ends the stream at EOS, stop tokens and stop strings itself and
  drops what follows; when it closes the stream after a chunk that may have completed the answer, the engine's next
  event decides (read shielded, bounded): its terminal means a complete answer (``finished``, no Abort), anything
  else a stop (``cancelled``, Abort);
* tokens the engine sent before a terminal ``EngineError`` reach the client before the error;
* one INFO line per request at its end (id, outcome, reason, tokens in/out, TTFT, duration); expected failures are
  that one line, at WARNING, never a traceback;
* a stop from the frontend cancels the task from outside (``cancel``); the worker cancels a request's own scope with
  a reason (drain deadline, engine lost), which becomes the matching migratable error.

Disaggregated legs (``docs/disaggregation.md``): the worker's role decides the leg (``convert`` maps it). A prefill
leg's ``PrefillReady`` moves the request to ``prefill_ready`` and its handoff chunk is the final one. A decode leg
carrying a handoff (``submit_decode``) **defers a client stop until the engine's first response** -- the KV transfer
has landed then, so the prefill engine's blocks are not stranded: the stream is opened and its first batch awaited
under a shield, while a watcher task outside the shield turns the client's stop into ``defer`` (``cancel_deferred``);
the stop is delivered right after the first batch (``first_token`` → ``cancelled``, then ``Abort``). The worker's own
cancellation (drain deadline, engine lost) reaches the shielded wait through the request's own scope and is never
deferred; the inactivity timeout still bounds the wait.

An inactivity timeout while no request got anything from the engine for as long means the engine is not producing:
``RequestServer.on_stall`` (the worker's withdrawal) runs before the error reaches the frontend, so the frontend's
migration goes to another worker instead of back to this one.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import trio

from openengine.v1 import generation_pb2
from openengine_bp.openengine.v1 import HealthState
from sidecar.convert import HEALTH_CANARY_PAYLOAD, build_generate_request
from sidecar.convert.enums import bp_enum
from sidecar.convert.request import role_of_engine
from sidecar.engine import StreamIdle
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
    from collections.abc import AsyncIterator, Awaitable, Callable
    from contextlib import AbstractAsyncContextManager

    from sidecar.convert import Capabilities, GenerateCall, ResponseMapper
    from sidecar.convert.request import Role
    from sidecar.dynamo import RequestContext
    from sidecar.engine import EngineClient

log: Final = logging.getLogger("sidecar.requests")

# After the terminal event the engine closes the stream at once (TensorRT-LLM does); one that does not is
# tolerated, but not waited for longer than this.
_EOF_GRACE_S: Final = 2.0
# How long a chunk ending with a token the engine's terminal follows (EOS / stop token id, the max_tokens-th token)
# waits for that terminal, and how long a close from the frontend after such a chunk waits to see it. The engine sends
# its terminal with the last token (the same engine step); a gap is transport framing, far below one inter-token
# interval. While the engine keeps generating, its next token ends the wait sooner; only an engine that stalls right
# after such a token costs the whole bound.
_TERMINAL_HOLD_S: Final = 0.25
# How long a request arriving while the engine is being rediscovered waits for the new serving context.
_PAUSE_WAIT_S: Final = 10.0
# Bound on the worker's withdrawal when a request finds the engine not producing.
_STALL_REPORT_S: Final = 5.0


_Batch = list[generation_pb2.GenerateResponse]


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


@dataclass(slots=True, eq=False)
class ActiveRequest:
    """A request between its arrival and its terminal state; the worker ends it early with :meth:`cancel`.

    The request task never holds a cancel scope across a ``yield`` (the consumer's code would run inside it), so a
    worker cancellation interrupts only the task's awaits on the engine: ``waiting`` is the scope of the await in
    progress, and the next await after a ``yield`` checks ``worker_error`` first.

    It also holds the request's engine stream between :meth:`open_stream` and :meth:`close_stream` (one slot where
    an ``AsyncExitStack`` used to be: the stream is opened under a shield on a decode leg, but always closed by the
    request task's own ``try``).
    """

    lifecycle: RequestLifecycle
    #: Prompt tokens, and the response mapper once the request is sent (its completion count): the load estimate.
    prompt_tokens: int = 0
    mapper: ResponseMapper | None = None
    waiting: trio.CancelScope | None = None
    # Set when the worker ends the request; it is what the client is told (a migratable error).
    worker_error: SidecarError | None = None
    _stream: AbstractAsyncContextManager[Any] | None = field(default=None, repr=False)
    # The inactivity timeout the engine stream watches itself (watch_idle), and the stream while waited on without
    # a cancel scope: see next_batch.
    _idle_s: float | None = field(default=None, repr=False)
    _parked: Any = field(default=None, repr=False)

    def cancel(self, error: SidecarError) -> None:
        """End the request from the worker's side (drain deadline, engine lost) with ``error`` for the client."""
        if self.worker_error is None:
            self.worker_error = error
        if self.waiting is not None:
            self.waiting.cancel(reason=error.message)
        elif self._parked is not None:
            self._parked.interrupt(self.worker_error)

    async def open_stream(
        self, client: EngineClient, call: GenerateCall, idle_timeout_s: float | None = None
    ) -> AsyncIterator[_Batch]:
        """Open the request's ``Generate`` stream (closed by :meth:`close_stream`) and return its batches.

        With ``idle_timeout_s``, a stream that can watch its own silence (``BatchIterator.watch_idle``) is asked to:
        waits of that length then need no cancel scope (:meth:`next_batch`).
        """
        stream = client.generate(call.request, metadata=call.metadata)
        batches = await stream.__aenter__()
        self._stream = stream
        watch = getattr(batches, "watch_idle", None)
        if idle_timeout_s is not None and watch is not None:
            watch(idle_timeout_s)
            self._idle_s = idle_timeout_s
        return aiter(batches)

    async def close_stream(self, error: BaseException | None) -> None:
        """Leave the engine stream as ``async with`` would, ``error`` being what ends the block (None: none)."""
        stream, self._stream = self._stream, None
        if stream is not None:
            if error is None:
                await stream.__aexit__(None, None, None)
            else:
                await stream.__aexit__(type(error), error, error.__traceback__)

    async def next_batch(self, stream: AsyncIterator[_Batch], timeout_s: float) -> _Batch | None:
        """The next batch from the engine, None at the end of the stream; raises on worker cancel or hang."""
        if self.worker_error is not None:
            raise self.worker_error
        if timeout_s == self._idle_s:
            # The common wait, once per engine batch: the stream times its own silence (StreamIdle) and the worker's
            # cancel interrupts the wait (cancel), so no cancel scope is made per batch (~5 µs and ~0.6 KiB while
            # parked; docs/performance.md).
            self._parked = stream
            try:
                return await anext(stream)
            except StopAsyncIteration:
                return None
            except StreamIdle:
                pass
            finally:
                self._parked = None
        else:
            with trio.CancelScope(deadline=trio.current_time() + timeout_s) as scope:
                self.waiting = scope
                try:
                    return await anext(stream)
                except StopAsyncIteration:
                    return None
                except StreamIdle:
                    pass  # the stream's own watch: silent for the whole inactivity timeout, even longer than this
                finally:
                    self.waiting = None
        if self.worker_error is not None:
            raise self.worker_error
        raise HungEngine(f"engine sent nothing for {timeout_s:g}s (request {self.lifecycle.request_id})")


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
        #: Batches delivered from the engine so far: lets the health watch tell a busy engine (Health slow, tokens
        #: flowing) from a lost one.
        self.progress = 0
        #: When any request last got a batch from the engine: an inactivity timeout with nothing received by anyone
        #: for as long means the engine is not producing (see :meth:`_report_stall`).
        self._last_batch_at = -float("inf")
        #: Called (awaited, bounded) when a request's inactivity timeout finds the engine not producing, before
        #: the error goes to the frontend: the worker withdraws from routing there.
        self.on_stall: Callable[[str], Awaitable[None]] | None = None
        # pause(): new requests wait for the next attach() instead of being sent elsewhere.
        self._paused = False
        self._resumed = trio.Event()

    @property
    def serving(self) -> ServingContext | None:
        return self._serving

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

    def active_requests(self) -> list[ActiveRequest]:
        return list(self._active.values())

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

    async def handle(self, request: dict[str, Any], ctx: RequestContext) -> AsyncIterator[list[dict[str, Any]]]:
        """The trio request handler given to the Dynamo adapter: yields batches of ``LLMEngineOutput`` chunks."""
        serving = self._serving
        if serving is None and self._paused:
            # The engine is being rediscovered (a restart was noticed): admit the request under the new context.
            with trio.move_on_after(_PAUSE_WAIT_S):
                await self._resumed.wait()
            serving = self._serving
        if serving is None:
            raise WorkerDraining("worker is not serving (starting, degraded or draining); retry on another worker")
        lifecycle = RequestLifecycle(ctx.request_id)
        logs.REQUEST_ID.set(ctx.request_id)  # every log line of this request's task names it
        metrics.REQUESTS_RECEIVED.inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s: %s", ctx.request_id, request_shape(request))
        end = _RequestEnd(ctx.request_id, len(request.get("token_ids") or ()))
        try:
            trace = dict(ctx.trace_headers)
            call = build_generate_request(
                request,
                request_id=ctx.request_id,
                model=serving.model,
                caps=serving.caps,
                context_length=serving.context_length,
                trace=trace,
                role=serving.worker_role,
                engine_detokenize=serving.engine_detokenize,
            )
        except RequestRejected as exc:
            lifecycle.fire("reject", reason=str(exc))
            metrics.REQUESTS_ENDED.labels(outcome="rejected").inc()
            end.log("rejected", str(exc))
            raise
        if ctx.request_id in self._active:
            lifecycle.fire("reject", reason="duplicate request id")
            metrics.REQUESTS_ENDED.labels(outcome="rejected").inc()
            end.log("rejected", "duplicate request id")
            raise RequestRejected("request_id", f"{ctx.request_id!r} is already in flight on this worker")

        mapper = call.response_mapper(eos_token_ids=_eos_token_ids(request))
        active = ActiveRequest(lifecycle, prompt_tokens=call.prompt_tokens, mapper=mapper)
        self._active[ctx.request_id] = active
        self._idle = trio.Event()
        # Stop strings are matched by the frontend on its own text: any chunk may be the one it ends the answer with.
        stop_texts = bool(call.stop_texts)
        engine_holds_request = False
        outcome = "failed"
        stats = metrics.RequestStats(end.input_tokens)
        end.stats = stats
        try:
            final: list[dict[str, Any]] = []
            # Set when the frontend ended the stream and the engine's terminal followed: a complete answer.
            ended_downstream = False
            # Chunks ending with a token the engine's terminal follows, held (bounded) for that terminal so that
            # the frontend gets the last token, finish_reason and usage in one chunk.
            held: list[dict[str, Any]] = []
            hold_deadline = 0.0
            # Whether the client may already have its whole answer: the frontend ends the stream at EOS / stop
            # tokens and stop strings itself, and its close is then no cancellation.
            may_be_complete = False
            try:  # the engine stream's block: every way out of it goes through active.close_stream
                first: _Batch | None = None
                have_first = False
                engine_holds_request = True
                if call.handoff:
                    lifecycle.fire("submit_decode")
                    stream, first = await _open_deferring_stop(serving, call, active)
                    have_first = True
                else:
                    lifecycle.fire("submit")
                    stream = await active.open_stream(serving.client, call, serving.inactivity_timeout_s)
                while True:
                    if have_first:
                        batch, have_first = first, False
                    else:
                        if mapper.done:
                            # After the terminal event the engine closes the stream at once; wait briefly for that
                            # close so an event after the terminal still fails the request instead of following a
                            # success.
                            timeout_s = _EOF_GRACE_S
                        elif held:
                            timeout_s = max(hold_deadline - trio.current_time(), 0.0)
                        else:
                            timeout_s = serving.inactivity_timeout_s
                        try:
                            batch = await active.next_batch(stream, timeout_s)
                        except HungEngine:
                            if mapper.done:
                                log.warning(
                                    "request %s: engine kept the stream open after its terminal", ctx.request_id
                                )
                                break
                            if not held:
                                raise
                            # No terminal within the hold: the chunks go out as they are.
                            chunks, held = held, []
                            may_be_complete = True
                            self.progress += 1
                            end.sent(chunks)
                            yield chunks
                            continue
                    if batch is None:
                        break
                    self._last_batch_at = trio.current_time()
                    chunks = mapper.map(batch, held)
                    if held:
                        held = []
                    if mapper.failure is not None:
                        # Tokens, then the engine's terminal error: the tokens are the client's, the error follows.
                        if lifecycle.state in ("submitted", "decoding"):
                            lifecycle.fire("first_token")
                        end.sent(chunks)
                        yield chunks
                        raise mapper.failure
                    if mapper.done:
                        if mapper.handed_off:
                            lifecycle.fire("handoff")
                        final.extend(chunks)
                        continue
                    if lifecycle.state in ("submitted", "decoding"):
                        lifecycle.fire("first_token")
                    if not chunks:
                        continue
                    if mapper.awaits_terminal(chunks):
                        held = chunks
                        hold_deadline = trio.current_time() + _TERMINAL_HOLD_S
                        continue
                    may_be_complete = stop_texts
                    self.progress += 1
                    end.sent(chunks)
                    yield chunks
            except BaseException as exc:
                if (
                    isinstance(exc, trio.Cancelled | GeneratorExit)
                    and may_be_complete
                    and lifecycle.state == "streaming"
                    and active.worker_error is None
                ):
                    ended_downstream = await _terminal_follows(stream, mapper)
                await active.close_stream(exc)
                raise
            await active.close_stream(None)
            # The stream ended on its own: the engine no longer holds the request.
            engine_holds_request = False
            mapper.end_of_stream()
            lifecycle.fire("finish")
            outcome = "finished"
            end.finished(final)
            if final:
                end.sent(final)
                yield final
        except (trio.Cancelled, GeneratorExit):
            if ended_downstream:
                # The frontend ended the stream at the answer's last token (EOS, stop token or string) and the engine's
                # terminal followed: a complete answer, nothing to abort.
                engine_holds_request = False
                lifecycle.fire("finish", reason="the frontend ended the stream at the answer's last token")
                outcome = "finished"
                end.reason = "ended by the frontend at the answer's last token"
                raise
            # The client (or Dynamo) stopped the request (a decode leg's deferred stop is already `cancelled`).
            if lifecycle.state == "prefill_ready":
                log.warning(
                    "request %s: stopped before its prefill handoff was delivered; the prefill engine holds that KV "
                    "session until it expires",
                    ctx.request_id,
                )
            lifecycle.fire("cancel", reason="stopped by the client")
            if lifecycle.state == "cancelled":
                outcome = "cancelled"
            end.reason = end.reason or "stopped by the client"
            raise
        except ProtocolViolation as exc:
            metrics.PROTOCOL_VIOLATIONS.labels(violation=exc.violation.value).inc()
            lifecycle.fire("fail", reason=str(exc))
            end.failed(str(exc), logging.ERROR)
            raise
        except (EngineRpcError, EngineFailure) as exc:
            # An engine that broke off the stream, refused the request or ended it with a terminal error no longer
            # holds it: nothing to abort.
            engine_holds_request = False
            if isinstance(exc, EngineRpcError) and exc.code is GrpcCode.UNAVAILABLE:
                self.engine_trouble.set()
                self.connection_lost.set()
            lifecycle.fire("fail", reason=str(exc))
            end.failed(str(exc), logging.WARNING)
            raise
        except SidecarError as exc:
            if exc is active.worker_error:
                # Ended by the worker (drain deadline, engine lost): cancelled, and the client migrates.
                lifecycle.fire("cancel", reason=str(exc))
                outcome = "cancelled"
                end.reason = str(exc)
                raise
            if isinstance(exc, HungEngine):
                await self._report_stall(serving, exc)
            lifecycle.fire("fail", reason=str(exc))
            end.failed(str(exc), logging.WARNING)
            raise
        except Exception as exc:
            lifecycle.fire("fail", reason=f"{type(exc).__name__}: {exc}")
            log.exception("request %s failed", ctx.request_id)
            end.failed(f"{type(exc).__name__}: {exc}", logging.ERROR)
            raise
        finally:
            # Every path reaches a terminal state; a cancel after a terminal is a documented no-op.
            lifecycle.fire("cancel", reason="request task ended")
            metrics.REQUESTS_ENDED.labels(outcome=outcome).inc()
            stats.end(code=metrics.rpc_code(sys.exc_info()[1]))
            if engine_holds_request:
                await _abort(serving, ctx.request_id)
            end.log(outcome)
            del self._active[ctx.request_id]
            if not self._active:
                self._idle.set()

    async def _report_stall(self, serving: ServingContext, error: HungEngine) -> None:
        """An inactivity timeout: when no request got anything from the engine for as long, the engine is not
        producing, and the worker withdraws (``on_stall``) before the error reaches the frontend, so that its
        migration lands on another worker instead of this wedged one."""
        silent_s = trio.current_time() - self._last_batch_at
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


async def _terminal_follows(stream: AsyncIterator[_Batch], mapper: ResponseMapper) -> bool:
    """The frontend closed the stream after a chunk that may have completed the answer: read the engine's next
    events (shielded, bounded by one hold). True when its terminal follows, i.e. the answer was complete; False
    when it goes on generating (a real stop), errs, or stays silent."""
    with trio.CancelScope(shield=True), trio.move_on_after(_TERMINAL_HOLD_S):
        while True:
            try:
                batch = await anext(stream)
                chunks = mapper.map(batch)
            except Exception:  # StopAsyncIteration (EOF without a terminal), a transport error, a breach, an error
                return False
            if mapper.failure is not None:
                return False
            if mapper.done:
                return not mapper.handed_off
            if any(chunk["token_ids"] for chunk in chunks):
                return False
    return False


async def _open_deferring_stop(
    serving: ServingContext, call: GenerateCall, active: ActiveRequest
) -> tuple[AsyncIterator[_Batch], _Batch | None]:
    """Open a decode leg's stream and wait for its first batch (None: the stream ended) with a client stop deferred.

    The open and the wait run shielded from the caller's cancellation; a watcher task outside the shield records a
    client stop as ``defer``. After the first batch a deferred stop becomes ``first_token`` → ``cancelled`` and is
    delivered by the checkpoint at the end. The worker's own cancellation and the inactivity timeout act on
    ``active``'s scope inside the shield, so they are never deferred.
    """
    lifecycle = active.lifecycle
    phase_over = False

    async def watch_client() -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            if not phase_over and lifecycle.may_fire("defer"):
                lifecycle.fire(
                    "defer", reason="client stopped while the KV cache was in flight; deferred until the first token"
                )
                log.info("request %s: client stop deferred until the KV transfer lands", lifecycle.request_id)
            # Not re-raised: the caller's cancellation stays in force and is delivered at the next checkpoint outside
            # the shield (re-raising would surface it wrapped in an ExceptionGroup at the nursery's exit).

    opened: tuple[AsyncIterator[_Batch], _Batch | None] | None = None
    error: BaseException | None = None
    async with trio.open_nursery() as watcher:
        watcher.start_soon(watch_client)
        with trio.CancelScope(shield=True):
            try:
                stream = await active.open_stream(serving.client, call, serving.inactivity_timeout_s)
                opened = (stream, await active.next_batch(stream, serving.inactivity_timeout_s))
            except BaseException as exc:  # re-raised below, outside the nursery (no ExceptionGroup wrapping)
                error = exc
        phase_over = True
        if error is None and lifecycle.state == "cancel_deferred":
            lifecycle.fire("first_token", reason="KV transfer landed: the deferred client stop takes effect")
        watcher.cancel_scope.cancel()
    if error is not None:
        raise error
    await trio.lowlevel.checkpoint()  # delivers a deferred client stop
    assert opened is not None
    return opened


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
