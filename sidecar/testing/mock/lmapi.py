"""The language-model interface the mock engine drives (implemented by ``sidecar.testing.mock.lm.TinyLM``).

A structural protocol, so the engine and its unit tests can run on any object with this shape.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

__all__ = ["LanguageModel"]


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
        rng: random.Random,
        *,
        temperature: float,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        lora: str | None = None,
    ) -> tuple[int, float]: ...

    def top_logprobs(self, context: Sequence[int], n: int) -> list[tuple[int, float]]: ...
