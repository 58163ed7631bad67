"""How much error accumulating a low-precision gradient over k micro-batches adds.

The gradient the optimizer sees after one window of k micro-batches on parameters of ``dtype``
(bfloat16, float16), compared with the float64 full-batch gradient *on the same weights* (the
low-precision weights widened exactly): relL2 = |g - g64| / |g64|. At k = 1 the error is the
model's own low-precision arithmetic; what k adds on top is the accumulation's rounding, which
``AccumConfig(accum_dtype="float32")`` removes (:mod:`gradaccum.step.accum_dtype`). ``verify``,
``benchmarks/precision.py`` and the tests measure with this one function, through the library's
own step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from gradaccum.batch import Batch, batch_size, cast, split
from gradaccum.errors import PlanError
from gradaccum.step.accumulator import Accumulator
from gradaccum.step.config import Scaling

__all__ = [
    "AccumulationError",
    "GradientProbe",
    "PrecisionReport",
    "accumulation_error",
    "accumulation_errors",
    "precision_report",
]


class GradientProbe(torch.optim.Optimizer):
    """An optimizer that records the gradients its ``step`` is handed and changes nothing."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        super().__init__(list(params), {})
        self.seen: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.seen = [
            torch.zeros(p.shape, dtype=torch.float64) if p.grad is None else p.grad.to(torch.float64)
            for group in self.param_groups
            for p in group["params"]
        ]


@dataclass(frozen=True, kw_only=True, slots=True)
class AccumulationError:
    """One measurement: relL2 of the optimizer's gradient against the float64 full batch."""

    accum_steps: int
    """k: micro-batches in the window (the global batch is the same for every k)."""
    accum_dtype: str | None
    """What the gradients were accumulated in (``None``: the parameters' dtype)."""
    rel_l2: float
    """|g - g64| / |g64|."""


def _flat(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def _reference(
    model: nn.Module, batch: Batch, loss_fn: Callable[..., torch.Tensor], count: float
) -> torch.Tensor:
    wide = copy.deepcopy(model).to(torch.float64)
    wide.zero_grad(set_to_none=True)
    (loss_fn(wide, cast(batch, torch.float64)) / count).backward()
    return _flat([torch.zeros_like(p) if p.grad is None else p.grad for p in wide.parameters()])


def accumulation_errors(
    model: nn.Module,
    batch: Batch,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    count_fn: Callable[[Any], Any],
    *,
    accum_steps: Sequence[int],
    accum_dtypes: Sequence[str | None] = (None, "float32"),
    dtype: torch.dtype = torch.bfloat16,
    scaling: Scaling = "pre",
) -> list[AccumulationError]:
    """relL2 for every k in ``accum_steps`` and every accumulation dtype, on one set of weights.

    ``model`` is cast to ``dtype`` once (those weights are the reference's too); ``batch`` is the
    global batch, split into k equal micro-batches (k must divide it); ``loss_fn(model, mb)``
    returns the micro-batch's summed loss, ``count_fn(mb)`` its units; ``scaling``: the step's.
    """
    size = batch_size(batch)
    bad = [k for k in accum_steps if k < 1 or size % k]
    if bad:
        raise PlanError(
            f"accum_steps {bad} must divide the batch of {size} examples into equal micro-batches"
        )
    low = copy.deepcopy(model).to(dtype)
    count = float(sum(float(count_fn(mb)) for mb in split(batch, 1)))
    reference = _reference(low, batch, loss_fn, count)
    norm = float(torch.linalg.vector_norm(reference))
    results = []
    for accum_dtype in accum_dtypes:
        for k in accum_steps:
            trial = copy.deepcopy(low)
            probe = GradientProbe(trial.parameters())
            step = Accumulator(trial, probe, accum_dtype=accum_dtype, scaling=scaling)
            step.step(split(cast(batch, dtype), size // k), loss_fn, count_fn)
            error = float(torch.linalg.vector_norm(_flat(probe.seen) - reference)) / norm
            results.append(AccumulationError(accum_steps=k, accum_dtype=accum_dtype, rel_l2=error))
    return results


def accumulation_error(
    model: nn.Module,
    batch: Batch,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    count_fn: Callable[[Any], Any],
    *,
    accum_steps: int,
    accum_dtype: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> float:
    """relL2 of one window of ``accum_steps`` micro-batches (see :func:`accumulation_errors`)."""
    (result,) = accumulation_errors(
        model, batch, loss_fn, count_fn, accum_steps=[accum_steps], accum_dtypes=[accum_dtype], dtype=dtype
    )
    return result.rel_l2


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionReport:
    """What ``verify --precision bfloat16`` prints: the accumulation error at the user's k beside k = 1."""

    dtype: str
    """The parameters' dtype measured (``bfloat16``/``float16``)."""
    accum_steps: int
    """The user's k."""
    at_one: float
    """relL2 at k = 1: the model's own low-precision arithmetic."""
    narrow: float
    """relL2 at k, gradients accumulated in the parameters' dtype (``accum_dtype=None``)."""
    wide: float
    """relL2 at k with ``accum_dtype="float32"``."""

    def lines(self) -> list[str]:
        k, base = self.accum_steps, self.at_one
        return [
            f"{self.dtype} parameters, relL2 of the optimizer's gradient vs the float64 full batch:",
            f"  k=1: {base:.3g}",
            f"  k={k}, .grad in {self.dtype}: {self.narrow:.3g} (x{self.narrow / base:.2f})",
            f"  k={k}, accum_dtype='float32': {self.wide:.3g} (x{self.wide / base:.2f})",
        ]


def precision_report(
    model: nn.Module,
    batch: Batch,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    count_fn: Callable[[Any], Any],
    *,
    accum_steps: int,
    dtype: torch.dtype,
) -> PrecisionReport:
    """The accumulation error of ``model`` in ``dtype`` at ``accum_steps`` beside k = 1."""
    found = accumulation_errors(
        model, batch, loss_fn, count_fn, accum_steps=sorted({1, accum_steps}), dtype=dtype
    )
    at = {(r.accum_dtype, r.accum_steps): r.rel_l2 for r in found}
    return PrecisionReport(
        dtype=str(dtype).removeprefix("torch."),
        accum_steps=accum_steps,
        at_one=at[(None, 1)],
        narrow=at[(None, accum_steps)],
        wide=at[("float32", accum_steps)],
    )
