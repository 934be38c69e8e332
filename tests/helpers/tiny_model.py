"""A throw-away Hugging Face-style model directory (tokenizer only, no weights) for the Dynamo frontend.

The recipe: a byte-level BPE trained on a few sentences plus the JSON files the
frontend reads. Used until ``sidecar/testing/mock/model/`` (the committed tiny model) exists.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>")

_CORPUS = [
    "Hello world",
    "One two three four five six seven eight nine ten",
    "The quick brown fox jumps over the lazy dog",
    "user assistant system",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789",
] * 20

_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def committed_model_dir() -> Path | None:
    """The committed mock model directory, once it exists."""
    path = Path(__file__).resolve().parents[2] / "sidecar" / "testing" / "mock" / "model"
    return path if (path / "tokenizer.json").is_file() and (path / "config.json").is_file() else None


def write_tiny_model(directory: Path) -> Path:
    """Train a ~400-entry byte-level BPE and write a frontend-loadable model directory into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    vocab_size = tokenizer.get_vocab_size()
    files: dict[str, object] = {
        "tokenizer_config.json": {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": "</s>",
            "add_bos_token": False,
            "model_max_length": 2048,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": _CHAT_TEMPLATE,
        },
        "config.json": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "num_hidden_layers": 2,
            "max_position_embeddings": 2048,
            "bos_token_id": ids["<s>"],
            "eos_token_id": ids["</s>"],
        },
        "generation_config.json": {
            "bos_token_id": ids["<s>"],
            "eos_token_id": [ids["</s>"], ids["<|im_end|>"]],
        },
    }
    for name, content in files.items():
        (directory / name).write_text(json.dumps(content, indent=2) + "\n")
    return directory
