"""The exactness checker of ``bench.chaos``: every response against its reference, and the sidecars' counters
against what the clients saw.

A response is one of:

* **complete** — HTTP 200, no error, every choice finished exactly once (streamed: ``[DONE]`` came), and equal to
  the reference: each choice's text, finish reason and logprobs, and the usage's prompt, completion and total tokens
  (``cached_tokens`` depends on which worker's cache held the prompt, so it is not compared);
* a **clean error** — an HTTP 4xx/5xx, or HTTP 200 with an SSE error event and no ``finish_reason`` anywhere; what
  arrived before the error must be a prefix of the reference (no token lost, duplicated or spliced). With ``n=2``
  one choice may finish before the other fails: the error is clean when that choice is whole and exact;
* **cancelled** — the client left on purpose; what arrived must be a prefix of the reference;
* a **violation** — anything else: a truncated 200 (no ``[DONE]`` or a choice without ``finish_reason``), a finish
  followed by an error, a text, logprob, finish or usage that differs from the reference, a malformed event, a
  stream broken without an error event, a request that outlived its bound.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from bench._chaos_load import Template, Transcript, events
from bench._chaos_logs import Tally, records

Outcome = Literal["complete", "clean_error", "cancelled", "violation"]


@dataclass(slots=True)
class Choice:
    text: str = ""
    finishes: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class Answer:
    """A response in a form that compares: what each choice said, the usage, the errors, whether it ended."""

    choices: dict[int, Choice] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    errors: list[Any] = field(default_factory=list)
    done: bool = False
    ids: set[str] = field(default_factory=set)
    malformed: list[str] = field(default_factory=list)

    def choice(self, index: int) -> Choice:
        return self.choices.setdefault(index, Choice())

    def usage_key(self) -> tuple[Any, ...] | None:
        if self.usage is None:
            return None
        return tuple(self.usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))

    def to_json(self) -> dict[str, Any]:
        return {
            "choices": {
                i: {"text": c.text, "finishes": c.finishes, "logprobs": len(c.logprobs)}
                for i, c in sorted(self.choices.items())
            },
            "usage": self.usage_key(),
            "errors": self.errors,
            "done": self.done,
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome
    kind: str
    detail: str = ""


#: The verdict of most requests, shared (an hour's run holds ~50 000).
EXACT: Final = Verdict("complete", "exact")


def _logprob_entries(api: str, raw: Any) -> list[Any]:
    if not isinstance(raw, dict):
        return []
    if api == "chat":
        entries = []
        for entry in raw.get("content") or []:
            top = tuple((t.get("token"), t.get("logprob")) for t in entry.get("top_logprobs") or [])
            entries.append((entry.get("token"), entry.get("logprob"), top))
        return entries
    tops = raw.get("top_logprobs") or []
    return [
        (token, logprob, tuple(sorted((tops[i] or {}).items())) if i < len(tops) else ())
        for i, (token, logprob) in enumerate(
            zip(raw.get("tokens") or [], raw.get("token_logprobs") or [], strict=False)
        )
    ]


def _add_choice(answer: Answer, api: str, raw: dict[str, Any], *, streamed: bool) -> None:
    index = raw.get("index", 0)
    if not isinstance(index, int):
        answer.malformed.append(f"choice index {index!r}")
        return
    choice = answer.choice(index)
    if api == "chat":
        message = raw.get("delta" if streamed else "message") or {}
        content = message.get("content")
    else:
        content = raw.get("text")
    if isinstance(content, str):
        choice.text += content
    elif content is not None:
        answer.malformed.append(f"content {content!r}")
    if raw.get("finish_reason"):
        choice.finishes.append(str(raw["finish_reason"]))
    choice.logprobs += _logprob_entries(api, raw.get("logprobs"))


def parse(transcript: Transcript) -> Answer:
    """The answer a 200 response carried (streamed: every event; otherwise the JSON body)."""
    template = transcript.template
    answer = Answer()
    if template.stream:
        for event in events(transcript):
            if event == "[DONE]":
                if answer.done:
                    answer.malformed.append("a second [DONE]")
                answer.done = True
                continue
            if isinstance(event, str):
                answer.malformed.append(f"not JSON: {event[:200]}")
                continue
            if answer.done:
                answer.malformed.append("an event after [DONE]")
            _event(answer, template.api, event, streamed=True)
        return answer
    body = transcript.lines[-1][1] if transcript.lines else ""
    try:
        value = json.loads(body)
    except ValueError:
        answer.malformed.append(f"not JSON: {body[:200]}")
        return answer
    if not isinstance(value, dict):
        answer.malformed.append(f"not an object: {body[:200]}")
        return answer
    _event(answer, template.api, value, streamed=False)
    answer.done = True
    return answer


def _event(answer: Answer, api: str, event: dict[str, Any], *, streamed: bool) -> None:
    if "error" in event:
        answer.errors.append(event["error"])
    if isinstance(event.get("id"), str):
        answer.ids.add(event["id"])
    if event.get("usage"):
        answer.usage = event["usage"]
    for raw in event.get("choices") or []:
        if isinstance(raw, dict):
            _add_choice(answer, api, raw, streamed=streamed)
        else:
            answer.malformed.append(f"choice {raw!r}")


def request_ids(answer: Answer) -> set[str]:
    """The worker-side request ids of a response (``chatcmpl-<id>`` / ``cmpl-<id>``)."""
    return {re.sub(r"^(chatcmpl|cmpl)-", "", i) for i in answer.ids}


def reference_problems(template: Template, answer: Answer) -> list[str]:
    """Why a reference answer cannot serve as one (it must be complete)."""
    problems = list(answer.malformed)
    if answer.errors:
        problems.append(f"error {answer.errors[0]}")
    if not answer.done:
        problems.append("no [DONE]")
    if sorted(answer.choices) != list(range(template.n)):
        problems.append(f"choices {sorted(answer.choices)}")
    problems += [f"choice {i}: finishes {c.finishes}" for i, c in answer.choices.items() if len(c.finishes) != 1]
    if answer.usage_key() is None:
        problems.append("no usage")
    return problems


def _prefix_problem(answer: Answer, reference: Answer) -> str | None:
    """None when every choice's text and logprobs so far are a prefix of the reference's."""
    for index, got in answer.choices.items():
        ref = reference.choices.get(index)
        if ref is None:
            return f"choice {index} is not in the reference"
        if not ref.text.startswith(got.text):
            return f"choice {index}: {_text_difference(got.text, ref.text)}"
        if got.logprobs != ref.logprobs[: len(got.logprobs)]:
            return f"choice {index}: logprobs are not a prefix of the reference's"
    return None


def _text_difference(got: str, ref: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), min(len(got), len(ref)))
    near = slice(max(0, at - 20), at + 30)
    return f"differs at character {at}: got …{got[near]!r}, reference …{ref[near]!r}"


def _compare(answer: Answer, reference: Answer) -> Verdict:
    if sorted(answer.choices) != sorted(reference.choices):
        return Verdict("violation", "choices_mismatch", f"choices {sorted(answer.choices)}")
    for index, ref in sorted(reference.choices.items()):
        got = answer.choices[index]
        if got.text != ref.text:
            # Shorter: tokens lost (at the end or inside); longer: tokens repeated; as long: another text spliced in.
            if len(got.text) < len(ref.text):
                kind = "tokens_lost"
            elif len(got.text) > len(ref.text):
                kind = "tokens_duplicated"
            else:
                kind = "tokens_spliced"
            return Verdict("violation", kind, f"choice {index}: {_text_difference(got.text, ref.text)}")
        if got.finishes != ref.finishes:
            return Verdict("violation", "finish_mismatch", f"choice {index}: {got.finishes} vs {ref.finishes}")
        if got.logprobs != ref.logprobs:
            where = next(
                (i for i, (a, b) in enumerate(zip(got.logprobs, ref.logprobs, strict=False)) if a != b),
                min(len(got.logprobs), len(ref.logprobs)),
            )
            return Verdict("violation", "logprobs_mismatch", f"choice {index}: entry {where} differs")
    if answer.usage_key() != reference.usage_key():
        return Verdict("violation", "usage_mismatch", f"usage {answer.usage_key()} vs {reference.usage_key()}")
    return EXACT


def judge(transcript: Transcript, reference: Answer) -> Verdict:
    """The verdict on one request (see the module docstring)."""
    if transcript.timed_out:
        return Verdict("violation", "hang", "no end within the request bound")
    if transcript.status is None:
        # Nothing came back: the frontend could not be reached or closed before answering.
        if transcript.disconnected:
            return Verdict("cancelled", "before_response")
        return Verdict("clean_error", "transport", transcript.transport_error or "no response")
    if transcript.status != 200:
        if transcript.disconnected and not transcript.lines:
            return Verdict("cancelled", "before_body")
        return Verdict("clean_error", f"http {transcript.status}")
    answer = parse(transcript)
    if answer.malformed:
        return Verdict("violation", "malformed", "; ".join(answer.malformed[:3]))
    finished = any(c.finishes for c in answer.choices.values())
    if transcript.disconnected:
        problem = _prefix_problem(answer, reference)
        if problem is not None:
            return Verdict("violation", "cancelled_not_prefix", problem)
        return Verdict("cancelled", "client_left")
    if answer.errors:
        if finished and transcript.template.n == 1:
            return Verdict("violation", "finish_then_error", f"error {answer.errors[0]} after a finish_reason")
        # n > 1: a choice may end before another fails; it must then be whole and exact.
        for index, got in answer.choices.items():
            ref = reference.choices.get(index)
            if got.finishes and (
                ref is None or (got.text, got.finishes, got.logprobs) != (ref.text, ref.finishes, ref.logprobs)
            ):
                return Verdict("violation", "finish_then_error", f"choice {index} finished, not as the reference")
        problem = _prefix_problem(answer, reference)
        if problem is not None:
            return Verdict("violation", "error_not_prefix", problem)
        code = answer.errors[0].get("code") if isinstance(answer.errors[0], dict) else None
        return Verdict("clean_error", f"sse {code}")
    if transcript.transport_error is not None:
        return Verdict("violation", "stream_broken", transcript.transport_error)
    if not answer.done:
        return Verdict("violation", "truncated_200", "no [DONE]")
    missing = [i for i in range(transcript.template.n) if not answer.choice(i).finishes]
    if missing:
        return Verdict("violation", "truncated_200", f"choice(s) {missing} without finish_reason")
    duplicated = [i for i, c in answer.choices.items() if len(c.finishes) > 1]
    if duplicated:
        return Verdict("violation", "finish_duplicated", f"choice(s) {duplicated}")
    return _compare(answer, reference)


def frontend_lost(verdict: Verdict, transcript: Transcript, reference: Answer, stops: Sequence[float]) -> Verdict:
    """A connection broken because a fault stopped its frontend while the request was in flight, as a clean error.

    A client whose frontend dies mid-answer sees its connection break (httpx: an incomplete chunked read): it knows
    the answer is incomplete, as with an HTTP error. Excused only when the break is the transport's
    (``transport_error``), a stop of that frontend falls between the request's start and end (``stops``, the run's
    clock), and what arrived before the break is a prefix of the reference; anything else stays a violation."""
    if verdict.outcome != "violation" or transcript.transport_error is None:
        return verdict
    ended = transcript.ended if transcript.ended is not None else transcript.started
    if not any(transcript.started <= stop <= ended for stop in stops):
        return verdict
    if transcript.template.stream:
        problem = _prefix_problem(parse(transcript), reference)
        if problem is not None:
            return verdict
    return Verdict("clean_error", "frontend_lost", f"{transcript.frontend} stopped: {transcript.transport_error}")


# ------------------------------------------------------------------------------------------ counters and logs

_END = re.compile(
    r"^\S+ +\S+ sidecar\.requests .*?: request (\S+) (finished|rejected|cancelled|failed) \((.*)\): "
    r"(\d+) in / (\d+) out tokens"
)
#: A run SIGKILLed this soon after it logged a request's end may not have sent that answer out: the frontend then
#: migrates it, and another run finishes it too.
_UNDELIVERED_S = 1.0
# Dynamo's exposition adds its own labels (namespace, component, endpoint) to every series of ours.
_METRIC_RECEIVED = re.compile(r"^openengine_sidecar_requests_received_total(?:\{[^}]*\})? (\S+)$", re.M)
_METRIC_ENDED = re.compile(r'^openengine_sidecar_requests_ended_total\{[^}]*\boutcome="(\w+)"[^}]*\} (\S+)$', re.M)
OUTCOMES = ("finished", "cancelled", "failed", "rejected")


@dataclass(frozen=True)
class End:
    """One request-end line of a sidecar's log: the sidecar's own account of one attempt."""

    request_id: str
    outcome: str
    reason: str
    tokens_in: int
    tokens_out: int
    #: The line's time (Unix).
    at: float = 0.0


def log_ends(path: Path, tally: Tally | None = None) -> list[End]:
    """Every request-end line in a sidecar's log (lines the reader does not know are counted in ``tally``)."""
    ends = []
    for record in records(path, Tally() if tally is None else tally, "sidecar"):
        m = _END.match(record.text)
        if m is not None:
            ends.append(End(m[1], m[2], m[3], int(m[4]), int(m[5]), record.at))
    return ends


def migrated_usage(verdict: Verdict, answer: Answer, reference: Answer, moved_by_frontend: int | None) -> Verdict:
    """A ``usage_mismatch`` that is exactly what Dynamo 1.6.1 reports after a migration, as a complete answer.

    The frontend migrates a stream by sending the prompt *plus the tokens generated so far* to the next worker, and
    then takes ``prompt_tokens`` from that worker's usage while it counts ``completion_tokens`` itself; the worker
    cannot tell the original prompt from the tokens appended to it. So the client's ``prompt_tokens`` counts the
    ``d`` tokens generated before the migration.

    Excused exactly when: the text, finish reason, logprobs and ``completion_tokens`` equal the reference (the
    checker compared them before); ``total_tokens = prompt_tokens + completion_tokens``; one choice (``n > 1`` is
    never migrated); and the surplus ``d = prompt_tokens - reference`` is what the frontend itself says it appended:
    ``moved_by_frontend``, the ``migration.tokens_completed`` of its last migration retry of this request
    (:func:`frontend_migrations`), with ``0 < d <= completion_tokens``. Anything else stays a violation.

    The frontend's own record, not the sidecar's end line of the last attempt: that line need not show ``d``. The
    frontend applies stop strings and EOS itself and ends the stream there, so the last attempt may log more output
    tokens than the client counts, or end ``cancelled``; and a worker SIGKILLed after its last chunk logs no end.
    """
    got, ref = answer.usage_key(), reference.usage_key()
    if verdict.kind != "usage_mismatch" or got is None or ref is None or len(answer.choices) != 1:
        return verdict
    prompt, completion, total = got
    moved = prompt - ref[0]
    if completion != ref[1] or total != prompt + completion or not 0 < moved <= completion:
        return verdict
    if moved_by_frontend != moved:
        return verdict
    detail = f"prompt_tokens {prompt} = {ref[0]} + {moved} generated before the migration (Dynamo 1.6.1)"
    return Verdict("complete", "migrated_prompt_tokens", detail)


#: Dynamo 1.6.1's frontend, at INFO, when it migrates a request (``migration.tokens_completed``: the tokens it
#: appends to the prompt), and the request ids of a line: its own span's and the worker-side id, both on a route line.
_MIGRATION = re.compile(r"migration retry scheduled .*?\bmigration\.tokens_completed=(\d+)")
_REQUEST_IDS = re.compile(r"\brequest_id=([0-9A-Za-z-]+)")


def frontend_migrations(paths: Sequence[Path], wanted: set[str], tally: Tally) -> dict[str, int]:
    """For each wanted worker-side request id, the ``migration.tokens_completed`` of the last migration retry a
    frontend scheduled for it (its log names the retry by its own span id, which a route line pairs with the
    worker-side id)."""
    moved: dict[str, int] = {}
    for path in paths:
        alias: dict[str, str] = {}  # the frontend's span id -> the worker-side id
        for record in records(path, tally, "frontend"):
            ids = _REQUEST_IDS.findall(record.text)
            if not ids:
                continue
            known = next((alias.get(i, i) for i in ids if alias.get(i, i) in wanted), None)
            if known is None:
                continue
            alias.update(dict.fromkeys(ids, known))
            match = _MIGRATION.search(record.text)
            if match is not None:
                moved[known] = max(moved.get(known, 0), int(match.group(1)))
    return moved


#: Dynamo 1.6.1's frontend, when it gives up on one attempt of a request (and re-routes it, or fails it): the
#: attempt's worker instance.
_ROUTE_FAILED = re.compile(r"route request failed .*?\bworker_id=(\d+)")
_INSTANCE = re.compile(r"\binstance_id=(\d+)")


def frontend_abandoned(paths: Sequence[Path], tally: Tally) -> dict[str, set[int]]:
    """For each request id a frontend's log names, the worker instances it gave up on for it ("route request
    failed": the NATS request timed out, the connect-back broke, the stream was lost)."""
    abandoned: dict[str, set[int]] = {}
    for path in paths:
        for record in records(path, tally, "frontend"):
            match = _ROUTE_FAILED.search(record.text)
            if match is not None:
                for rid in _REQUEST_IDS.findall(record.text):
                    abandoned.setdefault(rid, set()).add(int(match.group(1)))
    return abandoned


def log_instances(path: Path, tally: Tally) -> frozenset[int]:
    """The Dynamo instance ids a sidecar run served under (Dynamo's request lines name them)."""
    return frozenset(
        int(m.group(1)) for record in records(path, tally, "sidecar") if (m := _INSTANCE.search(record.text))
    )


def metric_counts(page: str) -> tuple[int, dict[str, int]] | None:
    """``(received, {outcome: ended})`` from a sidecar's metrics page; None when the page has no such counter."""
    received = [float(m.group(1)) for m in _METRIC_RECEIVED.finditer(page)]
    if not received:
        return None
    ended = dict.fromkeys(OUTCOMES, 0)
    for match in _METRIC_ENDED.finditer(page):
        ended[match.group(1)] = ended.get(match.group(1), 0) + int(float(match.group(2)))
    return int(sum(received)), ended


@dataclass
class LifeCounts:
    """One sidecar run: its metrics at the end (when it was alive then) and its log's request-end lines."""

    worker: str
    life: int
    end: str
    metrics: tuple[int, dict[str, int]] | None
    log: Counter[str]
    #: Requests this run finished with a whole answer: on a prefill worker only its early stops (a finish other than
    #: "length", which is the handoff to the decode worker).
    finished_ids: list[str]
    ends: list[End] = field(default_factory=list)
    #: When a SIGKILLed run was killed (Unix).
    killed_at: float | None = None
    #: The Dynamo instance ids this run served under (from its log).
    instances: frozenset[int] = frozenset()

    def delivered(self, request_id: str) -> bool:
        """Whether this run's finish of ``request_id`` can have reached the frontend (it was not killed right
        after logging it)."""
        if self.killed_at is None:
            return True
        ends = [e.at for e in self.ends if e.request_id == request_id and e.outcome == "finished"]
        return not ends or self.killed_at - max(ends) > _UNDELIVERED_S


@dataclass
class Reconciliation:
    lives: list[LifeCounts]
    #: Problems found (each a violation of kind ``reconcile``).
    problems: list[str]
    #: Complete answers the clients saw, and sidecar-side "finished" ends, per model kind.
    complete: Counter[str]
    finished: Counter[str]
    explained: dict[str, int]


def reconcile(
    lives: list[LifeCounts],
    verdicts: Sequence[tuple[Transcript, Verdict, Answer | None]],
    own_ids: set[str],
    abandoned: Mapping[str, set[int]] | None = None,
) -> Reconciliation:
    """received = finished + cancelled + failed + rejected for every run still alive at the end (its metrics, which
    must also equal its log's request-end lines); and finished = complete answers: every complete answer was
    finished by exactly one sidecar run (the decode worker for the pair's model), and every other "finished" is a
    client that left, one of this program's own requests, or a run's log line for a request that did not reach the
    client (each listed). A complete answer finished by more than one run is explained only when every run but one
    served under an instance the frontend abandoned for that request (``abandoned``: :func:`frontend_abandoned`)."""
    problems: list[str] = []
    for life in lives:
        if life.metrics is None:
            continue
        received, ended = life.metrics
        if received != sum(ended.values()):
            problems.append(
                f"{life.worker} run {life.life}: received {received} != ended {sum(ended.values())} {ended}"
            )
        logged = {o: life.log.get(o, 0) for o in OUTCOMES}
        if logged != ended:
            problems.append(f"{life.worker} run {life.life}: metrics {ended} != log lines {logged}")
    finished_where: dict[str, list[str]] = {}
    # Finishes a SIGKILLed run logged just before its death: their answer may or may not have left the process.
    maybe_lost: dict[str, list[str]] = {}
    for life in lives:
        for rid in life.finished_ids:
            into = finished_where if life.delivered(rid) else maybe_lost
            into.setdefault(rid, []).append(f"{life.worker}#{life.life}")
    complete: Counter[str] = Counter()
    finished: Counter[str] = Counter()
    explained = {"own": 0, "client_left": 0, "complete": 0, "rerouted": 0}
    instances = {f"{life.worker}#{life.life}": life.instances for life in lives}
    seen: set[str] = set()
    for transcript, verdict, answer in verdicts:
        ids = request_ids(answer) if answer is not None else set()
        kind = transcript.template.model_kind
        if verdict.outcome == "complete":
            complete[kind] += 1
            for rid in ids:
                where = [w for w in finished_where.get(rid, []) if _counts_for(kind, w)]
                maybe = [w for w in maybe_lost.get(rid, []) if _counts_for(kind, w)]
                # Dynamo's request plane delivers a request the frontend gave up on (its NATS request "failed", or the
                # connect-back broke) and re-routed: that run may finish it too, for nobody. Only the frontend's own
                # record of the abandoned attempt excuses a second finish.
                left = (abandoned or {}).get(rid, set())
                rerouted = [w for w in where if instances.get(w, frozenset()) & left]
                if len(where) > 1 and len(where) - len(rerouted) == 1:
                    explained["rerouted"] += len(rerouted)
                elif len(where) > 1 or not (where or maybe):
                    problems.append(f"request #{transcript.number} ({rid}): complete, finished by {where or 'none'}")
                seen.add(rid)
        elif verdict.outcome == "cancelled" or verdict.kind == "frontend_lost":
            # The client left, or its frontend died: the worker may have finished what nobody received.
            seen |= ids
            explained["client_left"] += sum(1 for rid in ids if rid in finished_where)
        elif verdict.outcome == "clean_error":
            for rid in ids:
                where = [w for w in finished_where.get(rid, []) if _counts_for(kind, w)]
                if where:
                    problems.append(f"request #{transcript.number} ({rid}): a clean error, yet finished by {where}")
                seen.add(rid)
    for rid, where in [*finished_where.items(), *maybe_lost.items()]:
        for w in where:
            finished["pd" if w.startswith("pd-") else "base+lora"] += 1
        if rid in own_ids:
            explained["own"] += 1
    explained["complete"] = sum(complete.values())
    unexplained = [rid for rid in {**maybe_lost, **finished_where} if rid not in seen and rid not in own_ids]
    anonymous = sum(
        1 for t, v, a in verdicts if v.outcome in ("cancelled", "clean_error") and not (a and request_ids(a))
    )
    if len(unexplained) > anonymous:
        problems.append(
            f"{len(unexplained)} finished request(s) no client saw or left, more than the {anonymous} requests "
            f"that ended without an id: {unexplained[:5]}"
        )
    return Reconciliation(lives, problems, complete, finished, explained)


def _counts_for(kind: str, where: str) -> bool:
    """Which sidecar's "finished" stands for a complete answer of this model kind (the pair's: the decode worker's,
    or the prefill worker's early stop)."""
    if kind == "pd":
        return where.startswith("pd-")
    return where.startswith("w")
