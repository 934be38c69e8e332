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
    """Token ids generated after ``prompt`` and whether an EOS ended them."""
    context = lm.encode(prompt)
    rng = random.Random(seed)
    out: list[int] = []
    for _ in range(max_tokens):
        token, _ = lm.sample(context + out, rng, temperature=temperature, top_p=top_p, lora=lora)
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
        "import random; from sidecar.testing.mock.lm import TinyLM; lm = TinyLM.load(); rng = random.Random(7); "
        "ctx = lm.encode('The wind'); out = []\n"
        "for _ in range(40): out.append(lm.sample(ctx + out, rng, temperature=0.9, top_p=0.95, lora='x')[0])\n"
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
    rng = random.Random(7)
    context = lm.encode("The wind")
    out: list[int] = []
    for _ in range(40):
        out.append(lm.sample(context + out, rng, temperature=0.9, top_p=0.95, lora="x")[0])
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
            token, logprob = lm.sample(context, rng, temperature=temperature)
            assert logprob == dist[token]
    best = lm.next_distribution(context)[0]
    assert lm.sample(context, random.Random(0), temperature=0.0) == best
    assert lm.top_logprobs(context, 1) == [best]


def test_truncation_parameters(lm: TinyLM) -> None:
    context = lm.encode("The")
    ranked = [token for token, _ in lm.next_distribution(context)]
    assert len(ranked) > 10
    rng = random.Random(5)

    def draws(temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> set[int]:
        return {
            lm.sample(context, rng, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)[0]
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
        token, _ = lm.sample(context + out[-4:], rng, temperature=0.8, top_p=0.95)
        out.append(token)
    assert time.perf_counter() - start < 1.0
