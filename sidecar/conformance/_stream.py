"""The Generate stream: the rules of wire §7.4 judged over a handful of sample requests (``rules.py``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from grpclib.const import Status

from openengine.v1 import generation_pb2, model_pb2

from . import rules
from ._context import Context
from ._model import FailCheck, Outcome, SkipCheck
from ._registry import check
from ._wire import Observation
from .rules import Finding, assemble, event_of, terminal_index

#: The window check's prompt leaves this many tokens of room; the request asks for more than that.
_WINDOW_ROOM = 4
#: Above this window the check's one long prompt stops being cheap; such engines skip it.
_WINDOW_CHECK_MAX = 65536


async def samples(ctx: Context) -> tuple[list[Observation], list[str]]:
    """The streams every stream rule is judged on (run once per run, shared by the checks).

    The baseline (greedy, ``ignore_eos``, 8 tokens); n = 2 with sampling (where ``max_num_sequences`` allows it);
    a plain request that may stop at EOS; prompt logprobs and output logprobs when advertised.
    """
    streams = [await ctx.good_baseline()]
    notes: list[str] = []
    gen = ctx.model_info.get().generation if ctx.model_info.ok else model_pb2.GenerationCapabilities()
    max_n = gen.max_num_sequences if gen.HasField("max_num_sequences") else None
    wanted: list[tuple[str, generation_pb2.GenerateRequest]] = []
    if max_n is None or max_n >= 2:
        wanted.append(("n=2", ctx.request("n2", max_tokens=6, temperature=1.0, n=2, seed=7)))
    else:
        notes.append("no n > 1 stream (max_num_sequences 1)")
    wanted.append(("eos", ctx.request("eos", max_tokens=8, ignore_eos=None)))
    if gen.prompt_logprobs.supported:
        request = ctx.request("prompt-logprobs", max_tokens=4)
        request.response.return_prompt_logprobs = True
        request.response.prompt_candidates.top_n = 1
        wanted.append(("prompt logprobs", request))
    if gen.output_logprobs.supported:
        request = ctx.request("output-logprobs", max_tokens=4)
        request.response.return_output_logprobs = True
        request.response.output_candidates.top_n = max(1, min(2, gen.output_logprobs.max_top_n))
        wanted.append(("output logprobs", request))
    for name, request in wanted:
        obs = await ctx.sample(name, request)
        if obs.accepted:
            streams.append(obs)
        else:
            notes.append(f"{name} refused: {obs.describe_end()}")
    return streams, notes


def _judged(finding: Finding, notes: Sequence[str]) -> Outcome:
    evidence = finding.evidence + (f" [{'; '.join(notes)}]" if notes else "")
    if finding.ok is None:
        return Outcome.skipped(evidence)
    return Outcome.passed(evidence) if finding.ok else Outcome.failed(evidence)


def _rule_check(judge: Callable[[Sequence[Observation]], Finding]) -> Callable[[Context], Awaitable[Outcome]]:
    async def run(ctx: Context) -> Outcome:
        streams, notes = await samples(ctx)
        return _judged(judge(streams), notes)

    return run


def _describe(obs: Observation) -> str:
    end = terminal_index(obs)
    if end is None:
        return f"{len(obs.messages)} messages, no terminal event, {obs.describe_end()}"
    final = obs.messages[end]
    kind = event_of(final)
    if kind == "finished":
        reason = generation_pb2.FinishReason.Name(final.finished.reason).removeprefix("FINISH_REASON_")
        kind = f"finished {reason}"
    usage = f", completion_tokens {final.usage.completion_tokens}" if final.HasField("usage") else ""
    return f"{len(obs.messages)} messages, {kind}{usage}"


def _completion(obs: Observation) -> int | None:
    end = terminal_index(obs)
    if end is None or not obs.messages[end].HasField("usage"):
        return None
    return int(obs.messages[end].usage.completion_tokens)


def _final_finished(obs: Observation) -> generation_pb2.GenerationFinished | None:
    end = terminal_index(obs)
    if end is None or event_of(obs.messages[end]) != "finished":
        return None
    return obs.messages[end].finished


@check(
    "stream.plain_request",
    "a plain greedy request (ignore_eos, max_tokens 8) is accepted and completes: tokens, finished, status OK",
    "wire §7.3, §7.4; trtllm §7",
)
async def plain_request(ctx: Context) -> Outcome:
    obs = await ctx.baseline()
    if not obs.accepted:
        raise FailCheck(f"refused: {obs.describe_end()}")
    end = terminal_index(obs)
    if end is None:
        raise FailCheck(f"no terminal event: {_describe(obs)}")
    if event_of(obs.messages[end]) == "error":
        error = obs.messages[end].error
        raise FailCheck(f"EngineError {error.code} {error.message!r}")
    tokens, text = assemble(obs)
    return Outcome.passed(f"{_describe(obs)}, {len(tokens)} tokens {text[:40]!r}, {obs.seconds:.2f} s")


for _id, _rule, _cites, _judge in (
    (
        "stream.output_index_set",
        "output_index is set on every TokenOutput and GenerationFinished, including index 0, within 0 … n−1",
        "wire §7.4; trtllm §7 (2)",
        rules.judge_output_index,
    ),
    (
        "stream.non_cumulative",
        "TokenOutput carries only new tokens and new text, never the output so far",
        "wire §7.4; trtllm §7 (2)",
        rules.judge_non_cumulative,
    ),
    (
        "stream.one_finished_per_output",
        "exactly one GenerationFinished per requested output, nothing for that output after it",
        "wire §7.4 'Terminal events'; trtllm §7 (3)",
        rules.judge_one_finished,
    ),
    (
        "stream.usage_on_last",
        "usage is set only on the final response, cumulative across outputs, totals consistent",
        "wire §7.4; trtllm §7 (3), 'Usage'",
        rules.judge_usage_last,
    ),
    (
        "stream.prompt_logprobs",
        "PromptOutput appears at most once, first, and only when prompt logprobs were asked",
        "wire §7.4; trtllm §7 (1)",
        rules.judge_prompt_logprobs,
    ),
    (
        "stream.nothing_after_terminal",
        "nothing follows the terminal event; the call then ends with status OK",
        "wire §7.3, §7.4 'Terminal events'; trtllm §7 'Termination'",
        rules.judge_nothing_after_terminal,
    ),
    (
        "stream.request_id",
        "every response carries the request's request_id",
        "wire §4 GenerateResponse; trtllm §7",
        rules.judge_request_id,
    ),
    (
        "stream.finish_reason",
        "every finish has a reason (UNSPECIFIED is no normal end); STOP names its stop_match",
        "wire §7.4; trtllm §7 'Finish reasons'",
        rules.judge_finish_reason,
    ),
):
    check(_id, _rule, _cites)(_rule_check(_judge))


@check(
    "stream.max_tokens",
    "max_tokens is honoured: with ignore_eos the output is exactly max_tokens long and finishes LENGTH",
    "wire §4 StoppingOptions; trtllm §6 sampling and stopping, §7 'Finish reasons'",
)
async def max_tokens(ctx: Context) -> Outcome:
    base = await ctx.good_baseline()
    wanted = base.request.stopping.max_tokens if base.request is not None else 8
    finished = _final_finished(base)
    tokens = len(assemble(base)[0])
    completion = _completion(base)
    if finished is None:
        raise FailCheck(f"the baseline did not finish: {_describe(base)}")
    if finished.reason != generation_pb2.FINISH_REASON_LENGTH:
        raise FailCheck(f"max_tokens {wanted} with ignore_eos finished {finished.reason}, not LENGTH")
    if completion is not None and completion != wanted:
        raise FailCheck(f"max_tokens {wanted}: usage.completion_tokens {completion}")
    if tokens != wanted:
        raise FailCheck(f"max_tokens {wanted}: {tokens} tokens streamed")
    streams, _ = await samples(ctx)
    for obs in streams:
        if obs.request is None:
            continue
        limit = obs.request.stopping.max_tokens * obs.n
        used = _completion(obs)
        if used is not None and used > limit:
            raise FailCheck(f"{obs.request_id!r}: completion_tokens {used} > max_tokens × n = {limit}")
    return Outcome.passed(f"max_tokens {wanted}: {tokens} tokens, LENGTH; {len(streams)} streams within their limit")


def _stop_choice(tokens: Sequence[int]) -> tuple[int, int] | None:
    """A token of the baseline to stop at: (position, id), its first occurrence, not the first token."""
    for position in range(2, len(tokens) - 1):
        if tokens[position] not in tokens[:position]:
            return position, tokens[position]
    return None


_IGNORE_EOS_VARIANT = "ignore_eos drops every stop word (TensorRT-LLM's SamplingParams; trtllm §6)"


def _stop_request(ctx: Context, tag: str, position: int, *, ignore_eos: bool) -> generation_pb2.GenerateRequest:
    """The baseline's request with a stop condition still to add, shaped so the stop rule is observable.

    The baseline sets ``ignore_eos``, which TensorRT-LLM maps to a SamplingParams that drops every stop word too
    (trtllm §6), so a stop sent with it would prove nothing there. Without it the greedy output may end at EOS before
    the stop position; ``min_tokens = position`` holds EOS back up to there (the same redraws ``ignore_eos`` made in
    the baseline) and lets the stop fire where the baseline generated it.
    """
    if ignore_eos:
        return ctx.request(tag)
    request = ctx.request(tag, ignore_eos=None)
    request.stopping.min_tokens = position
    return request


async def _observe_stop(
    ctx: Context, tag: str, condition: generation_pb2.StopCondition, at: int, what: str, *, ignore_eos: bool = False
) -> tuple[Observation, generation_pb2.GenerationFinished]:
    """The baseline's request with ``condition`` (see :func:`_stop_request`): the stream and its finish."""
    request = _stop_request(ctx, tag, at, ignore_eos=ignore_eos)
    request.stopping.conditions.append(condition)
    obs = await ctx.observe(request)
    finished = _final_finished(obs)
    if finished is None:
        raise FailCheck(f"{what}: {_describe(obs)}")
    return obs, finished


def _require_stop_match(
    finished: generation_pb2.GenerationFinished, condition: generation_pb2.StopCondition, what: str, not_stop: str
) -> None:
    """The finish is STOP (else FailCheck with ``not_stop``), and its ``stop_match`` names ``condition``."""
    if finished.reason != generation_pb2.FINISH_REASON_STOP:
        raise FailCheck(not_stop)
    field, match = condition.WhichOneof("condition"), finished.stop_match
    if match.WhichOneof("match") != field or getattr(match, field) != getattr(condition, field):
        raise FailCheck(f"{what}: STOP with stop_match {match}")


async def _with_ignore_eos(
    ctx: Context, tag: str, condition: generation_pb2.StopCondition, stop_at: int, evidence: str
) -> Outcome:
    """The stop with ``ignore_eos`` as well: PASS if it stops there too; running on to LENGTH is the known variant."""
    what = "the stop with ignore_eos"
    obs, finished = await _observe_stop(ctx, tag, condition, stop_at, what, ignore_eos=True)
    if finished.reason == generation_pb2.FINISH_REASON_STOP:
        return Outcome.passed(f"{evidence}; honoured with ignore_eos too")
    got = len(assemble(obs)[0])
    if finished.reason == generation_pb2.FINISH_REASON_LENGTH and got > stop_at:
        return Outcome.variant(f"{evidence}; with ignore_eos it ran on ({got} tokens, LENGTH): {_IGNORE_EOS_VARIANT}")
    raise FailCheck(f"{what}: {_describe(obs)}")


@check(
    "stream.stop_token",
    "a stop_token_id ends the output where it is generated: STOP with stop_match.stop_token_id",
    "wire §7.4 (STOP ⇒ stop_match); trtllm §6 stopping, §7 'Stop handling'",
)
async def stop_token(ctx: Context) -> Outcome:
    base = await ctx.good_baseline()
    tokens, _ = assemble(base)
    choice = _stop_choice(tokens)
    if choice is None:
        raise SkipCheck(f"the baseline's tokens {tokens} offer no token to stop at")
    position, token_id = choice
    condition = generation_pb2.StopCondition(stop_token_id=token_id)
    what = f"stop_token_id {token_id}"
    obs, finished = await _observe_stop(ctx, "stop-token", condition, position, what)
    got, _ = assemble(obs)
    if got[:position] != tokens[: min(position, len(got))]:
        raise SkipCheck(
            f"greedy output with min_tokens {position} differs from the baseline ({got} vs {tokens}): "
            "not reproducible here"
        )
    _require_stop_match(
        finished, condition, what, f"{what} (baseline position {position}): {_describe(obs)}, tokens {got}"
    )
    completion = _completion(obs)
    if len(got) > position + 1 or (completion is not None and completion > position + 1):
        raise FailCheck(f"{what} at position {position}: output went on ({got})")
    evidence = f"{what} (position {position}): STOP after {len(got)} tokens"
    return await _with_ignore_eos(ctx, "stop-token-ignore-eos", condition, position, evidence)


def _stop_text_choice(text: str) -> tuple[str, str, int] | None:
    """(stop string, the baseline's text before it, its word number): a later word of the output with the space
    before it, first occurring there.

    The space belongs to the stop string because TensorRT-LLM matches a stop string as its token ids at the end of
    the output (trtllm §7 'Stop handling'), and a word's token carries its leading space: ``"old"`` never matches the
    generated ``" old"``, while ``" old"`` does on every engine, whether it matches ids or text.
    """
    position = 0
    for number, word in enumerate(text.split()):
        position = text.index(word, position)
        candidate = word[: next((i for i, ch in enumerate(word) if not ch.isalnum()), len(word))]
        stop = " " + candidate
        if number >= 2 and len(candidate) >= 2 and text[position - 1 : position] == " " and stop not in text[:position]:
            return stop, text[: position - 1], number
        position += len(word)
    return None


@check(
    "stream.stop_text",
    "a stop string ends the output: STOP with stop_match.stop_text, the string withheld unless include_stop_in_output",
    "wire §7.4, §7.5; trtllm §6 stopping, §7 'Stop handling'",
)
async def stop_text(ctx: Context) -> Outcome:
    base = await ctx.good_baseline()
    choice = _stop_text_choice(assemble(base)[1])
    if choice is None:
        raise SkipCheck(f"the baseline's text {assemble(base)[1]!r} offers no stop string")
    stop, before, word = choice
    # Hold EOS back up to the word's first possible token (the output's first token is a word at most).
    at = max(1, word)
    condition = generation_pb2.StopCondition(stop_text=stop)
    what = f"stop_text {stop!r}"
    obs, finished = await _observe_stop(ctx, "stop-text", condition, at, what)
    _, text = assemble(obs)
    if not (text.startswith(before.rstrip()) or before.startswith(text)):
        raise SkipCheck(
            f"greedy output with min_tokens {at} differs from the baseline ({text!r} vs {before!r}…): "
            "not reproducible here"
        )
    _require_stop_match(finished, condition, what, f"{what}: {_describe(obs)}, text {text!r}")
    if stop in text:
        raise FailCheck(f"{what} appears in the output {text!r} without include_stop_in_output")
    evidence = f"{what}: STOP, output {text!r} withholds it"
    if ctx.advertised("supports_stop_in_output"):
        request = _stop_request(ctx, "stop-text-kept", at, ignore_eos=False)
        request.stopping.conditions.append(condition)
        request.stopping.include_stop_in_output = True
        kept = await ctx.observe(request)
        kept_text = assemble(kept)[1]
        if stop not in kept_text:
            raise FailCheck(f"{what} with include_stop_in_output: output {kept_text!r} lacks it")
        evidence += "; kept with include_stop_in_output"
    return await _with_ignore_eos(ctx, "stop-text-ignore-eos", condition, at, evidence)


@check(
    "stream.output_logprobs",
    "asked output logprobs come with every token: a logprob and at most top_n candidates ranked in order",
    "wire §4 TokenInfo, §7.5; trtllm §7 (2)",
)
async def output_logprobs(ctx: Context) -> Outcome:
    streams, _ = await samples(ctx)
    asked = [s for s in streams if s.request is not None and s.request.response.return_output_logprobs]
    if not asked:
        raise SkipCheck("not advertised: output logprobs")
    count = 0
    for obs in asked:
        assert obs.request is not None
        top_n = obs.request.response.output_candidates.top_n
        for message in rules.upto_terminal(obs):
            if event_of(message) != "token":
                continue
            for info in message.token.tokens:
                count += 1
                if not info.HasField("logprob"):
                    raise FailCheck(f"{obs.request_id!r}: token {info.token_id} without logprob")
                if len(info.candidates) > top_n:
                    raise FailCheck(f"{obs.request_id!r}: {len(info.candidates)} candidates for top_n {top_n}")
                ranks = [c.rank for c in info.candidates if c.HasField("rank")]
                if ranks != sorted(ranks):
                    raise FailCheck(f"{obs.request_id!r}: candidates not in rank order {ranks}")
    if not count:
        raise FailCheck("output logprobs asked, no token came back")
    return Outcome.passed(f"{count} tokens, each with a logprob and ≤ top_n ranked candidates")


@check(
    "stream.max_tokens_over_window",
    "max_tokens beyond the context window is clamped to the window or refused INVALID_ARGUMENT (both known)",
    "trtllm §5 max_output_tokens, §6 'Omitted max_tokens', §9 (prompt too long)",
)
async def max_tokens_over_window(ctx: Context) -> Outcome:
    window = ctx.window
    if window is None:
        raise SkipCheck("not advertised: max_context_length")
    if window > _WINDOW_CHECK_MAX:
        raise SkipCheck(f"max_context_length {window} is too large for one bounded request")
    base = await ctx.good_baseline()
    ids = assemble(base)[0]
    if not ids:
        raise SkipCheck("the baseline produced no token ids to build a long prompt from")
    length = window - _WINDOW_ROOM
    prompt = (ids * (length // len(ids) + 1))[:length]
    wanted = 4 * _WINDOW_ROOM
    obs = await ctx.observe(ctx.request("window", max_tokens=wanted, token_ids=prompt))
    what = f"prompt {length} + max_tokens {wanted} > window {window}"
    if not obs.messages:
        if obs.status is Status.INVALID_ARGUMENT:
            return Outcome.variant(f"{what}: refused INVALID_ARGUMENT, zero messages ({obs.details})")
        raise FailCheck(f"{what}: {obs.describe_end()}; expected INVALID_ARGUMENT or a clamped output")
    completion = _completion(obs)
    got = len(assemble(obs)[0])
    if terminal_index(obs) is None:
        raise FailCheck(f"{what}: accepted, {_describe(obs)}")
    if (completion if completion is not None else got) > _WINDOW_ROOM:
        raise FailCheck(f"{what}: generated {completion} tokens past the window")
    return Outcome.variant(f"{what}: clamped, {_describe(obs)}")
