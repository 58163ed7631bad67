"""The denominator audit: does ``count_fn`` count the units the summed loss actually uses?

The equivalence check cannot see a wrong denominator by itself: both of its sides divide by the
same ``count_fn``, so a count that is one too large per row (unshifted labels under a shifted
causal-LM loss, the most common real mistake) scales both gradients alike and passes. The audit
looks at the loss from the model's side instead: it backpropagates the summed loss to the model's
*output* only (``torch.autograd.grad``, no parameter gradient is touched) and counts the output
positions that receive a gradient. A position is one row of the output's last dimension: a
token's logits ``(b, t, :)``, an example's scores ``(b, :)``, or one element of a 1-d output.
Positions whose gradient is exactly zero (ignored labels, padding, masked examples) do not count.

What it cannot read is reported as not audited, never as passed: a loss that calls the model more
than once per micro-batch (two towers), an output that does not reach the loss, a 0-dim output.
A loss whose gradient is exactly zero for some counted units by design (an inactive hinge) would
look like a miscount; pass ``audit=False`` to ``verify`` for such losses.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn

__all__ = ["AuditStatus", "CountAudit", "audit_count", "audit_failure", "summarize_audits"]

AuditStatus = Literal["consistent", "mismatch", "not audited"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CountAudit:
    """One micro-batch's audit: what ``count_fn`` counts against what the loss uses."""

    status: AuditStatus
    """``consistent``, ``mismatch`` (the check fails), or ``not audited`` (see ``reason``)."""
    counted: int | None
    """Units ``count_fn`` counts in the micro-batch."""
    used: int | None
    """Positions of the model's output that receive a gradient from the summed loss."""
    rows: int | None = None
    """Size of the output's first dimension (sequences or examples)."""
    output_shape: tuple[int, ...] | None = None
    """Shape of the model output the audit read (``(b, t, vocab)`` for a causal LM)."""
    reason: str = ""
    """Why it mismatches (with the likely fix), or why it could not be audited."""
    declared: int | None = None
    """Target positions the count's owner declares (``CausalLMLoss.positions``), what ``used`` must
    equal when the units are sequences or documents; None when the units are the positions."""

    @property
    def expected(self) -> int | None:
        """The positions the loss must reach: ``declared``, or else ``counted``."""
        return self.declared if self.declared is not None else self.counted

    @property
    def passed(self) -> bool | None:
        """True when consistent, False on a mismatch, None when not audited."""
        return None if self.status == "not audited" else self.status == "consistent"

    def describe(self) -> str:
        if self.status == "consistent":
            return f"count_fn counts {self.counted} units, the loss uses {self.used} positions: consistent"
        return self.reason


def _output_tensor(output: object) -> torch.Tensor | None:
    """The tensor of a model output that the loss is computed from: the output itself, its
    ``logits`` (transformers' ModelOutput, a dict), or the first floating tensor of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)):
        return next((t for t in output if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    return None


def _not_audited(reason: str, counted: int | None = None) -> CountAudit:
    return CountAudit(status="not audited", counted=counted, used=None, reason=f"not audited: {reason}")


def _diagnose(counted: int, used: int, rows: int, rows_used: int, ndim: int) -> str:
    """The likely cause of ``counted != used``, with its fix; the figures first."""
    head = f"count_fn counts {counted} units, the loss uses {used} positions of the model's output"
    # a shifted loss never targets a row's first label: one fewer per row that has any label
    if ndim >= 3 and rows_used <= counted - used <= rows:
        return (
            f"{head} (one fewer per row, {rows} rows): the loss shifts its labels (position t predicts "
            "token t+1, so each row's first label is never a target) but count_fn counts them "
            "unshifted; use count_tokens(..., shift=True) (or gradaccum.CausalLMLoss)"
        )
    if ndim >= 3 and used - counted == rows_used:
        return (
            f"{head} (one more per row, {rows} rows): count_fn drops one label per row (shift=True) "
            "but the loss does not shift; use count_tokens(..., shift=False), or shift the loss "
            "(summed_cross_entropy(..., shift=True))"
        )
    if counted == rows and used > rows:
        return (
            f"{head}: count_fn counts the {rows} examples but the loss sums over {used} positions (tokens); "
            "count the tokens (count_tokens(key, shift=...), shift as the loss) or make the loss a sum of "
            "per-example means"
        )
    if used == rows and counted > rows:
        return (
            f"{head}: the loss gives each of the {rows} examples one term but count_fn counts {counted} "
            "units (tokens?); count examples (count_examples) or sum the loss over the tokens"
        )
    return (
        f"{head}: the window's mean would divide by the wrong number. count_fn must count exactly the "
        "units the summed loss adds up (if the loss gives some counted units an exactly zero gradient "
        "by design, e.g. an inactive hinge, verify with audit=False)"
    )


def _declared_positions(count_fn: Callable[[Any], Any], micro_batch: Any) -> int | None:
    """The target positions a count function's owner declares (``CausalLMLoss.positions``), if any."""
    owner = getattr(inspect.unwrap(count_fn), "__self__", None)  # through functools.wraps layers
    positions = getattr(owner, "positions", None)
    if not callable(positions):
        return None
    value = positions(micro_batch)
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def audit_count(
    model: nn.Module,
    micro_batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    count_fn: Callable[[Any], Any],
) -> CountAudit:
    """Compare ``count_fn(micro_batch)`` with the output positions the summed loss reaches.

    Runs one forward of ``loss_fn(model, micro_batch)`` and a backward to the output alone; the
    model's parameter gradients are not touched. Random layers draw as they are (the equivalence
    check calls this with randomness off).
    """
    raw = count_fn(micro_batch)
    try:
        counted = int(raw.item()) if isinstance(raw, torch.Tensor) else int(raw)
    except (TypeError, ValueError, RuntimeError):
        return _not_audited(f"count_fn returned {type(raw).__name__}, not a count")
    outputs: list[object] = []
    handle = model.register_forward_hook(lambda module, args, out: outputs.append(out))
    try:
        with torch.enable_grad():
            loss = loss_fn(model, micro_batch)
    finally:
        handle.remove()
    if len(outputs) != 1:
        return _not_audited(
            f"loss_fn called the model {len(outputs)} times for one micro-batch (not once), so the "
            "output's positions are not the units it counts (two towers, or a loss that does not call "
            "the model itself)",
            counted,
        )
    out = _output_tensor(outputs[0])
    if out is None or not out.requires_grad:
        return _not_audited("the model's output is not a tensor that requires grad", counted)
    if out.ndim == 0:
        return _not_audited("the model's output is a scalar: it has no positions to count", counted)
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.requires_grad:
        return _not_audited("loss_fn did not return a scalar that requires grad", counted)
    (grad,) = torch.autograd.grad(loss, out, allow_unused=True)
    if grad is None:
        return _not_audited("the loss does not depend on the model's output (logits)", counted)
    touched = grad != 0 if out.ndim == 1 else (grad != 0).any(dim=-1)
    used = int(touched.sum().item())
    rows = int(out.shape[0])
    rows_used = int(touched.reshape(rows, -1).any(dim=1).sum().item()) if out.ndim >= 2 else rows
    shape = tuple(int(s) for s in out.shape)
    declared = _declared_positions(count_fn, micro_batch)
    # a count of sequences or documents over weighted token losses: the units are not positions,
    # but the loss must still reach exactly the target positions it declares
    expected = counted if declared is None else declared
    if used == expected:
        return CountAudit(
            status="consistent", counted=counted, used=used, rows=rows, output_shape=shape, declared=declared
        )
    if declared is None:
        reason = _diagnose(counted, used, rows, rows_used, out.ndim)
    else:
        reason = (
            f"the loss declares {declared} target positions but the model's output receives a gradient "
            f"at {used}: its logits are not aligned with the labels (already shifted? set shift=False)"
        )
    return CountAudit(
        status="mismatch",
        counted=counted,
        used=used,
        rows=rows,
        output_shape=shape,
        reason=reason,
        declared=declared,
    )


def _over(window: str) -> str:
    return f" in {window}" if window else ""


def summarize_audits(audits: Sequence[CountAudit], *, unit: str = "units", window: str = "") -> str:
    """One line over a window's audits: consistent, the first mismatch, or why none was audited.

    ``unit`` is what ``count_fn`` counts ("tokens"), ``window`` the examples audited ("the 8
    examples of the checked batch"): the line says what its figures count, and over what. The
    positions are the model output's rows that receive a gradient from the summed loss (a
    causal LM's targets, after any shift)."""
    if not audits:
        return "not audited: no micro-batch"
    mismatch = next((a for a in audits if a.status == "mismatch"), None)
    if mismatch is not None:
        return (
            f"micro-batch {audits.index(mismatch)} of {window}: {mismatch.reason}"
            if window
            else mismatch.reason
        )
    if all(a.status == "consistent" for a in audits):
        counted = sum(a.counted or 0 for a in audits)
        used = sum(a.used or 0 for a in audits)
        if counted == used:
            where = f" in {window}" if window else ""
            return (
                f"consistent: count_fn counts exactly the {counted} {unit} the loss sums over{where} (the "
                "output positions that receive a gradient)"
            )
        return (
            f"consistent: the loss reaches exactly its {used} target positions, over {counted} counted "
            f"{unit}{_over(window)}"
        )
    return next(a.reason for a in audits if a.status == "not audited")


def audit_failure(audits: Sequence[CountAudit], *, unit: str = "units") -> str | None:
    """The denominator's failure in one clause with the window's figures, or None when no
    micro-batch mismatches: "the denominator: count_fn counts 128 tokens where the loss uses 136
    output positions (4 of 4 micro-batches)"."""
    wrong = [a for a in audits if a.status == "mismatch"]
    if not wrong:
        return None
    used = sum(a.used or 0 for a in wrong)
    where = f"{len(wrong)} of {len(audits)} micro-batches"
    if all(a.declared is None for a in wrong):
        counted = sum(a.counted or 0 for a in wrong)
        return (
            f"the denominator: count_fn counts {counted} {unit} where the loss uses {used} output "
            f"positions ({where})"
        )
    declared = sum(a.expected or 0 for a in wrong)
    return (
        f"the denominator: the loss declares {declared} target positions where the output receives a "
        f"gradient at {used} ({where})"
    )
