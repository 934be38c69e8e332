"""Stream shape and generation semantics of ``Generate`` (TensorRT-LLM's stream)."""

from __future__ import annotations

import functools
import json

import pytest
from grpclib.client import Channel
from grpclib.const import Status

from openengine.v1 import generation_pb2
from sidecar.testing.mock.lm import TinyLM

from ._client import Outcome, call, generate, make_request, new_id
from .conftest import StartMock

STOP = generation_pb2.FINISH_REASON_STOP
LENGTH = generation_pb2.FINISH_REASON_LENGTH


@functools.cache
def lm() -> TinyLM:
    return TinyLM.load()


def run(addr: str, req: generation_pb2.GenerateRequest) -> Outcome:
    out = call(addr, lambda ch: generate(ch, req))
    assert out.status == Status.OK, out
    return out


def assert_well_formed(out: Outcome, n: int = 1) -> None:
    """The stream rules every successful aggregated stream obeys."""
    assert out.messages, "at least the terminal event"
    finished_indices = []
    for i, m in enumerate(out.messages):
        event = m.WhichOneof("event")
        assert event in ("token", "finished", "prompt"), m
        if event == "token":
            assert m.token.HasField("output_index")
            assert m.token.output_index not in finished_indices, "nothing after an index's finished"
        if event == "finished":
            assert m.finished.HasField("output_index")
            finished_indices.append(m.finished.output_index)
        is_last = i == len(out.messages) - 1
        assert m.HasField("usage") == is_last, "usage only on the final response"
    assert sorted(finished_indices) == list(range(n)), "exactly one finished per output"
    usage = out.final.usage
    assert usage.HasField("cached_prompt_tokens")
    assert usage.completion_tokens == sum(len(out.tokens(i)) for i in range(n))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_basic_stream_shape_and_deltas(addr: str) -> None:
    out = run(addr, make_request(max_tokens=24, ignore_eos=True, seed=1))
    assert_well_formed(out)
    assert out.events == ["token"] * 24 + ["finished"]
    assert all(len(m.token.tokens) == 1 for m in out.messages[:-1]), "one token per message (stream_interval 1)"
    assert out.finished()[0].reason == LENGTH
    assert out.final.usage.prompt_tokens == len(lm().encode("The river"))
    assert out.text() == lm().decode(out.tokens()), "text deltas concatenate to the detokenized output"
    plain = out.messages[0].token.tokens[0]
    assert not plain.token, "TokenInfo.token only with logprobs"
    assert not plain.HasField("logprob")


def test_output_index_zero_is_present_on_the_wire(addr: str) -> None:
    out = run(addr, make_request(max_tokens=2))
    raw = out.messages[0].SerializeToString()
    # TokenOutput (field 3) starts with output_index (field 1, varint 0): tag 0x08, value 0x00.
    assert b"\x08\x00" in raw


def test_n2_interleaves_and_finishes_each_index_once(addr: str) -> None:
    out = run(addr, make_request(n=2, max_tokens=12, ignore_eos=True, seed=7))
    assert_well_formed(out, n=2)
    token_indices = [m.token.output_index for m in out.messages if m.WhichOneof("event") == "token"]
    assert token_indices[:4] == [0, 1, 0, 1]
    assert len(out.tokens(0)) == len(out.tokens(1)) == 12
    assert out.tokens(0) != out.tokens(1), "independent samples"


def test_greedy_stops_at_eos(addr: str) -> None:
    out = run(addr, make_request(temperature=0.0, max_tokens=200))
    assert_well_formed(out)
    fin = out.finished()[0]
    assert fin.reason == STOP
    assert fin.stop_match.WhichOneof("match") == "eos_token_id"
    assert fin.stop_match.eos_token_id in lm().eos_token_ids
    assert out.tokens()[-1] == fin.stop_match.eos_token_id
    assert "</s>" not in out.text()


def test_max_tokens_gives_length_and_ignore_eos_keeps_going(addr: str) -> None:
    out = run(addr, make_request(temperature=0.0, max_tokens=60, ignore_eos=True))
    assert out.finished()[0].reason == LENGTH
    assert out.final.usage.completion_tokens == 60
    assert not set(out.tokens()) & set(lm().eos_token_ids)


def test_min_tokens_suppresses_eos(addr: str) -> None:
    base = run(addr, make_request(temperature=0.0, max_tokens=200))
    natural = base.final.usage.completion_tokens
    out = run(addr, make_request(temperature=0.0, max_tokens=200, min_tokens=natural + 5))
    assert out.final.usage.completion_tokens > natural + 5
    assert not set(out.tokens()[: natural + 5]) & set(lm().eos_token_ids)


def test_default_max_tokens_fills_the_window(start_mock: StartMock) -> None:
    mock = start_mock("--profile", "full", "--max-context-length", "64")
    out = run(mock.address, make_request(max_tokens=None, ignore_eos=True, token_ids=[268, 395]))
    assert out.final.usage.completion_tokens == 62
    assert out.finished()[0].reason == LENGTH


def _greedy_text(addr: str, max_tokens: int = 40) -> tuple[list[int], str]:
    out = run(addr, make_request(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return out.tokens(), out.text()


def test_stop_string_cuts_text_and_reports_stop_text(addr: str) -> None:
    _, text = _greedy_text(addr)
    words = text.split()
    stop = words[4]  # a word well inside the greedy text
    cut = text.find(stop)
    out = run(addr, make_request(temperature=0.0, max_tokens=40, ignore_eos=True, stop_texts=[stop]))
    assert_well_formed(out)
    fin = out.finished()[0]
    assert fin.reason == STOP
    assert fin.stop_match.stop_text == stop
    assert out.text() == text[:cut]
    kept = run(
        addr, make_request(temperature=0.0, max_tokens=40, ignore_eos=True, stop_texts=[stop], include_stop=True)
    )
    assert kept.text() == text[: cut + len(stop)]
    assert kept.tokens() == out.tokens(), "the same tokens either way; only the text differs"


def test_stop_text_prefix_is_held_back(addr: str) -> None:
    _, text = _greedy_text(addr)
    # A stop string that starts like the greedy text's 3rd and 4th words but never completes: its prefix is held back
    # and then released as catch-up text, and the total text is unchanged. (With a one-word prefix the text, one step
    # behind the held tokens as TensorRT-LLM releases it, never shows the hold.)
    words = text.split()
    stop = f" {words[2]} {words[3]}\x01"
    out = run(addr, make_request(temperature=0.0, max_tokens=40, ignore_eos=True, stop_texts=[stop]))
    assert out.text() == text
    assert any(m.token.text == "" and m.token.tokens for m in out.messages if m.WhichOneof("event") == "token"), (
        "some delta carried tokens but held its text back"
    )


def test_stop_token_id(addr: str) -> None:
    tokens, _ = _greedy_text(addr)
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    out = run(addr, make_request(temperature=0.0, max_tokens=40, ignore_eos=True, stop_ids=[stop_id]))
    fin = out.finished()[0]
    assert fin.reason == STOP
    assert fin.stop_match.stop_token_id == stop_id
    assert out.tokens() == tokens[: first + 1]
    assert out.text() == lm().decode(tokens[:first])


def test_output_logprobs_top_n(addr: str) -> None:
    out = run(addr, make_request(max_tokens=10, seed=3, logprobs_top_n=3))
    infos = [t for m in out.messages if m.WhichOneof("event") == "token" for t in m.token.tokens]
    assert infos
    for info in infos:
        assert info.HasField("logprob")
        assert info.HasField("rank")
        assert info.rank >= 1
        assert info.token == lm().token_text(info.token_id)
        assert 1 <= len(info.candidates) <= 3
        assert [c.rank for c in info.candidates] == list(range(1, len(info.candidates) + 1))
        lps = [c.logprob for c in info.candidates]
        assert lps == sorted(lps, reverse=True)
        if info.rank <= len(info.candidates):
            assert info.candidates[info.rank - 1].token_id == info.token_id


def test_prompt_logprobs(addr: str) -> None:
    req = make_request(max_tokens=2)
    req.response.return_prompt_logprobs = True
    req.response.prompt_candidates.top_n = 2
    out = run(addr, req)
    assert out.events[0] == "prompt"
    prompt = out.messages[0].prompt.tokens
    assert [t.token_id for t in prompt] == lm().encode("The river")
    assert not prompt[0].HasField("logprob")
    assert not prompt[0].candidates
    assert all(t.HasField("logprob") and t.HasField("rank") for t in prompt[1:])
    assert out.events.count("prompt") == 1


def test_same_seed_same_tokens_and_greedy_is_deterministic(addr: str) -> None:
    def tokens(
        *, seed: int | None = None, temperature: float | None = None, request_id: str | None = None
    ) -> list[int]:
        req = make_request(request_id, max_tokens=30, ignore_eos=True, seed=seed, temperature=temperature)
        return run(addr, req).tokens()

    assert tokens(seed=11) == tokens(seed=11)
    assert tokens(seed=11) != tokens(seed=12)
    assert tokens(temperature=0.0) == tokens(temperature=0.0)
    rid = new_id("unseeded")
    assert tokens(request_id=rid) == tokens(request_id=rid), "unseeded runs are seeded from the request id"


def test_sampling_knobs_are_accepted(addr: str) -> None:
    req = make_request(max_tokens=8, seed=5, temperature=0.7)
    req.sampling.top_p = 0.9
    req.sampling.top_k = 5
    req.sampling.min_p = 0.05
    req.sampling.repetition_penalty = 1.1
    assert_well_formed(run(addr, req))


def test_detokenize_false_sends_no_text(addr: str) -> None:
    out = run(addr, make_request(max_tokens=10, extra={"detokenize": False}))
    assert out.tokens()
    assert out.text() == ""


def test_token_ids_input(addr: str) -> None:
    ids = lm().encode("The old city walls")
    out = run(addr, make_request(token_ids=ids, temperature=0.0, max_tokens=5))
    assert out.final.usage.prompt_tokens == len(ids)


def test_prefix_cache_hits_on_a_repeated_long_prompt(addr: str) -> None:
    prompt = " ".join(f"stone{i} river" for i in range(60))
    first = run(addr, make_request(prompt=prompt, max_tokens=2))
    second = run(addr, make_request(prompt=prompt, max_tokens=2))
    prompt_tokens = first.final.usage.prompt_tokens
    assert prompt_tokens > 64
    assert first.final.usage.cached_prompt_tokens == 0
    assert second.final.usage.cached_prompt_tokens >= (prompt_tokens // 16 - 1) * 16
    assert second.final.usage.cached_prompt_tokens < prompt_tokens


def test_cache_salt_separates_prefixes(addr: str) -> None:
    prompt = " ".join(f"salted{i} field" for i in range(40))
    a = make_request(prompt=prompt, max_tokens=1)
    a.kv.cache_salt = "tenant-a"
    b = make_request(prompt=prompt, max_tokens=1)
    b.kv.cache_salt = "tenant-b"
    run(addr, a)
    assert run(addr, b).final.usage.cached_prompt_tokens == 0
    again = make_request(prompt=prompt, max_tokens=1)
    again.kv.cache_salt = "tenant-a"
    assert run(addr, again).final.usage.cached_prompt_tokens > 0


def test_stream_interval_batches_tokens(start_mock: StartMock) -> None:
    mock = start_mock("--profile", "full", "--stream-interval", "4")
    out = run(mock.address, make_request(max_tokens=10, ignore_eos=True, seed=2))
    sizes = [len(m.token.tokens) for m in out.messages if m.WhichOneof("event") == "token"]
    assert sizes == [4, 4, 2]
    assert_well_formed(out)


def test_context_only_ends_with_prefill_ready_then_decode_replays(addr: str) -> None:
    prompt = "The family arrived"
    prefill = run(addr, make_request(prompt=prompt, max_tokens=1, extra={"request_type": "context_only"}, seed=1))
    assert prefill.events == ["token", "prefill_ready"]
    assert prefill.final.HasField("usage")
    assert prefill.final.usage.completion_tokens == 1
    session = prefill.final.prefill_ready.kv_session
    assert session.session_id.isdecimal()
    assert session.endpoints[0].port > 0
    first_token = prefill.tokens()[0]
    attrs = session.attributes_struct.fields
    assert [int(v.number_value) for v in attrs["first_gen_tokens"].list_value.values] == [first_token]
    assert attrs["ctx_info_endpoint"].string_value.startswith("tcp://")

    decode = make_request(prompt=prompt, max_tokens=8, ignore_eos=True, seed=1)
    decode.kv.session.CopyFrom(session)
    out = run(addr, decode)
    assert_well_formed(out)
    assert out.tokens()[0] == first_token, "the decode leg replays the first token"
    assert len(out.tokens()) == 8


def test_guided_json_object_when_enabled(start_mock: StartMock) -> None:
    mock = start_mock("--profile", "full", "--capability", "guided=true")
    req = make_request(max_tokens=50)
    req.guided.json_object.SetInParent()
    out = run(mock.address, req)
    assert isinstance(json.loads(out.text()), dict)  # some JSON object (tests/mock/test_guided.py: the rest)
    assert out.finished()[0].stop_match.WhichOneof("match") == "eos_token_id"


@pytest.mark.parametrize("n", [1, 3])
def test_abort_mid_stream_ends_with_cancelled_per_output(addr: str, n: int) -> None:
    import asyncio

    from ._client import abort, wait_for_load

    rid = new_id("abort")

    async def scenario(ch: Channel) -> tuple[Outcome, int, int]:
        task = asyncio.create_task(generate(ch, make_request(rid, n=n, seed=1, mock={"hang_after_tokens": 2 * n})))
        await wait_for_load(ch, lambda load: load.running_requests >= 1)
        first = await abort(ch, rid)
        out = await task
        second = await abort(ch, rid)
        return out, first.status, second.status

    from openengine.v1 import lifecycle_pb2

    out, first, second = call(addr, scenario)
    assert first == lifecycle_pb2.ABORT_STATUS_ABORTED
    assert second == lifecycle_pb2.ABORT_STATUS_ALREADY_FINISHED
    assert out.status == Status.OK
    assert_well_formed(out, n=n)
    assert {f.reason for f in out.finished()} == {generation_pb2.FINISH_REASON_CANCELLED}
    assert out.final.usage.completion_tokens == 2 * n
