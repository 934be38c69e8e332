"""The stream rules as pure judgements over observed ``Generate`` streams (wire §7.3, §7.4; trtllm §7).

Each ``judge_*`` function tests **one** rule and is lenient about every other: a stream whose ``output_index`` is
missing is still counted by the finish rule, deltas that are cumulative are still reassembled for the ``max_tokens``
rule, messages after the terminal event are ignored by every rule but :func:`judge_nothing_after_terminal`. An engine
that breaks one rule thus fails one check, and the report points at the cause instead of its echoes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from grpclib.const import Status

from openengine.v1 import generation_pb2

from ._wire import Observation

__all__ = [
    "Finding",
    "assemble",
    "event_of",
    "judge_finish_reason",
    "judge_non_cumulative",
    "judge_nothing_after_terminal",
    "judge_one_finished",
    "judge_output_index",
    "judge_prompt_logprobs",
    "judge_request_id",
    "judge_usage_last",
    "terminal_index",
    "upto_terminal",
]

_OUTPUT_EVENTS = ("token", "finished")


@dataclass(frozen=True, slots=True)
class Finding:
    """A rule's judgement over some streams: ``ok`` (``None``: nothing the rule applies to) and one line of evidence."""

    ok: bool | None
    evidence: str


def event_of(message: generation_pb2.GenerateResponse) -> str | None:
    kind = message.WhichOneof("event")
    return str(kind) if kind is not None else None


def _output_index(message: generation_pb2.GenerateResponse) -> tuple[int, bool]:
    """The message's output index and whether it was present (absent reads as 0, as a lenient client would)."""
    body = message.token if event_of(message) == "token" else message.finished
    return int(body.output_index), body.HasField("output_index")


def terminal_index(obs: Observation) -> int | None:
    """Position of the stream's terminal event, or ``None`` if it never came (wire §7.4 "Terminal events").

    ``error`` and ``prefill_ready`` end a stream; otherwise the ``finished`` that completes the last of ``n`` outputs.
    Without ``output_index`` the outputs cannot be told apart, so the n-th ``finished`` counts as the last.
    """
    finished: set[int] = set()
    count = 0
    indexed = True
    for position, message in enumerate(obs.messages):
        kind = event_of(message)
        if kind in ("error", "prefill_ready"):
            return position
        if kind == "finished":
            count += 1
            index, present = _output_index(message)
            indexed = indexed and present
            finished.add(index)
            if (indexed and finished >= set(range(obs.n))) or (not indexed and count >= obs.n):
                return position
    return None


def upto_terminal(obs: Observation) -> list[generation_pb2.GenerateResponse]:
    """The messages up to and including the terminal event (all of them when there is none)."""
    end = terminal_index(obs)
    return obs.messages if end is None else obs.messages[: end + 1]


def _deltas(obs: Observation, index: int) -> list[generation_pb2.TokenOutput]:
    return [m.token for m in upto_terminal(obs) if event_of(m) == "token" and _output_index(m)[0] == index]


def _cumulative_ids(deltas: Sequence[Sequence[int]]) -> bool:
    """True when every delta after the first repeats everything sent before it (and adds to it)."""
    informative = 0
    sent: list[int] = []
    for delta in deltas:
        if not delta:
            continue
        if sent:
            if not (len(delta) > len(sent) and list(delta[: len(sent)]) == sent):
                return False
            informative += 1
            sent = list(delta)
        else:
            sent = list(delta)
    return informative >= 2


def _cumulative_text(deltas: Sequence[str]) -> bool:
    informative = 0
    sent = ""
    for delta in deltas:
        if not delta:
            continue
        if sent:
            if not (len(delta) > len(sent) and delta.startswith(sent)):
                return False
            informative += 1
        sent = delta
    return informative >= 2


def assemble(obs: Observation, index: int = 0) -> tuple[list[int], str]:
    """Output ``index`` as a client reassembles it: deltas concatenated up to the terminal event.

    Cumulative deltas (judged by :func:`judge_non_cumulative`) are read as such — the last one is the output — so
    that the other rules judge what the engine generated, not the echo of another rule's breach.
    """
    deltas = _deltas(obs, index)
    ids = [[t.token_id for t in d.tokens] for d in deltas]
    texts = [d.text for d in deltas]
    tokens: list[int] = (
        next((d for d in reversed(ids) if d), []) if _cumulative_ids(ids) else [t for d in ids for t in d]
    )
    text = next((t for t in reversed(texts) if t), "") if _cumulative_text(texts) else "".join(texts)
    return tokens, text


def _label(obs: Observation) -> str:
    return f"{obs.request_id!r} (n={obs.n})"


def _accepted(streams: Iterable[Observation]) -> list[Observation]:
    return [s for s in streams if s.messages]


def _ended(streams: Iterable[Observation]) -> list[tuple[Observation, int]]:
    """The accepted streams that reached their terminal event, with its position (the rest: judge_one_finished)."""
    return [(obs, end) for obs in _accepted(streams) if (end := terminal_index(obs)) is not None]


_NOTHING_ENDED = Finding(None, "no stream with a terminal event (see stream.one_finished_per_output)")


def judge_output_index(streams: Sequence[Observation]) -> Finding:
    """Every ``TokenOutput`` and ``GenerationFinished`` carries ``output_index``, 0 included, in ``0 … n−1``."""
    checked = 0
    for obs in _accepted(streams):
        for position, message in enumerate(obs.messages):
            if event_of(message) not in _OUTPUT_EVENTS:
                continue
            checked += 1
            index, present = _output_index(message)
            if not present:
                return Finding(
                    False, f"{_label(obs)}: message #{position + 1} ({event_of(message)}) has no output_index"
                )
            if index >= obs.n:
                return Finding(False, f"{_label(obs)}: message #{position + 1} has output_index {index} ≥ n")
    if not checked:
        return Finding(None, "no token or finished event was observed")
    return Finding(True, f"{checked} token/finished events over {len(streams)} streams all carry output_index")


def judge_non_cumulative(streams: Sequence[Observation]) -> Finding:
    """``TokenOutput`` carries only new tokens and new text; the streamed tokens add up to at most the usage."""
    deltas_seen = 0
    for obs in _accepted(streams):
        for index in range(obs.n):
            deltas = _deltas(obs, index)
            deltas_seen += len(deltas)
            if _cumulative_ids([[t.token_id for t in d.tokens] for d in deltas]):
                sizes = [len(d.tokens) for d in deltas]
                return Finding(False, f"{_label(obs)} output {index}: each delta repeats the previous ones {sizes}")
            if _cumulative_text([d.text for d in deltas]):
                shown = [d.text for d in deltas][:4]
                return Finding(False, f"{_label(obs)} output {index}: text deltas repeat the text so far {shown}")
        end = terminal_index(obs)
        if end is not None and obs.messages[end].HasField("usage"):
            streamed = sum(len(m.token.tokens) for m in upto_terminal(obs) if event_of(m) == "token")
            completion = obs.messages[end].usage.completion_tokens
            if streamed > completion:
                return Finding(
                    False,
                    f"{_label(obs)}: {streamed} tokens streamed but usage.completion_tokens = {completion}",
                )
    if deltas_seen < 2:
        return Finding(None, "fewer than two token deltas were observed; nothing to judge")
    return Finding(True, f"{deltas_seen} deltas over {len(streams)} streams, none repeats earlier output")


def judge_one_finished(streams: Sequence[Observation]) -> Finding:
    """Exactly one ``finished`` per requested output; none of its tokens after it; no stream ends without them."""
    judged = 0
    for obs in _accepted(streams):
        messages = upto_terminal(obs)
        if any(event_of(m) in ("error", "prefill_ready") for m in messages):
            continue
        judged += 1
        finishes = [m for m in messages if event_of(m) == "finished"]
        indexed = all(_output_index(m)[1] for m in finishes) and all(
            _output_index(m)[1] for m in messages if event_of(m) == "token"
        )
        if not indexed:
            # Outputs cannot be told apart (judged by judge_output_index): only the count can be judged.
            if len(finishes) != obs.n:
                return Finding(False, f"{_label(obs)}: {len(finishes)} finished events for {obs.n} outputs")
            continue
        done: set[int] = set()
        for position, message in enumerate(messages):
            index, _ = _output_index(message)
            kind = event_of(message)
            if kind == "token" and index in done:
                return Finding(False, f"{_label(obs)}: token for output {index} after its finished (#{position + 1})")
            if kind == "finished":
                if index in done:
                    return Finding(False, f"{_label(obs)}: output {index} finished twice")
                done.add(index)
        missing = sorted(set(range(obs.n)) - done)
        if missing:
            return Finding(False, f"{_label(obs)}: outputs {missing} never finished ({obs.describe_end()})")
    if not judged:
        return Finding(None, "no complete generation stream was observed")
    return Finding(True, f"{judged} streams: one finished per output, no token after its output's finished")


def judge_usage_last(streams: Sequence[Observation]) -> Finding:
    """``usage`` only on the terminal event, cumulative over outputs and self-consistent."""
    ended = _ended(streams)
    if not ended:
        return _NOTHING_ENDED
    for obs, end in ended:
        for position, message in enumerate(obs.messages[:end]):
            if message.HasField("usage"):
                return Finding(
                    False,
                    f"{_label(obs)}: usage on non-final message #{position + 1} ({event_of(message)}),"
                    f" terminal is #{end + 1}",
                )
        final = obs.messages[end]
        if not final.HasField("usage"):
            return Finding(False, f"{_label(obs)}: the terminal {event_of(final)} carries no usage")
        usage = final.usage
        if usage.total_tokens != usage.prompt_tokens + usage.completion_tokens:
            return Finding(
                False,
                f"{_label(obs)}: total_tokens {usage.total_tokens} ≠ prompt {usage.prompt_tokens}"
                f" + completion {usage.completion_tokens}",
            )
        if usage.HasField("cached_prompt_tokens") and usage.cached_prompt_tokens > usage.prompt_tokens:
            return Finding(False, f"{_label(obs)}: cached_prompt_tokens {usage.cached_prompt_tokens} > prompt_tokens")
        if usage.HasField("reasoning_tokens") and usage.reasoning_tokens > usage.completion_tokens:
            return Finding(False, f"{_label(obs)}: reasoning_tokens {usage.reasoning_tokens} > completion_tokens")
    judged, multi = len(ended), sum(1 for s in streams if s.n > 1)
    return Finding(True, f"{judged} streams ({multi} with n > 1): usage on the terminal event only, totals consistent")


def _asked_prompt_logprobs(obs: Observation) -> bool:
    return obs.request is not None and obs.request.response.return_prompt_logprobs


def judge_prompt_logprobs(streams: Sequence[Observation]) -> Finding:
    """``PromptOutput`` at most once, first, only when asked; one token per prompt token, the first without logprob."""
    asked = 0
    for obs in _accepted(streams):
        messages = upto_terminal(obs)
        prompts = [p for p, m in enumerate(messages) if event_of(m) == "prompt"]
        if not _asked_prompt_logprobs(obs):
            if prompts:
                return Finding(False, f"{_label(obs)}: prompt event #{prompts[0] + 1} without prompt logprobs asked")
            continue
        asked += 1
        if event_of(messages[-1]) == "error":
            continue  # an accepted failure (e.g. the prompt-logprob blow-up) may replace the prompt event
        if prompts != [0]:
            where = "missing" if not prompts else f"at messages {[p + 1 for p in prompts]}"
            return Finding(False, f"{_label(obs)}: prompt logprobs asked, prompt event {where} (expected first, once)")
        tokens = messages[0].prompt.tokens
        if not tokens:
            return Finding(False, f"{_label(obs)}: the prompt event carries no tokens")
        first = tokens[0]
        if first.HasField("logprob") or first.HasField("rank") or len(first.candidates):
            return Finding(False, f"{_label(obs)}: the first prompt token has a logprob, rank or candidates")
        if any(not t.HasField("logprob") for t in tokens[1:]):
            return Finding(False, f"{_label(obs)}: a prompt token after the first has no logprob")
        final = messages[-1]
        if final.HasField("usage") and final.usage.prompt_tokens != len(tokens):
            return Finding(
                False,
                f"{_label(obs)}: {len(tokens)} prompt tokens in the event, usage says {final.usage.prompt_tokens}",
            )
    if not asked:
        return Finding(True, f"{len(streams)} streams without prompt logprobs asked carry no prompt event")
    return Finding(True, f"{asked} streams with prompt logprobs: one prompt event, first; none on the others")


def judge_nothing_after_terminal(streams: Sequence[Observation]) -> Finding:
    """After the terminal event nothing more arrives, and the call ends with status ``OK``."""
    ended = _ended(streams)
    if not ended:
        return _NOTHING_ENDED
    for obs, end in ended:
        after = obs.messages[end + 1 :]
        if after:
            kinds = [event_of(m) for m in after]
            return Finding(
                False,
                f"{_label(obs)}: {len(after)} message(s) {kinds} after the terminal {event_of(obs.messages[end])}",
            )
        if obs.status is not Status.OK:
            return Finding(False, f"{_label(obs)}: the terminal event was followed by {obs.describe_end()}, not OK")
    return Finding(True, f"{len(ended)} streams end with their terminal event, then status OK")


def judge_request_id(streams: Sequence[Observation]) -> Finding:
    """Every response carries the request's ``request_id``."""
    count = 0
    for obs in _accepted(streams):
        for position, message in enumerate(obs.messages):
            count += 1
            if message.request_id != obs.request_id:
                return Finding(
                    False,
                    f"{_label(obs)}: message #{position + 1} carries request_id {message.request_id!r}",
                )
    return Finding(True, f"{count} responses over {len(streams)} streams carry their request's id")


def judge_finish_reason(streams: Sequence[Observation]) -> Finding:
    """Every ``finished`` has a reason (never ``UNSPECIFIED`` for a normal end); ``STOP`` names its ``stop_match``."""
    count = 0
    for obs in _accepted(streams):
        for message in upto_terminal(obs):
            if event_of(message) != "finished":
                continue
            count += 1
            finished = message.finished
            reason = finished.reason
            if reason == generation_pb2.FINISH_REASON_UNSPECIFIED:
                return Finding(False, f"{_label(obs)}: finished with reason UNSPECIFIED ({finished.message!r})")
            if reason == generation_pb2.FINISH_REASON_STOP and finished.stop_match.WhichOneof("match") is None:
                return Finding(False, f"{_label(obs)}: finished STOP without stop_match")
    if not count:
        return Finding(None, "no finished event was observed (see stream.one_finished_per_output)")
    return Finding(True, f"{count} finished events, each with a reason (STOP with its stop_match)")
