"""Adaptive coalescing: merge the pending ``LLMEngineOutput`` chunks of one output into one chunk.

Dynamo's cost is per chunk (one yield, one response-plane message, one SSE event), not per token. When the engine
produces tokens faster than Dynamo takes chunks, the chunks waiting for Dynamo are merged; when Dynamo keeps up,
nothing waits and every chunk goes out alone, at once. No timer is involved: what is merged is exactly what piled up.

The rule (one output = one ``index``; order is the order chunks were added):

* a chunk merges into the **latest pending chunk of the same output** when that chunk is still open (none of
  ``finish_reason``, ``stop_reason``, ``completion_usage``): ``token_ids``, ``log_probs`` and ``top_logprobs`` are
  concatenated in order, and the later chunk's ``finish_reason`` / ``stop_reason`` / ``completion_usage`` are carried
  over;
* never across outputs, never past a terminal: a chunk after a terminal of its output starts a new chunk;
* a chunk with ``completion_usage`` (the stream's final chunk) merges only into the chunk right before it, so usage
  stays on the last chunk; nothing merges into or across it afterwards;
* merging may move a chunk of output *i* ahead of pending chunks of other outputs (per-output order is what the
  frontend uses, ``n > 1``), but never ahead of a chunk carrying usage or a chunk this module does not understand;
* logprobs stay aligned: two chunks merge only if both carry ``log_probs`` (resp. ``top_logprobs``), or the one
  without them carries no tokens;
* a chunk with any other key (``text``, ``disaggregated_params``, …) is never merged and nothing moves across it;
* every chunk handed out has ``token_ids`` (``[]`` is added where missing: Dynamo answers 500 without it).

Input chunks are never mutated: the first merge into a chunk replaces it with a copy that this module then owns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["MERGEABLE_KEYS", "Chunk", "PendingChunks", "coalesce"]

Chunk = dict[str, Any]

_TOKEN_IDS: Final = "token_ids"
_LOGPROB_KEYS: Final = ("log_probs", "top_logprobs")
_TERMINAL_KEYS: Final = ("finish_reason", "stop_reason", "completion_usage")
#: The keys a mergeable chunk may carry.
MERGEABLE_KEYS: Final = frozenset({_TOKEN_IDS, "index", *_LOGPROB_KEYS, *_TERMINAL_KEYS})


class PendingChunks:
    """Chunks waiting for the consumer, merged as they are added (``add``/``extend``) and handed out by ``take``.

    ``tokens`` counts the token ids pending, for a bound on how far the producer may run ahead.
    """

    __slots__ = ("_chunks", "_open", "_owned", "tokens")

    def __init__(self) -> None:
        self._chunks: list[Chunk] = []
        # output index -> position in _chunks of that output's latest chunk, while it may still take more tokens
        self._open: dict[Any, int] = {}
        # positions holding a copy made here (safe to extend in place)
        self._owned: set[int] = set()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def __bool__(self) -> bool:
        return bool(self._chunks)

    def take(self) -> list[Chunk]:
        """Everything pending, merged, in order; leaves this empty."""
        chunks = self._chunks
        self._chunks = []
        self._open.clear()
        self._owned.clear()
        self.tokens = 0
        return chunks

    def extend(self, chunks: Iterable[Chunk]) -> None:
        """``add`` each chunk in order."""
        for chunk in chunks:
            self.add(chunk)

    def add(self, chunk: Chunk) -> None:
        """Add one chunk after everything pending, merging it where the rule allows."""
        ids = chunk.get(_TOKEN_IDS)
        if ids is None:
            chunk = {**chunk, _TOKEN_IDS: []}
            ids = chunk[_TOKEN_IDS]
        self.tokens += len(ids)
        chunks = self._chunks
        if not chunk.keys() <= MERGEABLE_KEYS:
            # Not ours to understand: it goes out as it is, and nothing moves across it.
            chunks.append(chunk)
            self._open.clear()
            return
        index = chunk.get("index")
        usage = "completion_usage" in chunk
        terminal = usage or "finish_reason" in chunk or "stop_reason" in chunk
        position = self._open.get(index)
        if position is not None and (not usage or position == len(chunks) - 1):
            target = chunks[position]
            if _logprobs_compatible(target, chunk):
                self._merge(position, target, chunk)
                if terminal:
                    del self._open[index]
                if usage:
                    self._open.clear()
                return
        chunks.append(chunk)
        if usage:
            self._open.clear()  # the final chunk: nothing merges into it or moves ahead of it
        elif terminal:
            self._open.pop(index, None)
        else:
            self._open[index] = len(chunks) - 1

    def _merge(self, position: int, target: Chunk, chunk: Chunk) -> None:
        if position not in self._owned:
            target = {key: list(value) if key in _LIST_KEYS else value for key, value in target.items()}
            self._chunks[position] = target
            self._owned.add(position)
        target[_TOKEN_IDS].extend(chunk[_TOKEN_IDS])
        for key in _LOGPROB_KEYS:
            values = chunk.get(key)
            if values is not None:
                existing = target.get(key)
                if existing is None:
                    target[key] = list(values)
                else:
                    existing.extend(values)
        for key in _TERMINAL_KEYS:
            if key in chunk:
                target[key] = chunk[key]


_LIST_KEYS: Final = frozenset({_TOKEN_IDS, *_LOGPROB_KEYS})


def _logprobs_compatible(target: Chunk, chunk: Chunk) -> bool:
    # Merged logprobs must stay one entry per token: a side without them is fine only if it has no tokens.
    for key in _LOGPROB_KEYS:
        if (key in target) != (key in chunk):
            lacking = chunk if key in target else target
            if lacking[_TOKEN_IDS]:
                return False
    return True


def coalesce(chunks: Iterable[Chunk]) -> list[Chunk]:
    """The chunks merged by the rule above (a new list; the input chunks are not modified)."""
    pending = PendingChunks()
    pending.extend(chunks)
    return pending.take()
