"""Unit tests of incremental detokenization and stop-string hold-back, on a character-level fake tokenizer."""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.testing.mock.textstream import OutputText


class CharLM:
    """Token id = a Unicode code point, except ids >= 0x110000 which are raw UTF-8 bytes (id - 0x110000)."""

    vocab_size = 0x110100
    eos_token_ids = (0,)
    bos_token_id = 0

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        out = bytearray()
        for i in ids:
            out += bytes([i - 0x110000]) if i >= 0x110000 else chr(i).encode()
        return out.decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def next_distribution(self, context: Sequence[int], *, lora: str | None = None) -> list[tuple[int, float]]:
        return [(ord("a"), 0.0)]

    def sample(self, context: Sequence[int], u: float, **_: object) -> tuple[int, float]:
        return ord("a"), 0.0

    def top_logprobs(self, context: Sequence[int], n: int) -> list[tuple[int, float]]:
        return [(ord("a"), 0.0)][:n]


def _run(text: OutputText, chars: str) -> list[str]:
    deltas = []
    for c in chars:
        text.push(ord(c))
        if text.match_stop() is not None:
            break
        deltas.append(text.release(final=False))
    deltas.append(text.release(final=True))
    return deltas


def test_plain_text_streams_per_token() -> None:
    assert _run(OutputText(CharLM()), "abc") == ["a", "b", "c", ""]


def test_stop_prefix_is_held_back_then_released() -> None:
    text = OutputText(CharLM(), ["cd"])
    # "c" could start "cd": held back; "x" breaks the match → "cx" released together (catch-up text).
    assert _run(text, "abcxe") == ["a", "b", "", "cx", "e", ""]
    assert text.stopped is None


def test_stop_string_cut_and_include() -> None:
    text = OutputText(CharLM(), ["cd"])
    assert _run(text, "abcdef") == ["a", "b", "", ""]
    assert text.stopped == "cd"
    assert text.text == "ab"
    kept = OutputText(CharLM(), ["cd"], include_stop=True)
    assert "".join(_run(kept, "abcdef")) == "abcd"


def test_earliest_stop_wins_and_overlapping_prefixes() -> None:
    text = OutputText(CharLM(), ["aab", "b"])
    assert "".join(_run(text, "xaab")) == "x"
    assert text.stopped == "aab"


def test_incomplete_utf8_waits_for_the_next_byte() -> None:
    text = OutputText(CharLM())
    euro = "€".encode()
    ids = [0x110000 + b for b in euro]
    deltas = []
    for i in ids:
        text.push(i)
        deltas.append(text.release(final=False))
    assert deltas == ["", "", "€"]


def test_final_release_flushes_incomplete_bytes() -> None:
    text = OutputText(CharLM())
    text.push(0x110000 + "€".encode()[0])
    assert text.release(final=False) == ""
    assert text.release(final=True) == "\ufffd"
