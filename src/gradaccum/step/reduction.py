"""The first window's losses read for a mean passed as a sum (``loss_reduction="sum"``).

With ``loss_reduction="sum"`` (the default) the step multiplies each micro-batch's loss by W/N, N
the window's count: exact for a loss *summed* over ``count_fn``'s units. A loss that is already a
mean over n_j units (``F.cross_entropy`` with its default ``reduction="mean"``, ``.mean()``,
``loss.sum() / n_j``) then enters the update with a weight of 1/(n_j N) per unit instead of 1/N:
a mean of means, off in scale by the micro-batch's count (for equal counts the whole update is
n_j times too small), and nothing else would say so.

So the step reads each micro-batch's loss graph in its first window with
:func:`gradaccum.hazards.lossform.read_loss` (constants x a mean or a sum) and refuses, before the
micro-batch's backward, a loss that reads as

- a mean reduction (``NllLossBackward0`` with reduction=mean, ``MeanBackward0/1``, any loss node
  saved with reduction=mean) not multiplied back by its own count, or
- a sum divided by a constant equal to the micro-batch's ``count_fn`` count (a mean by hand).

The error is a :class:`~gradaccum.errors.LossError` raised inside the micro-batch, so the step's
failure handling clears the gradients and, under DDP, the agreement before the synchronizing
backward tells every rank (each rank reads its own loss, so every rank raises the same error where
the ranks share the ``loss_fn``). A loss that is not a sum over ``count_fn``'s units on purpose is
declared with ``check_loss_reduction=False``; a graph the reader does not recognise (a compiled
``loss_fn``, a custom autograd function, label smoothing's sum of two terms) is left alone.

The cost: one graph walk of a few nodes per micro-batch of the first window that reaches its
``loss_fn``; afterwards one boolean test per window (``benchmarks/step_pair.py``).
"""

from __future__ import annotations

import torch

from gradaccum.errors import LossError
from gradaccum.hazards.lossform import WEIGHT_RTOL, LossForm, read_loss

__all__ = ["ReductionCheck"]

_MEANS = {
    "NllLossBackward0": "cross_entropy/nll_loss with reduction='mean' (their default)",
    "NllLoss2DBackward0": "cross_entropy/nll_loss with reduction='mean' (their default)",
    "MeanBackward0": ".mean()",
    "MeanBackward1": ".mean(dim)",
}


class ReductionCheck:
    """Whether the next window's losses are read, and the reading itself."""

    __slots__ = ("pending",)

    def __init__(self, loss_reduction: str, check_loss_reduction: bool) -> None:
        self.pending = loss_reduction == "sum" and check_loss_reduction
        """True until a window's losses were read without a refusal."""

    def judge(self, loss: torch.Tensor, count: int | torch.Tensor | None, index: int) -> None:
        """Refuse ``loss`` (micro-batch ``index``, ``count`` units by ``count_fn``; ``None`` where
        the count is not at hand) when it reads as a mean over its units."""
        try:
            form = read_loss(loss, ("loss_fn", index), skip_top_mul=False)
        except (AttributeError, RuntimeError, TypeError, ValueError):
            return  # an unexpected graph is not judged, never broken
        if form is None:
            return
        n = None if count is None else int(count)
        problem = _mean_problem(form, n)
        if problem is not None:
            raise LossError(_message(problem, index, n))


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= WEIGHT_RTOL * max(abs(a), abs(b), 1.0)


def _mean_problem(form: LossForm, n: int | None) -> str | None:
    """What makes ``form`` a mean over the micro-batch's units, or ``None`` for a sum."""
    scale = form.scale()
    if form.count is not None:
        units = float(form.count)
        if _close(scale, units):  # mean * its own count: the sum, written the long way
            return None
        what = _MEANS.get(form.node, f"{form.node} with reduction='mean'")
        return f"its graph ends in {what}, a mean over {units:g} units"
    if n is None or n <= 1 or not any(divides for _, divides in form.factors):
        return None
    if _close(scale * n, 1.0):
        return f"it is a sum divided by {n}, this micro-batch's count_fn count: a mean written by hand"
    return None


def _message(problem: str, index: int, n: int | None) -> str:
    counted = "" if n is None else f" (count_fn counts {n} units in it)"
    return (
        f"loss_fn returned a mean-reduced loss for micro-batch {index}{counted}: {problem}. With "
        "loss_reduction='sum' (the default) the step takes each loss for the *summed* loss over "
        "count_fn's units and divides by the window's count once, so a mean would be divided "
        "twice: every unit would weigh 1/(n_j N) instead of 1/N and the update would be wrong in "
        "scale by the micro-batch's count. The window's gradients were discarded and no update "
        "was applied. Fix: return the sum over the units count_fn counts (reduction='sum'), or "
        "declare the mean with loss_reduction='mean' (the step multiplies it back by count_fn's "
        "count, which must count the same units). A loss that is not a sum over count_fn's units "
        "on purpose (a per-micro-batch loss with count_fn returning 1) is declared with "
        "check_loss_reduction=False."
    )
