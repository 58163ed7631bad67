"""Bundled workloads: ``gradaccum verify --workload gradaccum.examples:tiny_gpt``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from gradaccum.examples.gpt import GPTConfig, TinyGPT, sample_sequences, vocab
from gradaccum.loss import count_tokens, summed_cross_entropy
from gradaccum.workload import Workload

__all__ = ["build_tiny_gpt", "gpt_loss", "tiny_gpt"]


def build_tiny_gpt(seed: int = 0, *, dropout: float = 0.0, dtype: torch.dtype = torch.float32) -> TinyGPT:
    """The bundled tiny GPT with weights fixed by ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyGPT(GPTConfig(vocab_size=vocab().size, dropout=dropout))
    return model.to(dtype)


def gpt_loss(model: nn.Module, micro_batch: dict[str, Any]) -> torch.Tensor:
    """Summed next-character cross-entropy over the non-padding positions."""
    return summed_cross_entropy(model(micro_batch["input_ids"]), micro_batch["labels"])


def tiny_gpt() -> Workload:
    """A 2-layer character GPT on padded variable-length sequences of the bundled corpus."""
    return Workload(
        name="tiny_gpt",
        build_model=build_tiny_gpt,
        make_batch=lambda n, seed: sample_sequences(n, seed),
        loss_fn=gpt_loss,
        count_fn=count_tokens("labels"),
        batch_size=8,
        micro_batch=2,
        unit="tokens",
        description="tiny causal GPT, padded variable-length sequences: accumulation must be exact",
    )
