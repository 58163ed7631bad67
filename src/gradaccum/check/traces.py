"""Stage 2 of the equivalence check: loss and gradient-norm traces in production precision.

After the full-precision diagnostic (:mod:`gradaccum.check.equivalence`), the seeds' acceptance test restores
production precision and compares two partitionings over a predeclared window of optimizer steps:
the same initial weights, the same batches (step ``s`` draws ``make_batch(n, seed + s)``), random
layers off, and nothing different but how each batch is cut. Rounding differs between the two cuts
and compounds through the updates, so the tolerance is declared per dtype for a short window.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn

from gradaccum.batch import batch_size, cast, split, split_sizes
from gradaccum.check.controls import randomness_off
from gradaccum.check.report import TraceReport
from gradaccum.check.tolerances import MAX_TRACE_STEPS, TRACE_TOLERANCES
from gradaccum.check.workload import Workload
from gradaccum.errors import PlanError, WorkloadError
from gradaccum.precision import dtype_name
from gradaccum.step.accumulator import Accumulator
from gradaccum.step.config import AccumConfig

__all__ = ["MAX_TRACE_STEPS", "TraceReport", "compare_traces"]


class _Trace:
    def __init__(self) -> None:
        self.loss: list[float] = []
        self.grad_norm: list[float] = []
        self.skipped: list[str] = []
        self.first_sizes: list[int] = []  # the first step's (a token budget's vary by step)


Cut = Callable[[Any], list[Any]]
"""How one step's batch becomes the window of micro-batches a side steps."""


def _by_sizes(sizes: list[int]) -> Cut:
    return lambda batch: split(batch, sizes=sizes)


def _by_tokens(max_tokens: int, world: int) -> Cut:
    from gradaccum.tokens.split import split_by_tokens

    def cut(batch: Any) -> list[Any]:
        return [
            mb for rank in range(world) for mb in split_by_tokens(batch, max_tokens, rank=rank, world=world)
        ]

    return cut


def _run(
    workload: Workload,
    cut: Cut,
    total: int,
    steps: int,
    dtype: torch.dtype,
    where: torch.device,
    seed: int,
    accum: AccumConfig,
) -> _Trace:
    torch.manual_seed(seed)
    model = workload.build_model()
    if not isinstance(model, nn.Module):
        raise WorkloadError(
            f"workload {workload.name!r}: build_model() returned {type(model).__name__}, "
            "not a torch.nn.Module"
        )
    model = model.to(device=where, dtype=dtype)
    optimizer = workload.optimizer_factory(model.parameters())
    # a loss that is not a sum over count_fn's units is named by the trace's figures (and verify's
    # denominator audit) rather than refused by the step (AccumConfig.check_loss_reduction)
    acc = Accumulator(
        model, optimizer, config=replace(accum, track_grad_norm=True, check_loss_reduction=False)
    )
    trace = _Trace()
    with randomness_off(model):
        for step in range(steps):
            batch = cast(workload.make_batch(total, seed + step), dtype, where)
            torch.manual_seed(seed + step)  # any randomness left draws the same on both sides
            window = cut(batch)
            if step == 0:
                trace.first_sizes = [batch_size(mb) for mb in window]
            result = acc.step(window, workload.loss_fn, workload.count_fn)
            trace.loss.append(math.nan if result.loss is None or not result.applied else result.loss)
            trace.grad_norm.append(math.nan if result.grad_norm is None else result.grad_norm)
            if not result.applied:
                sizes = [batch_size(mb) for mb in window]
                trace.skipped.append(f"step {step} of {sizes}: {result.skip_reason}")
    return trace


def _max_rel_diff(baseline: Sequence[float], candidate: Sequence[float]) -> float:
    """Largest relative difference over the steps both sides applied (inf if one side is NaN alone)."""
    worst = 0.0
    for a, b in zip(baseline, candidate, strict=True):
        if math.isnan(a) and math.isnan(b):
            continue
        if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
            return math.inf
        worst = max(worst, abs(b - a) / max(abs(a), 1e-300))
    return worst


def compare_traces(
    workload: Workload,
    *,
    baseline_sizes: Sequence[int],
    candidate_sizes: Sequence[int],
    steps: int = 5,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str = "cpu",
    accum: AccumConfig | None = None,
    candidate_accum: AccumConfig | None = None,
    candidate_max_tokens: int | None = None,
    candidate_world: int = 1,
) -> TraceReport:
    """Run ``steps`` optimizer steps of both partitionings and compare their loss and norm traces.

    Both partitions must cut the same number of examples (e.g. ``[8]`` against ``[2, 2, 2, 2]``).
    The model and floating inputs are cast to ``dtype`` (pure low precision: the harsher case;
    autocast is not applied). ``accum``: the accumulator settings both sides run with (the
    production ones: clipping, skip policy); the gradient norm is always tracked.
    ``candidate_accum``: the candidate's settings where they differ from the baseline's (e.g.
    ``scaling="post"`` against ``"pre"``); ``None``: the same as ``accum``.
    ``candidate_max_tokens``: the candidate cuts each step's batch by this token budget instead
    (:func:`gradaccum.split_by_tokens`, every one of ``candidate_world`` ranks' micro-batches, in
    rank order, accumulated here on one process, as the exact step makes them add up under DDP);
    ``candidate_sizes`` then only says how many examples a step draws.
    """
    if not isinstance(workload, Workload):
        raise WorkloadError(f"compare_traces needs a gradaccum.Workload, got {type(workload).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_TRACE_STEPS:
        raise PlanError(
            f"steps must be an integer from 1 to {MAX_TRACE_STEPS} (the window the trace tolerances "
            f"are declared for), got {steps!r}"
        )
    if dtype not in TRACE_TOLERANCES:
        known = ", ".join(dtype_name(d) for d in TRACE_TOLERANCES)
        raise PlanError(f"compare_traces declares tolerances for {known}; got {dtype}")
    base = split_sizes(sum(baseline_sizes), sizes=baseline_sizes)
    cand = split_sizes(sum(candidate_sizes), sizes=candidate_sizes)
    if sum(base) != sum(cand):
        raise PlanError(
            f"baseline_sizes {base} cut {sum(base)} examples and candidate_sizes {cand} cut "
            f"{sum(cand)}: both partitionings must cover the same batch"
        )
    where = torch.device(device)
    tol = TRACE_TOLERANCES[dtype]
    with torch.random.fork_rng(devices=[where.index or 0] if where.type == "cuda" else []):
        a = _run(workload, _by_sizes(base), sum(base), steps, dtype, where, seed, accum or AccumConfig())
        cut = (
            _by_sizes(cand)
            if candidate_max_tokens is None
            else _by_tokens(candidate_max_tokens, candidate_world)
        )
        b = _run(
            workload, cut, sum(cand), steps, dtype, where, seed, candidate_accum or accum or AccumConfig()
        )
    loss_diff = _max_rel_diff(a.loss, b.loss)
    norm_diff = _max_rel_diff(a.grad_norm, b.grad_norm)
    same_skips = [math.isnan(x) for x in a.loss] == [math.isnan(x) for x in b.loss]
    return TraceReport(
        passed=same_skips and loss_diff <= tol.value and norm_diff <= tol.value,
        steps=steps,
        dtype=dtype_name(dtype),
        baseline_sizes=tuple(base),
        candidate_sizes=tuple(cand if candidate_max_tokens is None else b.first_sizes),
        baseline_loss=tuple(a.loss),
        candidate_loss=tuple(b.loss),
        baseline_grad_norm=tuple(a.grad_norm),
        candidate_grad_norm=tuple(b.grad_norm),
        loss_max_rel_diff=loss_diff,
        grad_norm_max_rel_diff=norm_diff,
        tol=tol,
        skipped=tuple(a.skipped + b.skipped),
        seed=seed,
        name=workload.name,
        device=str(where),
    )
