"""The reports of the equivalence check: the float64 diagnostic's and the production traces'."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from gradaccum.check.audit import CountAudit, summarize_audits
from gradaccum.check.tolerances import Tolerance
from gradaccum.errors import EquivalenceError
from gradaccum.fielddocs import document_fields
from gradaccum.hazards.scanner import Finding

__all__ = ["EquivalenceReport", "ParamRow", "TraceReport", "describe_sizes"]


def describe_sizes(sizes: tuple[int, ...] | list[int]) -> str:
    """Micro-batch sizes in words: ``4 micro-batches of 8 examples``, or the list when they differ."""
    parts = list(sizes)
    if parts and len(set(parts)) == 1:
        n = len(parts)
        return f"{n} micro-batch{'es' if n != 1 else ''} of {parts[0]} example{'s' if parts[0] != 1 else ''}"
    return f"micro-batches of {parts} examples"


class ParamRow(NamedTuple):
    """One parameter's errors: ``(name, grad_rel_err, param_abs_diff)``."""

    name: str
    grad_rel_err: float
    """Relative L2 error of the accumulated gradient (floored by ``check.equivalence.FLOOR_RATIO``)."""
    param_abs_diff: float
    """Largest absolute difference after one optimizer update."""


@document_fields
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
    """The gradient tolerance for ``dtype``, with the arithmetic that justifies it."""
    param_tol: Tolerance
    """The parameter tolerance for ``dtype``, with its justification."""
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
    """The random sources switched off for the diagnostic (``h.0.attn.attn_dropout.p=0.1``), the
    same ones the scan reports; restored when the check returns."""
    audit: tuple[CountAudit, ...] = ()
    """The denominator audit of each micro-batch (empty when ``audit=False``)."""
    candidate: str = "Accumulator.step"
    """What produced the accumulated update."""
    name: str = ""
    """The workload's name, when there is one."""
    device: str = "cpu"
    """Where the diagnostic ran."""

    @property
    def grad_passed(self) -> bool:
        return self.grad_max_rel_err <= self.grad_tol.value

    @property
    def param_passed(self) -> bool:
        return self.param_max_abs_diff <= self.param_tol.value

    @property
    def audit_summary(self) -> str:
        """One line on the denominator: consistent, the first mismatch and its fix, or not audited."""
        return summarize_audits(self.audit) if self.audit else "not audited: the audit was turned off"

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

    def __str__(self) -> str:
        """A few lines to print: what was compared, the verdict with its errors, the denominator,
        and the likely causes of a failure (the dataclass's repr holds every parameter's row)."""
        what = f"{self.name}: " if self.name else ""
        lines = [
            f"{what}{self.candidate} over {describe_sizes(self.sizes)} against the full batch",
            f"  {self.summary()}",
            f"  denominator: {self.audit_summary}",
        ]
        lines += [f"  likely cause: {c}" for c in self.likely_causes]
        return "\n".join(lines)

    def raise_if_failed(self) -> EquivalenceReport:
        """Raise :class:`EquivalenceError` naming the likely causes unless the check passed."""
        if not self.passed:
            causes = "".join(f"\n  - {c}" for c in self.likely_causes)
            raise EquivalenceError(f"{self.name or 'the model'}: {self.summary()}; likely causes:{causes}")
        return self


@document_fields
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
    """The candidate's mean loss per step, the same way."""
    baseline_grad_norm: tuple[float, ...]
    """Gradient norm before clipping per step (NaN where skipped)."""
    candidate_grad_norm: tuple[float, ...]
    """The candidate's gradient norm per step, the same way."""
    loss_max_rel_diff: float
    """Largest ``|candidate - baseline| / |baseline|`` over the loss trace."""
    grad_norm_max_rel_diff: float
    """Largest relative difference over the gradient-norm trace."""
    tol: Tolerance
    """The relative tolerance both traces must keep, with its justification."""
    skipped: tuple[str, ...] = ()
    """Steps skipped by either side, with the reason."""
    seed: int = 0
    """Seed of the initialization; step ``s`` draws its batch with seed ``seed + s``."""
    name: str = ""
    """The workload's name, when there is one."""
    device: str = "cpu"
    """Where the traces ran."""

    def __str__(self) -> str:
        return f"{self.name}: {self.summary()}" if self.name else self.summary()

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{verdict}: over {self.steps} steps in {self.dtype}, loss max rel diff "
            f"{self.loss_max_rel_diff:.2e}, gradient-norm max rel diff {self.grad_norm_max_rel_diff:.2e} "
            f"(tol {self.tol}), baseline {describe_sizes(self.baseline_sizes)} vs candidate "
            f"{describe_sizes(self.candidate_sizes)}"
        )
