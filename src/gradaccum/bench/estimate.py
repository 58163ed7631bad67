"""A plan's memory, estimated before any work starts from one small probe of the workload.

A plan of a million examples per micro-batch should be refused in a second, naming the figures,
not after building a million-example batch and failing to allocate 8 GB with a message that blames
``loss_fn``. The probe builds the model once, runs one example forward and backward with
saved-tensor hooks and one optimizer step, then one forward of two examples, and scales:

    data      = bytes of one example (``make_batch(1, seed)``) x examples materialized at once
    training  = persistent (parameters, gradients, optimizer state) + fixed activations
                + activations per example x micro_batch
    check     = what ``verify`` needs in float64: two models and the whole global batch in one
                forward (its reference), i.e. 2 x persistent64 + activations64 of the global batch

The activations per example are what the second example adds (the two-example forward's saved
bytes minus the one-example forward's), and the rest of the one-example figure is fixed: buffers
saved for backward that do not grow with the batch, such as a causal mask, are counted once, not
once per example. Activations are assumed to grow linearly with the examples per forward, which
holds for the per-example work of most models but is not proven for every model; kernels' working
memory and the allocator's slack come on top. So this is an estimate, not a bound: a plan is
refused only when the estimate exceeds the free memory, and a plan it admits may still run out.
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
    """Bytes each example adds to what a forward saves for backward (two examples minus one)."""
    fixed_activation_bytes: int = 0
    """Saved bytes that do not grow with the examples per forward (e.g. a causal mask): the
    one-example figure minus the per-example one."""
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
        # a second example: what grows with the batch, apart from what does not (a causal mask)
        del loss
        with saved_bytes(model) as saved_two:
            two = workload.loss_fn(model, cast(workload.make_batch(2, 0), dtype, where))
        del two
        optimizer.zero_grad(set_to_none=True)
    per_example = max(0, saved_two.bytes - saved.bytes)
    return Probe(
        persistent_bytes=persistent,
        activation_bytes_per_example=per_example,
        fixed_activation_bytes=max(0, saved.bytes - per_example),
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
            + (figures.fixed_activation_bytes + figures.activation_bytes_per_example * plan.global_batch)
            * widen
        )
    return PlanEstimate(
        plan=plan,
        data_bytes=figures.data_bytes_per_example * plan.global_batch,
        training_bytes=figures.persistent_bytes
        + figures.fixed_activation_bytes
        + figures.activation_bytes_per_example * plan.micro_batch,
        check_bytes=check_bytes,
    )
