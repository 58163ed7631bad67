"""Tiny models and data for the tests: an MLP and the bundled tiny GPT, in float64."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from gradaccum.examples import build_tiny_gpt, gpt_loss
from gradaccum.examples.gpt import sample_sequences
from gradaccum.loss import count_tokens

__all__ = ["count_rows", "gpt", "gpt_batch", "gpt_loss", "mlp", "mlp_batch", "mlp_loss", "tokens"]

tokens = count_tokens("labels", shift=False)


def mlp(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


def mlp_batch(n: int, seed: int = 1, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=gen, dtype=dtype)
    y = torch.randn(n, 3, generator=gen, dtype=dtype)
    # a per-example weight of 0 or 1 makes counts uneven: a masked-example regression
    w = (torch.rand(n, generator=gen) > 0.3).to(torch.long)
    return {"x": x, "y": y, "w": w}


def mlp_loss(model: nn.Module, mb: dict[str, Any]) -> torch.Tensor:
    per_example = ((model(mb["x"]) - mb["y"]) ** 2).sum(dim=1)
    return (per_example * mb["w"].to(per_example.dtype)).sum()


def count_rows(mb: dict[str, Any]) -> torch.Tensor:
    return mb["w"].sum()


def gpt(seed: int = 0) -> nn.Module:
    return build_tiny_gpt(seed, dtype=torch.float64)


def gpt_batch(n: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    return sample_sequences(n, seed)
