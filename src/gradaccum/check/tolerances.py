"""The declared tolerances of the equivalence check, per dtype, each with the arithmetic behind it.

They are declared before anything runs, and every report shows them with their reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradaccum.names import MAX_TRACE_STEPS

__all__ = ["GRAD_TOLERANCES", "MAX_TRACE_STEPS", "PARAM_TOLERANCES", "TRACE_TOLERANCES", "Tolerance"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Tolerance:
    """A declared tolerance and why it is that value."""

    value: float
    """The largest error that passes."""
    reason: str
    """The dtype's rounding against the size of the errors the check must catch."""

    def __str__(self) -> str:
        return f"{self.value:.0e}"

    def __float__(self) -> float:
        return float(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec) if spec else str(self)


GRAD_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(
        value=1e-10,
        reason="relative L2 per parameter. float64 rounds at 1.1e-16 and both sides sum the same terms "
        "in a different order, which moves a gradient by ~1e-15 relative at these sizes: 1e-10 "
        "leaves 1e5 of margin, while weighting errors (a mean of means, per-micro-batch "
        "BatchNorm) are above 1e-3",
    ),
    torch.float32: Tolerance(
        value=1e-4,
        reason="relative L2 per parameter. float32 rounds at 6e-8 and reordered sums of thousands of "
        "terms move gradients by up to ~1e-6 relative: 1e-4 leaves margin, while weighting "
        "errors are above 1e-3",
    ),
}
"""Gradient tolerances per diagnostic dtype. Half precisions belong to the trace stage."""

PARAM_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(
        value=1e-10,
        reason="largest absolute difference after one update. With SGD at lr 0.1, a gradient error "
        "at its tolerance moves O(1) weights by ~1e-11; float64 rounds them at 1e-16",
    ),
    torch.float32: Tolerance(
        value=1e-5,
        reason="largest absolute difference after one update. With SGD at lr 0.1, a gradient error "
        "at its tolerance moves O(1) weights by ~1e-5; float32 rounds them at 6e-8",
    ),
}


TRACE_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(
        value=1e-10,
        reason="largest relative difference of each trace over at most 50 steps. float64 rounds at "
        "1.1e-16; the tiny GPT's traces stay within 5e-16 over 50 steps, so 1e-10 allows a "
        "million-fold growth through the updates, while a batch-coupled layer moves them by >1e-2 "
        "within 5 steps",
    ),
    torch.float32: Tolerance(
        value=1e-4,
        reason="largest relative difference of each trace over at most 50 steps. float32 rounds at "
        "6e-8; the tiny GPT's traces stay within 2.2e-7 over 50 steps, so 1e-4 leaves 400x for "
        "models whose rounding compounds faster, while a batch-coupled layer moves them by >1e-2 "
        "within 5 steps",
    ),
    torch.bfloat16: Tolerance(
        value=5e-2,
        reason="largest relative difference of each trace over at most 50 steps. bfloat16 keeps 8 "
        "significant bits (one ulp is 7.8e-3 relative) and the gradient norm of bf16 gradients moves "
        "by about one ulp between partitionings (7.5e-3 at most on the tiny GPT over 50 steps): "
        "5e-2 is ~6 ulps. Only gross errors show at this precision; the float64 stage is the fine check",
    ),
    torch.float16: Tolerance(
        value=1e-2,
        reason="largest relative difference of each trace over at most 50 steps. float16 keeps 11 "
        "significant bits (one ulp is 9.8e-4 relative); the tiny GPT's traces differ by at most 9e-4 "
        "over 50 steps, and 1e-2 is ~10 ulps",
    ),
}
"""Trace tolerances per production precision, for windows of up to ``MAX_TRACE_STEPS`` steps."""
