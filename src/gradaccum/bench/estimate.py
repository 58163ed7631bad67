"""A plan's memory, estimated before any work starts from one small probe of the workload.

A plan of a million examples per micro-batch should be refused in a second, naming the figures,
not after building a million-example batch and failing to allocate 8 GB with a message that blames
``loss_fn``. The probe builds the model once, runs one example forward and backward with
saved-tensor hooks and one optimizer step, and scales:

    data      = bytes of one example (``make_batch(1, seed)``) x examples materialized at once
    training  = persistent (parameters, gradients, optimizer state) + activations of one example
                x micro_batch
    check     = what ``verify`` needs in float64: two models and the whole global batch in one
                forward (its reference), i.e. 2 x persistent64 + activations64 x global_batch

Activations are taken as proportional to the examples per forward, which holds for the per-example
work of most models; kernels' working memory and the allocator's slack come on top, so the estimate
is a floor: what it refuses cannot fit, what it admits may still run out of memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from gradaccum.batch import Batch, batch_size, cast
from gradaccum.bench.memory import persistent_bytes, saved_bytes
from gradaccum.check.workload import Workload
from gradaccum.plan import BatchPlan
from gradaccum.precision import param_dtype

__all__ = ["PlanEstimate", "Probe", "estimate", "probe"]


def _fmt(value: float) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def _tensor_bytes(batch: Batch) -> int:
    total = 0
    stack: list[object] = [batch]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


@dataclass(frozen=True, kw_only=True, slots=True)
class Probe:
    """One example of a workload, measured: the figures every plan's estimate scales from."""

    persistent_bytes: int
    """Parameters + gradients + optimizer state, at the probe's dtype."""
    activation_bytes_per_example: int
    """Bytes one example's forward saves for backward."""
    data_bytes_per_example: int
    """Bytes of one example as ``make_batch`` returns it."""
    dtype_bytes: int
    """Bytes per floating element of the probe (4 for float32)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanEstimate:
    """The estimated peak of one plan, by term."""

    plan: BatchPlan
    data_bytes: int
    """The global batch materialized at once (every rank draws it, then keeps its slice)."""
    training_bytes: int
    """Persistent state plus one micro-batch's activations, at production precision."""
    check_bytes: int
    """The float64 equivalence check's models and whole-batch forward (0 when none runs)."""

    @property
    def total_bytes(self) -> int:
        return self.data_bytes + max(self.training_bytes, self.check_bytes)

    def describe(self) -> str:
        parts = [
            f"the global batch of {self.plan.global_batch:,} examples {_fmt(self.data_bytes)}",
            f"training {_fmt(self.training_bytes)} (persistent state + activations of a micro-batch of "
            f"{self.plan.micro_batch:,})",
        ]
        if self.check_bytes:
            parts.append(
                f"the float64 check {_fmt(self.check_bytes)} (two models and the whole global batch in "
                "one forward)"
            )
        return f"about {_fmt(self.total_bytes)}: " + "; ".join(parts)


def probe(workload: Workload, *, precision: str = "float32", device: torch.device | str = "cpu") -> Probe:
    """Measure one example of ``workload``: one forward and backward and one optimizer step."""
    where = torch.device(device)
    dtype = param_dtype(precision)
    with torch.random.fork_rng(devices=[where.index or 0] if where.type == "cuda" else []):
        model: nn.Module = workload.build_model().to(device=where, dtype=dtype)
        optimizer = workload.optimizer_factory(model.parameters())
        example = workload.make_batch(1, 0)
        data = _tensor_bytes(example)
        moved = cast(example, dtype, where)
        batch_size(moved)  # a malformed batch is refused here, naming the problem
        with saved_bytes(model) as saved:
            loss = workload.loss_fn(model, moved)
        loss.backward()
        optimizer.step()  # materializes the optimizer's state
        persistent = sum(persistent_bytes(model, optimizer))
        optimizer.zero_grad(set_to_none=True)
    return Probe(
        persistent_bytes=persistent,
        activation_bytes_per_example=saved.bytes,
        data_bytes_per_example=data,
        dtype_bytes=torch.finfo(dtype).bits // 8,
    )


def estimate(figures: Probe, plan: BatchPlan, *, check: bool = False) -> PlanEstimate:
    """The peak of ``plan`` (one rank's), scaled from one example; ``check`` adds verify's float64 pass."""
    widen = 8 / figures.dtype_bytes  # float64 against the probe's dtype
    check_bytes = 0
    if check:
        check_bytes = int(
            2 * figures.persistent_bytes * widen
            + figures.activation_bytes_per_example * widen * plan.global_batch
        )
    return PlanEstimate(
        plan=plan,
        data_bytes=figures.data_bytes_per_example * plan.global_batch,
        training_bytes=figures.persistent_bytes + figures.activation_bytes_per_example * plan.micro_batch,
        check_bytes=check_bytes,
    )
