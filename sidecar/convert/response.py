"""OpenEngine ``GenerateResponse`` stream (upb) → Dynamo ``LLMEngineOutput`` chunk dicts.

One :class:`ResponseMapper` per request checks the stream contract (wire reference §7.4) while it
maps, and raises :class:`~sidecar.errors.ProtocolViolation` at the first breach, or
:class:`~sidecar.errors.EngineFailure` for the terminal in-band ``EngineError``. Either way the
mapper is then closed: nothing more is returned, and any later event is ``EVENT_AFTER_TERMINAL``.

Chunk shape (Dynamo 1.6.1's ``LLMEngineOutput``, checked by experiment):

* ``token_ids`` on every chunk (Dynamo answers 500 without it), ``index`` on every chunk;
* never ``text``: the frontend detokenizes from ids, and a chunk with ``text`` loses its logprobs;
* ``log_probs`` and ``top_logprobs`` (``[[{rank, token_id, token, logprob}]]``, one list per token)
  only when output logprobs were requested, only on chunks that carry tokens;
* ``finish_reason`` ``stop`` / ``length`` / ``cancelled``, with ``stop_reason`` (the matched stop
  token id, EOS id, or stop string) on ``stop``;
* ``completion_usage`` exactly on the final chunk.

Decisions:

* Consecutive token events for the same output within one batch become one chunk, and a
  ``finished`` event joins the chunk of the tokens just before it: Dynamo's cost is per chunk, and
  multi-token chunks are handled like single-token ones.
* A token event without tokens (TensorRT-LLM's stop-string hold-back sends text-only deltas)
  produces no chunk; its text is ignored.
* A missing selected-token logprob, or a non-finite one, becomes :data:`LOGPROB_FLOOR` (TensorRT-LLM's
  own clamp for −inf): Dynamo needs a finite number, and a decode leg legitimately replays its first
  token without one.
* With ``logprobs=0`` each token's ``top_logprobs`` is empty: the frontend adds the selected token.
* Prompt logprobs (when asked): the one ``prompt`` event (no usage on it) becomes ``engine_data.prompt_logprobs`` of
  the final chunk, in vLLM's shape (per prompt position ``{token_id: {logprob, rank, decoded_token}}``, None where the
  engine gives no logprob); an unasked or second ``prompt`` event is ``UNEXPECTED_EVENT``.
* A stop token id the engine kept in the output (``include_stop_in_output``; ``hidden_stop_ids``) is taken out of
  the output's last chunk when the output finishes on it, and out of ``completion_tokens``: Dynamo's frontend never
  shows a ``stop_token_ids`` token's text, but counts every token id it is sent, so text and usage would disagree
  (``docs/request-features.md``). A stop token already sent (its chunk was not held) stays counted.
* Usage is required on the final terminal (``MISSING_USAGE`` otherwise; TensorRT-LLM always sends
  it). Zero counts from the engine are replaced by what the mapper saw (prompt length, tokens
  streamed); ``total_tokens`` is recomputed; cached/reasoning tokens are clamped to their totals.
* Tokens mapped before an ``error`` event reach the client before the error: when a batch carries tokens and then
  the error, :meth:`ResponseMapper.map` returns the tokens and keeps the error pending (:attr:`~ResponseMapper.failure`,
  raised by the next ``map`` or ``end_of_stream``); the request fails (or is migrated, and the next worker
  regenerates from what the client has received, tokens included).
* The chunk that carries an output's last token also carries its ``finish_reason`` and usage: the frontend applies
  EOS and stop tokens itself, ends the stream at such a token and drops the chunk after it (Dynamo
  1.6.1; its ``Backend`` stops only when the chunk has no ``finish_reason`` of its own). So the request task asks
  :meth:`~ResponseMapper.awaits_terminal` whether a chunk ends with a token after which the engine's terminal is due
  (one of the request's EOS / stop token ids, the output's ``max_tokens``-th token, or -- with stop strings -- a
  token whose text the engine holds back), holds it, and hands it back as ``carry`` with the next batch, where the
  ``finished`` event joins it.

Disaggregated legs (``leg``, as Dynamo's TensorRT-LLM sidecar on OpenEngine maps them):

* **prefill**: token events are held back. The terminal ``prefill_ready`` becomes the final chunk: no tokens (the
  decode engine replays the first token; sending it here too would show it twice), ``finish_reason = "length"``
  (Dynamo's prefill router chains into decode only on ``length``), usage (prompt, 0 completion, cached as reported)
  and ``disaggregated_params`` = the handoff JSON (:mod:`.handoff`; a malformed session is ``BAD_HANDOFF``). A
  ``finished`` with ``stop`` is a legitimate early stop (EOS at the first token): the held tokens are the whole answer.
  Any other ``finished`` (``length``: the engine ran the leg as a plain one-token generation, i.e. it has no KV cache
  transceiver; ``cancelled``: it dropped the leg) is :class:`~sidecar.errors.HandoffMissing`, saying why.
* **decode**: tokens flow as in an aggregated request — the stream starts with the replayed first token, which the
  client has not seen yet. The final usage's cached tokens are the prefill leg's (``cached_tokens``).
* ``prefill_ready`` on any other leg is ``UNEXPECTED_EVENT``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from openengine.v1 import generation_pb2
from sidecar.errors import EngineFailure, HandoffMissing, ProtocolViolation, Violation

from .enums import pb_enum
from .handoff import HandoffError, session_to_handoff

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

__all__ = ["LOGPROB_FLOOR", "Chunk", "ResponseMapper"]

Chunk = dict[str, Any]

#: Stand-in for a missing or non-finite logprob (TensorRT-LLM clamps −inf to this value too).
LOGPROB_FLOOR: Final = -9999.0
_INF: Final = float("inf")

_STOP: Final = generation_pb2.FINISH_REASON_STOP
_FINISH_REASONS: Final[dict[int, str]] = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_CANCELLED: "cancelled",
}


def _finite(logprob: float) -> float:
    return logprob if LOGPROB_FLOOR < logprob < _INF else LOGPROB_FLOOR


class ResponseMapper:
    """Maps one request's ``GenerateResponse`` batches to chunk dicts, enforcing the stream contract."""

    __slots__ = (
        "_cached_tokens",
        "_closed",
        "_completion",
        "_failure",
        "_finished",
        "_handed_off",
        "_held",
        "_hidden_stop_ids",
        "_leg",
        "_logprobs",
        "_max_tokens",
        "_min_tokens",
        "_n",
        "_open",
        "_prompt_logprobs",
        "_prompt_positions",
        "_prompt_tokens",
        "_request_id",
        "_stop_strings",
        "_stopped_at",
        "_terminal_ids",
        "_text_first",
        "_text_hold",
        "_text_seen",
        "_text_tail",
        "_text_withheld",
        "_trimmed",
    )

    def __init__(
        self,
        request_id: str,
        *,
        n: int,
        logprobs: int | None,
        prompt_tokens: int,
        leg: str = "aggregated",
        cached_tokens: int | None = None,
        prompt_logprobs: int | None = None,
        terminal_ids: Iterable[int] = (),
        min_tokens: int = 0,
        max_tokens: int | None = None,
        stop_texts: bool = False,
        stop_strings: Sequence[str] = (),
        hidden_stop_ids: Iterable[int] = (),
    ) -> None:
        """``n`` outputs were asked for; ``logprobs`` as requested (None = not asked).

        ``leg`` is ``aggregated``, ``prefill`` or ``decode``; ``cached_tokens`` (decode legs) replaces the engine's
        cached prompt tokens in the final usage. ``prompt_logprobs`` as requested (None = not asked): the one
        ``prompt`` event then becomes the final chunk's ``engine_data.prompt_logprobs``.

        ``terminal_ids`` (the request's EOS and stop token ids), ``min_tokens`` and ``max_tokens`` tell
        :meth:`awaits_terminal` which tokens the engine's terminal event follows; ``stop_texts``: the request has stop
        strings and the engine sends its text (see :meth:`awaits_terminal`); ``stop_strings``: those strings, matched
        on the engine's text as the frontend matches them on its own (see :attr:`ends_at_stop_string`).

        ``hidden_stop_ids``: stop token ids the engine was asked to keep in its output (``include_stop_in_output``)
        that the frontend never shows; an output finishing on one loses that last token (see the module docstring).
        """
        if n < 1:
            raise ValueError(f"n must be ≥ 1, got {n}")
        if leg not in ("aggregated", "prefill", "decode"):
            raise ValueError(f"unknown leg {leg!r}")
        if leg == "prefill" and n != 1:
            raise ValueError("a prefill leg has exactly one output")
        self._leg = leg
        self._cached_tokens = cached_tokens
        self._held: list[Chunk] = []  # a prefill leg's tokens, returned only on a legitimate early stop
        self._handed_off = False
        self._request_id = request_id
        self._n = n
        self._logprobs = logprobs
        self._prompt_tokens = prompt_tokens
        self._prompt_logprobs = prompt_logprobs
        self._prompt_positions: list[dict[str, Any] | None] | None = None  # the mapped prompt event, once seen
        self._finished = [False] * n
        self._completion = [0] * n  # tokens returned per output
        self._open = n  # outputs without a terminal yet
        self._closed = False
        self._failure: EngineFailure | None = None  # an error event met after tokens of the same batch
        self._terminal_ids = frozenset(terminal_ids)
        self._hidden_stop_ids = frozenset(hidden_stop_ids)
        self._trimmed = 0  # stop tokens taken out of the output (and out of the engine's completion count)
        self._min_tokens = min_tokens
        self._max_tokens = max_tokens
        self._text_hold = stop_texts or bool(stop_strings)
        self._stop_strings = tuple(s for s in stop_strings if s)
        self._text_tail = [""] * n  # the end of each output's text, as long as a stop string could reach back
        self._stopped_at: list[str | None] = [None] * n  # the stop string the frontend ends this output at
        self._text_seen = [False] * n  # the engine sent text for this output (it detokenizes)
        self._text_withheld = [False] * n  # its last token event had tokens but no text
        # The output's first token may end it (a stop string of one token, or a migrated stream's continuation): a
        # withheld first text is a candidate once even before any text was seen (one hold for an engine without text).
        self._text_first = [True] * n

    @property
    def done(self) -> bool:
        """True once the stream reached its end: all outputs finished, an error, a violation, or a cancel."""
        return self._closed

    @property
    def handed_off(self) -> bool:
        """True once a prefill leg's ``prefill_ready`` was mapped into the final chunk (the handoff)."""
        return self._handed_off

    @property
    def failure(self) -> EngineFailure | None:
        """The engine's terminal error when :meth:`map` returned the tokens that came before it (raise it next)."""
        return self._failure

    @property
    def completion_tokens(self) -> int:
        """Output tokens mapped so far, over all outputs."""
        return sum(self._completion)

    def _violation(self, violation: Violation, detail: str) -> ProtocolViolation:
        self._closed = True
        return ProtocolViolation(violation, detail)

    def map(self, responses: Sequence[generation_pb2.GenerateResponse], carry: Sequence[Chunk] = ()) -> list[Chunk]:
        """Map one batch of responses to chunks (possibly none). Raises on a breach or engine error.

        ``carry``: chunks returned earlier and not sent yet (held for the terminal, see :meth:`awaits_terminal`);
        they come first in the result, and this batch's tokens and ``finished`` events join them. An engine error
        after chunks (carried or mapped here) does not raise: the chunks are returned and :attr:`failure` is set.
        """
        if self._failure is not None:
            raise self._failure
        chunks: list[Chunk] = list(carry)
        # A prefill leg's tokens are held back (see the module docstring).
        tokens_to = self._held if self._leg == "prefill" else chunks
        request_id = self._request_id
        finished = self._finished
        n = self._n
        for response in responses:
            if self._closed:
                raise self._violation(Violation.EVENT_AFTER_TERMINAL, "event after the end of the stream")
            if response.request_id != request_id:
                raise self._violation(
                    Violation.WRONG_REQUEST_ID, f"got request_id {response.request_id!r}, expected {request_id!r}"
                )
            kind = response.WhichOneof("event")
            if kind == "token":
                if response.HasField("usage"):
                    raise self._violation(Violation.USAGE_BEFORE_END, "usage on a token event")
                token = response.token
                if not token.HasField("output_index"):
                    raise self._violation(Violation.MISSING_OUTPUT_INDEX, "token event without output_index")
                index: int = token.output_index
                if index >= n:
                    raise self._violation(Violation.OUTPUT_INDEX_OUT_OF_RANGE, f"token for output {index} of {n}")
                if finished[index]:
                    raise self._violation(Violation.EVENT_AFTER_TERMINAL, f"token after output {index} finished")
                infos = token.tokens
                if not infos:
                    continue
                if self._stopped_at[index] is not None:
                    continue  # past the frontend's stop string: the engine goes on, but the answer has ended
                if self._text_hold:
                    if token.text:
                        self._text_seen[index] = True
                        if self._stop_strings:
                            self._match_stop_string(index, token.text)
                    self._text_withheld[index] = not token.text
                # One token per event is the common case (TensorRT-LLM's default stream interval): no list
                # comprehension (a frame of its own) for it.
                ids = [infos[0].token_id] if len(infos) == 1 else [info.token_id for info in infos]
                self._completion[index] += len(ids)
                last = tokens_to[-1] if tokens_to else None
                if last is not None and last["index"] == index and "finish_reason" not in last:
                    last["token_ids"].extend(ids)
                    if self._logprobs is not None:
                        self._add_logprobs(last, infos)
                else:
                    chunk: Chunk = {"token_ids": ids, "index": index}
                    if self._logprobs is not None:
                        chunk["log_probs"] = []
                        chunk["top_logprobs"] = []
                        self._add_logprobs(chunk, infos)
                    tokens_to.append(chunk)
            elif kind == "finished":
                chunk = self._finish(response, tokens_to)
                if self._leg == "prefill" and chunk["finish_reason"] != "stop":
                    raise self._no_handoff(chunk["finish_reason"], response.finished.message)
                chunks.append(chunk)
            elif kind == "error":
                error = response.error
                self._closed = True
                failure = EngineFailure(error.code, error.message, error.retryable)
                if not chunks:
                    raise failure
                # The tokens before the error are the client's: they go out first, the error right after.
                self._failure = failure
                return chunks
            elif kind is None:
                raise self._violation(Violation.EMPTY_EVENT, "response without an event")
            elif kind == "prompt":
                if self._prompt_logprobs is None:
                    raise self._violation(Violation.UNEXPECTED_EVENT, "prompt event, prompt logprobs not requested")
                if self._prompt_positions is not None:
                    raise self._violation(Violation.UNEXPECTED_EVENT, "a second prompt event")
                if response.HasField("usage"):
                    raise self._violation(Violation.USAGE_BEFORE_END, "usage on a prompt event")
                self._prompt_positions = self._map_prompt(response.prompt.tokens)
            elif kind == "prefill_ready":
                if self._leg != "prefill":
                    what = "a decode leg" if self._leg == "decode" else "an aggregated request"
                    raise self._violation(Violation.UNEXPECTED_EVENT, f"prefill_ready on {what}")
                chunks.append(self._handoff(response))
            else:  # a oneof member this build does not know cannot be parsed into one; defensive
                raise self._violation(Violation.UNEXPECTED_EVENT, f"unknown event {kind!r}")
        return chunks

    def _match_stop_string(self, index: int, text: str) -> None:
        """The frontend matches stop strings on its own text, inside a token too (stop ``" th"`` in ``" the"``), and
        ends the answer at the token that completes one, whatever the engine does: an engine that matches stop
        strings as token sequences (TensorRT-LLM) goes on. The same match on the engine's text marks the output."""
        window = self._text_tail[index] + text
        found = [(window.find(stop), stop) for stop in self._stop_strings if stop in window]
        if found:
            self._stopped_at[index] = min(found)[1]
        reach = max(len(stop) for stop in self._stop_strings) - 1
        self._text_tail[index] = window[-reach:] if reach else ""

    @property
    def stop_string(self) -> str | None:
        """The stop string the frontend ends the (first such) output at, per the engine's text; None if none."""
        return next((stop for stop in self._stopped_at if stop is not None), None)

    @property
    def ends_at_stop_string(self) -> bool:
        """Every output still open has reached a stop string in the engine's text (where the frontend ends it): the
        answer is complete for the client, and an engine still generating past it should be aborted; its terminal then
        closes the answer at the stop string, with the engine's usage (cached tokens) and the tokens the client got."""
        open_outputs = [i for i, done in enumerate(self._finished) if not done]
        return bool(open_outputs) and all(self._stopped_at[i] is not None for i in open_outputs)

    def _add_logprobs(self, chunk: Chunk, infos: Sequence[generation_pb2.TokenInfo]) -> None:
        log_probs: list[float] = chunk["log_probs"]
        top_logprobs: list[list[dict[str, Any]]] = chunk["top_logprobs"]
        alternatives = self._logprobs != 0
        for info in infos:
            logprob = info.logprob if info.HasField("logprob") else LOGPROB_FLOOR
            # The chained comparison is False for NaN and ±inf too: none has a place in Dynamo's logprobs.
            log_probs.append(logprob if LOGPROB_FLOOR < logprob < _INF else LOGPROB_FLOOR)
            if alternatives:
                top_logprobs.append(
                    [
                        {
                            "rank": c.rank if c.HasField("rank") else position,
                            "token_id": c.token_id,
                            "token": c.token or None,
                            "logprob": c.logprob if LOGPROB_FLOOR < c.logprob < _INF else LOGPROB_FLOOR,
                        }
                        for position, c in enumerate(info.candidates, 1)
                    ]
                )
            else:
                top_logprobs.append([])

    def _finish(self, response: generation_pb2.GenerateResponse, chunks: list[Chunk]) -> Chunk:
        finished = response.finished
        if not finished.HasField("output_index"):
            raise self._violation(Violation.MISSING_OUTPUT_INDEX, "finished event without output_index")
        index: int = finished.output_index
        if index >= self._n:
            raise self._violation(Violation.OUTPUT_INDEX_OUT_OF_RANGE, f"finished for output {index} of {self._n}")
        if self._finished[index]:
            raise self._violation(Violation.DUPLICATE_FINISH, f"output {index} finished twice")
        reason = pb_enum(finished.reason, generation_pb2.FinishReason)
        if reason == generation_pb2.FINISH_REASON_UNSPECIFIED:
            raise self._violation(
                Violation.UNSPECIFIED_FINISH_REASON, f"output {index} finished with reason {finished.reason}"
            )
        self._finished[index] = True
        self._open -= 1
        has_usage = response.HasField("usage")
        if self._open and has_usage:
            detail = f"usage on output {index}'s finish, {self._open} outputs still open"
            raise self._violation(Violation.USAGE_BEFORE_END, detail)
        if not self._open and not has_usage:
            raise self._violation(Violation.MISSING_USAGE, "the final finished event carries no usage")

        # The finish joins this output's last chunk (with n > 1 another output's chunk may follow it): the frontend must
        # see the last token and the finish_reason together.
        last: Chunk | None = None
        for position in range(len(chunks) - 1, -1, -1):
            if chunks[position]["index"] == index:
                if "finish_reason" not in chunks[position]:
                    last = chunks.pop(position)
                break
        chunk: Chunk = last if last is not None else {"token_ids": [], "index": index}
        chunk["finish_reason"] = _FINISH_REASONS[reason]
        stopped_at = self._stopped_at[index]
        if stopped_at is not None:
            # The frontend's stop string ended this output (the engine's own reason is what came after it).
            chunk["finish_reason"] = "stop"
            chunk["stop_reason"] = stopped_at
        elif reason == _STOP and finished.HasField("stop_match"):
            match = finished.stop_match
            which = match.WhichOneof("match")
            if which is not None:
                chunk["stop_reason"] = getattr(match, which)
                if which == "stop_token_id" and match.stop_token_id in self._hidden_stop_ids:
                    self._trim_stop_token(chunk, index, match.stop_token_id)
        if not self._open:
            self._closed = True
            chunk["completion_usage"] = self._usage(response.usage)
            if self._prompt_logprobs is not None:
                chunk["engine_data"] = {"prompt_logprobs": self._prompt_positions or []}
        return chunk

    def _trim_stop_token(self, chunk: Chunk, index: int, stop_token_id: int) -> None:
        """Take the stop token the output ends with out of ``chunk`` (and its logprob entries) and out of the count."""
        ids: list[int] = chunk["token_ids"]
        if not ids or ids[-1] != stop_token_id:
            return  # already sent in an earlier chunk: the client has it, its count stands
        ids.pop()
        if "log_probs" in chunk:
            chunk["log_probs"].pop()
            chunk["top_logprobs"].pop()
        self._completion[index] -= 1
        self._trimmed += 1

    def _map_prompt(self, infos: Sequence[generation_pb2.TokenInfo]) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs`` shape: per prompt position ``{token_id: {logprob, rank, decoded_token}}``.

        The prompt token itself is always there; its top alternatives too unless ``prompt_logprobs=0``. A position
        without a logprob (the first prompt token has none) is None. Keys are decimal strings (JSON objects).
        """
        alternatives = self._prompt_logprobs != 0
        positions: list[dict[str, Any] | None] = []
        for info in infos:
            if not info.HasField("logprob"):
                positions.append(None)
                continue
            entry: dict[str, Any] = {
                str(info.token_id): {
                    "logprob": _finite(info.logprob),
                    "rank": info.rank if info.HasField("rank") else None,
                    "decoded_token": info.token or None,
                }
            }
            if alternatives:
                for position, c in enumerate(info.candidates, 1):
                    entry.setdefault(
                        str(c.token_id),
                        {
                            "logprob": _finite(c.logprob),
                            "rank": c.rank if c.HasField("rank") else position,
                            "decoded_token": c.token or None,
                        },
                    )
            positions.append(entry)
        return positions

    def _no_handoff(self, finish_reason: str, message: str) -> HandoffMissing:
        self._closed = True
        if finish_reason == "length":
            why = (
                "the engine ran the context-only request as a plain one-token generation, so it has no KV cache "
                "transceiver for disaggregated serving (TensorRT-LLM: configure cache_transceiver_config)"
            )
        else:
            why = "the engine ended the leg before it could hand the KV cache off"
        detail = f"; engine says: {message}" if message else ""
        return HandoffMissing(f"prefill leg finished with {finish_reason!r} and no PrefillReady: {why}{detail}")

    def _handoff(self, response: generation_pb2.GenerateResponse) -> Chunk:
        """The final chunk of a prefill leg: no tokens, ``length``, usage and the handoff JSON."""
        if not response.HasField("usage"):
            raise self._violation(Violation.MISSING_USAGE, "prefill_ready carries no usage")
        ready = response.prefill_ready
        if not ready.HasField("kv_session"):
            raise self._violation(Violation.BAD_HANDOFF, "prefill_ready carries no kv_session")
        try:
            params = session_to_handoff(ready.kv_session)
        except HandoffError as exc:
            raise self._violation(Violation.BAD_HANDOFF, str(exc)) from None
        self._closed = True
        self._handed_off = True
        self._held.clear()
        self._finished[0] = True
        self._open = 0
        usage = response.usage
        prompt: int = usage.prompt_tokens or self._prompt_tokens
        result: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}
        if usage.HasField("cached_prompt_tokens"):
            result["prompt_tokens_details"] = {"cached_tokens": min(usage.cached_prompt_tokens, prompt)}
        return {
            "token_ids": [],
            "index": 0,
            "finish_reason": "length",
            "completion_usage": result,
            "disaggregated_params": params,
        }

    def _usage(self, usage: generation_pb2.Usage) -> dict[str, Any]:
        prompt: int = usage.prompt_tokens or self._prompt_tokens
        completion: int = max(usage.completion_tokens - self._trimmed, 0) or sum(self._completion)
        if any(stop is not None for stop in self._stopped_at):
            completion = sum(self._completion)  # the tokens the client got, not what the engine made past the stop
        result: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if self._cached_tokens is not None:
            # A decode leg: the engine counts the transferred prompt as cached; the prefill leg's figure is the truth.
            result["prompt_tokens_details"] = {"cached_tokens": min(self._cached_tokens, prompt)}
        elif usage.HasField("cached_prompt_tokens"):
            result["prompt_tokens_details"] = {"cached_tokens": min(usage.cached_prompt_tokens, prompt)}
        if usage.HasField("reasoning_tokens"):
            result["completion_tokens_details"] = {"reasoning_tokens": min(usage.reasoning_tokens, completion)}
        return result

    def awaits_terminal(self, chunks: Sequence[Chunk]) -> bool:
        """Whether ``chunks`` (just mapped, not terminal) end an output with a token that its terminal follows.

        That is an output's last chunk ending with one of the request's EOS / stop token ids (once ``min_tokens``
        are out), or an output that has its ``max_tokens`` tokens. The frontend would end the stream at such a token
        and drop the ``finished`` that follows, so the caller holds the chunks for the next batch (bounded).

        Stop strings are matched by the frontend on its own text, so no token id names the end. The engine matches
        them too and holds back text that could begin one (TensorRT-LLM, ``openengine-mock``); when the stop string
        completes, its text is cut. So with stop strings (and an engine that sends text at all) a token event that
        carries tokens but no text is a candidate as well: the next event shows whether the engine finished there.
        """
        if self._n == 1:
            # One output (nearly every request): its last chunk decides; a finished output awaits nothing.
            if not chunks or self._finished[0]:
                return False
            return self._ends_with_terminal_token(chunks[-1], 0)
        seen: set[int] = set()
        for chunk in reversed(chunks):
            index: int = chunk["index"]
            if index in seen or "finish_reason" in chunk or self._finished[index]:
                continue
            seen.add(index)
            if self._ends_with_terminal_token(chunk, index):
                return True
        return False

    def _ends_with_terminal_token(self, chunk: Chunk, index: int) -> bool:
        ids: list[int] = chunk["token_ids"]
        if not ids or "finish_reason" in chunk:
            return False
        if self._stopped_at[index] is not None:
            return True  # the frontend ends the output here: its finish_reason and usage must come with it
        count = self._completion[index]
        if self._max_tokens is not None and count >= self._max_tokens:
            return True
        if ids[-1] in self._terminal_ids and count >= self._min_tokens:
            return True
        if self._text_withheld[index] and count >= self._min_tokens:
            # The engine holds this token's text back: it may be the start -- or the end -- of a stop string.
            if self._text_seen[index]:
                return True
            if self._text_first[index]:
                self._text_first[index] = False
                return True
        self._text_first[index] = False
        return False

    def end_of_stream(self) -> None:
        """The engine closed the stream (status OK): raise ``EOF_BEFORE_TERMINAL`` unless it was complete, or the
        engine error still pending (:attr:`failure`)."""
        if self._failure is not None:
            raise self._failure
        if not self._closed:
            open_outputs = [i for i, done in enumerate(self._finished) if not done]
            raise self._violation(Violation.EOF_BEFORE_TERMINAL, f"stream ended with outputs {open_outputs} unfinished")

    def cancelled_chunk(self) -> Chunk:
        """The final chunk for a request cancelled on our side: ``cancelled`` with partial usage.

        Usage counts the prompt and the tokens returned so far. The chunk's ``index`` is the first
        output still open. Closes the mapper; only valid while not :attr:`done`.
        """
        if self._closed:
            raise RuntimeError("cancelled_chunk() after the stream ended")
        self._closed = True
        completion = sum(self._completion)
        return {
            "token_ids": [],
            "index": self._finished.index(False),
            "finish_reason": "cancelled",
            "completion_usage": {
                "prompt_tokens": self._prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": self._prompt_tokens + completion,
            },
        }
