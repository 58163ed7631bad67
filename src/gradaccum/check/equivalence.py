"""The equivalence acceptance check: does the accumulated update equal the full-batch update?

The same examples in the same order run twice from the same initial weights: once as the whole
batch in one forward/backward (the reference, ``loss_fn(model, batch) / count_fn(batch)``), once
as micro-batches through :meth:`Accumulator.step` (or a ``candidate_step``). Full precision by
default; every random source the scan recognises is switched off (drop probabilities set to 0 and
restored afterwards; normalization keeps its training mode, because per-micro-batch statistics are
exactly what must show). Gradients are compared before clipping and parameters after one
optimizer update, against tolerances declared per dtype.

Both sides divide by the same ``count_fn``, so a wrong count cannot show in the gradients: a
denominator audit (:mod:`gradaccum.check.audit`) first checks, per micro-batch, that ``count_fn``
counts the output positions the summed loss actually uses; a mismatch fails the check.

On failure the likely causes come from the audit, the scan, the hazards the workload declares, and
cheap probes (:mod:`gradaccum.check.probes`). The production-precision trace stage is
:mod:`gradaccum.check.traces`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn as nn

from gradaccum.batch import Batch, batch_size, cast, split, split_sizes
from gradaccum.check.audit import CountAudit, audit_count
from gradaccum.check.controls import randomness_off
from gradaccum.check.probes import callable_name, factor_cause, likely_causes, probe_causes
from gradaccum.check.report import EquivalenceReport, ParamRow
from gradaccum.check.runs import (
    CandidateStep,
    buffer_diff,
    candidate_run,
    compare,
    fresh,
    host_count,
    reference,
    same_start,
)
from gradaccum.check.tolerances import GRAD_TOLERANCES, PARAM_TOLERANCES, Tolerance
from gradaccum.check.traces import TraceReport, compare_traces
from gradaccum.check.workload import OptimizerFactory, Workload, sgd
from gradaccum.errors import ConfigError, PlanError, WorkloadError
from gradaccum.hazards.scanner import scan
from gradaccum.precision import dtype_name
from gradaccum.step.accumulator import CountFn, LossFn
from gradaccum.step.config import SCALINGS, Scaling
from gradaccum.values import require_choice

__all__ = [
    "GRAD_TOLERANCES",
    "PARAM_TOLERANCES",
    "CandidateStep",
    "EquivalenceReport",
    "ParamRow",
    "Tolerance",
    "TraceReport",
    "compare_traces",
    "verify",
    "verify_workload",
]


def _tolerances(dtype: torch.dtype) -> tuple[Tolerance, Tolerance]:
    if dtype not in GRAD_TOLERANCES:
        supported = ", ".join(dtype_name(d) for d in GRAD_TOLERANCES)
        raise PlanError(
            f"verify runs its diagnostic in {supported}, not {dtype}: half-precision rounding "
            "(~1e-3) hides the weighting errors it must catch. Use float64 for the check and "
            "gradaccum.check.traces.compare_traces for production precision."
        )
    return GRAD_TOLERANCES[dtype], PARAM_TOLERANCES[dtype]


def verify(
    build_model: Callable[[], nn.Module],
    batch: Batch,
    loss_fn: LossFn,
    count_fn: CountFn,
    *,
    micro_batch: int | None = None,
    sizes: Sequence[int] | None = None,
    optimizer_factory: OptimizerFactory | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    candidate_step: CandidateStep | None = None,
    declared_hazards: Iterable[str] = (),
    seed: int = 0,
    name: str = "",
    unit: str = "units",
    audit: bool = True,
    compile: bool = False,
    scaling: Scaling = "pre",
) -> EquivalenceReport:
    """Check that accumulating ``batch`` in micro-batches gives the full-batch update.

    ``build_model()`` returns a fresh model with the same weights on every call; ``batch`` is a
    tensor, tuple or mapping of tensors sharing dim 0; ``loss_fn(model, micro_batch)`` returns the
    loss *summed* over the ``count_fn(micro_batch)`` units. Give ``micro_batch`` (which must divide
    the batch) or an explicit partition ``sizes`` such as ``[1, 3, 4]``. The optimizer defaults to
    SGD at lr 0.1, which shows gradient differences one-to-one in the parameters.

    ``audit`` (default on) first checks that ``count_fn`` counts the output positions the loss uses
    (see :mod:`gradaccum.check.audit`); turn it off only for a loss that gives some counted units an
    exactly zero gradient by design. It runs on this process alone (a plain model, no process group
    needed); the global random generator and every switched-off drop probability are restored on
    return.

    ``compile=True`` compiles the candidate's model in place (``nn.Module.compile()``, torch's
    default backend) and checks the compiled accumulation against the eager full-batch reference.

    ``scaling`` is the candidate accumulator's ``AccumConfig.scaling``: ``post`` checks the streamed
    window whose gradients are scaled once after it (the same tolerances: it adds one rounding).
    """
    require_choice("scaling", scaling, SCALINGS)
    if candidate_step is not None and scaling != "pre":
        raise ConfigError(
            f"scaling={scaling!r} sets the Accumulator that verify builds; a candidate_step replaces "
            "that Accumulator, so it would not apply. Build the scaling into candidate_step, or drop it."
        )
    parts = split_sizes(batch_size(batch), micro_batch, sizes)
    grad_tol, param_tol = _tolerances(dtype)
    factory = optimizer_factory or sgd
    where = torch.device(device)
    data = cast(batch, dtype, where)
    micro = split(data, sizes=parts)
    uniform = parts[0] if len(set(parts)) == 1 else None
    hazards = tuple(declared_hazards)
    devices = [where.index or 0] if where.type == "cuda" else []

    with torch.random.fork_rng(devices=devices), contextlib.ExitStack() as randomness:

        def build() -> nn.Module:
            model = fresh(build_model, dtype, where, seed)
            randomness.enter_context(randomness_off(model))  # restored when verify returns
            return model

        ref_model = fresh(build_model, dtype, where, seed)
        cand_model = fresh(build_model, dtype, where, seed)
        same_start(ref_model, cand_model)
        if compile:
            cand_model.compile()  # in place: the same parameters, names and weights
        findings = tuple(
            scan(cand_model, len(parts), micro_batch=uniform, declared_hazards=hazards, loss_fn=loss_fn)
        )
        disabled = randomness.enter_context(randomness_off(ref_model, cand_model))
        counts = [host_count(count_fn(mb), f"micro-batch {i}") for i, mb in enumerate(micro)]
        audits: tuple[CountAudit, ...] = ()
        if audit:
            audit_model = build()
            audits = tuple(audit_count(audit_model, mb, loss_fn, count_fn) for mb in micro)
        names = [n for n, _ in ref_model.named_parameters()]
        torch.manual_seed(seed)
        ref = reference(ref_model, data, loss_fn, count_fn, factory)
        torch.manual_seed(seed)
        cand = candidate_run(cand_model, micro, loss_fn, count_fn, factory, candidate_step, scaling)
        rows = compare(names, ref, cand)
        grad_err = max((r.grad_rel_err for r in rows), default=0.0)
        param_err = max((r.param_abs_diff for r in rows), default=0.0)
        miscounted = [a for a in audits if a.status == "mismatch"]
        passed = grad_err <= grad_tol.value and param_err <= param_tol.value and not miscounted
        causes: list[str] = []
        if miscounted:
            first = miscounted[0]
            causes.append(f"the denominator is wrong (micro-batch {audits.index(first)}): {first.reason}")
        if grad_err > grad_tol.value or param_err > param_tol.value:
            causes += likely_causes(
                cand,
                findings,
                candidate_step,
                probe_causes(build, data, micro, loss_fn, count_fn, counts, ref, names, grad_tol, seed),
                factor_cause(ref, cand, counts),
            )
    return EquivalenceReport(
        passed=passed,
        grad_max_rel_err=grad_err,
        param_max_abs_diff=param_err,
        grad_tol=grad_tol,
        param_tol=param_tol,
        worst=tuple(rows),
        likely_causes=tuple(causes),
        sizes=tuple(parts),
        dtype=dtype_name(dtype),
        counts=tuple(counts),
        unit=unit,
        reference_loss=ref.loss if ref.loss is not None else math.nan,
        candidate_loss=cand.loss,
        buffer_max_abs_diff=buffer_diff(ref, cand),
        findings=findings,
        disabled=tuple(s.describe() for s in disabled if s.switchable),
        audit=audits,
        candidate=("Accumulator.step" if candidate_step is None else callable_name(candidate_step))
        + (f" (scaling={scaling!r})" if scaling != "pre" else "")
        + (" (compiled model)" if compile else ""),
        name=name,
        device=str(where),
    )


def verify_workload(
    workload: Workload,
    *,
    micro_batch: int | None = None,
    sizes: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    candidate_step: CandidateStep | None = None,
    seed: int = 0,
    compile: bool = False,
    scaling: Scaling = "pre",
) -> EquivalenceReport:
    """:func:`verify` on a workload's verification batch (``workload.batch(seed)``), with its
    optimizer and declared hazards; the micro-batch defaults to ``workload.micro_batch``;
    ``compile`` and ``scaling`` as in :func:`verify`."""
    if not isinstance(workload, Workload):
        raise WorkloadError(f"verify_workload needs a gradaccum.Workload, got {type(workload).__name__}")
    if micro_batch is None and sizes is None:
        micro_batch = workload.micro_batch
    return verify(
        workload.build_model,
        workload.batch(seed),
        workload.loss_fn,
        workload.count_fn,
        micro_batch=micro_batch,
        sizes=sizes,
        optimizer_factory=workload.optimizer_factory,
        dtype=dtype,
        device=device,
        candidate_step=candidate_step,
        declared_hazards=workload.declared_hazards,
        seed=seed,
        name=workload.name,
        unit=workload.unit,
        compile=compile,
        scaling=scaling,
    )
