"""Per-output text: incremental detokenization, stop-string matching and TensorRT-LLM-style hold-back.

* Text is produced incrementally (the prefix/read-offset method): a token whose bytes do not yet form complete UTF-8
  yields no text until a later token completes it, so deltas never carry a replacement character mid-stream.
* Text that could be the beginning of a stop string is **held back** (not released) until it either completes the stop
  string — then the output stops and the stop string is cut — or stops matching, and is then released as catch-up
  text. With ``include_stop_in_output`` nothing is held back (as TensorRT-LLM's formatter: nothing would be cut). The
  final release flushes everything that is left.
* ``lag``: when the engine also holds token ids back (a multi-token stop word), TensorRT-LLM releases at most the
  text the previous step had, one step behind.
"""

from __future__ import annotations

from collections.abc import Sequence

from .lmapi import LanguageModel

__all__ = ["OutputText"]

_REPLACEMENT = "\ufffd"


class OutputText:
    """The text of one output. Feed tokens with :meth:`push`, then :meth:`match_stop` and :meth:`release`."""

    __slots__ = (
        "_ids",
        "_include_stop",
        "_lm",
        "_observed",
        "_prefix",
        "_read",
        "_released",
        "_stops",
        "stopped",
        "text",
    )

    def __init__(self, lm: LanguageModel, stop_texts: Sequence[str] = (), *, include_stop: bool = False) -> None:
        self._lm = lm
        self._stops = tuple(s for s in stop_texts if s)
        self._include_stop = include_stop
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._released = 0
        self._observed = 0  # the text's length at the previous release (``lag``)
        #: Everything detokenized so far (cut at the stop string once one matched).
        self.text = ""
        #: The stop string that ended this output, if any.
        self.stopped: str | None = None

    def push(self, token_id: int) -> None:
        """Append one token's text (if it completes any)."""
        if self.stopped is not None:
            return
        self._ids.append(token_id)
        self.text += self._delta(final=False)

    def match_stop(self) -> str | None:
        """If a stop string now occurs in the unreleased text, cut the text there and return the stop string."""
        if self.stopped is not None or not self._stops:
            return self.stopped
        best: tuple[int, str] | None = None
        for stop in self._stops:
            # With include_stop_in_output nothing is held back: part of the stop string may be out already.
            index = self.text.find(stop, max(self._released - len(stop) + 1, 0))
            if index >= 0 and (best is None or index < best[0] or (index == best[0] and len(stop) > len(best[1]))):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.text = self.text[: index + len(stop)] if self._include_stop else self.text[:index]
        self.stopped = stop
        return stop

    def drop_tokens(self, count: int) -> None:
        """Forget the last ``count`` tokens (a trimmed stop word) and stop: the text is that of the rest.

        Text already released stays released; hold-back keeps a stop word's text from going out before it matches.
        """
        if count > 0:
            del self._ids[len(self._ids) - count :]
        self.text = self._lm.decode(self._ids)
        self._prefix = self._read = len(self._ids)
        self.stopped = ""

    def release(self, *, final: bool, lag: bool = False) -> str:
        """The text that may be sent now; ``final`` flushes held-back text and incomplete UTF-8 as well; ``lag``:
        no more than the text had at the previous release."""
        if final:
            if self.stopped is None:
                self.text += self._delta(final=True)
            end = len(self.text)
        else:
            end = len(self.text) - self._holdback()
            if lag:
                end = min(end, self._observed)
            self._observed = len(self.text)
        if end <= self._released:
            return ""
        chunk = self.text[self._released : end]
        self._released = end
        return chunk

    def _holdback(self) -> int:
        """Length of the longest unreleased suffix that is a proper prefix of some stop string."""
        if not self._stops or self._include_stop:
            return 0
        text = self.text
        available = len(text) - self._released
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, available), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def _delta(self, *, final: bool) -> str:
        ids = self._ids
        if self._read >= len(ids):
            return ""
        decode = self._lm.decode
        prefix_text = decode(ids[self._prefix : self._read]) if self._read > self._prefix else ""
        new_text = decode(ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix = self._read
        self._read = len(ids)
        return new_text[len(prefix_text) :]
