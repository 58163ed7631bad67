"""A tiny local transformers model folder and data files, built in a temporary directory.

Nothing is downloaded: the tokenizer is a word-level ``tokenizers`` tokenizer trained on the test
text, the model a 2-layer Llama of width 16. ``make_model_folder(..., weights=False)`` writes the
config and tokenizer only (the workload then builds the model from the config with a fixed seed);
``weights=True`` also saves seeded weights.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

_VOCABULARY = """the a cat dog sat ran on under mat box far near home away birds fly high low red blue green
old new small big quick slow jumps sleeps eats reads writes sings tree river hill road"""
WORDS = tuple(_VOCABULARY.split())


def texts(n: int = 24, seed: int = 0) -> list[str]:
    """Documents of 1 to 14 words: uneven lengths, some of one word (no target after the shift)."""
    rng = random.Random(seed)
    out = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 14))) for _ in range(n)]
    out[3] = WORDS[0]  # a one-token document: no target, no unit
    return out


def write_txt(path: Path, documents: list[str]) -> Path:
    path.write_text("\n".join(documents) + "\n", encoding="utf-8")
    return path


def write_jsonl(path: Path, documents: list[str], field: str = "body") -> Path:
    lines = [json.dumps({"id": i, field: d}) for i, d in enumerate(documents)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def word_tokenizer(words: tuple[str, ...] | list[str], *, eos: bool = False) -> Any:
    """A word-level ``PreTrainedTokenizerFast`` over ``words``: ``[PAD]`` is id 0, ``[UNK]`` 1 and,
    with ``eos``, ``[EOS]`` 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[PAD]", "[UNK]", *(["[EOS]"] if eos else [])]
    raw.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=special))
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="[UNK]", pad_token="[PAD]", **({"eos_token": "[EOS]"} if eos else {})
    )


def tiny_llama_config(
    vocab_size: int, *, layers: int = 2, max_positions: int = 64, eos_token_id: int | None = None
) -> Any:
    """A Llama of width 16 (2 heads, MLP 32), padding id 0 and no BOS."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=eos_token_id,
    )


def make_model_folder(
    folder: Path, *, weights: bool, seed: int = 1, max_positions: int = 64, dtype: torch.dtype | None = None
) -> Path:
    """``dtype``: save the weights in it (a bfloat16 folder, as most published checkpoints are)."""
    from transformers import LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(WORDS)
    tokenizer.save_pretrained(folder)
    config = tiny_llama_config(len(tokenizer), max_positions=max_positions)
    if weights:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
        model.to(dtype or torch.float32).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return folder
