"""Independent references: the full batch in one forward/backward, and error measures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn


def full_batch_grads(
    model: nn.Module, batch: Any, loss_fn: Callable[..., torch.Tensor], count_fn: Callable[[Any], Any]
) -> dict[str, torch.Tensor]:
    """Gradients of (summed loss over the whole batch) / (its count), in one pass."""
    model.zero_grad(set_to_none=True)
    n = int(torch.as_tensor(count_fn(batch)))
    (loss_fn(model, batch) / n).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def max_rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest relative L2 error over parameters: |got - want| / max(|want|, tiny)."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    worst = 0.0
    for name in want:
        denom = max(want[name].norm().item(), 1e-30)
        worst = max(worst, (got[name] - want[name]).norm().item() / denom)
    return worst


def max_abs_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max((got[k] - want[k]).abs().max().item() for k in want)
