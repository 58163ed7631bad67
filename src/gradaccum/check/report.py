"""What both stages of the equivalence check share: declared tolerances, controlled conditions, reports.

Tolerances are declared per dtype with their reason before anything runs, and every report shows
them. Both stages cast the model and the floating inputs to one dtype and switch random layers off
(dropout only; normalization keeps its training mode) so that the partitionings differ in nothing but
how the batch is cut.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn

from gradaccum.batch import Batch
from gradaccum.errors import EquivalenceError
from gradaccum.hazards.scanner import Finding, stochastic_modules

__all__ = [
    "GRAD_TOLERANCES",
    "PARAM_TOLERANCES",
    "TRACE_TOLERANCES",
    "EquivalenceReport",
    "ParamRow",
    "Tolerance",
    "TraceReport",
    "cast_batch",
    "disable_stochastic",
    "dtype_name",
]


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


class ParamRow(NamedTuple):
    """One parameter's errors: ``(name, grad_rel_err, param_abs_diff)``."""

    name: str
    grad_rel_err: float
    """Relative L2 error of the accumulated gradient (floored by ``check.equivalence.FLOOR_RATIO``)."""
    param_abs_diff: float
    """Largest absolute difference after one optimizer update."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EquivalenceReport:
    """The outcome of one equivalence check."""

    passed: bool
    """Gradients and parameters both within their tolerances."""
    grad_max_rel_err: float
    """Worst per-parameter relative L2 error of the gradient, before clipping."""
    param_max_abs_diff: float
    """Worst absolute parameter difference after one optimizer update."""
    grad_tol: Tolerance
    param_tol: Tolerance
    worst: tuple[ParamRow, ...]
    """Every parameter, worst gradient error first."""
    likely_causes: tuple[str, ...]
    """Why it failed, most specific first; empty when it passed."""
    sizes: tuple[int, ...]
    """The partition of the batch into micro-batches (examples per micro-batch)."""
    dtype: str
    """The diagnostic precision, e.g. ``float64``."""
    counts: tuple[int, ...] = ()
    """Units ``count_fn`` counts in each micro-batch; their sum is the denominator N."""
    unit: str = "units"
    """What ``count_fn`` counts ("tokens", "examples")."""
    reference_loss: float = math.nan
    """The full-batch loss (summed loss / N) at the initial weights."""
    candidate_loss: float | None = None
    """The accumulated step's loss (None for a custom ``candidate_step``)."""
    buffer_max_abs_diff: float | None = None
    """Worst difference of floating buffers (running statistics) after the step; not part of
    ``passed``, which is about the update. None when the model has none."""
    findings: tuple[Finding, ...] = ()
    """The scan of the model for this partition, the declared hazards included."""
    disabled: tuple[str, ...] = ()
    """Paths of the random layers switched off for the diagnostic."""
    candidate: str = "Accumulator.step"
    """What produced the accumulated update."""
    name: str = ""
    """The workload's name, when there is one."""
    device: str = "cpu"

    @property
    def grad_passed(self) -> bool:
        return self.grad_max_rel_err <= self.grad_tol.value

    @property
    def param_passed(self) -> bool:
        return self.param_max_abs_diff <= self.param_tol.value

    @property
    def global_count(self) -> int:
        return sum(self.counts)

    def summary(self) -> str:
        """One line: the verdict and both errors against their tolerances."""
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{verdict}: gradient max rel err {self.grad_max_rel_err:.2e} (tol {self.grad_tol}), "
            f"parameter max abs diff {self.param_max_abs_diff:.2e} (tol {self.param_tol}), "
            f"{self.dtype}, micro-batches {list(self.sizes)}"
        )

    def raise_if_failed(self) -> EquivalenceReport:
        """Raise :class:`EquivalenceError` naming the likely causes unless the check passed."""
        if not self.passed:
            causes = "".join(f"\n  - {c}" for c in self.likely_causes)
            raise EquivalenceError(f"{self.name or 'the model'}: {self.summary()}; likely causes:{causes}")
        return self


def cast_batch(batch: Batch, dtype: torch.dtype, device: torch.device | str) -> Batch:
    """``batch`` on ``device`` with floating tensors in ``dtype`` (integer tensors keep theirs)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device=device, dtype=dtype if batch.is_floating_point() else batch.dtype)
    if isinstance(batch, Mapping):
        cast = {key: cast_batch(value, dtype, device) for key, value in batch.items()}
        try:
            return type(batch)(cast)  # type: ignore[call-arg]
        except TypeError:  # a mapping type that cannot be built from a dict
            return cast
    if isinstance(batch, (tuple, list)):
        values = [cast_batch(value, dtype, device) for value in batch]
        return type(batch)(*values) if hasattr(batch, "_fields") else type(batch)(values)
    return batch


def disable_stochastic(model: nn.Module) -> tuple[str, ...]:
    """Switch off the random layers the scan recognises, leaving normalization's mode alone.

    Dropout-like modules go to eval mode; MultiheadAttention gets ``dropout=0``. Fractional max
    pooling cannot be switched off and stays (the reproducibility probe reports it).
    """
    disabled = []
    for path, module in list(stochastic_modules(model)):
        if isinstance(module, nn.MultiheadAttention):
            module.dropout = 0.0
        elif isinstance(module, (nn.FractionalMaxPool2d, nn.FractionalMaxPool3d)):
            continue
        else:
            module.eval()
        disabled.append(path)
    return tuple(disabled)


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


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float64`` -> ``"float64"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceReport:
    """Stage 2: loss and gradient-norm traces of two partitionings over the same optimizer steps."""

    passed: bool
    """Both traces within ``tol`` on every step, and the same steps skipped (if any) in both."""
    steps: int
    """Optimizer steps run on each side (the predeclared window)."""
    dtype: str
    """The production precision the model and inputs were cast to."""
    baseline_sizes: tuple[int, ...]
    """Micro-batch sizes of the baseline, usually the whole batch in one (``(8,)``)."""
    candidate_sizes: tuple[int, ...]
    """Micro-batch sizes of the candidate partitioning."""
    baseline_loss: tuple[float, ...]
    """Mean loss per step (NaN where the step was skipped)."""
    candidate_loss: tuple[float, ...]
    baseline_grad_norm: tuple[float, ...]
    """Gradient norm before clipping per step (NaN where skipped)."""
    candidate_grad_norm: tuple[float, ...]
    loss_max_rel_diff: float
    """Largest ``|candidate - baseline| / |baseline|`` over the loss trace."""
    grad_norm_max_rel_diff: float
    """Largest relative difference over the gradient-norm trace."""
    tol: Tolerance
    skipped: tuple[str, ...] = ()
    """Steps skipped by either side, with the reason."""
    seed: int = 0
    """Seed of the initialization; step ``s`` draws its batch with seed ``seed + s``."""
    name: str = ""
    device: str = "cpu"

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{verdict}: over {self.steps} steps in {self.dtype}, loss max rel diff "
            f"{self.loss_max_rel_diff:.2e}, gradient-norm max rel diff {self.grad_norm_max_rel_diff:.2e} "
            f"(tol {self.tol}), {list(self.baseline_sizes)} vs {list(self.candidate_sizes)}"
        )
