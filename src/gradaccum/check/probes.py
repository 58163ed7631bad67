"""Why an equivalence check failed: the scan's findings, and probes that test the usual suspects
(randomness left on, a count or a loss that does not add up over micro-batches, a mean returned
where a sum belongs). Every cause carries the figure that supports it and the fix."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from gradaccum.batch import Batch
from gradaccum.check.runs import CandidateStep, Run, compare, host_count, reference
from gradaccum.check.tolerances import Tolerance
from gradaccum.check.workload import sgd
from gradaccum.hazards.scanner import Finding
from gradaccum.step.accumulator import CountFn, LossFn

__all__ = [
    "CAUSES_PER_RULE",
    "FACTOR_RTOL",
    "factor_cause",
    "finding_causes",
    "likely_causes",
    "probe_causes",
]

CAUSES_PER_RULE = 3
"""Findings of one rule listed by name among the likely causes before the rest are counted."""

FACTOR_RTOL = 1e-6
"""How close the accumulated gradient must be to c x the full-batch gradient for a uniform factor
to be named: float64 runs agree to ~1e-15, float32 to ~1e-7, and a weighting error that is not a
single scalar (a mean of means over uneven micro-batches) leaves a residual of 1e-3 or more."""


def _sizes_note(finding: Finding) -> str:
    micro, whole = finding.figures.get("micro_batch"), finding.figures.get("global_batch")
    if micro is None or whole is None:
        return ""
    return f" (micro-batches of {micro:g} examples instead of the batch of {whole:g})"


def finding_causes(findings: Iterable[Finding]) -> list[str]:
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


def probe_causes(
    build: Callable[[], nn.Module],
    data: Batch,
    micro: list[Any],
    loss_fn: LossFn,
    count_fn: CountFn,
    counts: list[int],
    ref: Run,
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
    repeat = reference(model, data, loss_fn, count_fn, sgd)
    repeat_err = max((row.grad_rel_err for row in compare(names, ref, repeat)), default=0.0)
    if repeat_err > tol.value:
        causes.append(
            f"the reference is not reproducible: two full-batch passes from the same weights with "
            f"different random draws differ by {repeat_err:.1e} (relative), so something the scan "
            "does not recognise draws random numbers (functional dropout, random pooling); switch it "
            "off for the check"
        )
        return causes, False  # the probes below would only measure the same randomness
    # 2. count_fn must add up over the micro-batches to the whole batch's count
    whole_count = host_count(count_fn(data), "the whole batch")
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
    mean = None if additive else _mean_signature(whole, parts, counts)
    if mean is not None:
        causes.append(mean)
    elif not additive:
        causes.append(
            f"loss_fn is not additive across micro-batches: the whole batch's summed loss is "
            f"{whole:.6g} but the micro-batches' sum to {sum(parts):.6g} at the same weights, so examples "
            "interact in the forward or the loss"
        )
    return causes, additive


def _mean_signature(whole: float, parts: list[float], counts: list[int]) -> str | None:
    """The cause, with its figures and the fix, when the losses look like per-micro-batch means.

    A sum over the whole batch is the sum of the parts; a mean over it is a weighted mean of the
    parts' means, so it lies between the smallest and the largest part, and the parts add up to
    about k times the whole. Either the count-weighted pattern holds exactly (the loss divides by
    what ``count_fn`` counts) or only the range does (it divides by a count of its own, e.g.
    transformers' shifted token count).
    """
    k = len(parts)
    if k < 2 or not all(math.isfinite(p) and p > 0 for p in parts) or whole <= 0:
        return None
    n = sum(counts)
    weighted = sum(p * c for p, c in zip(parts, counts, strict=True)) / n if n else math.nan
    slack = 1e-9 * max(abs(p) for p in parts)
    if not (min(parts) - slack <= whole <= max(parts) + slack):
        return None
    pattern = (
        f"the count-weighted mean of the micro-batches' losses ({weighted:.6g})"
        if math.isfinite(weighted) and abs(whole - weighted) <= 1e-9 * whole
        else f"between the smallest and the largest micro-batch loss ({min(parts):.6g}..{max(parts):.6g})"
    )
    return (
        f"loss_fn returns a mean over the micro-batch, not a sum: the whole batch's loss ({whole:.6g}) is "
        f"{pattern}, and the {k} micro-batch losses add up to {sum(parts):.6g} = "
        f"{sum(parts) / whole:.2f} x the whole (a sum would equal it). Return the loss summed over the "
        "counted units (reduction='sum', gradaccum.summed_cross_entropy(logits, labels, shift=True) for "
        "a causal LM; a model's own .loss is a mean): the step divides by the window's count once"
    )


def factor_cause(ref: Run, cand: Run, counts: list[int]) -> str | None:
    """When the accumulated gradient is the full-batch gradient times one scalar c (to
    ``FACTOR_RTOL``), the cause with the measured c: a division by k or by the count once too
    often (TRL #5619, ms-swift #10117), a missing one, or another window's count (TRL #6024)."""
    names = [n for n in ref.grads if n in cand.grads]
    if not names:
        return None
    ref_sq = sum(float((ref.grads[n].double() ** 2).sum()) for n in names)
    if ref_sq == 0.0:
        return None
    dot = sum(float((ref.grads[n].double() * cand.grads[n].double()).sum()) for n in names)
    c = dot / ref_sq
    residual = math.sqrt(
        sum(float(((cand.grads[n].double() - c * ref.grads[n].double()) ** 2).sum()) for n in names)
    )
    if (
        not math.isfinite(c)
        or c == 0.0
        or abs(c - 1.0) <= FACTOR_RTOL
        or residual > FACTOR_RTOL * abs(c) * math.sqrt(ref_sq)
    ):
        return None
    k, n = len(counts), sum(counts)
    head = f"the accumulated gradient is {c:.6g} x the full-batch gradient (uniform to {FACTOR_RTOL:g})"
    named = {
        1.0 / k: f"1/k with k = {k} micro-batches: the loss is divided by the accumulation steps once too "
        "often (already normalized by the window's count or num_items_in_batch, then divided by k "
        "again); divide by the window's count once",
        float(k): f"k = {k}: the window's summed loss is not divided by the accumulation steps (or a mean "
        "is multiplied by k)",
    }
    if n > 0:
        named[1.0 / n] = (
            f"1/N with N = {n} counted units: the loss is divided by the count twice (loss_fn returns a "
            "mean and the step divides by the window's count again); return the sum"
        )
        if len(set(counts)) == 1 and counts[0] > 0:
            named[1.0 / counts[0]] = (
                f"1/n with n = {counts[0]} units per micro-batch: each micro-batch's loss is divided by its "
                "own count and then by the window's: divide by the window's count once"
            )
    for value, text in named.items():
        if abs(c - value) <= FACTOR_RTOL * abs(value):
            return f"{head}: {text}"
    return (
        f"{head}: the update is divided by the wrong denominator, {1 / c:.6g} x the window's count (another "
        "window's count, e.g. a generation batch's average over its updates, or a count of other units); "
        "divide by this window's own count of the units the loss sums"
    )


def likely_causes(
    cand: Run,
    findings: tuple[Finding, ...],
    candidate_step: CandidateStep | None,
    probed: tuple[list[str], bool],
    factor: str | None = None,
) -> list[str]:
    """Most specific first: a skipped step, probe results, a uniform factor, scan findings, then the
    candidate step."""
    probe_causes, additive = probed
    causes = []
    if cand.skip_reason is not None:
        causes.append(f"the accumulated step was skipped: {cand.skip_reason}")
    from_scan = finding_causes(findings)
    # a non-additive loss is the symptom the scan's findings explain; keep the probe's line otherwise
    causes.extend(c for c in probe_causes if not (from_scan and c.startswith("loss_fn is not additive")))
    if factor is not None:
        causes.append(factor)
    causes.extend(from_scan)
    if candidate_step is not None and additive and not from_scan and factor is None:
        causes.append(
            f"the candidate step ({callable_name(candidate_step)}) does not reproduce the full-batch "
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


def callable_name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__
