"""Reading a loss's autograd graph as ``constants x reduction``: how the guard spots a mean of means.

The graph is read through the ``grad_fn._saved_*`` attributes that PyTorch's autograd notes document.
Only the form ``c1 * c2 / ... * reduction(...)`` is recognised; anything else is left unjudged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["WEIGHT_RTOL", "LossForm", "listed", "read_loss"]

# Relative spread of per-unit weights taken as unequal: float32 scale factors round at ~6e-8, and a
# one-unit difference between counts below 10^5 moves a weight by more than 1e-5.
WEIGHT_RTOL = 1e-6


@dataclass(frozen=True, slots=True)
class LossForm:
    """A backward's root read as ``prod(factors) * reduction``: mean over ``count`` units, or a sum."""

    site: tuple[str, int]
    factors: tuple[tuple[torch.Tensor, bool], ...]
    """0-dim constants the reduction was multiplied by (False) or divided by (True)."""
    count: torch.Tensor | int | None
    """Units the mean reduction divided by; ``None`` for a sum."""
    node: str = ""
    """The autograd node of the reduction (``NllLossBackward0``, ``MeanBackward0``, ...)."""

    def scale(self) -> float:
        out = 1.0
        for value, divides in self.factors:
            v = float(value)
            out = out / v if divides else out * v
        return out

    def weight(self) -> float:
        """The factor by which each counted unit's loss enters the gradient."""
        return self.scale() / (1.0 if self.count is None else float(self.count))


def _constant(node: Any, index: int) -> torch.Tensor | None:
    """The 0-dim constant operand of a binary Mul/Div node whose other operand carries the graph."""
    saved = getattr(node, "_saved_self" if index == 0 else "_saved_other", None)
    if isinstance(saved, torch.Tensor) and saved.numel() == 1 and not saved.requires_grad:
        return saved.detach().clone()  # clone: a GradScaler's scale changes in place later
    return None


def read_loss(root: Any, site: tuple[str, int], skip_top_mul: bool) -> LossForm | None:
    """Read ``root``'s graph as constants times a mean or sum reduction, or None if it is not one."""
    if not isinstance(root, torch.Tensor) or root.numel() != 1 or root.grad_fn is None:
        return None
    node: Any = root.grad_fn
    factors: list[tuple[torch.Tensor, bool]] = []
    for depth in range(16):
        name = type(node).__name__
        if name in ("MulBackward0", "DivBackward0"):
            live = [i for i, (fn, _) in enumerate(node.next_functions) if fn is not None]
            if len(live) != 1 or (name == "DivBackward0" and live != [0]):
                return None
            const = _constant(node, 1 - live[0])
            if const is None:
                return None
            if not (skip_top_mul and depth == 0 and name == "MulBackward0"):
                factors.append((const, name == "DivBackward0"))
            node = node.next_functions[live[0]][0]
        elif name in ("ToCopyBackward0", "CloneBackward0", "AliasBackward0"):
            node = node.next_functions[0][0]
        else:
            break
        if node is None:
            return None
    name = type(node).__name__
    reduction = getattr(node, "_saved_reduction", None)
    count: torch.Tensor | int | None
    if name in ("NllLossBackward0", "NllLoss2DBackward0") and reduction in (1, 2):
        count = node._saved_total_weight.detach() if reduction == 1 else None
    elif name == "MeanBackward0":
        count = int(node._saved_self_sym_numel)
    elif name == "MeanBackward1":
        sizes = node._saved_self_sym_sizes
        dims = [d % len(sizes) for d in node._saved_dim] or range(len(sizes))
        count = math.prod(int(sizes[d]) for d in dims)
    elif name == "SumBackward0":
        count = None
    elif reduction in (1, 2) and isinstance(getattr(node, "_saved_self", None), torch.Tensor):
        count = node._saved_self.numel() if reduction == 1 else None
    else:
        return None
    return LossForm(site, tuple(factors), count, name)


def listed(values: list[float]) -> str:
    shown = ", ".join(f"{v:.4g}" for v in values[:8])
    return f"[{shown}{', ...' if len(values) > 8 else ''}]"
