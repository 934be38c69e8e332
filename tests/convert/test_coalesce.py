"""The coalescing rule (``sidecar.convert.coalesce``): a table of cases, then properties over random chunk streams."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.convert.coalesce import MERGEABLE_KEYS, PendingChunks, coalesce

Chunk = dict[str, Any]

USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def tok(index: int, *ids: int, lp: bool = False) -> Chunk:
    chunk: Chunk = {"token_ids": list(ids), "index": index}
    if lp:
        chunk["log_probs"] = [-float(i) for i in ids]
        chunk["top_logprobs"] = [[{"rank": 1, "token_id": i, "token": None, "logprob": -float(i)}] for i in ids]
    return chunk


def no_top(chunk: Chunk) -> Chunk:
    """``chunk`` with its ``log_probs`` but without ``top_logprobs`` (a token's logprob without candidates)."""
    return {key: value for key, value in chunk.items() if key != "top_logprobs"}


def fin(index: int, *ids: int, reason: str = "length", usage: bool = False, lp: bool = False, **extra: Any) -> Chunk:
    chunk = tok(index, *ids, lp=lp)
    chunk["finish_reason"] = reason
    chunk.update(extra)
    if usage:
        chunk["completion_usage"] = dict(USAGE)
    return chunk


CASES: list[tuple[str, list[Chunk], list[Chunk]]] = [
    ("empty", [], []),
    ("one chunk alone", [tok(0, 1)], [tok(0, 1)]),
    ("consecutive deltas of one output", [tok(0, 1), tok(0, 2), tok(0, 3)], [tok(0, 1, 2, 3)]),
    ("multi-token deltas", [tok(0, 1, 2), tok(0, 3, 4)], [tok(0, 1, 2, 3, 4)]),
    ("terminal joins the tokens before it", [tok(0, 1), fin(0, 2)], [fin(0, 1, 2)]),
    ("empty terminal joins", [tok(0, 1), fin(0)], [fin(0, 1)]),
    ("final chunk with usage joins an adjacent chunk", [tok(0, 1), fin(0, 2, usage=True)], [fin(0, 1, 2, usage=True)]),
    (
        "stop reason is carried",
        [tok(0, 1), fin(0, 2, reason="stop", stop_reason=4, usage=True)],
        [fin(0, 1, 2, reason="stop", stop_reason=4, usage=True)],
    ),
    ("never past a terminal", [fin(0, 1), tok(0, 2)], [fin(0, 1), tok(0, 2)]),
    ("never past the final chunk", [fin(0, 1, usage=True), tok(0, 2)], [fin(0, 1, usage=True), tok(0, 2)]),
    ("never across outputs", [tok(0, 1), tok(1, 2)], [tok(0, 1), tok(1, 2)]),
    (
        "interleaved outputs merge per output",
        [tok(0, 1), tok(1, 10), tok(0, 2), tok(1, 11)],
        [tok(0, 1, 2), tok(1, 10, 11)],
    ),
    (
        "a terminal of one output moves ahead of another output's chunk",
        [tok(0, 1), tok(1, 10), fin(0, 2), tok(1, 11)],
        [fin(0, 1, 2), tok(1, 10, 11)],
    ),
    (
        "usage never moves ahead of other outputs",
        [tok(0, 1), fin(1, 10), fin(0, 2, usage=True)],
        [tok(0, 1), fin(1, 10), fin(0, 2, usage=True)],
    ),
    (
        "usage merges into the adjacent chunk of its output",
        [fin(1, 10), tok(0, 1), fin(0, 2, usage=True)],
        [fin(1, 10), fin(0, 1, 2, usage=True)],
    ),
    ("logprobs are concatenated", [tok(0, 1, lp=True), tok(0, 2, 3, lp=True)], [tok(0, 1, 2, 3, lp=True)]),
    ("an empty terminal without logprobs joins", [tok(0, 1, lp=True), fin(0)], [fin(0, 1, lp=True)]),
    (
        "logprobs next to tokens without them: kept apart",
        [tok(0, 1, lp=True), tok(0, 2)],
        [tok(0, 1, lp=True), tok(0, 2)],
    ),
    (
        "tokens without logprobs, then with: kept apart",
        [tok(0, 1), tok(0, 2, lp=True)],
        [tok(0, 1), tok(0, 2, lp=True)],
    ),
    (
        "logprobs without top logprobs next to both: kept apart",
        [no_top(tok(0, 1, lp=True)), tok(0, 2, lp=True)],
        [no_top(tok(0, 1, lp=True)), tok(0, 2, lp=True)],
    ),
    (
        "both, then logprobs without top logprobs: kept apart",
        [tok(0, 1, lp=True), no_top(tok(0, 2, lp=True))],
        [tok(0, 1, lp=True), no_top(tok(0, 2, lp=True))],
    ),
    ("an empty open chunk takes logprobs", [tok(0), tok(0, 2, lp=True)], [tok(0, 2, lp=True)]),
    ("a chunk without token_ids gets them", [{"index": 0, "finish_reason": "stop"}], [fin(0, reason="stop")]),
    (
        "a chunk without token_ids still merges",
        [tok(0, 1), {"index": 0, "finish_reason": "stop"}],
        [fin(0, 1, reason="stop")],
    ),
    ("chunks without index merge with each other", [{"token_ids": [1]}, {"token_ids": [2]}], [{"token_ids": [1, 2]}]),
    ("no index is not index 0", [{"token_ids": [1]}, tok(0, 2)], [{"token_ids": [1]}, tok(0, 2)]),
    (
        "a chunk with text is never merged",
        [tok(0, 1), {"token_ids": [2], "index": 0, "text": "b"}, tok(0, 3)],
        [tok(0, 1), {"token_ids": [2], "index": 0, "text": "b"}, tok(0, 3)],
    ),
    (
        "nothing moves across an unknown chunk",
        [tok(0, 1), {"token_ids": [], "index": 1, "disaggregated_params": {}}, tok(0, 2)],
        [tok(0, 1), {"token_ids": [], "index": 1, "disaggregated_params": {}}, tok(0, 2)],
    ),
    (
        "a stop reason alone closes the chunk",
        [{"token_ids": [1], "index": 0, "stop_reason": 4}, tok(0, 2)],
        [{"token_ids": [1], "index": 0, "stop_reason": 4}, tok(0, 2)],
    ),
    (
        "a chunk without index stays apart from index 0",
        [tok(0, 1), {"token_ids": [], "finish_reason": "cancelled"}],
        [tok(0, 1), {"token_ids": [], "finish_reason": "cancelled"}],
    ),
]


@pytest.mark.parametrize(("chunks", "expected"), [(c, e) for _, c, e in CASES], ids=[name for name, _, _ in CASES])
def test_table(chunks: list[Chunk], expected: list[Chunk]) -> None:
    before = copy.deepcopy(chunks)
    out = coalesce(chunks)
    assert chunks == before  # inputs untouched
    assert out == expected


def test_pending_counts_tokens_and_take_empties() -> None:
    pending = PendingChunks()
    assert not pending
    pending.extend([tok(0, 1, 2), tok(0, 3), tok(1, 4)])
    assert pending.tokens == 4
    assert len(pending) == 2
    assert pending.take() == [tok(0, 1, 2, 3), tok(1, 4)]
    assert not pending
    assert pending.tokens == 0
    pending.add(tok(0, 5))  # after take, nothing merges into what was handed out
    assert pending.take() == [tok(0, 5)]


def test_merged_chunk_is_a_copy_that_later_merges_extend() -> None:
    first = tok(0, 1, lp=True)
    pending = PendingChunks()
    pending.extend([first, tok(0, 2, lp=True), tok(0, 3, lp=True)])
    (merged,) = pending.take()
    assert merged is not first
    assert first == tok(0, 1, lp=True)
    assert merged == tok(0, 1, 2, 3, lp=True)


# ------------------------------------------------------------------------------------------------- properties

_KEYS = st.sampled_from(["plain", "lp", "lp_no_top", "finish", "finish_lp", "usage"])


@st.composite
def streams(draw: st.DrawFn) -> list[Chunk]:
    """Random chunk sequences, including ones that break the stream contract (tokens after a terminal, …)."""
    n = draw(st.integers(1, 3))
    next_id = 0
    chunks: list[Chunk] = []
    for _ in range(draw(st.integers(0, 25))):
        index = draw(st.integers(0, n - 1))
        count = draw(st.integers(0, 3))
        ids = list(range(next_id, next_id + count))
        next_id += count
        kind = draw(_KEYS)
        lp = kind in ("lp", "lp_no_top", "finish_lp")
        if kind == "lp_no_top":
            chunks.append(no_top(tok(index, *ids, lp=True)))
        elif kind in ("finish", "finish_lp"):
            chunks.append(fin(index, *ids, reason=draw(st.sampled_from(["stop", "length"])), lp=lp))
        elif kind == "usage":
            chunks.append(fin(index, *ids, usage=True))
        else:
            chunks.append(tok(index, *ids, lp=lp))
    return chunks


def per_output(chunks: list[Chunk], key: str) -> dict[Any, list[Any]]:
    out: dict[Any, list[Any]] = {}
    for chunk in chunks:
        out.setdefault(chunk.get("index"), []).extend(chunk.get(key) or [])
    return out


def terminals(chunks: list[Chunk]) -> dict[Any, list[tuple[int, str]]]:
    """Per output: (tokens of that output before and including the terminal chunk, finish reason)."""
    seen: dict[Any, int] = {}
    out: dict[Any, list[tuple[int, str]]] = {}
    for chunk in chunks:
        index = chunk.get("index")
        seen[index] = seen.get(index, 0) + len(chunk["token_ids"])
        if "finish_reason" in chunk:
            out.setdefault(index, []).append((seen[index], chunk["finish_reason"]))
    return out


@settings(max_examples=400, deadline=None)
@given(streams())
def test_properties(chunks: list[Chunk]) -> None:
    before = copy.deepcopy(chunks)
    out = coalesce(chunks)
    assert chunks == before
    # Every chunk has token_ids; none is added.
    assert all("token_ids" in c for c in out)
    assert len(out) <= len(chunks)
    # Per output, the tokens and their logprobs come out in order, none lost, none added.
    assert per_output(out, "token_ids") == per_output(chunks, "token_ids")
    assert per_output(out, "log_probs") == per_output(chunks, "log_probs")
    assert per_output(out, "top_logprobs") == per_output(chunks, "top_logprobs")
    # Logprobs stay aligned with tokens in every chunk that has them.
    for chunk in out:
        for key in ("log_probs", "top_logprobs"):
            if key in chunk:
                assert len(chunk[key]) == len(chunk["token_ids"]), key
    # Every terminal stays after exactly the tokens that preceded it, and none is merged away.
    assert terminals(out) == terminals(chunks)
    # Usage: as many chunks carry it as before, and if the input ended with it, so does the output.
    assert sum("completion_usage" in c for c in out) == sum("completion_usage" in c for c in chunks)
    if chunks and "completion_usage" in chunks[-1]:
        assert "completion_usage" in out[-1]
    # Nothing moves across a chunk with usage: the chunks before it (per output, in tokens) stay before it.
    for position, chunk in enumerate(out):
        if "completion_usage" in chunk:
            later = per_output(out[position + 1 :], "token_ids")
            original = next(i for i, c in enumerate(chunks) if c.get("completion_usage") is chunk["completion_usage"])
            assert later == per_output(chunks[original + 1 :], "token_ids")
    # A coalesced stream cannot be coalesced further.
    assert coalesce(out) == out
    # Only known keys.
    assert all(c.keys() <= MERGEABLE_KEYS for c in out)


@settings(max_examples=200, deadline=None)
@given(streams(), st.lists(st.integers(0, 25), max_size=5))
def test_taking_in_between_only_splits(chunks: list[Chunk], cuts: list[int]) -> None:
    """Handing out what is pending at any moment yields the same per-output streams (the consumer may take early)."""
    pending = PendingChunks()
    out: list[Chunk] = []
    for position, chunk in enumerate(chunks):
        pending.add(chunk)
        if position in cuts:
            out.extend(pending.take())
    out.extend(pending.take())
    assert per_output(out, "token_ids") == per_output(chunks, "token_ids")
    assert terminals(out) == terminals(chunks)
    assert len(out) <= len(chunks)
