"""Bundled workloads: ``gradaccum verify --workload gradaccum.examples:tiny_gpt``.

``tiny_gpt`` must pass verify; ``bn_cnn`` (BatchNorm) and ``contrastive`` (in-batch negatives) must
fail it and say why.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from gradaccum.check.workload import Workload
from gradaccum.examples.cnn import build_bn_cnn, cnn_loss, synthetic_images
from gradaccum.examples.contrastive import (
    build_pair_encoder,
    encode_pairs,
    info_nce_sum,
    pair_loss,
    synthetic_pairs,
)
from gradaccum.examples.gpt import GPTConfig, TinyGPT, parallelize_gpt, sample_sequences, vocab
from gradaccum.loss import count_examples, count_tokens, summed_cross_entropy

__all__ = ["bn_cnn", "build_tiny_gpt", "contrastive", "gpt_loss", "tiny_gpt"]


def build_tiny_gpt(seed: int = 0, *, dropout: float = 0.0, dtype: torch.dtype = torch.float32) -> TinyGPT:
    """The bundled tiny GPT with weights fixed by ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyGPT(GPTConfig(vocab_size=vocab().size, dropout=dropout))
    return model.to(dtype)


def gpt_loss(model: nn.Module, micro_batch: dict[str, Any]) -> torch.Tensor:
    """Summed next-character cross-entropy over the non-padding positions."""
    return summed_cross_entropy(model(micro_batch["input_ids"]), micro_batch["labels"], shift=False)


def tiny_gpt() -> Workload:
    """A 2-layer character GPT on padded variable-length sequences of the bundled corpus."""
    return Workload(
        name="tiny_gpt",
        build_model=build_tiny_gpt,
        make_batch=lambda n, seed: sample_sequences(n, seed),
        loss_fn=gpt_loss,
        count_fn=count_tokens("labels", shift=False),
        batch_size=8,
        micro_batch=2,
        unit="tokens",
        description="tiny causal GPT, padded variable-length sequences: accumulation must be exact",
        parallelize=parallelize_gpt,
    )


def bn_cnn() -> Workload:
    """A small ResNet-shaped CNN with BatchNorm on synthetic 8x8 images: accumulation is NOT exact."""
    return Workload(
        name="bn_cnn",
        build_model=build_bn_cnn,
        make_batch=lambda n, seed: synthetic_images(n, seed),
        loss_fn=cnn_loss,
        count_fn=count_examples,
        batch_size=8,
        micro_batch=2,
        unit="examples",
        description="small CNN with BatchNorm: each micro-batch is normalized on its own, so verify fails",
    )


def contrastive() -> Workload:
    """A pair encoder with in-batch-negative InfoNCE: accumulation changes the objective.

    ``extras`` hold what a gradient cache needs (see :mod:`gradaccum.examples.contrastive`):
    ``encode_fn(model, micro_batch) -> (query_reps, positive_reps)``, and
    ``rep_loss_fn(reps) -> Tensor``, the loss summed over the window's examples computed from the
    whole window's representations concatenated along dim 0 in window order.
    """
    return Workload(
        name="contrastive",
        build_model=build_pair_encoder,
        make_batch=lambda n, seed: synthetic_pairs(n, seed),
        loss_fn=pair_loss,
        count_fn=count_examples,
        batch_size=8,
        micro_batch=2,
        unit="examples",
        description="contrastive pair encoder with in-batch negatives: micro-batches see fewer negatives",
        declared_hazards=("in-batch-negatives",),
        extras={"encode_fn": encode_pairs, "rep_loss_fn": info_nce_sum},
    )
