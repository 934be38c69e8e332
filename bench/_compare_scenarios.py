"""The fault scenarios of ``bench.compare``, each run the same way against either sidecar, and the rule that judges
each row (ours against Dynamo's).

A scenario runs on a fresh stack (:mod:`bench._compare_stack`), does what its ``setup`` says, and returns one row of
figures per case (most scenarios have one; the bad requests have one per kind) plus what the stack was left with
(:func:`bench._compare_stack.end_of_scenario`). Every figure a rule reads is in the row; ``saw`` and ``timings`` are
the cells the table shows. A scenario measures what the sidecar does, whatever it does: a sidecar that never
serves again, or a request that never ends, is a figure (``None``, ``no answer``), never an exception. An
exception is a harness failure and is reported as such.

Rules (:data:`SCENARIOS` ``rule``) are stated in the generated document beside the table. Before any of them, one
rule for every row: a side whose sidecar exited without being asked to, or whose engine still held a request when
the scenario ended, loses the row.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, Literal

import httpx
import trio

from bench._compare_client import (
    PROBE_INTERVAL_S,
    Api,
    HealthLog,
    Seen,
    body_for,
    serves,
    statuses,
    stream,
    tally,
    unary,
    unroutable_window,
)
from bench._compare_stack import (
    Env,
    end_of_scenario,
    engine,
    engine_idle_after,
    engine_running,
    listened,
    worker,
)
from sidecar.testing.mock.lm import TinyLM
from tests.helpers.processes import free_port
from tests.helpers.stack import MODEL, MODEL_DIR, mock_stats
from tests.helpers.waits import wait_until

Figures = dict[str, Any]
Verdict = Literal["equal", "better", "worse"]
Judged = tuple[Verdict, str]
Result = tuple[list[Figures], dict[str, object]]


@dataclass(frozen=True)
class Params:
    """What a run varies: the full run uses the issue's figures, ``--quick`` short ones."""

    quick: bool = False
    #: How long the engine is SIGSTOPped, and when (into the stall) the extra request is sent.
    stall_s: float = 70.0
    stall_request_at_s: float = 15.0
    #: How long the engine stays away before each restart of the SIGKILL scenario.
    outages: tuple[float, ...] = (1.0, 3.0, 7.0)
    stop_requests: int = 25
    #: After each bad request the model is probed for this long (and until it serves again).
    route_window_s: float = 2.0
    disconnects: int = 5
    #: The client's bound on the hung engine's request.
    hang_bound_s: float = 90.0
    #: The stall of the second SIGSTOP scenario: shorter than the sidecars' default inactivity timeout (60 s).
    short_stall_s: float = 30.0

    @classmethod
    def for_run(cls, *, quick: bool, stall_s: float | None = None) -> Params:
        base = cls(True, 5.0, 2.0, (1.0,), 10, 0.5, 3, 30.0) if quick else cls()
        if stall_s is not None:
            base = dataclasses.replace(
                base, stall_s=stall_s, stall_request_at_s=min(base.stall_request_at_s, stall_s * 0.4)
            )
        return base


@dataclass(frozen=True)
class Scenario:
    key: str
    title: Callable[[Params], str]
    setup: Callable[[Params], str]
    rule: str
    run: Callable[[Env, Params], Awaitable[Result]]
    judge: Callable[[Figures, Figures], Judged]
    quick: bool = False
    migration_limit: int = 0


# ------------------------------------------------------------------------------------------------------- helpers


def _row(key: str, title: str, saw: str, timings: str, **figures: Any) -> Figures:
    return {"key": key, "title": title, "saw": saw, "timings": timings, **figures}


def _more(ours: float, theirs: float, what: str) -> Judged | None:
    """More is better; None on a tie."""
    if ours > theirs:
        return "better", f"more {what} ({_n(ours)} vs {_n(theirs)})"
    if ours < theirs:
        return "worse", f"fewer {what} ({_n(ours)} vs {_n(theirs)})"
    return None


def _less(ours: float | None, theirs: float | None, what: str, tolerance: float, unit: str = "s") -> Judged | None:
    """Less is better beyond ``tolerance``; None (never) counts as infinitely much; None on a tie."""
    a = math.inf if ours is None else ours
    b = math.inf if theirs is None else theirs
    if a == b or abs(a - b) <= tolerance:
        return None
    shown = f"{_v(ours, unit)} vs {_v(theirs, unit)}"
    return ("better", f"{what} shorter ({shown})") if a < b else ("worse", f"{what} longer ({shown})")


def _n(value: float) -> str:
    return f"{value:g}"


def _v(value: float | None, unit: str) -> str:
    if value is None:
        return "never"
    return f"{value * 1000:.0f} ms" if unit == "ms" else f"{value:.2f} s"


def _first(*judged: Judged | None, tie: str = "same figures") -> Judged:
    for one in judged:
        if one is not None:
            return one
    return "equal", tie


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


async def _start_streams(
    nursery: trio.Nursery, env: Env, outcomes: Sequence[Seen], max_tokens: int, bound_s: float = 90.0
) -> None:
    for i, outcome in enumerate(outcomes):
        body = body_for("completions", f"Story {i}.", max_tokens=max_tokens, ignore_eos=True)
        nursery.start_soon(partial(stream, env.http, env.url, body, bound_s=bound_s, into=outcome))


async def _each_has(outcomes: Sequence[Seen], pieces: int, bound_s: float = 60.0) -> None:
    """Until every stream received ``pieces`` pieces of text (they are all under way)."""
    await wait_until(
        lambda: min(len(o.pieces) for o in outcomes) >= pieces,
        timeout=bound_s,
        interval=0.005,
        what=f"every stream has {pieces} pieces",
    )


#: The model serves *steadily* from a probe answered after which every probe for this long is answered too: a
#: worker that answers once and then withdraws to rediscover its engine has not come back yet.
STEADY_S: Final = 2.0


async def _serving_again(env: Env, since: float, bound_s: float) -> tuple[float | None, float | None]:
    """Probe every ``PROBE_INTERVAL_S`` from ``since``: when the first probe was answered, and since when every probe
    was answered for ``STEADY_S`` (``time.monotonic()``; None for what did not happen within ``bound_s``)."""
    first: float | None = None
    streak: float | None = None
    while time.monotonic() - since < bound_s:
        asked = time.monotonic()
        if await serves(env.http, env.url):
            first = asked if first is None else first
            streak = asked if streak is None else streak
            if time.monotonic() - streak >= STEADY_S:
                return first, streak
        else:
            streak = None
        await trio.sleep(PROBE_INTERVAL_S)
    return first, None


def _back(first: float | None, steady: float | None, listen: float | None) -> dict[str, float | None]:
    """The way back as figures: seconds from ``listen`` to the first answer and to steady serving."""
    if listen is None:
        return {"first": None, "steady": None}
    return {k: None if v is None else max(0.0, v - listen) for k, v in (("first", first), ("steady", steady))}


def _shown_back(back: dict[str, float | None]) -> str:
    first, steady = back["first"], back["steady"]
    if first is not None and (steady is None or steady - first > PROBE_INTERVAL_S):
        return f"{_s(steady)} (a first answer at {_s(first)})"
    return _s(steady)


async def _restart_and_time(
    env: Env, args: Sequence[str], port: int, name: str, stack: AsyncExitStack
) -> dict[str, float | None]:
    """Start the engine ``name`` on ``port``; the way back (:func:`_back`): how long after it listened the model
    first served through the frontend, and served steadily (probed every 50 ms from the moment it listens).

    Nothing is sent while the engine is away: a request that fails then can make the frontend hold the instance
    back for seconds (it does after a 500), which would time the frontend's caution, not the sidecar's return."""
    times: dict[str, float | None] = {}
    heard = trio.Event()

    async def listen() -> None:
        times["listen"] = await listened(env, name)
        heard.set()

    async def probe() -> None:
        await heard.wait()
        times["first"], times["steady"] = await _serving_again(env, time.monotonic(), 60.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(listen)
        nursery.start_soon(probe)
        await stack.enter_async_context(engine(env, *args, name=name, port=port))
    return _back(times.get("first"), times.get("steady"), times.get("listen"))


# ------------------------------------------------------------------------------------------- engine SIGTERM


async def engine_sigterm(env: Env, p: Params) -> Result:
    port = free_port()
    outcomes = [Seen() for _ in range(8)]
    async with (
        engine(env, "--decode-ms-per-token", "20", "--stop-grace-secs", "5", port=port) as eng,
        worker(env, eng.address) as sidecar,
    ):
        await env.routable()
        health = HealthLog(sidecar.system_url)
        async with trio.open_nursery() as background:
            await background.start(health.run)
            async with trio.open_nursery() as nursery:
                await _start_streams(nursery, env, outcomes, 60)
                await _each_has(outcomes, 10)
                sigterm = time.monotonic()
                eng.process.signal(signal.SIGTERM)
            code = await eng.process.wait(30)
            gone = time.monotonic()
            await trio.sleep(1.0)  # not a synchronisation: the window in which /health is sampled with no engine
            background.cancel_scope.cancel()
        end = await end_of_scenario(env)
    last = max(o.ended or sigterm for o in outcomes) - sigterm
    while_gone = health.between(gone)
    complete = sum(o.complete(tokens=60) for o in outcomes)
    saw = f"{tally(outcomes, tokens=60)}; `/health` while the engine was gone: {statuses(while_gone)}"
    timings = f"last stream ended {last:.2f} s after the SIGTERM; engine exit {code} {gone - sigterm:.2f} s after it"
    return [_row("engine_sigterm", "", saw, timings, complete=complete, health_gone=dict(while_gone))], end


def judge_engine_sigterm(ours: Figures, theirs: Figures) -> Judged:
    def truthful(f: Figures) -> int:
        """1 when ``/health`` was sampled with the engine gone and never said 200 then."""
        return int(bool(f["health_gone"]) and "200" not in {str(k) for k in f["health_gone"]})

    return _first(
        _more(ours["complete"], theirs["complete"], "complete streams"),
        _more(truthful(ours), truthful(theirs), "truthful `/health` (never 200 while the engine was gone)"),
    )


# -------------------------------------------------------------------------------------------- engine SIGKILL


async def engine_sigkill(env: Env, p: Params) -> Result:
    port = free_port()
    outcomes = [Seen() for _ in range(8)]
    args = ("--decode-ms-per-token", "20")
    backs: list[dict[str, float | None]] = []
    async with AsyncExitStack() as stack:
        eng = await stack.enter_async_context(engine(env, *args, port=port))
        await stack.enter_async_context(worker(env, eng.address))
        await env.routable()
        async with trio.open_nursery() as nursery:
            await _start_streams(nursery, env, outcomes, 200)
            await _each_has(outcomes, 5)
            eng.process.proc.kill()
            killed = time.monotonic()
        for i, outage in enumerate(p.outages):
            if i:
                eng.process.proc.kill()
                killed = time.monotonic()
            await eng.process.wait(10)
            await trio.sleep(max(0.0, killed + outage - time.monotonic()))  # the outage itself, not a sync
            back = await _restart_and_time(env, args, port, f"engine-{i + 2}", stack)
            backs.append(back)
            eng = env.engines[-1]
        served = await unary(env.http, env.url, body_for("completions", "The river", max_tokens=8, ignore_eos=True))
        end = await end_of_scenario(env)
    kinds = Counter(o.kind() for o in outcomes)
    away = ", ".join(f"{o:g}" for o in p.outages)
    saw = f"8 streams: {tally(outcomes, tokens=200)}; after the restarts: {served.kind()}"
    timings = f"serving again {' / '.join(_shown_back(b) for b in backs)} after the engine listened (away {away} s)"
    return [_row("engine_sigkill", "", saw, timings, kinds=dict(kinds), backs=backs,
                 truncated=sum(o.truncated for o in outcomes), served=served.complete())], end  # fmt: skip


def judge_engine_sigkill(ours: Figures, theirs: Figures) -> Judged:
    def worst(f: Figures) -> float | None:
        steady = [b["steady"] for b in f["backs"]]
        return None if not steady or None in steady else max(steady)

    def retryable(f: Figures) -> int:
        return int(f["kinds"].get("SSE 503", 0))

    return _first(
        _less(ours["truncated"], theirs["truncated"], "truncated answers", 0, "n"),
        _more(int(ours["served"]), int(theirs["served"]), "answers after the restarts"),
        _less(worst(ours), worst(theirs), "the slowest way back to steady serving", PROBE_INTERVAL_S),
        _more(retryable(ours), retryable(theirs), "streams ended with a retryable 503"),
    )


# -------------------------------------------------------------------------------------------- engine SIGSTOP


async def engine_sigstop(env: Env, p: Params) -> Result:
    return await _sigstop(env, "engine_sigstop", p.stall_s, p.stall_request_at_s)


async def engine_sigstop_short(env: Env, p: Params) -> Result:
    return await _sigstop(
        env, "engine_sigstop_short", p.short_stall_s, min(p.stall_request_at_s, p.short_stall_s * 0.4)
    )


async def _sigstop(env: Env, key: str, stall_s: float, request_at_s: float) -> Result:
    outcomes = [Seen() for _ in range(4)]
    late = Seen()
    bound = stall_s + 60
    async with engine(env, "--decode-ms-per-token", "20") as eng, worker(env, eng.address) as sidecar:
        await env.routable()
        health = HealthLog(sidecar.system_url, interval=0.25)
        async with trio.open_nursery() as background:
            await background.start(health.run)
            async with trio.open_nursery() as nursery:
                await _start_streams(nursery, env, outcomes, 200, bound_s=bound)
                await _each_has(outcomes, 5)
                eng.process.signal(signal.SIGSTOP)
                stopped = time.monotonic()
                try:
                    await trio.sleep(request_at_s)  # the stall itself: the extra request comes this far in
                    body = body_for("completions", "A late one.", max_tokens=60, ignore_eos=True)
                    nursery.start_soon(partial(stream, env.http, env.url, body, bound_s=bound, into=late))
                    await trio.sleep(max(0.0, stopped + stall_s - time.monotonic()))
                finally:
                    eng.process.signal(signal.SIGCONT)
                resumed = time.monotonic()
            background.cancel_scope.cancel()
        end = await end_of_scenario(env)
    ends = sorted((o.ended or stopped) - stopped for o in outcomes)
    failed_at = sorted((o.ended or stopped) - stopped for o in outcomes if not o.complete(tokens=200))
    during = health.between(stopped, resumed)
    saw = (
        f"4 streams: {tally(outcomes, tokens=200)}; the request sent {request_at_s:g} s into the stall: "
        f"{late.kind()}; `/health` during the stall: {statuses(during)}"
    )
    timings = f"streams ended {ends[0]:.1f}–{ends[-1]:.1f} s after the SIGSTOP (SIGCONT at {resumed - stopped:.1f} s)"
    if failed_at:
        timings += f"; failures at {failed_at[0]:.1f}–{failed_at[-1]:.1f} s"
    complete = sum(o.complete(tokens=200) for o in outcomes) + int(late.complete(tokens=60))
    return [_row(key, "", saw, timings, complete=complete, health=dict(during))], end


def judge_engine_sigstop(ours: Figures, theirs: Figures) -> Judged:
    return _first(_more(ours["complete"], theirs["complete"], "complete answers (of 5)"))


# ------------------------------------------------------------------------------- engine restarted, other context


_LM: list[TinyLM] = []


def _prompt_of(tokens_between: tuple[int, int]) -> str:
    """A text prompt whose length in the test model's tokens lies in ``tokens_between``."""
    if not _LM:
        _LM.append(TinyLM.load(MODEL_DIR))
    lm = _LM[0]
    sentence = " The river bends past the mill, the bridge and the quiet town."
    text = "Once upon a time."
    while len(lm.encode(text)) < tokens_between[0]:
        text += sentence
    assert len(lm.encode(text)) < tokens_between[1], "the sentence is longer than the window it must fit"
    return text


async def _context_window(http: httpx.AsyncClient, url: str) -> int | None:
    try:
        models = (await http.get(f"{url}/v1/models", timeout=5)).json().get("data", [])
    except (httpx.HTTPError, ValueError):
        return None
    windows = [m.get("context_window") for m in models if m.get("id") == MODEL]
    return int(windows[0]) if windows and isinstance(windows[0], int) else None


async def context_change(env: Env, p: Params) -> Result:
    port = free_port()
    async with AsyncExitStack() as stack:
        eng = await stack.enter_async_context(engine(env, "--speedup", "0", "--max-context-length", "2048", port=port))
        await stack.enter_async_context(worker(env, eng.address))
        await env.routable()
        before = await _context_window(env.http, env.url)
        eng.process.signal(signal.SIGTERM)
        await eng.process.wait(30)
        back = await _restart_and_time(
            env, ("--speedup", "0", "--max-context-length", "1024"), port, "engine-1024", stack
        )
        card: int | None = None
        waited = time.monotonic()
        while time.monotonic() - waited < 10:  # the card may follow a moment after the first answer
            card = await _context_window(env.http, env.url)
            if card == 1024:
                break
            await trio.sleep(0.1)
        prompt = await unary(env.http, env.url, body_for("completions", _prompt_of((1100, 1900)), max_tokens=16))
        asked = 1500
        big = await unary(
            env.http, env.url, body_for("completions", "The river", max_tokens=asked, ignore_eos=True), bound_s=120
        )
        end = await end_of_scenario(env)

    def shown(seen: Seen, *, tokens: bool = False) -> str:
        if seen.status == 200 and tokens:
            return f"200 with {seen.completion_tokens} tokens"
        message = seen.message[:90].replace("|", "/")
        return f"{seen.kind()} “{message}”" if message else seen.kind()

    saw = (
        f"card {before} → {card}; a 1100–1900-token prompt: {shown(prompt)}; `max_tokens` {asked}: "
        f"{shown(big, tokens=True)}"
    )
    timings = f"serving again {_shown_back(back)} after the engine listened"
    score = int(card == 1024) + _limit_score(prompt, None) + _limit_score(big, asked)
    return [_row("context_change", "", saw, timings, card=card, score=score, back=back)], end


def _limit_score(seen: Seen, asked: int | None) -> int:
    """1 for an answer that tells the truth about the engine's limit: a 4xx naming it, or (``asked``) every token
    asked for; 0 for a 5xx, no answer, or fewer tokens than asked without a word."""
    if seen.status is not None and 400 <= seen.status < 500:
        return 1
    if seen.status == 200 and asked is not None and seen.completion_tokens == asked:
        return 1
    return 0


def judge_context_change(ours: Figures, theirs: Figures) -> Judged:
    return _first(_more(ours["score"], theirs["score"], "truthful answers (of 3: card, prompt, max_tokens)"))


# --------------------------------------------------------------------------------------------- bad requests


@dataclass(frozen=True)
class BadKind:
    key: str
    title: str
    api: Api
    fields: dict[str, Any]
    #: Words one of which a refusal must name (case-insensitive) to count as naming the field.
    names: tuple[str, ...]
    #: ``serve``: serving it as asked is right (a refusal is acceptable); ``refuse``: it cannot be served as asked.
    expect: Literal["serve", "refuse"]
    choices: int = 1


BAD_KINDS: Final = (
    BadKind("json_object", "`response_format: json_object`, engine without guided decoding", "chat",
            {"response_format": {"type": "json_object"}}, ("guided",), "refuse"),
    BadKind("n2", "`n: 2`", "completions", {"n": 2}, ("`n`", " n ", "num_sequences"), "serve", choices=2),
    BadKind("logprobs", "`logprobs: 50` (the API allows 5)", "completions", {"logprobs": 50}, ("logprobs",), "refuse"),
    BadKind("unknown", "an unknown field (`frobnicate: 3`)", "completions", {"frobnicate": 3}, ("frobnicate",),
            "refuse"),
    BadKind("guided_choice", "`guided_choice` (TensorRT-LLM has no choice mode)", "completions",
            {"guided_choice": ["yes", "no"]}, ("guided", "choice"), "refuse"),
    BadKind("prompt_logprobs", "`prompt_logprobs: 1`, engine without prompt logprobs", "completions",
            {"prompt_logprobs": 1}, ("prompt_logprobs",), "refuse"),
    BadKind("priority", "`nvext.agent_hints.priority: 7`, engine without priorities", "completions",
            {"nvext": {"agent_hints": {"priority": 7}}}, ("priority",), "refuse"),
    BadKind("min_tokens", "`min_tokens: 20` above `max_tokens: 4`", "completions", {"min_tokens": 20, "max_tokens": 4},
            ("min_tokens",), "refuse"),
    BadKind("seed", "`seed: -3`", "completions", {"seed": -3}, ("seed",), "refuse"),
)  # fmt: skip

#: How each outcome of a bad request ranks (higher is better).
_BAD_RANKS: Final = {"served": 3, "refused, naming it": 2, "refused": 1, "served, ignoring it": 1, "failed": 0}


def _bad_outcome(kind: BadKind, seen: Seen) -> str:
    if seen.status == 200:
        whole = seen.complete(kind.choices)
        return "served" if kind.expect == "serve" and whole else "served, ignoring it"
    if seen.status is not None and 400 <= seen.status < 500:
        message = f" {seen.message.lower()} "
        return "refused, naming it" if any(n.lower() in message for n in kind.names) else "refused"
    return "failed"


async def bad_requests(env: Env, p: Params) -> Result:
    flags = ("--speedup", "0", "--capability", "guided=false", "--capability", "prompt_logprobs=false")
    rows: list[Figures] = []
    async with engine(env, *flags) as eng, worker(env, eng.address):
        await env.routable()
        for kind in BAD_KINDS:
            body = body_for(kind.api, "The river", **{"max_tokens": 8, **kind.fields})
            seen = await unary(env.http, env.url, body, api=kind.api, bound_s=30)
            unserved = await unroutable_window(env.http, env.url, p.route_window_s, 30.0)
            outcome = _bad_outcome(kind, seen)
            message = seen.message[:80].replace("|", "/")
            detail = f"{seen.kind()}" + (f" “{message}”" if message and seen.status != 200 else "")
            if seen.status == 200:
                detail += f", {len(seen.choices)} choice(s)"
            serving = "model served throughout" if unserved == 0 else f"model not served for {unserved:.2f} s"
            rows.append(
                _row(f"bad_{kind.key}", kind.title, f"{outcome}: {detail}", serving, outcome=outcome, unserved=unserved)
            )
        end = await end_of_scenario(env)
    return rows, end


def judge_bad_request(ours: Figures, theirs: Figures) -> Judged:
    def stays(f: Figures) -> int:
        return int(f["unserved"] <= 0.1)

    return _first(
        _more(stays(ours), stays(theirs), "rows where the model kept serving"),
        _more(_BAD_RANKS[ours["outcome"]], _BAD_RANKS[theirs["outcome"]], "useful answer (rank)"),
    )


# ----------------------------------------------------------------------------------- stop string inside a token

_PROMPTS: Final = ("The river", "Once upon a time", "Tell me about the town", "A bridge", "The mill", "The gardener")


async def stop_in_token(env: Env, p: Params) -> Result:
    """TensorRT-LLM matches stop strings as token sequences: " th" never matches inside the token " the", so the
    engine goes on, while the frontend matches it in the text and ends the answer there."""
    bodies = [
        body_for("completions", f"{_PROMPTS[i % 6]} {i}", max_tokens=40, temperature=0, stop=[" th"])
        for i in range(p.stop_requests)
    ]
    answers: list[Seen] = [Seen() for _ in bodies]
    async with engine(env, "--decode-ms-per-token", "10") as eng, worker(env, eng.address):
        await env.routable()
        limit = trio.Semaphore(4)
        async with trio.open_nursery() as nursery:
            for i, body in enumerate(bodies):

                async def one(i: int = i, body: dict[str, Any] = body) -> None:
                    async with limit:
                        await stream(env.http, env.url, body, into=answers[i])

                nursery.start_soon(one)
        end = await end_of_scenario(env)
    complete = sum(a.complete() and a.finish_reasons[-1] == "stop" and " th" not in a.text for a in answers)
    cached = sum(a.cached_tokens_present for a in answers)
    n = len(answers)
    saw = f"{complete}/{n} complete (stopped before “ th”); `cached_tokens` in {cached}/{n} usages"
    durations = sorted(a.seconds or 0.0 for a in answers)
    timings = f"median answer {statistics.median(durations):.2f} s"
    return [_row("stop_in_token", "", saw, timings, complete=complete, cached=cached)], end


def judge_stop_in_token(ours: Figures, theirs: Figures) -> Judged:
    return _first(
        _more(ours["complete"], theirs["complete"], "complete answers"),
        _more(ours["cached"], theirs["cached"], "usages with `cached_tokens`"),
    )


# ------------------------------------------------------------------------------------------- sidecar SIGTERM


async def sidecar_sigterm(env: Env, p: Params) -> Result:
    outcomes = [Seen() for _ in range(8)]
    async with engine(env, "--decode-ms-per-token", "20") as eng, worker(env, eng.address) as sidecar:
        await env.routable()
        async with trio.open_nursery() as nursery:
            await _start_streams(nursery, env, outcomes, 60)
            await _each_has(outcomes, 5)
            env.stopped.add(sidecar.process.pid)
            sigterm = time.monotonic()
            sidecar.process.signal(signal.SIGTERM)
            try:
                code: int | None = await sidecar.process.wait(60)
            except trio.TooSlowError:
                code = None
            took = time.monotonic() - sigterm
        end = await end_of_scenario(env)
    complete = sum(o.complete(tokens=60) for o in outcomes)
    saw = f"drained {tally(outcomes, tokens=60)}"
    timings = f"exit {code} {took:.2f} s after the SIGTERM" if code is not None else "no exit within 60 s"
    return [_row("sidecar_sigterm", "", saw, timings, complete=complete, code=code, took=took)], end


def judge_sidecar_sigterm(ours: Figures, theirs: Figures) -> Judged:
    def clean(f: Figures) -> int:
        return int(f["code"] == 0)

    def took(f: Figures) -> float | None:
        return f["took"] if f["code"] is not None else None

    tolerance = max(0.5, 0.2 * min(ours["took"], theirs["took"]))
    return _first(
        _more(ours["complete"], theirs["complete"], "drained streams"),
        _more(clean(ours), clean(theirs), "clean exits (status 0)"),
        _less(took(ours), took(theirs), "exit", tolerance),
    )


# ----------------------------------------------------------------------------- two engines, migration, SIGKILL


async def migration_kill(env: Env, p: Params) -> Result:
    outcomes = [Seen() for _ in range(16)]
    async with (
        engine(env, "--decode-ms-per-token", "20", name="engine-a") as eng_a,
        engine(env, "--decode-ms-per-token", "20", name="engine-b") as eng_b,
        worker(env, eng_a.address, name="sidecar-a"),
        worker(env, eng_b.address, name="sidecar-b"),
    ):
        await env.routable(workers=2)
        async with trio.open_nursery() as nursery:
            await _start_streams(nursery, env, outcomes, 120)
            await _each_has(outcomes, 5)

            async def both_busy() -> bool:
                return await engine_running(eng_a.address) > 0 and await engine_running(eng_b.address) > 0

            await wait_until(both_busy, timeout=20, what="both engines busy")
            on_a = await engine_running(eng_a.address)
            eng_a.process.proc.kill()
            killed = time.monotonic()
        end = await end_of_scenario(env)
    last = max(o.ended or killed for o in outcomes) - killed
    complete = sum(o.complete(tokens=120) for o in outcomes)
    saw = f"{tally(outcomes, tokens=120)} ({on_a} were on the killed engine)"
    timings = f"last answer {last:.2f} s after the SIGKILL"
    return [_row("migration_kill", "", saw, timings, complete=complete)], end


def judge_complete(ours: Figures, theirs: Figures) -> Judged:
    return _first(_more(ours["complete"], theirs["complete"], "complete answers"))


# -------------------------------------------------------------------------------------------- client faults


async def _drop_after(env: Env, body: dict[str, Any], events: int) -> float:
    """Stream ``body``, read ``events`` SSE events (0: none, hold until cancelled), close; returns the close time."""
    async with env.http.stream("POST", env.url + "/v1/completions", json={**body, "stream": True}) as response:
        seen = 0
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                seen += 1
            if seen >= events:
                break
    return time.monotonic()


async def disconnect_decode(env: Env, p: Params) -> Result:
    releases: list[float | None] = []
    async with engine(env, "--decode-ms-per-token", "20") as eng, worker(env, eng.address):
        await env.routable()
        before = await mock_stats(eng.address)
        for i in range(p.disconnects):
            body = body_for("completions", f"Story {i}.", max_tokens=500, ignore_eos=True)
            closed = await _drop_after(env, body, 3)
            releases.append(await engine_idle_after(eng.address, 2.0, since=closed))
            await engine_idle_after(eng.address, 10.0)  # the next try starts on an idle engine
        after = await mock_stats(eng.address)
        end = await end_of_scenario(env)
    aborts = int(after.get("aborts_received", 0)) - int(before.get("aborts_received", 0))
    got = [r for r in releases if r is not None]
    median = statistics.median(got) if len(got) == len(releases) else None
    saw = f"{len(got)}/{len(releases)} released by the engine within 2 s; Aborts received: {aborts}"
    timings = f"released {', '.join(_v(r, 'ms') for r in releases)} after the client closed"
    return [_row("disconnect_decode", "", saw, timings, leaked=len(releases) - len(got), median=median)], end


async def disconnect_prefill(env: Env, p: Params) -> Result:
    prompt = " ".join(["The river carries leaves toward the coast."] * 60)
    releases: list[float | None] = []
    async with (
        engine(env, "--prefill-tokens-per-s", "200", "--decode-ms-per-token", "20") as eng,
        worker(env, eng.address),
    ):
        await env.routable()
        for _ in range(3):
            body = body_for("completions", prompt, max_tokens=50, ignore_eos=True)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(_drop_after, env, body, 1))

                async def prefilling() -> bool:
                    return bool((await mock_stats(eng.address)).get("prefilling_requests"))

                await wait_until(prefilling, timeout=20, interval=0.01, what="the request in prefill")
                nursery.cancel_scope.cancel()
                left = time.monotonic()
            releases.append(await engine_idle_after(eng.address, 2.0, since=left))
            await engine_idle_after(eng.address, 10.0)
        end = await end_of_scenario(env)
    got = [r for r in releases if r is not None]
    median = statistics.median(got) if len(got) == len(releases) else None
    saw = f"{len(got)}/{len(releases)} released by the engine within 2 s (the client left mid-prefill)"
    timings = f"released {', '.join(_v(r, 'ms') for r in releases)} after the client closed"
    return [_row("disconnect_prefill", "", saw, timings, leaked=len(releases) - len(got), median=median)], end


def judge_release(ours: Figures, theirs: Figures) -> Judged:
    return _first(
        _less(ours["leaked"], theirs["leaked"], "requests the engine kept", 0, "n"),
        _less(ours["median"], theirs["median"], "median release", 0.02, "ms"),
    )


async def frontend_killed(env: Env, p: Params) -> Result:
    async with engine(env, "--decode-ms-per-token", "20") as eng, worker(env, eng.address) as sidecar:
        await env.routable()
        seen = Seen()
        async with trio.open_nursery() as nursery:
            body = body_for("completions", "The river", max_tokens=500, ignore_eos=True)
            nursery.start_soon(partial(stream, env.http, env.url, body, into=seen))
            await _each_has([seen], 3)
            env.frontend.process.proc.kill()
            released = await engine_idle_after(eng.address, 10.0, since=time.monotonic())
            nursery.cancel_scope.cancel()
        await trio.sleep(1.0)  # not a synchronisation: the sidecar is given a moment to show it outlived its frontend
        alive = sidecar.process.returncode is None
        end = await end_of_scenario(env)
    saw = f"the client's stream: {seen.kind()}; sidecar {'still running' if alive else 'exited'}"
    timings = f"engine released {_s(released)} after the frontend's SIGKILL" if released is not None else (
        "engine still held the request 10 s after the frontend's SIGKILL")  # fmt: skip
    return [_row("frontend_killed", "", saw, timings, leaked=int(released is None), median=released)], end


def judge_frontend_killed(ours: Figures, theirs: Figures) -> Judged:
    return _first(
        _less(ours["leaked"], theirs["leaked"], "requests the engine kept", 0, "n"),
        _less(ours["median"], theirs["median"], "release", 0.1),
    )


# -------------------------------------------------------------------------------------------- engine errors

_FAULT = "[mock-fault {}]"


async def engine_errors(env: Env, p: Params) -> Result:
    cases = (
        ("before the first token", "error_after_tokens=0 error_code=INTERNAL error_retryable=false"),
        ("after 3 tokens", "error_after_tokens=3 error_code=INTERNAL error_retryable=false"),
        ("protocol: no terminal before EOF", "violation=eof_before_terminal"),
        ("protocol: a wrong request id", "violation=wrong_request_id"),
    )
    parts: list[str] = []
    good = 0
    async with engine(env, "--speedup", "0", "--faults-from-prompt") as eng, worker(env, eng.address):
        await env.routable()
        for label, directive in cases:
            body = body_for("completions", f"river {_FAULT.format(directive)}", max_tokens=12, ignore_eos=True)
            seen = await stream(env.http, env.url, body, bound_s=60)
            after = await unary(env.http, env.url, body_for("completions", "The river", max_tokens=4))
            idle = await engine_idle_after(eng.address, 5.0) is not None
            clean = not seen.complete() and not seen.truncated and seen.kind() != "no answer"
            good += int(clean and after.complete() and idle)
            parts.append(f"{label}: {seen.kind()}{'' if after.complete() else ', next request ' + after.kind()}")
        end = await end_of_scenario(env)
    saw = "; ".join(parts)
    timings = f"{good}/{len(cases)}: a clean error, the engine released, the next request served"
    return [_row("engine_errors", "", saw, timings, good=good)], end


def judge_engine_errors(ours: Figures, theirs: Figures) -> Judged:
    return _first(_more(ours["good"], theirs["good"], "cases handled cleanly"))


async def retryable_two_workers(env: Env, p: Params) -> Result:
    prompt = f"river {_FAULT.format('error_after_tokens=2 error_code=INTERNAL error_retryable=true')}"
    outcomes: list[Seen] = []
    async with (
        engine(env, "--speedup", "0", "--faults-from-prompt", name="engine-a") as eng_a,
        engine(env, "--speedup", "0", name="engine-b"),
        worker(env, eng_a.address, name="sidecar-a"),
        worker(env, env.engines[-1].address, name="sidecar-b"),
    ):
        await env.routable(workers=2)
        for _ in range(6):
            body = body_for("completions", prompt, max_tokens=12, ignore_eos=True)
            outcomes.append(await stream(env.http, env.url, body, bound_s=60))
        end = await end_of_scenario(env)
    complete = sum(o.complete(tokens=12) for o in outcomes)
    times = sorted(o.seconds or 0.0 for o in outcomes)
    saw = tally(outcomes, tokens=12)
    return [_row("retryable_two_workers", "", saw, f"slowest answer {times[-1]:.2f} s", complete=complete)], end


async def engine_hang(env: Env, p: Params) -> Result:
    async with engine(env, "--speedup", "0", "--faults-from-prompt") as eng, worker(env, eng.address):
        await env.routable()
        body = body_for("completions", f"river {_FAULT.format('hang_after_tokens=3')}", max_tokens=20)
        seen = await stream(env.http, env.url, body, bound_s=p.hang_bound_s)
        await engine_idle_after(eng.address, 10.0)
        again = await unroutable_window(env.http, env.url, 0.0, 60.0)
        end = await end_of_scenario(env)
    when = f"after {seen.seconds:.1f} s" if seen.kind() != "no answer" else f"within the client's {p.hang_bound_s:g} s"
    saw = f"{seen.kind()} {when}; the model served again {again:.1f} s later"
    error_at = seen.seconds if seen.kind() not in ("no answer", "complete") else None
    return [_row("engine_hang", "", saw, f"error {_s(error_at)} after the request", error_at=error_at)], end


def judge_engine_hang(ours: Figures, theirs: Figures) -> Judged:
    return _first(_less(ours["error_at"], theirs["error_at"], "wait for a clean error", 1.0))


# ------------------------------------------------------------------------------- engine that starts late


async def engine_late_start(env: Env, p: Params) -> Result:
    """TensorRT-LLM opens its port only once its model is loaded: the sidecar starts against a closed port. Where
    its retries stand when the port opens is chance (both retry every second by default), so three loads of
    different lengths are timed, each with a sidecar and an engine of its own."""
    backs: list[dict[str, float | None]] = []
    ends: list[dict[str, object]] = []
    for i, load_s in enumerate(LATE_LOADS_S):
        back, one = await _late_start_once(env, load_s, f"engine-{i + 1}", f"sidecar-{i + 1}")
        backs.append(back)
        ends.append(one)
    end = {
        "exit": ", ".join(str(e.get("exit")) for e in ends),
        "engine": "; ".join(str(e.get("engine")) for e in ends if e.get("engine") != "idle") or "idle",
        "alive": all(e.get("alive", True) for e in ends),
        "leak": any(e.get("leak") for e in ends),
    }
    got = [b["steady"] for b in backs if b["steady"] is not None]
    median = statistics.median(got) if len(got) == len(backs) else None
    loads = ", ".join(f"{load:g}" for load in LATE_LOADS_S)
    saw = f"sidecar started {loads} s before the engine listened: served steadily {len(got)}/{len(backs)} times"
    timings = f"serving {' / '.join(_shown_back(b) for b in backs)} after the engine listened (median {_s(median)})"
    return [_row("engine_late_start", "", saw, timings, back=median)], end


#: How long the engine keeps its port closed, in each try of :func:`engine_late_start`.
LATE_LOADS_S: Final = (2.0, 3.3, 4.6)


async def _late_start_once(
    env: Env, load_s: float, engine_name: str, sidecar_name: str
) -> tuple[dict[str, float | None], dict[str, object]]:
    port = free_port()
    times: dict[str, float | None] = {}
    release, heard = trio.Event(), trio.Event()
    end: dict[str, object] = {}
    async with trio.open_nursery() as nursery:

        async def listen() -> None:
            times["listen"] = await listened(env, engine_name)
            heard.set()

        async def probe() -> None:
            await heard.wait()
            times["first"], times["steady"] = await _serving_again(env, time.monotonic(), 90.0)
            times["ok"] = times["steady"]

        async def engine_life() -> None:
            async with engine(env, "--speedup", "0", "--startup-delay", f"{load_s:g}", port=port, name=engine_name):
                await release.wait()

        nursery.start_soon(listen)
        nursery.start_soon(probe)
        nursery.start_soon(engine_life)
        try:
            async with worker(env, f"127.0.0.1:{port}", name=sidecar_name):
                while "ok" not in times:  # noqa: ASYNC110 (the probe task's result, polled)
                    await trio.sleep(0.05)
                end = await end_of_scenario(env)
        finally:
            release.set()
    return _back(times.get("first"), times.get("steady"), times.get("listen")), end


def judge_back(ours: Figures, theirs: Figures) -> Judged:
    return _first(_less(ours["back"], theirs["back"], "the way to serving", PROBE_INTERVAL_S))


# ------------------------------------------------------------------------------------------------- the table


def _fixed(text: str) -> Callable[[Params], str]:
    return lambda _: text


SCENARIOS: Final[tuple[Scenario, ...]] = (
    Scenario(
        "engine_sigterm",
        _fixed("engine SIGTERM (grace 5 s) during 8 × 60-token streams, `/health` polled"),
        _fixed("engine at 20 ms/token, `--stop-grace-secs 5`; SIGTERM once every stream has 10 pieces; the "
               "sidecar's `/health` polled every 50 ms, then for 1 s with the engine gone"),
        "more complete streams wins; on a tie, a `/health` that is never 200 while the engine is gone beats one "
        "that is (a probe or load balancer would keep a worker with no engine)",
        engine_sigterm, judge_engine_sigterm, quick=False,
    ),
    Scenario(
        "engine_sigkill",
        lambda p: f"engine SIGKILL during 8 streams, restarted after {', '.join(f'{o:g}' for o in p.outages)} s",
        lambda p: "engine at 20 ms/token; 8 × 200-token streams, SIGKILL once each has 5 pieces; the engine "
        "restarted on its port after each outage (killed again, idle, before the next); from the moment it listens "
        "(its port file, polled every 2 ms) a 1-token request every 50 ms until every one is answered for 2 s: the "
        "way back is the time to that steady serving (a first, lone answer before it is shown too); then an "
        "8-token request",
        "a truncated 200 loses; then the request after the restarts answered; then the slowest way back (beyond the "
        "50 ms poll interval); then streams ended with a retryable 503 (the frontend can migrate those) beat a 500",
        engine_sigkill, judge_engine_sigkill, quick=True,
    ),
    Scenario(
        "engine_sigstop",
        lambda p: f"engine SIGSTOP {p.stall_s:g} s during 4 streams, then SIGCONT; a request sent at "
                  f"{p.stall_request_at_s:g} s",
        lambda p: f"engine at 20 ms/token; 4 × 200-token streams, SIGSTOP once each has 5 pieces; a 60-token "
                  f"request {p.stall_request_at_s:g} s into the stall; SIGCONT at {p.stall_s:g} s; clients wait "
                  f"{p.stall_s + 60:g} s",
        "more complete answers (of the 5) wins",
        engine_sigstop, judge_engine_sigstop, quick=True,
    ),
    Scenario(
        "engine_sigstop_short",
        lambda p: f"engine SIGSTOP {p.short_stall_s:g} s (less than the inactivity timeout) during 4 streams, then "
                  f"SIGCONT; a request sent at {min(p.stall_request_at_s, p.short_stall_s * 0.4):g} s",
        lambda p: f"as the SIGSTOP scenario above, the stall {p.short_stall_s:g} s: shorter than either sidecar's "
                  "default inactivity timeout (60 s)",
        "more complete answers (of the 5) wins",
        engine_sigstop_short, judge_engine_sigstop,
    ),
    Scenario(
        "context_change",
        _fixed("engine restarted with its context 2048 → 1024: the card, a too-long prompt, a too-large `max_tokens`"),
        _fixed("engine `--max-context-length 2048`, SIGTERM, restarted on its port with 1024; `/v1/models` polled "
               "up to 10 s after the first answer; then a 1100–1900-token prompt and `max_tokens: 1500` (unary)"),
        "one point each for: the card saying 1024; the prompt refused with a 4xx; `max_tokens` refused with a 4xx "
        "or served in full (a 5xx, or fewer tokens than asked without a word, scores 0); more points wins",
        context_change, judge_context_change,
    ),
    Scenario(
        "bad_requests",
        _fixed("bad or unsupported requests"),
        lambda p: "engine `--capability guided=false --capability prompt_logprobs=false` (TensorRT-LLM without a "
                  "guided-decoding backend or prompt logprobs); each request unary, then the model probed every "
                  f"50 ms for {p.route_window_s:g} s (and until it serves)",
        "a model that stopped serving afterwards (> 0.1 s) loses; then the answer's rank: served as asked (where "
        "that is right) 3, a 4xx naming the field 2, an anonymous 4xx or a 200 that ignored the field 1, a 5xx 0",
        bad_requests, judge_bad_request, quick=True,
    ),
    Scenario(
        "stop_in_token",
        lambda p: f"a stop string inside a token (`stop: [\" th\"]`) × {p.stop_requests} streams",
        _fixed("engine at 10 ms/token; greedy, 40 tokens, 4 at a time; the frontend matches “ th” inside “ the”"),
        "more complete answers wins; then more usages carrying `cached_tokens`",
        stop_in_token, judge_stop_in_token, quick=True,
    ),
    Scenario(
        "sidecar_sigterm",
        _fixed("sidecar SIGTERM during 8 × 60-token streams"),
        _fixed("engine at 20 ms/token; SIGTERM to the sidecar once each stream has 5 pieces; its defaults"),
        "more drained (complete) streams wins; then exit status 0; then the quicker exit (beyond 0.5 s or 20 %)",
        sidecar_sigterm, judge_sidecar_sigterm, quick=True,
    ),
    Scenario(
        "migration_kill",
        _fixed("2 engines, `--migration-limit 3`, one SIGKILLed during 16 streams"),
        _fixed("engines at 20 ms/token, a sidecar each; 16 × 120-token streams; SIGKILL engine A once both are busy"),
        "more complete answers (exact token count) wins",
        migration_kill, judge_complete, migration_limit=3,
    ),
    Scenario(
        "disconnect_decode",
        lambda p: f"client disconnects mid-decode × {p.disconnects}",
        _fixed("engine at 20 ms/token; a 500-token stream closed after 3 events; the engine's GetLoad polled "
               "every 2 ms until it runs nothing"),
        "a request the engine still holds after 2 s loses; then the median release (beyond 20 ms)",
        disconnect_decode, judge_release,
    ),
    Scenario(
        "disconnect_prefill",
        _fixed("client disconnects during prefill × 3"),
        _fixed("engine prefilling 200 tokens/s, a ~400-token prompt; the client leaves while the engine prefills"),
        "a request the engine still holds after 2 s loses; then the median release (beyond 20 ms)",
        disconnect_prefill, judge_release,
    ),
    Scenario(
        "frontend_killed",
        _fixed("frontend SIGKILLed mid-stream"),
        _fixed("engine at 20 ms/token; a 500-token stream; the frontend SIGKILLed after 3 pieces"),
        "a request the engine still holds after 10 s loses (as does a sidecar that exits); then the quicker "
        "release (beyond 0.1 s)",
        frontend_killed, judge_frontend_killed,
    ),
    Scenario(
        "engine_errors",
        _fixed("engine errors by phase and protocol violations"),
        _fixed("engine `--faults-from-prompt`: a non-retryable `EngineError(INTERNAL)` before the first token and "
               "after 3; a stream ending without a terminal; responses stamped with another request's id; each "
               "followed by a plain request"),
        "more cases with a clean error (no truncated 200, no hang), the engine released and the next request "
        "served wins; an answer assembled from responses stamped with another request's id is not clean (on a "
        "real engine those are another request's tokens)",
        engine_errors, judge_engine_errors,
    ),
    Scenario(
        "retryable_two_workers",
        _fixed("retryable `EngineError` on one of 2 workers, `--migration-limit 3`, 6 requests"),
        _fixed("engine A answers every request with a retryable `EngineError(INTERNAL)` after 2 tokens, engine B "
               "serves; round-robin routing; 6 × 12-token streams one after the other"),
        "more complete answers (exact token count) wins",
        retryable_two_workers, judge_complete, migration_limit=3,
    ),
    Scenario(
        "engine_hang",
        _fixed("engine hangs mid-stream (no message, connection open)"),
        lambda p: f"engine `--faults-from-prompt`, `hang_after_tokens=3`; the client waits at most "
                  f"{p.hang_bound_s:g} s; each sidecar's default timeouts",
        "a clean error beats no answer; between two clean errors the sooner (beyond 1 s) wins",
        engine_hang, judge_engine_hang,
    ),
    Scenario(
        "engine_late_start",
        _fixed("engine port closed while it loads, sidecar started first (× 3)"),
        _fixed("engine `--startup-delay` 2, 3.3 and 4.6 s (TensorRT-LLM opens its port once loaded) started with "
               "the sidecar, a new pair each time; a 1-token request polled every 50 ms from the moment the engine "
               "listens; the median of the three times to steady serving (every probe answered for 2 s)"),
        "serving every time wins; then the quicker median way to serving (beyond the 50 ms poll interval)",
        engine_late_start, judge_back, quick=False,
    ),
)  # fmt: skip

__all__ = ["BAD_KINDS", "SCENARIOS", "Figures", "Judged", "Params", "Result", "Scenario", "Verdict"]
