"""A contrastive pair encoder with an in-batch-negative InfoNCE loss: a workload verify must fail.

Each query is scored against every positive of the same forward; the other examples' positives are
its negatives. Split into micro-batches of 2, a query meets 1 negative instead of 7, so the
accumulated objective is a different one. The model has no batch-coupled layer, so the scan cannot
see this: the workload declares it (``declared_hazards=("in-batch-negatives",)``).

For a gradient cache, the workload's ``extras`` split the loss at the representations:

- ``encode_fn(model, micro_batch) -> (query_reps, positive_reps)``: both ``(b, d)``, one row per
  example of the micro-batch, in its order; the only place the model's parameters are used.
- ``rep_loss_fn((query_reps, positive_reps)) -> Tensor``: the InfoNCE loss *summed* over the rows
  (the same convention as ``loss_fn``; the objective is this divided by the window's example
  count), given the whole window's representations concatenated along dim 0 in window order.

So ``loss_fn(model, batch) == rep_loss_fn(encode_fn(model, batch))`` for any batch, and the window's
objective is ``rep_loss_fn`` of the micro-batches' representations concatenated in order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "TEMPERATURE",
    "PairEncoder",
    "build_pair_encoder",
    "encode_pairs",
    "info_nce_sum",
    "pair_loss",
    "synthetic_pairs",
]

TEMPERATURE = 0.1
"""Softmax temperature of the InfoNCE logits (fixed, so that the loss has no parameters of its own)."""
INPUT_DIM = 16


class PairEncoder(nn.Module):
    """One tower shared by queries and positives: an MLP and an L2 normalization."""

    def __init__(self, d_in: int = INPUT_DIM, hidden: int = 32, d_out: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.net(x), dim=-1)


def build_pair_encoder(seed: int = 0, *, dtype: torch.dtype = torch.float32) -> PairEncoder:
    """The bundled encoder with weights fixed by ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = PairEncoder()
    return model.to(dtype)


def synthetic_pairs(n: int, seed: int, *, d_in: int = INPUT_DIM) -> dict[str, torch.Tensor]:
    """``n`` pairs: two noisy views (``query``, ``positive``) of the same random point."""
    gen = torch.Generator().manual_seed(seed)
    anchor = torch.randn(n, d_in, generator=gen)
    query = anchor + 0.3 * torch.randn(n, d_in, generator=gen)
    positive = anchor + 0.3 * torch.randn(n, d_in, generator=gen)
    return {"query": query, "positive": positive}


def encode_pairs(model: nn.Module, micro_batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The representations of a micro-batch: ``(query_reps, positive_reps)``, one row per example."""
    return model(micro_batch["query"]), model(micro_batch["positive"])


def info_nce_sum(reps: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """InfoNCE summed over the rows: query i against every positive, positive i the target.

    Every positive of the same call is a negative for the other queries: this is the in-batch
    coupling that accumulation breaks.
    """
    queries, positives = reps
    logits = queries @ positives.T / TEMPERATURE
    targets = torch.arange(queries.shape[0], device=queries.device)
    return F.cross_entropy(logits, targets, reduction="sum")


def pair_loss(model: nn.Module, micro_batch: dict[str, Any]) -> torch.Tensor:
    """The ``loss_fn``: InfoNCE summed over the micro-batch, negatives from the micro-batch only."""
    return info_nce_sum(encode_pairs(model, micro_batch))
