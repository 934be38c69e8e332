"""The language-model interface the mock engine drives (implemented by ``sidecar.testing.mock.lm.TinyLM``), and the
random draws that make its output a function of the context and the absolute position.

A structural protocol, so the engine and its unit tests can run on any object with this shape.

Why positional draws: Dynamo's frontend migrates a failed stream by sending the prompt *plus the tokens received so
far* to another worker. For the continuation to be exact, the token at absolute position ``p`` (its index in
prompt + output) may depend only on the context before it, the sampling parameters and -- when sampling -- the seed
and ``p``; never on how many draws a per-request random stream has made, the request id or the engine instance. So a
seeded output draws ``seeded_uniform(seed, p, attempt)`` for its token at ``p`` and the model turns that uniform into
a token (:meth:`LanguageModel.sample`), which also makes a disaggregated decode leg continue its prefill leg exactly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final, Protocol

__all__ = ["LanguageModel", "context_seed", "output_seed", "seeded_uniform"]

_MASK: Final = (1 << 64) - 1
_UNIT: Final = 1.0 / (1 << 53)


class LanguageModel(Protocol):
    """Tokenizer + next-token model. Distributions are sorted by descending logprob and normalised."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def bos_token_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...

    def next_distribution(self, context: Sequence[int], *, lora: str | None = None) -> list[tuple[int, float]]: ...

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
        """The next token for the uniform draw ``u`` in [0, 1): a pure function of its arguments."""
        ...

    def top_logprobs(self, context: Sequence[int], n: int) -> list[tuple[int, float]]: ...


def _mix(x: int) -> int:
    """SplitMix64's finaliser: a fast, well-spread 64-bit hash that is the same in every process and version."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int, attempt: int = 0) -> float:
    """The uniform draw in [0, 1) of the token at absolute ``position`` for ``seed``.

    ``attempt`` numbers the redraws at one position (the engine redraws a token that ``min_tokens``/``ignore_eos``
    forbid), so a redraw is as reproducible as the first draw.
    """
    return (_mix(_mix(_mix(seed & _MASK) ^ (position & _MASK)) ^ (attempt & _MASK)) >> 11) * _UNIT


def output_seed(seed: int, index: int) -> int:
    """The seed of output ``index`` of a request with ``seed``: output 0 keeps it (an ``n=1`` request and output 0 of
    an ``n>1`` one agree); the others get independent seeds derived from both."""
    return seed if index == 0 else _mix(_mix(seed & _MASK) ^ _mix(index))


def context_seed(ids: Sequence[int]) -> int:
    """A seed that is a function of a token sequence alone (greedy guided output depends on the prompt only)."""
    digest = hashlib.blake2b(b",".join(b"%d" % i for i in ids), digest_size=8).digest()
    return int.from_bytes(digest, "little")
