"""The two runs the equivalence check compares, and how it compares them: fresh models from the
same weights, the full-batch reference update, snapshots of gradients and parameters, and the
per-parameter errors."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from gradaccum.batch import Batch
from gradaccum.check.report import ParamRow
from gradaccum.check.workload import OptimizerFactory
from gradaccum.errors import CountError, LossError, WorkloadError
from gradaccum.step.accumulator import Accumulator, CountFn, LossFn
from gradaccum.step.config import Scaling

__all__ = [
    "FLOOR_RATIO",
    "CandidateStep",
    "Run",
    "buffer_diff",
    "candidate_run",
    "compare",
    "fresh",
    "host_count",
    "reference",
    "same_start",
    "snapshot",
]

CandidateStep = Callable[[nn.Module, torch.optim.Optimizer, list[Any]], None]
"""``candidate_step(model, optimizer, micro_batches)``: performs one accumulated update in place of
``Accumulator.step``, leaving the accumulated (unclipped) gradient in ``.grad`` after stepping."""

FLOOR_RATIO = 1e-3
"""A parameter's relative error is measured against at least this fraction of the whole model's
gradient norm: a gradient that is exactly zero in theory (a bias before BatchNorm) holds only
rounding noise, and noise over noise says nothing."""


def host_count(value: object, where: str) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value.item())
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise CountError(f"count_fn returned {value!r} for {where}; it must return an int or integer tensor")


def fresh(
    build_model: Callable[[], nn.Module], dtype: torch.dtype, device: torch.device, seed: int
) -> nn.Module:
    torch.manual_seed(seed)  # a build_model that draws from the global generator builds the same weights
    model = build_model()
    if not isinstance(model, nn.Module):
        raise WorkloadError(
            f"build_model() returned {type(model).__name__}; it must return a torch.nn.Module"
        )
    return model.to(device=device, dtype=dtype)


def same_start(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        if x.shape != y.shape or not torch.equal(x, y):
            raise WorkloadError(
                f"build_model() returned different initial weights on two calls (first difference: "
                f"`{name}`); the check compares two fresh models, so fix the initialization inside "
                "build_model (torch.manual_seed in a torch.random.fork_rng block)."
            )


class Run(NamedTuple):
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    loss: float | None
    skip_reason: str | None = None


def snapshot(model: nn.Module, loss: float | None, skip_reason: str | None = None) -> Run:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers() if b.is_floating_point()}
    return Run(grads, params, buffers, loss, skip_reason)


def reference(
    model: nn.Module, batch: Batch, loss_fn: LossFn, count_fn: CountFn, factory: OptimizerFactory
) -> Run:
    """The whole batch in one forward/backward, then one optimizer update."""
    count = host_count(count_fn(batch), "the whole batch")
    if count <= 0:
        raise CountError(
            f"count_fn counts {count} units in the whole verification batch; the full-batch mean is "
            "undefined. Verify on a batch with at least one counted unit."
        )
    optimizer = factory(model.parameters())
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.requires_grad:
        raise LossError(
            f"loss_fn(model, batch) returned {type(loss).__name__}"
            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; it must return a scalar "
            "that requires grad: the loss summed over the counted units"
        )
    (loss / count).backward()
    grads = snapshot(model, None).grads  # before the update: what the candidate must match
    optimizer.step()
    return snapshot(model, float(loss.detach()) / count)._replace(grads=grads)


def candidate_run(
    model: nn.Module,
    micro: list[Any],
    loss_fn: LossFn,
    count_fn: CountFn,
    factory: OptimizerFactory,
    candidate_step: CandidateStep | None,
    scaling: Scaling = "pre",
) -> Run:
    optimizer = factory(model.parameters())
    if candidate_step is not None:
        candidate_step(model, optimizer, micro)
        return snapshot(model, None)
    # verify measures the loss as given: a mean is named, with its fix, by verify's own report
    # (the denominator audit) rather than refused by the step (AccumConfig.check_loss_reduction)
    acc = Accumulator(model, optimizer, scaling=scaling, check_loss_reduction=False)
    result = acc.step(micro, loss_fn, count_fn)
    return snapshot(model, result.loss, result.skip_reason)


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.detach().to(torch.float64)))


def compare(names: list[str], ref: Run, cand: Run) -> list[ParamRow]:
    """Per-parameter errors; a missing gradient counts as zero (what an optimizer sees)."""
    total = math.sqrt(sum(_norm(g) ** 2 for g in ref.grads.values()))
    floor = FLOOR_RATIO * total
    rows = []
    for name in names:
        want, got = ref.grads.get(name), cand.grads.get(name)
        present = [g for g in (want, got) if g is not None]
        if not present:
            rel = 0.0
        else:
            zero = torch.zeros_like(present[0])
            diff = _norm((zero if got is None else got) - (zero if want is None else want))
            denom = max(0.0 if want is None else _norm(want), floor)
            rel = diff / denom if denom > 0 else (0.0 if diff == 0 else math.inf)
        moved = float((cand.params[name] - ref.params[name]).abs().max()) if ref.params[name].numel() else 0.0
        rows.append(ParamRow(name, _nan_to_inf(rel), _nan_to_inf(moved)))
    rows.sort(key=lambda r: (r.grad_rel_err, r.param_abs_diff), reverse=True)
    return rows


def _nan_to_inf(x: float) -> float:
    return math.inf if math.isnan(x) else x


def buffer_diff(ref: Run, cand: Run) -> float | None:
    diffs = [float((cand.buffers[n] - b).abs().max()) for n, b in ref.buffers.items() if b.numel()]
    return max(diffs) if diffs else None
