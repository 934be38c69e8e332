"""A deterministic, readable "language model" for `openengine-mock`: a seeded Markov chain over the tiny tokenizer.

The chain is built at load time from ``corpus.txt`` in the model directory (one sentence per line):

* Every sentence is tokenized twice, as it reads at the start of a text (``"The river"``) and after a space
  (``" The river"``), and each ends with a pseudo-token END. Counts of order 1 (previous token) and order 2 (two
  previous tokens) are kept for the transitions inside sentences.
* ``P(w | a, b) = (c(a, b, w) + ALPHA * P(w | b)) / (c(a, b) + ALPHA)``: the order-2 estimate, smoothed toward order 1.
  A context whose last two tokens were never seen backs off to order 1; a context whose last token was never seen
  (an empty prompt, a chat template's ``"assistant\\n"``, a special token) backs off to the *start distribution*
  (the first tokens of corpus sentences), so every context has a non-empty distribution.
* END is then expanded: with probability ``STOP_PROBABILITY`` the text ends (``</s>``), otherwise a new sentence starts
  (the space-prefixed first tokens). Greedy decoding therefore ends after one sentence; sampling after ~2 on average.
* A LoRA adapter name deterministically picks ~1/8 of the vocabulary (SHAKE-128 of the name) whose probability is
  multiplied by ``exp(LORA_BOOST)`` (then renormalised), so an adapter visibly changes the text.

Everything is deterministic across processes: no ``hash()`` of strings, no set iteration, candidate lists sorted by
(probability desc, token id asc). Distributions and sampling tables are cached per (context state, adapter[, params]);
a sample is a dictionary lookup and a bisection of the caller's uniform draw (``lmapi.seeded_uniform``).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from tokenizers import Tokenizer

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

__all__ = ["MODEL_DIR", "TinyLM"]

MODEL_DIR: Final = Path(__file__).resolve().parent / "model"
"""The packaged tiny model directory (``scripts/build_tiny_model.py`` writes it)."""

ALPHA: Final = 0.5
"""Weight of the order-1 distribution in the smoothed order-2 estimate (in units of corpus counts)."""
STOP_PROBABILITY: Final = 0.5
"""Probability that a generation ends (``</s>``) where a sentence ends."""
LORA_BOOST: Final = 2.0
"""Log-probability boost of an adapter's token subset."""
_LORA_SUBSET_BYTE: Final = 32  # a token is in an adapter's subset when its SHAKE byte is below this: 1/8

_END: Final = -1  # pseudo-token: end of a sentence (only inside the count tables)
_State = tuple[int, ...]  # (), (b,) or (a, b): the resolved context
_CACHE_LIMIT: Final = 1 << 15  # entries; one adapter's full table is ~7k (~15 MB)
_LORA_CACHE_LIMIT: Final = 64


@dataclass(frozen=True, slots=True)
class _Dist:
    """A normalised distribution, sorted by probability desc then id asc."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    cum: tuple[float, ...]  # cumulative probabilities (untempered)


def _byte_decoder() -> dict[str, int]:
    """The inverse of the GPT-2 byte-to-unicode table that byte-level BPE tokens are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codepoints = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codepoints.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codepoints, strict=True)}


def _normalise(weights: Mapping[int, float]) -> dict[int, float]:
    total = math.fsum(weights.values())
    return {w: p / total for w, p in weights.items() if p > 0.0}


def _counts_to_probs(counts: Mapping[int, int]) -> dict[int, float]:
    total = sum(counts.values())
    return {w: c / total for w, c in counts.items()}


class TinyLM:
    """A seeded Markov-chain text model over the tiny tokenizer. Build with :meth:`load`."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int

    def __init__(
        self,
        tokenizer: Tokenizer,
        sentences: Iterable[str],
        *,
        bos_token_id: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        if not eos_token_ids:
            raise ValueError("eos_token_ids must not be empty")
        self._tokenizer = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self._eos = eos_token_ids[0]
        self._special: frozenset[int] = frozenset(int(i) for i in tokenizer.get_added_tokens_decoder())
        self._pieces = self._token_pieces()

        lines = [s.strip() for s in sentences]
        lines = [s for s in lines if s]
        if not lines:
            raise ValueError("the corpus has no sentences")
        encodings = tokenizer.encode_batch([*lines, *(" " + s for s in lines)], add_special_tokens=False)
        first: dict[int, int] = {}  # first tokens at the start of a text
        after_space: dict[int, int] = {}  # first tokens after a space (a following sentence)
        c1: dict[int, dict[int, int]] = {}
        c2: dict[tuple[int, int], dict[int, int]] = {}
        for n, encoding in enumerate(encodings):
            ids = [int(i) for i in encoding.ids]
            if not ids:
                continue
            starts = first if n < len(lines) else after_space
            starts[ids[0]] = starts.get(ids[0], 0) + 1
            seq = [*ids, _END]
            for i in range(1, len(seq)):
                b, w = seq[i - 1], seq[i]
                row = c1.setdefault(b, {})
                row[w] = row.get(w, 0) + 1
                if i >= 2:
                    row2 = c2.setdefault((seq[i - 2], b), {})
                    row2[w] = row2.get(w, 0) + 1
        self._start = _counts_to_probs(first)
        self._continue = _counts_to_probs(after_space)
        self._p1 = {b: _counts_to_probs(row) for b, row in c1.items()}
        self._c2 = c2
        self._dists: dict[tuple[_State, str | None], _Dist] = {}
        self._samplers: dict[tuple[_State, str | None, float, int, float, float], tuple[int, tuple[float, ...]]] = {}
        self._lora_masks: dict[str, bytes] = {}

    # -- construction -----------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, model_dir: Path | None = None) -> TinyLM:
        """Load ``tokenizer.json`` and build the chain from ``corpus.txt`` (None = the packaged directory).

        A model directory without ``corpus.txt`` (any Hugging Face tokenizer directory) uses the packaged corpus.
        """
        directory = MODEL_DIR if model_dir is None else Path(model_dir)
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        corpus = directory / "corpus.txt"
        if not corpus.is_file():
            corpus = MODEL_DIR / "corpus.txt"
        tokenizer_config = _read_json(directory / "tokenizer_config.json")
        generation_config = _read_json(directory / "generation_config.json")
        config = _read_json(directory / "config.json")

        def token_id(value: Any) -> int | None:
            if isinstance(value, dict):  # {"content": "<s>", ...} in some tokenizer_config files
                value = value.get("content")
            if isinstance(value, str):
                found = tokenizer.token_to_id(value)
                return None if found is None else int(found)
            return None

        eos: list[int] = []
        for raw in (generation_config.get("eos_token_id"), config.get("eos_token_id")):
            for value in raw if isinstance(raw, list) else [raw]:
                if isinstance(value, int) and not isinstance(value, bool) and value not in eos:
                    eos.append(value)
        fallback_eos = token_id(tokenizer_config.get("eos_token"))
        if fallback_eos is not None and fallback_eos not in eos:
            eos.append(fallback_eos)
        if not eos:
            raise ValueError(f"{directory}: no eos token id in generation_config.json, config.json or tokenizer_config")

        bos = generation_config.get("bos_token_id", config.get("bos_token_id"))
        if not isinstance(bos, int) or isinstance(bos, bool):
            bos = token_id(tokenizer_config.get("bos_token"))
        return cls(
            tokenizer,
            corpus.read_text(encoding="utf-8").splitlines(),
            bos_token_id=eos[0] if bos is None else bos,
            eos_token_ids=tuple(eos),
        )

    def _token_pieces(self) -> tuple[str, ...]:
        decoder = _byte_decoder()
        pieces: list[str] = []
        for token_id in range(self.vocab_size):
            token = self._tokenizer.id_to_token(token_id)
            if token is None:
                pieces.append("")
            elif token_id in self._special or any(ch not in decoder for ch in token):
                pieces.append(str(token))
            else:
                pieces.append(bytes(decoder[ch] for ch in token).decode("utf-8", errors="replace"))
        return tuple(pieces)

    # -- text -------------------------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS is added; special-token text such as ``<|im_start|>`` maps to its id)."""
        return [int(i) for i in self._tokenizer.encode(text, add_special_tokens=False).ids]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """The token's own text piece (``" river"``; a special token's own spelling; ``"\\ufffd"`` for a partial
        UTF-8 byte; ``""`` outside the vocabulary)."""
        if 0 <= token_id < len(self._pieces):
            return self._pieces[token_id]
        return ""

    # -- distributions ----------------------------------------------------------------------------------------------

    def _state(self, context: Sequence[int]) -> _State:
        n = len(context)
        if n >= 2:
            key = (context[-2], context[-1])
            if key in self._c2:
                return key
        if n >= 1:
            last = context[-1]
            if last in self._p1:
                return (last,)
        return ()

    def _dist(self, context: Sequence[int], lora: str | None) -> tuple[_State, _Dist]:
        state = self._state(context)
        key = (state, lora)
        dist = self._dists.get(key)
        if dist is None:
            if len(self._dists) >= _CACHE_LIMIT:
                self._dists.clear()
            dist = self._dists[key] = self._compute(state, lora)
        return state, dist

    def _compute(self, state: _State, lora: str | None) -> _Dist:
        probs: dict[int, float]
        if len(state) == 2:
            a, b = state
            p1 = self._p1[b]
            row = self._c2[(a, b)]
            total = sum(row.values()) + ALPHA
            probs = {w: ALPHA * p / total for w, p in p1.items()}
            for w, c in row.items():
                probs[w] = probs.get(w, 0.0) + c / total
        elif len(state) == 1:
            probs = dict(self._p1[state[0]])
        else:
            probs = dict(self._start)
        end = probs.pop(_END, 0.0)
        following = self._continue
        if lora is not None:  # reshape the word choice, keeping the mass of the sentence end (text length)
            probs = self._reshape(probs, lora, 1.0 - end)
            following = self._reshape(following, lora, 1.0)
        if end > 0.0:
            probs[self._eos] = probs.get(self._eos, 0.0) + end * STOP_PROBABILITY
            for w, p in following.items():
                probs[w] = probs.get(w, 0.0) + end * (1.0 - STOP_PROBABILITY) * p
        probs = _normalise(probs)
        ranked = sorted(probs.items(), key=lambda item: (-item[1], item[0]))
        cum: list[float] = []
        running = 0.0
        for _, p in ranked:
            running += p
            cum.append(running)
        return _Dist(
            ids=tuple(w for w, _ in ranked),
            logprobs=tuple(math.log(p) for _, p in ranked),
            cum=tuple(cum),
        )

    def _reshape(self, probs: Mapping[int, float], lora: str, mass: float) -> dict[int, float]:
        """Boost the adapter's token subset among ``probs``, then rescale them to sum to ``mass``."""
        if not probs:
            return {}
        mask = self._lora_mask(lora)
        boost = math.exp(LORA_BOOST)
        boosted = {w: p * boost if mask[w] < _LORA_SUBSET_BYTE else p for w, p in probs.items()}
        scale = mass / math.fsum(boosted.values())
        return {w: p * scale for w, p in boosted.items()}

    def _lora_mask(self, lora: str) -> bytes:
        """One byte per token id; special tokens never boosted (an adapter must not change where text ends)."""
        mask = self._lora_masks.get(lora)
        if mask is None:
            if len(self._lora_masks) >= _LORA_CACHE_LIMIT:
                self._lora_masks.clear()
            raw = bytearray(hashlib.shake_128(b"openengine-mock-lora\0" + lora.encode("utf-8")).digest(self.vocab_size))
            for token_id in self._special:
                if token_id < len(raw):
                    raw[token_id] = 255
            mask = self._lora_masks[lora] = bytes(raw)
        return mask

    def next_distribution(self, context: Sequence[int], *, lora: str | None = None) -> list[tuple[int, float]]:
        """Candidate ``(token_id, logprob)`` pairs for the next token, most likely first (ties: lowest id first).

        Normalised (the probabilities sum to 1) and never empty; ``lora`` applies that adapter's reshaping.
        """
        _, dist = self._dist(context, lora)
        return list(zip(dist.ids, dist.logprobs, strict=True))

    def top_logprobs(self, context: Sequence[int], n: int, *, lora: str | None = None) -> list[tuple[int, float]]:
        """The ``n`` most likely next tokens with their log-probabilities (fewer if there are fewer candidates)."""
        _, dist = self._dist(context, lora)
        k = max(0, n)
        return list(zip(dist.ids[:k], dist.logprobs[:k], strict=True))

    def logprob(self, context: Sequence[int], token_id: int, *, lora: str | None = None) -> float:
        """Log-probability of ``token_id`` after ``context`` (``-inf`` if it is not a candidate)."""
        _, dist = self._dist(context, lora)
        for i, w in enumerate(dist.ids):
            if w == token_id:
                return dist.logprobs[i]
        return -math.inf

    # -- sampling ---------------------------------------------------------------------------------------------------

    def sample(
        self,
        context: Sequence[int],
        u: float,
        *,
        temperature: float,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        lora: str | None = None,
    ) -> tuple[int, float]:
        """The next token for the uniform draw ``u`` in [0, 1); returns ``(token_id, logprob under the untempered
        distribution)``. A pure function of its arguments (see ``lmapi``: the engine draws ``u`` by position).

        ``temperature <= 0`` is greedy (the most likely token, ties to the lowest id; ``u`` is not used). Otherwise
        the candidates are cut to the ``top_k`` most likely (0 = all), then, on the tempered probabilities, to the
        smallest prefix whose mass reaches ``top_p`` and to those with at least ``min_p`` times the largest
        probability; ``u`` picks among the rest in proportion to their tempered probability (inverse CDF).
        """
        state, dist = self._dist(context, lora)
        if temperature <= 0.0:
            return dist.ids[0], dist.logprobs[0]
        if temperature == 1.0 and top_k <= 0 and top_p >= 1.0 and min_p <= 0.0:
            cum = dist.cum
            n = len(cum)
        else:
            key = (state, lora, float(temperature), int(top_k), float(top_p), float(min_p))
            cached = self._samplers.get(key)
            if cached is None:
                if len(self._samplers) >= _CACHE_LIMIT:
                    self._samplers.clear()
                cached = self._samplers[key] = _truncate(dist, temperature, top_k, top_p, min_p)
            n, cum = cached
        i = bisect.bisect_right(cum, u * cum[n - 1], 0, n)
        if i >= n:
            i = n - 1
        return dist.ids[i], dist.logprobs[i]


def _truncate(dist: _Dist, temperature: float, top_k: int, top_p: float, min_p: float) -> tuple[int, tuple[float, ...]]:
    """The kept prefix length and the cumulative tempered weights over it (filters keep a prefix of the ranking)."""
    n = len(dist.ids)
    if top_k > 0:
        n = min(n, top_k)
    top = dist.logprobs[0]
    weights = [math.exp((lp - top) / temperature) for lp in dist.logprobs[:n]]  # tempered, relative to the best
    total = math.fsum(weights)
    if min_p > 0.0:
        threshold = min_p * weights[0]
        n = max(1, sum(1 for w in weights if w >= threshold))  # weights are non-increasing: a prefix
    if top_p < 1.0:
        running = 0.0
        for i in range(n):
            running += weights[i] / total
            if running >= top_p:
                n = i + 1
                break
    cum: list[float] = []
    running = 0.0
    for w in weights[:n]:
        running += w
        cum.append(running)
    return n, tuple(cum)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}
