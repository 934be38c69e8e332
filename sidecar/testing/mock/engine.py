"""The simulated engine: admission, KV blocks, model time, token generation and the response stream.

Theory of operation
-------------------
Every accepted ``Generate`` runs as its own asyncio task (the grpclib handler) through
``queued → prefill → decode → done``:

* **queued** — waits (FIFO) until a running slot (``--max-running-requests``) and a KV reservation for its worst case
  (prompt + ``max_tokens`` per output) are free; counted in ``GetLoad.queued_requests``.
* **prefill** — pins its prefix-cache hits, "computes" the rest of the prompt at ``--prefill-tokens-per-s`` and
  registers the prompt's full blocks for later reuse.
* **decode** — one step per token for every unfinished output; a step lasts
  ``decode_ms_per_token × (1 + (B − 1) / 64)`` where ``B`` is the number of sequences decoding engine-wide, all
  divided by ``--speedup`` (0 = no delay). Each step ends in a real suspension (``asyncio.sleep``) so the server never
  starves other streams, even at zero delay. ``--step-clock per-request`` (the default): each request paces its own
  steps on a timer of its own, so the tokens of concurrent requests leave at scattered times. ``--step-clock
  engine``: one engine-wide step (:class:`StepClock`) -- every decoding sequence gets its token at the same step,
  and the server writes that step's messages together (one write per connection), as TensorRT-LLM's executor hands
  one iteration's outputs for all requests at once.

All waits of a request go through :meth:`LiveRequest.wait`, which ``Abort`` interrupts; client cancellation arrives as
``CancelledError`` at the same points. Whatever ends a request, :meth:`Engine._finish` releases its id and blocks --
except a prefill leg that handed off: its blocks go to a held KV session until a decode engine claims them
(``kvsessions``), and a decode leg claims its session (the "KV transfer") in place of computing the prompt.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import enum
import hashlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from openengine.v1 import error_pb2, generation_pb2, kv_pb2, lifecycle_pb2, lora_pb2, server_pb2

from .faults import MockFaults
from .kvcache import Allocation, Block, BlockPool, block_hash, block_namespace, prompt_block_hashes
from .kvsessions import KvClaimError, KvSessionStore, claim_session, prompt_digest
from .lmapi import context_seed, output_seed, seeded_uniform
from .structs import fill_struct
from .textstream import OutputText
from .validate import PROMPT_LOGPROB_LIMIT, Rejection, ReplayLogprob, RequestPlan, validate_request

if TYPE_CHECKING:
    from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
    from multidict import MultiDict

    from .config import MockConfig
    from .faults import Violation
    from .lmapi import LanguageModel

__all__ = ["Engine", "LiveRequest", "RequestState", "Sender", "StepClock"]

log = logging.getLogger("openengine_mock")

Sender = Callable[[generation_pb2.GenerateResponse], Awaitable[None]]
#: A token as generated: (token_id, logprob, rank, candidates); logprob data only when requested.
_Token = tuple[int, float | None, int | None, Sequence[tuple[int, float]]]
#: How an output ended: the finish reason and the stop match (``("eos_token_id", 2)``, …), if any.
_End = tuple[generation_pb2.FinishReason, tuple[str, int | str] | None]

_LOGPROB_FLOOR = -9999.0
_BATCH_SLOWDOWN = 64.0
_PROBE_TIMEOUT_S = 30.0


def _burn_cpu(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time (a stand-in for the work of a real detokenizer)."""
    end = time.thread_time_ns() + int(seconds * 1e9)
    while time.thread_time_ns() < end:
        pass


def _first_gen_log_probs(token: _Token, top_n: int) -> float | list[list[float]]:
    """One position of ``PrefillReady``'s ``first_gen_log_probs``: the logprob alone without candidates, else
    ``[token_id, logprob, rank]`` for the top-``top_n`` candidates and the sampled token (TensorRT-LLM's shape)."""
    token_id, logprob, rank, candidates = token
    assert logprob is not None
    if top_n <= 0:
        return _clamp(logprob)
    triples = [[float(cid), _clamp(clp), float(r)] for r, (cid, clp) in enumerate(candidates, 1)]
    if all(cid != token_id for cid, _ in candidates):
        triples.append([float(token_id), _clamp(logprob), float(rank if rank is not None else len(triples) + 1)])
    return triples


def _replayed(token_id: int, entry: ReplayLogprob, top_n: int) -> _Token:
    """The decode leg's replayed first token with the logprob data its ``first_gen_log_probs`` carried."""
    if isinstance(entry, float):
        return (token_id, entry, None, ())
    own = next(((lp, rank) for tid, lp, rank in entry if tid == token_id), None)
    candidates = [(tid, lp) for tid, lp, rank in sorted(entry, key=lambda t: t[2]) if rank <= top_n]
    if own is None:
        return (token_id, None, None, candidates)
    return (token_id, own[0], own[1], candidates)


class RequestState(enum.Enum):
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


class _Aborted(Exception):
    """``Abort`` hit this request."""


class _Stalled(Exception):
    """The client did not read for ``--stall-timeout`` seconds."""


class _ConnectionDropped(Exception):
    """A ``drop_after_tokens`` fault closed the connection."""


def _clamp(logprob: float) -> float:
    return logprob if logprob > _LOGPROB_FLOOR else _LOGPROB_FLOOR  # also maps -inf and NaN


class LiveRequest:
    """One accepted request: its plan, state, KV allocation and counters."""

    __slots__ = (
        "_loop",
        "_waiter",
        "aborted",
        "alloc",
        "blocks_needed",
        "cached_tokens",
        "generated",
        "plan",
        "prompt_hashes",
        "prompt_parent",
        "state",
        "terminal_sent",
        "unfinished",
    )

    def __init__(self, plan: RequestPlan) -> None:
        self.plan = plan
        self.state = RequestState.QUEUED
        self.aborted = False
        self.terminal_sent = False
        self.alloc: Allocation | None = None
        self.prompt_hashes: list[int] = []
        self.prompt_parent: int | None = None
        self.blocks_needed = 0
        self.cached_tokens = 0
        self.generated = 0
        self.unfinished = plan.n
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.plan.prompt_ids)

    def usage(self) -> generation_pb2.Usage:
        return generation_pb2.Usage(
            prompt_tokens=self.prompt_len,
            completion_tokens=self.generated,
            total_tokens=self.prompt_len + self.generated,
            cached_prompt_tokens=self.cached_tokens,
        )

    def abort(self) -> bool:
        """Ask the request to stop; ``False`` if it already sent its terminal event (or was aborted before)."""
        if self.terminal_sent or self.aborted or self.state is RequestState.DONE:
            return False
        self.aborted = True
        self.wake()
        return True

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self, delay: float | None) -> None:
        """Sleep ``delay`` seconds (``None`` = until woken); raises :class:`_Aborted` if aborted before or during."""
        if self.aborted:
            raise _Aborted
        if delay is not None and delay <= 0:
            await asyncio.sleep(0)
        else:
            waiter = self._waiter = self._loop.create_future()
            timer = self._loop.call_later(delay, self.wake) if delay is not None else None
            try:
                await waiter
            finally:
                if timer is not None:
                    timer.cancel()
                self._waiter = None
        if self.aborted:
            raise _Aborted


def _nothing() -> None:
    pass


class StepClock:
    """``--step-clock engine``: one decode step for the whole engine.

    A decoding request waits for the next step (:meth:`next_step`); at the step every waiting request is woken at
    once, in one pass of the event loop, with the server's writes held (``hold_writes``) until they have all sent
    their messages (``release_writes``, scheduled behind them). A step lasts :meth:`Engine._step_time` at the batch
    of that moment, on absolute deadlines (a late step starts from now); the clock stops when nothing decodes and
    restarts, one step ahead, with the next request that waits. An abort wakes a waiting request as before (its
    ``wait`` raises)."""

    __slots__ = ("_busy", "_due", "_step_time", "_timer", "_waiting", "hold_writes", "release_writes", "steps")

    def __init__(self, step_time: Callable[[], float], busy: Callable[[], bool]) -> None:
        self._step_time = step_time
        self._busy = busy
        self._waiting: dict[LiveRequest, None] = {}  # insertion-ordered: woken in the order they came
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0
        #: Set by the server: hold every connection's writes / write what each holds in one go.
        self.hold_writes: Callable[[], None] = _nothing
        self.release_writes: Callable[[], None] = _nothing
        #: Steps run (``mock_stats.engine_steps``).
        self.steps = 0

    async def next_step(self, req: LiveRequest) -> None:
        """Wait for the engine's next step (raises :class:`_Aborted` if ``req`` is aborted)."""
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._due = loop.time() + self._step_time()
            self._timer = loop.call_at(self._due, self._step)
        self._waiting[req] = None
        try:
            await req.wait(None)
        finally:
            self._waiting.pop(req, None)

    def _step(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = None
        self.steps += 1
        waiting = list(self._waiting)
        self._waiting.clear()
        if waiting:
            self.hold_writes()
            for req in waiting:
                req.wake()
            # Behind every woken request's wake-up: each sends this step's messages before the writes go.
            loop.call_soon(self.release_writes)
        if self._busy():
            self._due = max(self._due + self._step_time(), loop.time())
            self._timer = loop.call_at(self._due, self._step)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _Output:
    """One of the request's ``n`` sequences."""

    __slots__ = (
        "block",
        "block_tokens",
        "count",
        "ctx",
        "finished",
        "index",
        "parent",
        "pending",
        "replay",
        "replay_logprobs",
        "script",
        "script_eos",
        "script_pos",
        "seed",
        "text",
    )

    def __init__(self, index: int, plan: RequestPlan, seed: int, text: OutputText | None) -> None:
        self.index = index
        self.seed = seed  # this output's own: its draws are seeded_uniform(seed, absolute position, attempt)
        self.text = text
        self.ctx = list(plan.prompt_ids)
        self.count = 0
        self.finished = False
        self.pending: list[_Token] = []
        self.replay = collections.deque(plan.session.replay_tokens if plan.session is not None else ())
        self.replay_logprobs = collections.deque(plan.session.replay_logprobs if plan.session is not None else ())
        #: Tokens to emit instead of sampling (``extra.mock.tokens`` or a guided text), then EOS if ``script_eos``.
        self.script = plan.script
        self.script_eos = plan.script_ends_with_eos
        self.script_pos = 0
        self.block: Block | None = None
        self.block_tokens: list[int] = []
        self.parent: int | None = None


class _Emitter:
    """Builds and sends the response events of one request; applies the ``violation`` fault and the stall watchdog."""

    def __init__(
        self,
        request: LiveRequest,
        send: Sender,
        lm: LanguageModel,
        *,
        stall_timeout: float,
    ) -> None:
        self._req = request
        self._send_raw = send
        self._lm = lm
        self._violation: Violation | None = request.plan.faults.violation
        self._stall_timeout = stall_timeout
        self._first = True
        self._with_logprobs = request.plan.output_logprobs
        #: ``cumulative_deltas``: every token event so far per output, repeated in front of the next one.
        self._sent: dict[int, tuple[list[_Token], list[str]]] = {}

    async def _send(self, response: generation_pb2.GenerateResponse, *, terminal: bool) -> None:
        req, violation = self._req, self._violation
        if terminal:
            req.terminal_sent = True
            if violation == "eof_before_terminal":
                return
        if violation is not None and self._first:
            if violation == "wrong_request_id":
                response.request_id = response.request_id + "-wrong"
            elif violation == "usage_on_non_final" and not terminal:
                response.usage.CopyFrom(req.usage())
        if violation == "missing_output_index":
            event = response.WhichOneof("event")
            if event == "token":
                response.token.ClearField("output_index")
            elif event == "finished":
                response.finished.ClearField("output_index")
        self._first = False
        loop = asyncio.get_running_loop()
        started = loop.time()
        await self._send_raw(response)
        if terminal:
            if violation == "event_after_terminal":
                extra = generation_pb2.GenerateResponse(request_id=req.plan.request_id)
                extra.token.output_index = 0
                extra.token.tokens.add(token_id=self._lm.bos_token_id)
                await self._send_raw(extra)
        elif loop.time() - started > self._stall_timeout:
            raise _Stalled

    def _response(self) -> generation_pb2.GenerateResponse:
        return generation_pb2.GenerateResponse(request_id=self._req.plan.request_id)

    def _fill(
        self,
        container: RepeatedCompositeFieldContainer[generation_pb2.TokenInfo],
        tokens: Sequence[_Token],
        *,
        with_logprobs: bool,
    ) -> None:
        add = container.add
        token_text = self._lm.token_text
        for token_id, logprob, rank, candidates in tokens:
            if not with_logprobs:
                add(token_id=token_id)
                continue
            info = add(token_id=token_id, token=token_text(token_id))
            if logprob is not None:
                info.logprob = _clamp(logprob)
            if rank is not None:
                info.rank = rank
            for r, (cid, clp) in enumerate(candidates, 1):
                info.candidates.add(token_id=cid, logprob=_clamp(clp), token=token_text(cid), rank=r)

    async def token(self, index: int, tokens: Sequence[_Token], text: str) -> None:
        if self._violation == "cumulative_deltas":
            seen_tokens, seen_text = self._sent.setdefault(index, ([], []))
            seen_tokens.extend(tokens)
            seen_text.append(text)
            tokens, text = list(seen_tokens), "".join(seen_text)
        response = self._response()
        event = response.token
        event.output_index = index
        self._fill(event.tokens, tokens, with_logprobs=self._with_logprobs)
        event.text = text
        await self._send(response, terminal=False)

    async def prompt(self, tokens: Sequence[_Token]) -> None:
        response = self._response()
        self._fill(response.prompt.tokens, tokens, with_logprobs=True)
        await self._send(response, terminal=False)

    async def finished(
        self,
        index: int,
        reason: generation_pb2.FinishReason,
        stop: tuple[str, int | str] | None,
        *,
        last: bool,
        message: str = "",
    ) -> None:
        response = self._response()
        event = response.finished
        event.output_index = index
        if self._violation != "unspecified_finish":
            event.reason = reason
            if stop is not None:
                setattr(event.stop_match, stop[0], stop[1])
        if message:
            event.message = message
        if last or self._violation == "usage_on_every_finish":
            response.usage.CopyFrom(self._req.usage())
        await self._send(response, terminal=last)

    async def prefill_ready(self, session: kv_pb2.KvSessionRef) -> None:
        response = self._response()
        response.prefill_ready.kv_session.CopyFrom(session)
        response.usage.CopyFrom(self._req.usage())
        await self._send(response, terminal=True)

    async def error(self, code: error_pb2.ErrorCode, message: str, retryable: bool, *, terminal: bool = True) -> None:
        """One ``EngineError`` with usage. ``terminal=False``: the stream goes on after it (TensorRT-LLM's formatter
        after the prompt-logprob limit), so the request can still be aborted."""
        response = self._response()
        response.error.code = code
        response.error.message = message
        response.error.retryable = retryable
        response.usage.CopyFrom(self._req.usage())
        await self._send(response, terminal=terminal)


class Engine:
    """The mock engine shared by the ``Inference`` and ``Control`` services."""

    def __init__(self, config: MockConfig, lm: LanguageModel) -> None:
        self.config = config
        # SIGUSR1 flips this between None and "not_ready": a running engine going unwell and recovering.
        self.health_override: str | None = None
        self.lm = lm
        self.pool = BlockPool(config.total_kv_blocks, config.kv_block_size)
        self.live: dict[str, LiveRequest] = {}
        self.loras: dict[str, lora_pb2.LoraAdapter] = {}
        self.ready = config.startup_delay <= 0
        self.draining = False
        self.accepted = 0
        self.listen_host = config.host
        self.listen_port = config.port
        self._queue: collections.deque[LiveRequest] = collections.deque()
        self._counts = dict.fromkeys(RequestState, 0)
        self._decoding_sequences = 0
        #: ``--step-clock engine``: the engine-wide decode step (``None``: each request paces itself).
        self.step_clock = (
            StepClock(self._step_time, lambda: self._decoding_sequences > 0) if config.step_clock == "engine" else None
        )
        self._sessions = 0
        self.kv_sessions = KvSessionStore(
            timeout_s=config.kv_session_timeout,
            transfer_s=self._time(config.kv_transfer_ms / 1000.0),
            on_release=self._pump,
        )
        #: What this engine served, by kind (``ServerInfo.extra.mock_stats``): prefill legs, decode legs, whole
        #: requests, request features, plus the KV session counters of ``kv_sessions``.
        self.served: collections.Counter[str] = collections.Counter()
        #: The last media request's items in the order the engine fills placeholders (``mock_stats.last_media``).
        self.last_media: list[dict[str, str]] = []
        self._probes = 0
        self._probe: asyncio.Future[tuple[lifecycle_pb2.HealthState, str]] | None = None
        self._eos = frozenset(lm.eos_token_ids)
        self._idle = asyncio.Event()
        self._idle.set()
        #: Handler tasks that never end by themselves (KV event subscriptions): a stop does not wait for them.
        self.endless_tasks: set[asyncio.Task[None]] = set()

    @property
    def prefilling(self) -> int:
        """Requests in their prefill now (``mock_stats.prefilling_requests``)."""
        return self._counts[RequestState.PREFILL]

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    async def run_startup(self) -> None:
        """Stay in ``STARTING`` for ``--startup-delay`` seconds."""
        if not self.ready:
            await asyncio.sleep(self.config.startup_delay)
            self.ready = True
            log.info("startup delay over: ready")

    async def wait_idle(self, grace: float) -> bool:
        """Wait until no request is live (``True``) or ``grace`` seconds pass (``False``)."""
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except TimeoutError:
            return False
        return True

    # -- Generate ----------------------------------------------------------------------------------------------------

    def accept(self, request: generation_pb2.GenerateRequest, metadata: MultiDict[str | bytes] | None) -> LiveRequest:
        """Validate and register ``request``; raises ``GRPCError`` (zero stream messages) when refused."""
        if self.draining:
            raise GRPCError(Status.UNAVAILABLE, "openengine-mock is shutting down")
        if not self.ready:
            raise GRPCError(Status.UNAVAILABLE, "openengine-mock is starting (model not loaded yet)")
        try:
            plan = validate_request(
                request, metadata, config=self.config, lm=self.lm, is_live=self.live.__contains__, loras=self.loras
            )
        except Rejection as exc:
            log.warning("rejected %r: %s %s", request.request_id, exc.status.name, exc.message)
            raise GRPCError(exc.status, exc.message) from None
        req = LiveRequest(plan)
        self._register(req)
        self.accepted += 1
        self._count_features(plan)
        limit = self.config.fault_exit_after_requests
        if limit is not None and self.accepted >= limit:
            log.error("--fault-exit-after-requests %d reached: exiting hard", limit)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        return req

    def _count_features(self, plan: RequestPlan) -> None:
        """Count the request features seen (``mock_stats``), so tests can tell a mapped field reached the engine."""
        served = self.served
        if plan.priority:
            served["priority_requests"] += 1
            served["last_priority"] = plan.priority
        if plan.cache_salt is not None:
            served["cache_salt_requests"] += 1
        if plan.bypass_prefix_cache:
            served["bypass_prefix_cache_requests"] += 1
        if plan.prompt_logprobs:
            served["prompt_logprobs_requests"] += 1
        if plan.guide is not None and plan.script is None:
            served["guided_requests"] += 1
        if plan.text_prompt:
            served["text_prompt_requests"] += 1
        if plan.media:
            served["media_requests"] += 1
            self.last_media = [{"modality": m.modality, "source": m.source, "uuid": m.uuid} for m in plan.media]

    async def generate(self, req: LiveRequest, send: Sender, drop: Callable[[], None]) -> None:
        """Serve an accepted request to its end; never raises for application failures (they become events)."""
        try:
            await self._run(req, send, drop)
        except asyncio.CancelledError:
            if not req.terminal_sent:
                # The client cancelled the RPC (RST_STREAM) or the connection went: freed below, like TRT's
                # done-callback abort. Counted apart from Control.Abort so tests can tell the two apart.
                self.served["requests_cancelled"] += 1
            raise
        finally:
            self._finish(req)

    async def _run(self, req: LiveRequest, send: Sender, drop: Callable[[], None]) -> None:
        plan = req.plan
        em = _Emitter(req, send, self.lm, stall_timeout=self.config.stall_timeout)
        outputs: list[_Output] = []
        try:
            if plan.deferred_error is not None:
                log.warning("request %r failed after submission: %s", plan.request_id, plan.deferred_error)
                await em.error(error_pb2.ERROR_CODE_INTERNAL, plan.deferred_error, False)
                return
            await self._admit(req)
            await self._prefill(req)
            kind = "prefill_legs" if plan.context_only else "decode_legs" if plan.session is not None else "requests"
            self.served[kind] += 1
            outputs = self._make_outputs(req)
            self._set_state(req, RequestState.DECODE)
            if await self._fault_point(req, em, outputs, drop):
                return
            prompt_error: str | None = None
            if plan.prompt_logprobs:
                entries = req.prompt_len * max(plan.prompt_top_n, 1)
                if entries <= PROMPT_LOGPROB_LIMIT:
                    await em.prompt(self._prompt_tokens(plan))
                else:
                    prompt_error = (
                        f"prompt logprobs too large: {req.prompt_len} prompt tokens x "
                        f"{max(plan.prompt_top_n, 1)} candidates > {PROMPT_LOGPROB_LIMIT}"
                    )
                    if not self.config.engine.streams_after_prompt_logprob_error:
                        await em.error(error_pb2.ERROR_CODE_INVALID_ARGUMENT, prompt_error, False)
                        return
            if plan.context_only:
                if prompt_error is not None:
                    await em.error(error_pb2.ERROR_CODE_INVALID_ARGUMENT, prompt_error, False, terminal=False)
                await self._context_only(req, em, outputs[0])
            else:
                await self._decode(req, em, outputs, drop, prompt_error)
        except _Aborted:
            log.info("request %r aborted", plan.request_id)
            self.served["requests_aborted"] += 1
            await self._cancel(req, em, outputs, "aborted")
        except _Stalled:
            log.warning("request %r: response consumer stalled for %.0f s", plan.request_id, self.config.stall_timeout)
            await em.error(error_pb2.ERROR_CODE_OVERLOADED, "response consumer stalled", True)
        except _ConnectionDropped:
            log.warning("request %r: dropped the connection (extra.mock.drop_after_tokens)", plan.request_id)
        except KvClaimError as exc:
            log.warning("request %r: KV transfer failed: %s", plan.request_id, exc.message)
            self.served["decode_kv_failures"] += 1
            # TensorRT-LLM reports every failed transfer as a plain executor error; the full engine names it.
            code = error_pb2.ERROR_CODE_INTERNAL if self.config.engine.kv_transfer_errors == "internal" else exc.code
            await em.error(code, exc.message, False)
        except Exception as exc:
            log.exception("request %r failed", plan.request_id)
            if not req.terminal_sent:
                try:
                    await em.error(error_pb2.ERROR_CODE_INTERNAL, f"openengine-mock internal error: {exc!r}", False)
                except Exception as send_exc:  # the stream itself is broken; nothing more to say
                    log.warning("request %r: could not send the terminal error: %r", plan.request_id, send_exc)

    # -- scheduling --------------------------------------------------------------------------------------------------

    def _register(self, req: LiveRequest) -> None:
        self.live[req.plan.request_id] = req
        self._counts[req.state] += 1
        self._idle.clear()

    def _set_state(self, req: LiveRequest, state: RequestState) -> None:
        if req.state is RequestState.DECODE:
            self._decoding_sequences -= req.unfinished
        self._counts[req.state] -= 1
        req.state = state
        self._counts[state] += 1
        if state is RequestState.DECODE:
            self._decoding_sequences += req.unfinished

    def _finish(self, req: LiveRequest) -> None:
        if req.state is RequestState.QUEUED and req in self._queue:
            self._queue.remove(req)
        was_admitted = req.state in (RequestState.PREFILL, RequestState.DECODE)
        self._set_state(req, RequestState.DONE)
        self._counts[RequestState.DONE] -= 1
        if req.alloc is not None:
            req.alloc.release()
            req.alloc = None
        if self.live.get(req.plan.request_id) is req:
            del self.live[req.plan.request_id]
        if not self.live:
            self._idle.set()
        if was_admitted or self._queue:
            self._pump()

    def _try_admit(self, req: LiveRequest) -> bool:
        if self._counts[RequestState.PREFILL] + self._counts[RequestState.DECODE] >= self.config.max_running_requests:
            return False
        lookup = () if req.plan.bypass_prefix_cache else req.prompt_hashes
        alloc = self.pool.try_admit(lookup, req.blocks_needed)
        if alloc is None:
            return False
        req.alloc = alloc
        self._set_state(req, RequestState.PREFILL)
        return True

    def _pump(self) -> None:
        while self._queue:
            head = self._queue[0]
            if head.aborted:
                self._queue.popleft()
                head.wake()
                continue
            if not self._try_admit(head):
                return
            self._queue.popleft()
            head.wake()

    async def _admit(self, req: LiveRequest) -> None:
        plan = req.plan
        bs = self.config.kv_block_size
        namespace = block_namespace(plan.lora_name, plan.cache_salt)
        req.prompt_hashes = prompt_block_hashes(plan.prompt_ids, bs, namespace)
        full = len(req.prompt_hashes)
        req.blocks_needed = full + plan.n * (-(-(req.prompt_len + plan.max_tokens) // bs) - full)
        if not self._queue and self._try_admit(req):
            return
        self._queue.append(req)
        try:
            await req.wait(None)
        finally:
            if req.state is RequestState.QUEUED and req in self._queue:
                self._queue.remove(req)

    def _time(self, seconds: float) -> float:
        speedup = self.config.speedup
        return 0.0 if speedup <= 0 else seconds / speedup

    def _step_time(self) -> float:
        batch = max(self._decoding_sequences, 1)
        return self._time(self.config.decode_ms_per_token / 1000.0 * (1.0 + (batch - 1) / _BATCH_SLOWDOWN))

    # -- prefill -----------------------------------------------------------------------------------------------------

    async def _prefill(self, req: LiveRequest) -> None:
        plan, alloc = req.plan, req.alloc
        assert alloc is not None
        bs = self.config.kv_block_size
        hits = alloc.cached_blocks
        req.cached_tokens = min(hits * bs, req.prompt_len - 1)
        if plan.session is None:  # a decode leg receives its KV instead of computing it
            await req.wait(self._time((req.prompt_len - req.cached_tokens) / self.config.prefill_tokens_per_s))
        else:
            await self._receive_kv(req)
        parent = req.prompt_hashes[hits - 1] if hits else None
        for i in range(hits, len(req.prompt_hashes)):
            block = alloc.take()
            h = req.prompt_hashes[i]
            self.pool.register(block, h, parent, plan.prompt_ids[i * bs : (i + 1) * bs], plan.lora_name)
            parent = h
        req.prompt_parent = parent

    def _make_outputs(self, req: LiveRequest) -> list[_Output]:
        plan, alloc = req.plan, req.alloc
        assert alloc is not None
        base = (
            plan.seed
            if plan.seed is not None
            else int.from_bytes(hashlib.blake2b(plan.request_id.encode(), digest_size=8).digest(), "little")
        )
        # Text is produced only when sent, or when stop strings are matched on it (the full engine).
        need_text = plan.detokenize or (plan.text_stops and bool(plan.stop_texts))
        tail_start = len(req.prompt_hashes) * self.config.kv_block_size
        outputs = []
        for i in range(plan.n):
            text = OutputText(self.lm, plan.stop_texts, include_stop=plan.include_stop) if need_text else None
            out = _Output(i, plan, output_seed(base, i), text)
            if plan.guide is not None and plan.script is None:  # extra.mock.tokens overrides the guide
                # Greedy output is a function of the prompt alone; sampled output varies with the output's seed.
                text_seed = context_seed(plan.prompt_ids) if plan.greedy else out.seed
                out.script = tuple(self.lm.encode(plan.guide.text(text_seed)))
                out.script_eos = True
                out.script_pos = len(out.replay)  # a decode leg continues after the prefill leg's tokens
            out.parent = req.prompt_parent
            out.block_tokens = list(plan.prompt_ids[tail_start:])
            if out.block_tokens:
                out.block = alloc.take()
            outputs.append(out)
        return outputs

    def _prompt_tokens(self, plan: RequestPlan) -> list[_Token]:
        prompt = plan.prompt_ids
        tokens: list[_Token] = [(prompt[0], None, None, ())]
        for i in range(1, len(prompt)):
            dist = self.lm.next_distribution(prompt[:i], lora=plan.lora_name)
            logprob, rank = self._rank(dist, prompt[i])
            tokens.append((prompt[i], logprob, rank, dist[: plan.prompt_top_n]))
        return tokens

    @staticmethod
    def _rank(dist: Sequence[tuple[int, float]], token_id: int) -> tuple[float, int]:
        for rank, (tid, logprob) in enumerate(dist, 1):
            if tid == token_id:
                return logprob, rank
        return -math.inf, len(dist) + 1

    # -- decode ------------------------------------------------------------------------------------------------------

    def _next_token(self, req: LiveRequest, out: _Output) -> _Token | None:
        """The next token of ``out``; ``None`` when a ``mock.tokens`` script is exhausted."""
        plan, lm = req.plan, self.lm
        logprob: float | None = None
        if out.replay:
            token_id = out.replay.popleft()
            entry = out.replay_logprobs.popleft() if out.replay_logprobs else None
            if not plan.output_logprobs or entry is None:
                return (token_id, None, None, ())
            return _replayed(token_id, entry, plan.output_top_n)
        if out.script is not None:
            if out.script_pos < len(out.script):
                token_id = out.script[out.script_pos]
                out.script_pos += 1
            elif out.script_eos and lm.eos_token_ids:
                token_id = lm.eos_token_ids[0]
            else:
                return None
        else:
            banned: frozenset[int] | set[int] = frozenset()
            if out.count < plan.min_tokens:
                banned = self._eos | plan.stop_ids
            elif plan.ignore_eos:
                banned = self._eos
            token_id, logprob = self._sample(plan, out, 0)
            for attempt in range(1, 5):
                if token_id not in banned:
                    break
                token_id, logprob = self._sample(plan, out, attempt)
            else:
                if token_id in banned:
                    dist = lm.next_distribution(out.ctx, lora=plan.lora_name)
                    token_id, logprob = next(((t, lp) for t, lp in dist if t not in banned), dist[0])
        if not plan.output_logprobs:
            return (token_id, logprob, None, ())
        dist = lm.next_distribution(out.ctx, lora=plan.lora_name)
        logprob, rank = self._rank(dist, token_id)
        return (token_id, logprob, rank, dist[: plan.output_top_n])

    def _sample(self, plan: RequestPlan, out: _Output, attempt: int) -> tuple[int, float]:
        """One draw for the token at absolute position ``len(out.ctx)`` (``lmapi``: migration continues exactly)."""
        return self.lm.sample(
            out.ctx,
            0.0 if plan.greedy else seeded_uniform(out.seed, len(out.ctx), attempt),
            temperature=plan.temperature,
            top_k=plan.top_k,
            top_p=plan.top_p,
            min_p=plan.min_p,
            lora=plan.lora_name,
        )

    def _append(self, req: LiveRequest, out: _Output, token: _Token) -> _End | None:
        """Account one generated token; returns the finish reason and stop match if it ends ``out``."""
        plan = req.plan
        token_id = token[0]
        out.count += 1
        req.generated += 1
        out.ctx.append(token_id)
        out.pending.append(token)
        self._kv_append(req, out, token_id)
        text = out.text
        if token_id in self._eos and not plan.ignore_eos:
            if not self.config.engine.streams_eos:
                # TensorRT-LLM's output ends before the end id: it is neither streamed nor counted.
                out.pending.pop()
                out.count -= 1
                req.generated -= 1
            return generation_pb2.FINISH_REASON_STOP, ("eos_token_id", token_id)
        if not plan.text_stops:
            return self._token_stop(req, out, token_id)
        if token_id in plan.stop_ids:
            if text is not None and plan.include_stop:
                self._detokenize(text, token_id)
            return generation_pb2.FINISH_REASON_STOP, ("stop_token_id", token_id)
        if text is not None:
            self._detokenize(text, token_id)
            if out.count >= plan.min_tokens:
                stop = text.match_stop()
                if stop is not None:
                    return generation_pb2.FINISH_REASON_STOP, ("stop_text", stop)
        if out.count >= plan.max_tokens:
            return generation_pb2.FINISH_REASON_LENGTH, None
        return None

    def _token_stop(self, req: LiveRequest, out: _Output, token_id: int) -> _End | None:
        """TensorRT-LLM's stop words: token sequences matched at the end of the output; without
        ``include_stop_in_output`` the matched ids are dropped (not streamed, not counted)."""
        plan = req.plan
        if out.text is not None:
            self._detokenize(out.text, token_id)
        matched: tuple[int, tuple[str, int | str]] | None = None
        if out.count >= plan.min_tokens:
            if token_id in plan.stop_ids:
                matched = 1, ("stop_token_id", token_id)
            else:
                generated = out.ctx[len(out.ctx) - out.count :]
                for stop, ids in plan.stop_sequences:
                    if len(ids) <= len(generated) and tuple(generated[-len(ids) :]) == ids:
                        matched = len(ids), ("stop_text", stop)
                        break
        if matched is None:
            if out.count >= plan.max_tokens:
                return generation_pb2.FINISH_REASON_LENGTH, None
            return None
        length, stop_match = matched
        if plan.trim_stops:
            length = min(length, len(out.pending))
            del out.pending[len(out.pending) - length :]
            out.count -= length
            req.generated -= length
            if out.text is not None:
                out.text.drop_tokens(length)
        return generation_pb2.FINISH_REASON_STOP, stop_match

    def _detokenize(self, text: OutputText, token_id: int) -> None:
        """Detokenize one more token of an output (counted; ``--detokenize-cost-us`` of CPU each)."""
        text.push(token_id)
        self.served["detokenized_tokens"] += 1
        cost = self.config.detokenize_cost_us
        if cost > 0:
            _burn_cpu(cost / 1e6)

    def _kv_append(self, req: LiveRequest, out: _Output, token_id: int) -> None:
        alloc = req.alloc
        assert alloc is not None
        if out.block is None:
            out.block = alloc.take()
        out.block_tokens.append(token_id)
        if len(out.block_tokens) == self.config.kv_block_size:
            plan = req.plan
            h = block_hash(out.parent, out.block_tokens, block_namespace(plan.lora_name, plan.cache_salt))
            self.pool.register(out.block, h, out.parent, out.block_tokens, plan.lora_name)
            out.parent = h
            out.block = None
            out.block_tokens = []

    async def _flush(self, em: _Emitter, plan: RequestPlan, out: _Output, *, final: bool) -> bool:
        """Send what ``out`` may release now (everything when ``final``); ``True`` if a message was sent.

        Hold-back as TensorRT-LLM's formatter: token ids wait for ``token_holdback`` more tokens; text that could
        begin a stop string waits until it stops matching; with a token hold-back the text is also one step behind
        (at most what the previous step had). So while tokens are still held, a step can release text alone: a token
        event with ``tokens=[]`` and only text.
        """
        text = ""
        if final:
            tokens, out.pending = out.pending, []
            if out.text is not None:
                text = out.text.release(final=True)
        else:
            ready = len(out.pending) - plan.token_holdback
            tokens = []
            if ready >= self.config.stream_interval:
                tokens = out.pending[:ready]
                del out.pending[:ready]
            # With a stream interval above 1 only the steps that release tokens are results at all.
            if out.text is not None and (tokens or self.config.stream_interval == 1):
                text = out.text.release(final=False, lag=plan.token_holdback > 0)
        if not plan.detokenize:
            text = ""
        if tokens or text:
            await em.token(out.index, tokens, text)
            return True
        return False

    def _end_output(self, req: LiveRequest, out: _Output) -> bool:
        """Mark ``out`` finished; ``True`` if it was the request's last unfinished output."""
        out.finished = True
        req.unfinished -= 1
        if req.state is RequestState.DECODE:
            self._decoding_sequences -= 1
        return req.unfinished == 0

    async def _decode(
        self,
        req: LiveRequest,
        em: _Emitter,
        outputs: list[_Output],
        drop: Callable[[], None],
        prompt_error: str | None = None,
    ) -> None:
        """Decode steps until every output finished.

        ``prompt_error`` (prompt logprobs over the limit, on an engine that streams on after it): TensorRT-LLM's
        formatter turns the first step's result into that ``EngineError`` alone and formats the next results as
        usual, so the first step's tokens go out with the second step's and an output that ended in the first step
        finishes right after the error; when every output ended there, the error is the stream's last event.
        """
        plan = req.plan
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while req.unfinished:
            if await self._fault_point(req, em, outputs, drop):
                return
            step = self._step_time()
            if step > 0 and self.step_clock is not None:
                await self.step_clock.next_step(req)
            elif step > 0:
                now = loop.time()
                next_at = max(next_at + step, now)
                await req.wait(next_at - now)
            else:
                await req.wait(0)
            ended: list[tuple[_Output, _End, bool]] = []
            for out in outputs:
                if out.finished:
                    continue
                token = self._next_token(req, out)
                end = (generation_pb2.FINISH_REASON_LENGTH, None) if token is None else self._append(req, out, token)
                if end is None:
                    if prompt_error is None:
                        await self._flush(em, plan, out, final=False)
                    continue
                last = self._end_output(req, out)
                if prompt_error is None:
                    await self._finish_output(em, plan, out, end, last=last)
                else:
                    ended.append((out, end, last))
            if prompt_error is not None:
                done = not req.unfinished
                await em.error(error_pb2.ERROR_CODE_INVALID_ARGUMENT, prompt_error, False, terminal=done)
                prompt_error = None
                if done:
                    return
                for out, end, last in ended:
                    await self._finish_output(em, plan, out, end, last=last)

    async def _finish_output(self, em: _Emitter, plan: RequestPlan, out: _Output, end: _End, *, last: bool) -> None:
        """An output's last tokens and its ``finished`` (``--split-finish-ms`` apart when asked)."""
        if await self._flush(em, plan, out, final=True) and plan.split_finish_ms > 0:
            # The last token message goes out alone; its finished follows in a later write.
            await asyncio.sleep(plan.split_finish_ms / 1000.0)
        await em.finished(out.index, end[0], end[1], last=last)

    async def _context_only(self, req: LiveRequest, em: _Emitter, out: _Output) -> None:
        """The prefill leg: the first token, then ``PrefillReady`` (terminal, with usage, no ``finished``).

        The KV blocks stay pinned in a held session until a decode engine claims them (or the session times out).
        A first token that ends the output by a stop (EOS, a stop token or string) is a complete answer: no handoff,
        ``finished(STOP)`` as TensorRT-LLM does. Without a cache transceiver (``--no-cache-transceiver``) the leg is a
        plain one-token generation: ``finished(LENGTH)``, no handoff.
        """
        plan = req.plan
        token = self._next_token(req, out)
        end = self._append(req, out, token) if token is not None else None
        self._end_output(req, out)
        await self._flush(em, plan, out, final=True)
        if end is not None and end[0] == generation_pb2.FINISH_REASON_STOP:
            self.served["prefill_early_stops"] += 1
            await em.finished(out.index, end[0], end[1], last=True)
            return
        if self.config.no_cache_transceiver:
            await em.finished(out.index, generation_pb2.FINISH_REASON_LENGTH, None, last=True)
            return
        session = self._session(req, token)
        alloc, req.alloc = req.alloc, None
        assert alloc is not None
        namespace = block_namespace(plan.lora_name, plan.cache_salt)
        self.kv_sessions.hold(session.session_id, plan.request_id, prompt_digest(plan.prompt_ids, namespace), alloc)
        try:
            await em.prefill_ready(session)
        except BaseException:
            # The handoff never left this engine: nobody can claim the session.
            self.kv_sessions.release(session.session_id, "PrefillReady could not be sent")
            raise

    async def _receive_kv(self, req: LiveRequest) -> None:
        """A decode leg's KV transfer: claim the session from its context engine (abortable)."""
        plan = req.plan
        session = plan.session
        assert session is not None
        if session.host is None or session.port is None:
            raise KvClaimError(
                error_pb2.ERROR_CODE_KV_TRANSFER_FAILED, "kv.session names no endpoint to pull the KV cache from"
            )
        digest = prompt_digest(plan.prompt_ids, block_namespace(plan.lora_name, plan.cache_salt))
        claim = asyncio.ensure_future(
            claim_session(session.host, session.port, session.session_id, plan.request_id, digest)
        )
        claim.add_done_callback(lambda _: req.wake())
        self.kv_sessions.claims_in_flight += 1
        try:
            while not claim.done():
                await req.wait(None)
        finally:
            self.kv_sessions.claims_in_flight -= 1
            if not claim.done():
                claim.cancel()
        claim.result()

    def _session(self, req: LiveRequest, first: _Token | None) -> kv_pb2.KvSessionRef:
        self._sessions += 1
        session_id = str(self._sessions)
        host = self.listen_host
        url_host = f"[{host}]" if ":" in host else host
        kv_port = self.kv_sessions.port
        session = kv_pb2.KvSessionRef(
            session_id=session_id, transfer_backend=self.config.kv_transfer_backend, dp_rank=0
        )
        session.endpoints.add(host=host, port=kv_port, protocol="tcp")
        opaque = json.dumps({"request_id": req.plan.request_id, "prompt_tokens": req.prompt_len}).encode()
        attributes: dict[str, object] = {
            "ctx_info_endpoint": f"tcp://{url_host}:{kv_port}",
            "opaque_state": base64.b64encode(opaque).decode(),
            "first_gen_tokens": [] if first is None else [first[0]],
            "disagg_request_id": session_id,
            "ctx_dp_rank": 0,
        }
        if (
            self.config.engine.carries_first_gen_log_probs
            and req.plan.output_logprobs
            and first is not None
            and first[1] is not None
        ):
            # TensorRT-LLM hands the first token's logprobs to the decode leg, which replays them.
            attributes["first_gen_log_probs"] = [_first_gen_log_probs(first, req.plan.output_top_n)]
        fill_struct(session.attributes_struct, attributes)
        return session

    async def _fault_point(
        self, req: LiveRequest, em: _Emitter, outputs: list[_Output], drop: Callable[[], None]
    ) -> bool:
        """Fire a token-count fault if due; ``True`` when the request is over."""
        faults = req.plan.faults
        if not faults.token_faults:
            return False
        generated = req.generated
        error_at, drop_at, hang_at = faults.error_after_tokens, faults.drop_after_tokens, faults.hang_after_tokens
        due_error = error_at is not None and generated >= error_at
        due_drop = drop_at is not None and generated >= drop_at
        due_hang = hang_at is not None and generated >= hang_at
        if not (due_error or due_drop or due_hang):
            return False
        for out in outputs:
            if not out.finished:
                await self._flush(em, req.plan, out, final=True)
        if due_error:
            log.info("request %r: injected EngineError after %d tokens", req.plan.request_id, generated)
            name = error_pb2.ErrorCode.Name(faults.error_code)
            await em.error(
                faults.error_code, f"openengine-mock: injected {name} after {generated} tokens", faults.error_retryable
            )
            return True
        if due_drop:
            drop()
            raise _ConnectionDropped
        log.info("request %r: hanging after %d tokens (extra.mock.hang_after_tokens)", req.plan.request_id, generated)
        await req.wait(None)
        return False  # unreachable in practice: only abort (→ _Aborted) or cancellation ends the wait

    async def _cancel(self, req: LiveRequest, em: _Emitter, outputs: list[_Output], message: str) -> None:
        """``finished(CANCELLED)`` for every unfinished output, usage on the last; pending text is flushed first."""
        plan = req.plan
        by_index = {out.index: out for out in outputs}
        remaining = [i for i in range(plan.n) if i not in by_index or not by_index[i].finished]
        for k, index in enumerate(remaining):
            out = by_index.get(index)
            if out is not None:
                out.finished = True
                await self._flush(em, plan, out, final=True)
            await em.finished(
                index, generation_pb2.FINISH_REASON_CANCELLED, None, last=k == len(remaining) - 1, message=message
            )

    # -- Control -----------------------------------------------------------------------------------------------------

    def abort(self, request: lifecycle_pb2.AbortRequest) -> lifecycle_pb2.AbortResponse:
        """``Control.Abort`` as TensorRT-LLM answers it; every call is counted in ``mock_stats`` (the abort log)."""
        served = self.served
        served["aborts_received"] += 1
        target = request.WhichOneof("target")
        served[f"aborts_by_{target or 'no_target'}"] += 1
        response = self._abort(request, target)
        status = lifecycle_pb2.AbortStatus.Name(response.status).removeprefix("ABORT_STATUS_").lower()
        served[f"aborts_{status}"] += 1
        return response

    def _abort(self, request: lifecycle_pb2.AbortRequest, target: str | None) -> lifecycle_pb2.AbortResponse:
        if target is None:
            raise Rejection(Status.INVALID_ARGUMENT, "Abort needs a target: request_id, kv_session or all_requests")
        if target == "kv_session":
            raise Rejection(Status.UNIMPLEMENTED, "Abort(kv_session) is not supported")
        if target == "request_id":
            if not request.request_id and self.config.engine.refuses_empty_abort_id:
                raise Rejection(Status.INVALID_ARGUMENT, "request_id must not be empty")
            req = self.live.get(request.request_id)
            if req is not None and req.abort():
                self.served["aborts_in_flight"] += 1
                return lifecycle_pb2.AbortResponse(
                    status=lifecycle_pb2.ABORT_STATUS_ABORTED, message=f"aborted request {request.request_id!r}"
                )
            return lifecycle_pb2.AbortResponse(
                status=lifecycle_pb2.ABORT_STATUS_ALREADY_FINISHED,
                message=f"request {request.request_id!r} is not running",
            )
        count = sum(1 for req in list(self.live.values()) if req.abort())
        if count:
            self.served["aborts_in_flight"] += count
            return lifecycle_pb2.AbortResponse(
                status=lifecycle_pb2.ABORT_STATUS_ABORTED, message=f"aborted {count} request(s)"
            )
        return lifecycle_pb2.AbortResponse(status=lifecycle_pb2.ABORT_STATUS_ALREADY_FINISHED, message="no requests")

    def load(self, request: server_pb2.GetLoadRequest) -> server_pb2.LoadInfo:
        """``Control.GetLoad`` at the ``--load-report`` detail."""
        report = self.config.load_report
        if report == "minimal":
            # TensorRT-LLM's baseline: every in-flight Generate stream (queued ones too) and health probe;
            # include_per_rank is ignored.
            return server_pb2.LoadInfo(
                instance_id=self.config.instance_id,
                timestamp_unix_nanos=time.time_ns(),
                running_requests=len(self.live),
            )
        running = self._counts[RequestState.PREFILL] + self._counts[RequestState.DECODE]
        if report == "routing":
            # TensorRT-LLM's newer opt-in routing load: requests and KV blocks, per rank on request.
            info = server_pb2.LoadInfo(
                instance_id=self.config.instance_id,
                timestamp_unix_nanos=time.time_ns(),
                running_requests=len(self.live),
                used_kv_blocks=self.pool.used_blocks,
                total_kv_blocks=self.pool.total_blocks,
            )
            if request.include_per_rank:
                info.ranks.add(
                    data_parallel_rank=0,
                    running_requests=len(self.live),
                    used_kv_blocks=self.pool.used_blocks,
                    total_kv_blocks=self.pool.total_blocks,
                )
            return info
        running_tokens = 0
        waiting_tokens = 0
        for req in self.live.values():
            if req.state is RequestState.QUEUED:
                waiting_tokens += req.prompt_len
            elif req.state is not RequestState.DONE:
                running_tokens += req.prompt_len + req.generated
        info = server_pb2.LoadInfo(
            instance_id=self.config.instance_id,
            timestamp_unix_nanos=time.time_ns(),
            running_requests=running,
            queued_requests=len(self._queue),
            active_kv_sessions=self.kv_sessions.active,
            used_kv_blocks=self.pool.used_blocks,
            total_kv_blocks=self.pool.total_blocks,
            running_tokens=running_tokens,
            waiting_tokens=waiting_tokens,
            prefill_batch_size=self._counts[RequestState.PREFILL],
            decode_batch_size=self._counts[RequestState.DECODE],
        )
        if request.include_per_rank:
            info.ranks.add(
                data_parallel_rank=0,
                running_requests=running,
                queued_requests=len(self._queue),
                used_kv_blocks=self.pool.used_blocks,
                total_kv_blocks=self.pool.total_blocks,
                prefill_batch_size=self._counts[RequestState.PREFILL],
                decode_batch_size=self._counts[RequestState.DECODE],
            )
        return info

    async def health(self, request: lifecycle_pb2.HealthRequest) -> lifecycle_pb2.HealthResponse:
        """``Control.Health``: checks ``grpc``, ``model`` (+ ``kv_connector``, ``inference_probe``)."""
        if self.config.fault_health_delay_ms:
            await asyncio.sleep(self.config.fault_health_delay_ms / 1000.0)
        hs = lifecycle_pb2
        response = hs.HealthResponse()
        response.checks.add(name="grpc", state=hs.HEALTH_STATE_READY, message="serving")
        if self.draining:
            response.checks.add(name="model", state=hs.HEALTH_STATE_NOT_READY, message="shutting down")
        elif not self.ready:
            response.checks.add(name="model", state=hs.HEALTH_STATE_STARTING, message="loading")
        elif self.health_override == "not_ready":
            response.checks.add(name="model", state=hs.HEALTH_STATE_NOT_READY, message="toggled by SIGUSR1")
        elif self.config.health == "not_ready":
            response.checks.add(name="model", state=hs.HEALTH_STATE_NOT_READY, message="engine health check failed")
        elif self.config.health == "degraded":
            response.checks.add(name="model", state=hs.HEALTH_STATE_DEGRADED, message="forced by --health degraded")
        else:
            response.checks.add(name="model", state=hs.HEALTH_STATE_READY, message="loaded")
        if self.config.reports_kv_connector:
            backend = self.config.kv_transfer_backend
            response.checks.add(name="kv_connector", state=hs.HEALTH_STATE_READY, message=backend)
        if request.include_inference_probe and self.ready and not self.draining:
            state, message = await self._shared_probe()
            response.checks.add(name="inference_probe", state=state, message=message)
        response.state = next(
            (c.state for c in response.checks if c.state != hs.HEALTH_STATE_READY), hs.HEALTH_STATE_READY
        )
        return response

    async def _shared_probe(self) -> tuple[lifecycle_pb2.HealthState, str]:
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._run_probe())
        return await asyncio.shield(self._probe)

    async def _run_probe(self) -> tuple[lifecycle_pb2.HealthState, str]:
        self._probes += 1
        plan = _probe_plan(f"health-probe-{self._probes}", self.config, self.lm)
        req = LiveRequest(plan)
        self._register(req)
        events: list[generation_pb2.GenerateResponse] = []

        async def collect(response: generation_pb2.GenerateResponse) -> None:
            events.append(response)

        try:
            await asyncio.wait_for(self.generate(req, collect, lambda: None), _PROBE_TIMEOUT_S)
        except TimeoutError:
            return lifecycle_pb2.HEALTH_STATE_DEGRADED, "inference probe timed out"
        if (
            events
            and events[-1].WhichOneof("event") == "finished"
            and events[-1].finished.reason
            in (
                generation_pb2.FINISH_REASON_STOP,
                generation_pb2.FINISH_REASON_LENGTH,
            )
        ):
            return lifecycle_pb2.HEALTH_STATE_READY, "generated 1 token"
        return lifecycle_pb2.HEALTH_STATE_DEGRADED, "inference probe failed"


def _probe_plan(request_id: str, config: MockConfig, lm: LanguageModel) -> RequestPlan:
    return RequestPlan(
        request_id=request_id,
        model=config.served_model_name,
        prompt_ids=(1 if lm.vocab_size > 1 else 0,),
        n=1,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        seed=0,
        max_tokens=1,
        min_tokens=0,
        ignore_eos=False,
        include_stop=False,
        stop_texts=(),
        stop_ids=frozenset(),
        token_holdback=0,
        output_logprobs=False,
        output_top_n=0,
        prompt_logprobs=False,
        prompt_top_n=0,
        context_only=False,
        session=None,
        detokenize=False,
        lora_name=None,
        cache_salt=None,
        bypass_prefix_cache=False,
        priority=0,
        script=None,
        script_ends_with_eos=False,
        faults=MockFaults(),
    )
