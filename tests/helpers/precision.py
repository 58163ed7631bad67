"""The issue's measurement set: a transformers GPT-2 (2 layers, n_embd 64) built from a config,
and 128 padded sequences of uneven lengths, made here (nothing is downloaded)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["SEQUENCES", "gpt2", "gpt2_count", "gpt2_loss", "padded_sequences"]

SEQUENCES = 128
VOCAB = 128
LENGTH = 32


def gpt2(seed: int = 0) -> nn.Module:
    """GPT-2 of 2 layers, 64 channels, in float64 (the measurement casts it)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=LENGTH,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(config).to(torch.float64)


def padded_sequences(n: int = SEQUENCES, seed: int = 1) -> dict[str, torch.Tensor]:
    """``n`` token sequences of 4..32 tokens, right-padded to 32 (labels -100 on the padding)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, LENGTH + 1, (n,), generator=gen)
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=gen)
    mask = torch.arange(LENGTH)[None] < lengths[:, None]
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": ids.masked_fill(~mask, -100)}


def gpt2_loss(model: nn.Module, mb: dict[str, Any]) -> torch.Tensor:
    """The summed next-token cross-entropy, computed in float32 or wider (as a bf16 model's loss is)."""
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits[:, :-1]
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, VOCAB), mb["labels"][:, 1:].reshape(-1), reduction="sum")


def gpt2_count(mb: dict[str, Any]) -> torch.Tensor:
    return (mb["labels"][:, 1:] != -100).sum()
