"""The tiny model directory (``scripts/build_tiny_model.py``) and the Markov text model over it (``TinyLM``)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from tokenizers import Tokenizer

from sidecar.testing.mock.lm import MODEL_DIR, TinyLM
from sidecar.testing.mock.lmapi import output_seed, seeded_uniform

if TYPE_CHECKING:
    from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "build_tiny_model.py"
MODEL_FILES = ("corpus.txt", "tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json")
CHATML_PROMPT = "<|im_start|>user\nTell me about rivers.<|im_end|>\n<|im_start|>assistant\n"


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_tiny_model", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return _load_script()


@pytest.fixture(scope="module")
def lm() -> TinyLM:
    return TinyLM.load()


def _generate(
    lm: TinyLM,
    prompt: str,
    *,
    seed: int = 0,
    temperature: float = 0.0,
    top_p: float = 1.0,
    lora: str | None = None,
    max_tokens: int = 200,
) -> tuple[list[int], bool]:
    """Token ids generated after ``prompt`` and whether an EOS ended them (the engine's positional draws)."""
    context = lm.encode(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        ctx = context + out
        token, _ = lm.sample(ctx, seeded_uniform(seed, len(ctx)), temperature=temperature, top_p=top_p, lora=lora)
        if token in lm.eos_token_ids:
            return out, True
        out.append(token)
    return out, False


def _readable(text: str) -> bool:
    words = text.split()
    plain = [w for w in words if w.strip(".,;:!?'\"").isascii() and w.strip(".,;:!?'\"").isalnum()]
    return len(words) >= 3 and len(plain) >= 0.9 * len(words)


# -- the model directory ----------------------------------------------------------------------------------------------


def test_build_is_deterministic(script: ModuleType, tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    script.build(first)
    script.build(second)
    script.build(second)  # re-runnable over an existing directory
    for name in MODEL_FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert sorted(p.name for p in second.iterdir()) == sorted(MODEL_FILES)  # no temp files left behind


def test_build_is_deterministic_across_processes(tmp_path: Path) -> None:
    for name, hash_seed in (("a", "1"), ("b", "2")):
        subprocess.run(
            [sys.executable, str(SCRIPT), "--out-dir", str(tmp_path / name)],
            check=True,
            capture_output=True,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
            timeout=120,
        )
    for name in MODEL_FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_committed_directory_equals_a_fresh_build(script: ModuleType, tmp_path: Path) -> None:
    script.build(tmp_path)
    for name in MODEL_FILES:
        assert (MODEL_DIR / name).read_bytes() == (tmp_path / name).read_bytes(), (
            f"{name} is stale: run python scripts/build_tiny_model.py"
        )


def test_directory_is_small() -> None:
    assert sum((MODEL_DIR / name).stat().st_size for name in MODEL_FILES) < 512 * 1024


def test_metadata() -> None:
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    for token_id, token in enumerate(("<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>")):
        assert tokenizer.token_to_id(token) == token_id
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    assert 2048 <= vocab_size <= 4096
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["vocab_size"] == vocab_size
    assert config["max_position_embeddings"] == 2048
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    generation = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 0, "eos_token_id": [1, 4]}
    tokenizer_config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<s>", "</s>")
    assert tokenizer_config["add_bos_token"] is False
    assert tokenizer_config["model_max_length"] == 2048


def test_chat_template_renders_chatml() -> None:
    jinja2 = pytest.importorskip("jinja2")
    template = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())["chat_template"]
    render = jinja2.Environment().from_string(template).render
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "image_url", "image_url": {}}]},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Tell me about rivers."},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
        "<|im_start|>assistant\nHi.<|im_end|>\n<|im_start|>user\nTell me about rivers.<|im_end|>\n"
    )
    assert render(messages=messages, add_generation_prompt=False) == expected
    assert render(messages=messages, add_generation_prompt=True) == expected + "<|im_start|>assistant\n"


def test_corpus_is_plain_prose() -> None:
    sentences = [line for line in (MODEL_DIR / "corpus.txt").read_text().splitlines() if line]
    assert 300 <= len(sentences) <= 5000
    assert len(set(sentences)) == len(sentences)
    for sentence in sentences:
        assert sentence.isascii(), sentence
        assert sentence[0].isupper(), sentence
        assert sentence[-1] in ".?!", sentence
        assert sentence.count(".") <= 1, sentence  # a full stop only ends a sentence


# -- the text model ---------------------------------------------------------------------------------------------------


def test_load_is_fast_and_reads_metadata() -> None:
    start = time.perf_counter()
    lm = TinyLM.load(MODEL_DIR)
    assert time.perf_counter() - start < 1.0
    assert lm.vocab_size == json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]
    assert lm.bos_token_id == 0
    assert lm.eos_token_ids == (1, 4)


def test_tokenizer_round_trips_corpus_sentences(lm: TinyLM) -> None:
    sentences = [line for line in (MODEL_DIR / "corpus.txt").read_text().splitlines() if line]
    for sentence in [*sentences[::7], "Unicode too: café, naïve, 東京 🌧."]:
        ids = lm.encode(sentence)
        assert lm.decode(ids) == sentence
        assert "".join(lm.token_text(i) for i in ids) == sentence or not sentence.isascii()
    assert lm.encode("The river")[0] != lm.encode(" The river")[0]  # no prefix space is added


def test_special_tokens(lm: TinyLM) -> None:
    ids = lm.encode(CHATML_PROMPT)
    assert ids[0] == 3
    assert 4 in ids
    assert lm.token_text(3) == "<|im_start|>"
    assert lm.token_text(1) == "</s>"
    assert lm.decode([3, *lm.encode("user"), 4]) == "user"
    assert lm.decode([3, 4], skip_special_tokens=False) == "<|im_start|><|im_end|>"
    assert lm.token_text(-1) == ""
    assert lm.token_text(lm.vocab_size) == ""


def test_greedy_generation_is_readable_deterministic_and_ends(lm: TinyLM) -> None:
    ids, ended = _generate(lm, "The river")
    text = lm.decode(ids)
    assert ended, text
    assert _readable("The river" + text), text
    assert text.endswith(".")
    assert _generate(TinyLM.load(), "The river") == (ids, ended)  # a fresh instance (no shared cache)


def test_generation_after_a_chat_prompt_starts_a_sentence(lm: TinyLM) -> None:
    ids, ended = _generate(lm, CHATML_PROMPT)
    text = lm.decode(ids)
    assert ended, text
    assert _readable(text), text
    assert text[0].isupper(), text
    assert _generate(lm, "")[0] == ids  # an empty context backs off the same way


def test_seeded_sampling_is_reproducible(lm: TinyLM) -> None:
    runs = [_generate(lm, "The river", seed=seed, temperature=1.0) for seed in range(20)]
    assert runs == [_generate(lm, "The river", seed=seed, temperature=1.0) for seed in range(20)]
    assert len({tuple(ids) for ids, _ in runs}) > 10  # seeds matter
    assert sum(ended for _, ended in runs) >= 18  # sampled text ends by itself too
    texts = [lm.decode(ids) for ids, _ in runs]
    assert sum(_readable("The river" + t) for t in texts) >= 18, texts


def test_sampling_is_reproducible_across_processes(lm: TinyLM) -> None:
    code = (
        "from sidecar.testing.mock.lm import TinyLM; from sidecar.testing.mock.lmapi import seeded_uniform as u; "
        "lm = TinyLM.load(); ctx = lm.encode('The wind'); out = []\n"
        "for _ in range(40): "
        "out.append(lm.sample(ctx + out, u(7, len(out)), temperature=0.9, top_p=0.95, lora='x')[0])\n"
        "print(out)"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONHASHSEED": seed},
            timeout=60,
        ).stdout
        for seed in ("1", "2")
    }
    context = lm.encode("The wind")
    out: list[int] = []
    for _ in range(40):
        out.append(lm.sample(context + out, seeded_uniform(7, len(out)), temperature=0.9, top_p=0.95, lora="x")[0])
    assert outputs == {f"{out}\n"}


@pytest.mark.parametrize("prompt", ["The river", "", CHATML_PROMPT, "The ship left the harbor.", "zzz qqq", "<s>"])
def test_distribution_is_normalised_and_sorted(lm: TinyLM, prompt: str) -> None:
    for lora in (None, "adapter-a"):
        dist = lm.next_distribution(lm.encode(prompt), lora=lora)
        assert dist
        assert math.isclose(math.fsum(math.exp(lp) for _, lp in dist), 1.0, abs_tol=1e-9)
        assert all(lp <= 0.0 for _, lp in dist)
        assert dist == sorted(dist, key=lambda item: (-item[1], item[0]))
        assert len({token for token, _ in dist}) == len(dist)
        assert all(0 <= token < lm.vocab_size for token, _ in dist)
        assert lm.top_logprobs(lm.encode(prompt), 3, lora=lora) == dist[:3]


def test_eos_has_mass_at_sentence_ends_only(lm: TinyLM) -> None:
    eos = lm.eos_token_ids[0]
    after_sentence = dict(lm.next_distribution(lm.encode("The ship left the harbor.")))
    assert after_sentence[eos] == max(after_sentence.values())
    assert math.isclose(math.exp(after_sentence[eos]), 0.5, abs_tol=0.05)
    assert eos not in dict(lm.next_distribution(lm.encode("The ship left the")))
    assert eos not in dict(lm.next_distribution(lm.encode(CHATML_PROMPT)))


def test_sample_returns_untempered_logprob_and_greedy_ties(lm: TinyLM) -> None:
    context = lm.encode("The river")
    dist = dict(lm.next_distribution(context))
    rng = random.Random(3)
    for temperature in (0.0, 0.3, 1.0, 2.5):
        for _ in range(50):
            token, logprob = lm.sample(context, rng.random(), temperature=temperature)
            assert logprob == dist[token]
    best = lm.next_distribution(context)[0]
    assert lm.sample(context, 0.999, temperature=0.0) == best
    assert lm.top_logprobs(context, 1) == [best]


def test_truncation_parameters(lm: TinyLM) -> None:
    context = lm.encode("The")
    ranked = [token for token, _ in lm.next_distribution(context)]
    assert len(ranked) > 10
    rng = random.Random(5)

    def draws(temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> set[int]:
        return {
            lm.sample(context, rng.random(), temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)[0]
            for _ in range(300)
        }

    assert draws(temperature=1.0, top_k=1) == {ranked[0]}
    assert draws(temperature=1.0, top_k=3) <= set(ranked[:3])
    assert draws(temperature=1.0, top_p=1e-9) == {ranked[0]}
    best = lm.next_distribution(context)[0][1]
    assert draws(temperature=1.0, min_p=1.0) <= {token for token, lp in lm.next_distribution(context) if lp == best}
    assert len(draws(temperature=5.0)) > len(draws(temperature=0.2))


def test_lora_changes_output_deterministically(lm: TinyLM) -> None:
    base = _generate(lm, "The river")[0]
    assert _generate(lm, "The river", lora="adapter-b")[0] != base
    changed = sum(_generate(lm, "The river", lora=f"adapter-{i}")[0] != base for i in range(10))
    assert changed >= 6
    first = _generate(lm, "The wind", seed=4, temperature=1.0, lora="pirate")
    assert first == _generate(TinyLM.load(), "The wind", seed=4, temperature=1.0, lora="pirate")
    assert first != _generate(lm, "The wind", seed=4, temperature=1.0)
    ids, ended = _generate(lm, "The river", lora="adapter-b")
    assert ended
    assert _readable("The river" + lm.decode(ids))
    context = lm.encode("The ship left the harbor.")  # an adapter changes the words, not where text may end
    eos = lm.eos_token_ids[0]
    assert dict(lm.next_distribution(context, lora="adapter-b"))[eos] == pytest.approx(
        dict(lm.next_distribution(context))[eos]
    )


def test_model_dir_without_corpus_uses_the_packaged_corpus(tmp_path: Path) -> None:
    for name in MODEL_FILES[1:]:
        (tmp_path / name).write_bytes((MODEL_DIR / name).read_bytes())
    lm = TinyLM.load(tmp_path)
    assert _generate(lm, "The river") == _generate(TinyLM.load(), "The river")


def test_sampling_is_fast(lm: TinyLM) -> None:
    context = lm.encode("The river")
    rng = random.Random(11)
    out: list[int] = []
    start = time.perf_counter()
    for _ in range(10_000):
        token, _ = lm.sample(context + out[-4:], rng.random(), temperature=0.8, top_p=0.95)
        out.append(token)
    assert time.perf_counter() - start < 1.0


# -- output as a function of the context and the absolute position (migration continues exactly) ---------------------


def _steps(
    lm: TinyLM, context: list[int], count: int, *, seed: int, temperature: float
) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """``count`` tokens after ``context`` as the engine draws them: (token, logprob, top-3 candidates) each."""
    ctx = list(context)
    steps = []
    for _ in range(count):
        token, logprob = lm.sample(ctx, seeded_uniform(seed, len(ctx)), temperature=temperature, top_p=0.95)
        steps.append((token, logprob, lm.top_logprobs(ctx, 3)))
        ctx.append(token)
    return steps


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.8])
def test_continuing_from_any_prefix_is_exact(lm: TinyLM, temperature: float) -> None:
    prompt = lm.encode(CHATML_PROMPT)
    whole = _steps(lm, prompt, 40, seed=1234, temperature=temperature)
    for k in (1, 2, 7, 20, 39):
        resent = prompt + [token for token, _, _ in whole[:k]]
        assert _steps(TinyLM.load(), resent, 40 - k, seed=1234, temperature=temperature) == whole[k:], k


def test_sampling_does_not_depend_on_earlier_calls(lm: TinyLM) -> None:
    context = lm.encode("The river")
    first = [lm.sample(context, u / 50, temperature=0.9, top_k=20) for u in range(50)]
    for other in ("The wind", "", CHATML_PROMPT):  # fill and churn the caches with other states
        [lm.sample(lm.encode(other), u / 50, temperature=0.9, top_k=20) for u in range(50)]
    assert [lm.sample(context, u / 50, temperature=0.9, top_k=20) for u in range(50)] == first
    assert len({token for token, _ in first}) > 3  # the draw decides


def test_seeded_draws() -> None:
    draws = [seeded_uniform(42, position) for position in range(10_000)]
    assert draws == [seeded_uniform(42, position) for position in range(10_000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert 0.48 < sum(draws) / len(draws) < 0.52
    assert sum(u < 0.1 for u in draws) in range(900, 1100)
    assert len(set(draws)) == len(draws)
    assert seeded_uniform(42, 7) != seeded_uniform(43, 7)
    assert seeded_uniform(42, 7) != seeded_uniform(42, 7, 1)
    assert seeded_uniform(2**64 - 1, 3) == seeded_uniform(-1, 3)  # the proto's uint64 seed, any int accepted
    assert output_seed(42, 0) == 42  # an n=1 request and output 0 of an n>1 request agree
    assert len({output_seed(42, i) for i in range(100)}) == 100
    assert output_seed(42, 1) != output_seed(43, 1)


def _engine_run(
    addr: str, token_ids: list[int], max_tokens: int, *, seed: int | None, temperature: float, n: int = 1
) -> list[list[tuple[int, float, int, list[tuple[int, float, int]]]]]:
    """Each output's (token, logprob, rank, candidates) as the mock process streamed them over gRPC."""
    from ._client import call, generate, make_request

    request = make_request(
        token_ids=token_ids,
        max_tokens=max_tokens,
        ignore_eos=True,
        seed=seed,
        temperature=temperature,
        n=n if n > 1 else None,
        logprobs_top_n=3,
    )
    outcome = call(addr, lambda ch: generate(ch, request))
    assert outcome.status.name == "OK", outcome.details
    outputs: list[list[tuple[int, float, int, list[tuple[int, float, int]]]]] = [[] for _ in range(n)]
    for message in outcome.messages:
        if message.WhichOneof("event") == "token":
            outputs[message.token.output_index].extend(
                (t.token_id, t.logprob, t.rank, [(c.token_id, c.logprob, c.rank) for c in t.candidates])
                for t in message.token.tokens
            )
    return outputs


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (1.0, 7), (0.6, 2**63 + 5)])
def test_engine_continues_a_migrated_request_exactly(
    addr: str, lm: TinyLM, temperature: float, seed: int | None
) -> None:
    """Dynamo's migration re-sends prompt + the tokens so far (``max_tokens`` reduced): the rest must be identical."""
    prompt = lm.encode(CHATML_PROMPT)
    total = 30
    (whole,) = _engine_run(addr, prompt, total, seed=seed, temperature=temperature)
    assert len(whole) == total
    for k in (1, 4, 13, 29):
        resent = prompt + [token for token, *_ in whole[:k]]
        (rest,) = _engine_run(addr, resent, total - k, seed=seed, temperature=temperature)
        assert rest == whole[k:], f"continuation after {k} tokens differs"


def test_engine_outputs_have_their_own_seeds(addr: str, lm: TinyLM) -> None:
    prompt = lm.encode("The river")
    (single,) = _engine_run(addr, prompt, 20, seed=99, temperature=1.0)
    first, second = _engine_run(addr, prompt, 20, seed=99, temperature=1.0, n=2)
    assert first == single  # output 0 keeps the request's seed
    assert second != first
    (other,) = _engine_run(addr, prompt, 20, seed=100, temperature=1.0)
    assert other != single


def test_engine_decode_leg_continues_its_prefill_leg_exactly(addr: str) -> None:
    """Disaggregated = aggregated for seeded sampling: the decode leg draws by position after the replayed token."""
    from ._client import call, generate, make_request

    prompt = "The family arrived at the river"
    whole = make_request(prompt=prompt, seed=5, temperature=1.0, max_tokens=12, ignore_eos=True)
    context_only = make_request(prompt=prompt, seed=5, temperature=1.0, extra={"request_type": "context_only"})
    decode = make_request(prompt=prompt, seed=5, temperature=1.0, max_tokens=12, ignore_eos=True)
    aggregated = call(addr, lambda ch: generate(ch, whole))
    first = call(addr, lambda ch: generate(ch, context_only))
    assert first.events == ["token", "prefill_ready"], first.events
    decode.kv.session.CopyFrom(first.final.prefill_ready.kv_session)
    rest = call(addr, lambda ch: generate(ch, decode))
    assert len(aggregated.tokens()) == 12
    assert rest.tokens() == aggregated.tokens()
