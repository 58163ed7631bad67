"""The equivalence acceptance check: does the accumulated update equal the full-batch update?

The same examples in the same order run twice from the same initial weights: once as the whole
batch in one forward/backward (the reference, ``loss_fn(model, batch) / count_fn(batch)``), once
as micro-batches through :meth:`Accumulator.step` (or a ``candidate_step``). Full precision by
default; random layers are switched off (dropout only: normalization keeps its training mode,
because per-micro-batch statistics are exactly what must show). Gradients are compared before
clipping and parameters after one optimizer update, against tolerances declared per dtype.

On failure the likely cause comes from :func:`gradaccum.hazards.scanner.scan`, the hazards the workload
declares, and three cheap probes: is the reference reproducible, is ``count_fn`` additive over the
micro-batches, is ``loss_fn``. The production-precision trace stage is :mod:`gradaccum.check.traces`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from gradaccum.batch import Batch, batch_size, cast, split, split_sizes
from gradaccum.check.controls import disable_stochastic
from gradaccum.check.report import EquivalenceReport, ParamRow
from gradaccum.check.tolerances import GRAD_TOLERANCES, PARAM_TOLERANCES, Tolerance
from gradaccum.check.traces import TraceReport, compare_traces
from gradaccum.check.workload import OptimizerFactory, Workload, sgd
from gradaccum.errors import CountError, LossError, PlanError, WorkloadError
from gradaccum.hazards.scanner import Finding, scan
from gradaccum.precision import dtype_name
from gradaccum.step.accumulator import Accumulator, CountFn, LossFn

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

CandidateStep = Callable[[nn.Module, torch.optim.Optimizer, list[Any]], None]
"""``candidate_step(model, optimizer, micro_batches)``: performs one accumulated update in place of
``Accumulator.step``, leaving the accumulated (unclipped) gradient in ``.grad`` after stepping."""


FLOOR_RATIO = 1e-3
"""A parameter's relative error is measured against at least this fraction of the whole model's
gradient norm: a gradient that is exactly zero in theory (a bias before BatchNorm) holds only
rounding noise, and noise over noise says nothing."""
CAUSES_PER_RULE = 3
"""Findings of one rule listed by name among the likely causes before the rest are counted."""


def _tolerances(dtype: torch.dtype) -> tuple[Tolerance, Tolerance]:
    if dtype not in GRAD_TOLERANCES:
        supported = ", ".join(dtype_name(d) for d in GRAD_TOLERANCES)
        raise PlanError(
            f"verify runs its diagnostic in {supported}, not {dtype}: half-precision rounding "
            "(~1e-3) hides the weighting errors it must catch. Use float64 for the check and "
            "gradaccum.check.traces.compare_traces for production precision."
        )
    return GRAD_TOLERANCES[dtype], PARAM_TOLERANCES[dtype]


def _host_count(value: object, where: str) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value.item())
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise CountError(f"count_fn returned {value!r} for {where}; it must return an int or integer tensor")


def _fresh(
    build_model: Callable[[], nn.Module], dtype: torch.dtype, device: torch.device, seed: int
) -> nn.Module:
    torch.manual_seed(seed)  # a build_model that draws from the global generator builds the same weights
    model = build_model()
    if not isinstance(model, nn.Module):
        raise WorkloadError(
            f"build_model() returned {type(model).__name__}; it must return a torch.nn.Module"
        )
    return model.to(device=device, dtype=dtype)


def _check_same_start(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        if x.shape != y.shape or not torch.equal(x, y):
            raise WorkloadError(
                f"build_model() returned different initial weights on two calls (first difference: "
                f"`{name}`); the check compares two fresh models, so fix the initialization inside "
                "build_model (torch.manual_seed in a torch.random.fork_rng block)."
            )


class _Run(NamedTuple):
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    loss: float | None
    skip_reason: str | None = None


def _snapshot(model: nn.Module, loss: float | None, skip_reason: str | None = None) -> _Run:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers() if b.is_floating_point()}
    return _Run(grads, params, buffers, loss, skip_reason)


def _reference(
    model: nn.Module, batch: Batch, loss_fn: LossFn, count_fn: CountFn, factory: OptimizerFactory
) -> _Run:
    """The whole batch in one forward/backward, then one optimizer update."""
    count = _host_count(count_fn(batch), "the whole batch")
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
    grads = _snapshot(model, None).grads  # before the update: what the candidate must match
    optimizer.step()
    return _snapshot(model, float(loss.detach()) / count)._replace(grads=grads)


def _candidate(
    model: nn.Module,
    micro: list[Any],
    loss_fn: LossFn,
    count_fn: CountFn,
    factory: OptimizerFactory,
    candidate_step: CandidateStep | None,
) -> _Run:
    optimizer = factory(model.parameters())
    if candidate_step is not None:
        candidate_step(model, optimizer, micro)
        return _snapshot(model, None)
    result = Accumulator(model, optimizer).step(micro, loss_fn, count_fn)
    return _snapshot(model, result.loss, result.skip_reason)


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.detach().to(torch.float64)))


def _compare(names: list[str], ref: _Run, cand: _Run) -> list[ParamRow]:
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


def _buffer_diff(ref: _Run, cand: _Run) -> float | None:
    diffs = [float((cand.buffers[n] - b).abs().max()) for n, b in ref.buffers.items() if b.numel()]
    return max(diffs) if diffs else None


def _sizes_note(finding: Finding) -> str:
    micro, whole = finding.figures.get("micro_batch"), finding.figures.get("global_batch")
    if micro is None or whole is None:
        return ""
    return f" (micro-batches of {micro:g} examples instead of the batch of {whole:g})"


def _finding_causes(findings: Iterable[Finding]) -> list[str]:
    """Headlines of the findings that break equivalence, a few per rule."""
    by_code: dict[str, list[Finding]] = {}
    for finding in findings:
        if finding.breaks_equivalence:
            by_code.setdefault(finding.code, []).append(finding)
    causes: list[str] = []
    for group in by_code.values():
        causes.extend(f.headline + _sizes_note(f) for f in group[:CAUSES_PER_RULE])
        if len(group) > CAUSES_PER_RULE:
            causes.append(f"... and {len(group) - CAUSES_PER_RULE} more {group[0].code} findings like these")
    return causes


def _probe_causes(
    build: Callable[[], nn.Module],
    data: Batch,
    micro: list[Any],
    loss_fn: LossFn,
    count_fn: CountFn,
    counts: list[int],
    ref: _Run,
    names: list[str],
    tol: Tolerance,
    seed: int,
) -> tuple[list[str], bool]:
    """Causes found by probing: reproducibility, additive counts, additive loss. Also returns
    whether the loss is additive across the micro-batches at the initial weights."""
    causes: list[str] = []
    # 1. the reference itself, with other random draws: if it moves, something random is still on
    model = build()
    torch.manual_seed(seed + 1)  # the reference drew after manual_seed(seed)
    repeat = _reference(model, data, loss_fn, count_fn, sgd)
    repeat_err = max((row.grad_rel_err for row in _compare(names, ref, repeat)), default=0.0)
    if repeat_err > tol.value:
        causes.append(
            f"the reference is not reproducible: two full-batch passes from the same weights with "
            f"different random draws differ by {repeat_err:.1e} (relative), so something the scan "
            "does not recognise draws random numbers (functional dropout, random pooling); switch it "
            "off for the check"
        )
        return causes, False  # the probes below would only measure the same randomness
    # 2. count_fn must add up over the micro-batches to the whole batch's count
    whole_count = _host_count(count_fn(data), "the whole batch")
    if sum(counts) != whole_count:
        causes.append(
            f"count_fn is not additive: the whole batch counts {whole_count} units but its "
            f"micro-batches count {counts} (sum {sum(counts)}); count the units the summed loss adds up"
        )
    # 3. the summed loss of the whole batch must be the sum of the micro-batches' summed losses
    model = build()
    with torch.no_grad():
        whole = float(loss_fn(model, data))
        parts = [float(loss_fn(model, mb)) for mb in micro]
    scale = max(abs(whole), 1e-300)
    additive = abs(whole - sum(parts)) <= tol.value * scale
    n = sum(counts)
    if not additive and n > 0 and all(c > 0 for c in counts):
        weighted = sum(p * c for p, c in zip(parts, counts, strict=True)) / n
        if abs(whole - weighted) <= tol.value * scale:
            causes.append(
                f"loss_fn returns a mean, not a sum: the whole batch's loss ({whole:.6g}) is the "
                f"count-weighted mean of the micro-batches' ({weighted:.6g}), not their sum "
                f"({sum(parts):.6g}). Return the loss summed over the counted units (reduction='sum'); "
                "the step divides by the window's count once"
            )
            return causes, additive
    if not additive:
        causes.append(
            f"loss_fn is not additive across micro-batches: the whole batch's summed loss is "
            f"{whole:.6g} but the micro-batches' sum to {sum(parts):.6g} at the same weights, so examples "
            "interact in the forward or the loss"
        )
    return causes, additive


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
) -> EquivalenceReport:
    """Check that accumulating ``batch`` in micro-batches gives the full-batch update.

    ``build_model()`` returns a fresh model with the same weights on every call; ``batch`` is a
    tensor, tuple or mapping of tensors sharing dim 0; ``loss_fn(model, micro_batch)`` returns the
    loss *summed* over the ``count_fn(micro_batch)`` units. Give ``micro_batch`` (which must divide
    the batch) or an explicit partition ``sizes`` such as ``[1, 3, 4]``. The optimizer defaults to
    SGD at lr 0.1, which shows gradient differences one-to-one in the parameters.

    It runs on this process alone (a plain model, no process group needed); the global random
    generator is restored on return.
    """
    parts = split_sizes(batch_size(batch), micro_batch, sizes)
    grad_tol, param_tol = _tolerances(dtype)
    factory = optimizer_factory or sgd
    where = torch.device(device)
    data = cast(batch, dtype, where)
    micro = split(data, sizes=parts)
    uniform = parts[0] if len(set(parts)) == 1 else None
    hazards = tuple(declared_hazards)
    devices = [where.index or 0] if where.type == "cuda" else []

    def build() -> nn.Module:
        model = _fresh(build_model, dtype, where, seed)
        disable_stochastic(model)
        return model

    with torch.random.fork_rng(devices=devices):
        ref_model = _fresh(build_model, dtype, where, seed)
        cand_model = _fresh(build_model, dtype, where, seed)
        _check_same_start(ref_model, cand_model)
        findings = tuple(scan(cand_model, len(parts), micro_batch=uniform, declared_hazards=hazards))
        disabled = disable_stochastic(ref_model)
        disable_stochastic(cand_model)
        counts = [_host_count(count_fn(mb), f"micro-batch {i}") for i, mb in enumerate(micro)]
        names = [n for n, _ in ref_model.named_parameters()]
        torch.manual_seed(seed)
        ref = _reference(ref_model, data, loss_fn, count_fn, factory)
        torch.manual_seed(seed)
        cand = _candidate(cand_model, micro, loss_fn, count_fn, factory, candidate_step)
        rows = _compare(names, ref, cand)
        grad_err = max((r.grad_rel_err for r in rows), default=0.0)
        param_err = max((r.param_abs_diff for r in rows), default=0.0)
        passed = grad_err <= grad_tol.value and param_err <= param_tol.value
        causes: list[str] = []
        if not passed:
            causes = _likely_causes(
                cand,
                findings,
                candidate_step,
                _probe_causes(build, data, micro, loss_fn, count_fn, counts, ref, names, grad_tol, seed),
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
        buffer_max_abs_diff=_buffer_diff(ref, cand),
        findings=findings,
        disabled=disabled,
        candidate="Accumulator.step" if candidate_step is None else _callable_name(candidate_step),
        name=name,
        device=str(where),
    )


def _likely_causes(
    cand: _Run,
    findings: tuple[Finding, ...],
    candidate_step: CandidateStep | None,
    probed: tuple[list[str], bool],
) -> list[str]:
    """Most specific first: a skipped step, probe results, scan findings, then the candidate step."""
    probe_causes, additive = probed
    causes = []
    if cand.skip_reason is not None:
        causes.append(f"the accumulated step was skipped: {cand.skip_reason}")
    from_scan = _finding_causes(findings)
    # a non-additive loss is the symptom the scan's findings explain; keep the probe's line otherwise
    causes.extend(c for c in probe_causes if not (from_scan and c.startswith("loss_fn is not additive")))
    causes.extend(from_scan)
    if candidate_step is not None and additive and not from_scan:
        causes.append(
            f"the candidate step ({_callable_name(candidate_step)}) does not reproduce the full-batch "
            "gradient although the loss adds up over the micro-batches: it weights them wrongly (a "
            "mean loss divided by k is a mean of means), clips, zeroes or steps per micro-batch"
        )
    if not causes:
        causes.append(
            "no cause recognised: the loss adds up over the micro-batches at the initial weights and "
            "the scan found no batch-coupled layer. Look for state that changes between micro-batches "
            "(activations cached across calls, buffers or parameters updated in forward)"
        )
    return causes


def _callable_name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def verify_workload(
    workload: Workload,
    *,
    micro_batch: int | None = None,
    sizes: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    candidate_step: CandidateStep | None = None,
    seed: int = 0,
) -> EquivalenceReport:
    """:func:`verify` on a workload's verification batch (``workload.batch(seed)``), with its
    optimizer and declared hazards; the micro-batch defaults to ``workload.micro_batch``."""
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
    )
