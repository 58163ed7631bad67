"""Steps 1 and 2 of the acceptance protocol: the float64 equivalence check of each partitioning
against the full batch, and the production-precision traces of both, run in this process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gradaccum.batch import select
from gradaccum.bench.accept_spec import AcceptSpec, Arm
from gradaccum.bench.verdict import ParamCheck, TraceCheck
from gradaccum.check.workload import Workload
from gradaccum.plan import BatchPlan
from gradaccum.precision import dtype_of
from gradaccum.tokens.split import plan_batch

__all__ = ["Equivalence", "check_equivalence", "partition", "token_partition"]


def partition(plan: BatchPlan) -> list[int]:
    """The plan's micro-batch sizes over the whole global batch, as one process sees it.

    Under DP each rank sums its share and DDP averages; the exact step makes that equal to one
    process accumulating all ``dp x accum_steps`` micro-batches, which is what the check runs.
    """
    return [plan.micro_batch] * (plan.accum_steps * plan.dp)


def token_partition(batch: Any, max_tokens: int, dp: int) -> tuple[Any, list[int]]:
    """A token budget's micro-batches as one process sees them: the batch's rows in the order of
    every rank's micro-batches (:func:`gradaccum.split_by_tokens`), and their sizes.

    The full-batch update does not depend on the order of rows, so the check cuts this reordered
    batch by these sizes; each micro-batch is left at the batch's length (trimming only removes
    padding, which :mod:`gradaccum.check.traces` steps as trimmed).
    """
    plan = plan_batch(batch, max_tokens, world=dp)
    groups = [rows for rank in plan.ranks for rows in rank]
    order = torch.tensor([i for rows in groups for i in rows], dtype=torch.long)
    return select(batch, order), [len(rows) for rows in groups]


@dataclass(frozen=True, kw_only=True, slots=True)
class Equivalence:
    """Steps 1 and 2: the float64 checks of both partitionings and the trace comparison."""

    params: tuple[ParamCheck, ...]
    """Baseline and candidate against the full batch, float64."""
    trace: TraceCheck
    """Production-precision traces of both."""
    details: dict[str, Any] = field(default_factory=dict)
    """The underlying reports as plain data (for results.json)."""


def _plain(obj: Any) -> Any:
    """A JSON-ready copy of a report (dataclass, tuple, tensor, dtype ...)."""
    if hasattr(obj, "__dataclass_fields__"):
        return {name: _plain(getattr(obj, name)) for name in obj.__dataclass_fields__}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def check_equivalence(spec: AcceptSpec, workload: Workload) -> Equivalence:
    """Run the ``verify`` machinery on both partitionings (float64) and compare traces.

    The float64 check cuts one global batch (``make_batch(global_batch, seed)``) both ways, each
    against that batch in one forward/backward; the traces run ``trace_steps`` updates of both.
    """
    # imported here so that measurement works without the checks
    from gradaccum.check.equivalence import compare_traces, verify

    params = []
    details: dict[str, Any] = {}
    batch = workload.make_batch(spec.baseline.global_batch, spec.settings.seed)
    arms: tuple[Arm, Arm] = ("baseline", "candidate")
    for name in arms:
        plan = spec.plan_of(name)
        budget = spec.max_tokens_of(name)
        rows, sizes = (batch, partition(plan)) if budget is None else token_partition(batch, budget, plan.dp)
        report = verify(
            workload.build_model,
            rows,
            workload.loss_fn,
            workload.count_fn,
            sizes=sizes,
            optimizer_factory=workload.optimizer_factory,
            dtype=torch.float64,
            device=spec.settings.device,
            declared_hazards=workload.declared_hazards,
            seed=spec.settings.seed,
            name=workload.name,
            unit=workload.unit,
            scaling=spec.scaling_of(name),
        )
        details[f"equivalence_{name}"] = _plain(report)
        params.append(
            ParamCheck(
                label=f"{name} {spec.label_of(name)}",
                grad_max_rel_err=float(report.grad_max_rel_err),
                grad_tol=float(report.grad_tol),
                param_max_abs_diff=float(report.param_max_abs_diff),
                param_tol=float(report.param_tol),
                passed=bool(report.passed),
                causes=tuple(str(c) for c in report.likely_causes),
            )
        )
    trace = compare_traces(
        workload,
        baseline_sizes=partition(spec.baseline),
        candidate_sizes=partition(spec.candidate),
        steps=spec.trace_steps,
        dtype=dtype_of(spec.settings.precision),
        seed=spec.settings.seed,
        device=spec.settings.device,
        accum=spec.accum_of("baseline"),
        candidate_accum=spec.accum_of("candidate"),
        candidate_max_tokens=spec.candidate_max_tokens,
        candidate_world=spec.candidate.dp,
    )
    details["trace"] = _plain(trace)
    return Equivalence(
        params=tuple(params),
        trace=TraceCheck(passed=bool(trace.passed), figure=_trace_figure(trace)),
        details=details,
    )


def _trace_figure(trace: Any) -> str:
    """The trace report's one-line summary, without its own PASS/FAIL (the verdict shows that)."""
    text = str(trace.summary())
    for prefix in ("PASS: ", "FAIL: "):
        text = text.removeprefix(prefix)
    if trace.skipped:
        text += f"; skipped: {'; '.join(trace.skipped)}"
    return text
