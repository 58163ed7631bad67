"""The noise-scale estimator recomputed from closed-form per-example gradients, and its error bars.

Independent of the step: no hooks, no W/N, no loss scale, no autograd. Each micro-batch's summed
gradient is sum_i w_i g_i from :meth:`RegressionPopulation.per_example_grads`, and the window's
estimates follow the unit-weighted formulas of :mod:`gradaccum.step.noise`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradaccum.step.noise import EMA_BETA

__all__ = ["bias_corrected_ema", "ema_factor", "reference_estimate", "spread", "within"]


def reference_estimate(per_example: torch.Tensor, window: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """(tr(Sigma), |G|^2) of one window (every rank's micro-batches) from per-example gradients."""
    sums, counts = [], []
    for mb in window:
        weight = mb["w"].to(torch.float64)
        if weight.sum() > 0:
            sums.append((weight[:, None] * per_example[mb["i"]]).sum(0))
            counts.append(float(weight.sum()))
    k, n = len(sums), sum(counts)
    small = sum(float(s @ s) / c for s, c in zip(sums, counts, strict=True)) / n  # sum_j (n_j/N) |g_j|^2
    mean = torch.stack(sums).sum(0) / n
    big = float(mean @ mean)
    return n * (small - big) / (k - 1), (k * big - small) / (k - 1)


def bias_corrected_ema(values: Sequence[float], beta: float = EMA_BETA) -> float:
    m = 0.0
    for v in values:
        m = beta * m + (1 - beta) * v
    return m / (1 - beta ** len(values))


def spread(
    per_example: torch.Tensor,
    draw: Callable[[torch.Generator], Sequence[dict[str, Any]]],
    windows: int,
    seed: int,
) -> tuple[float, float]:
    """The per-window standard deviations of (tr(Sigma)^, |G|^2^) over ``windows`` fresh windows of
    the same design (``draw``), from the reference: the spread the tests' error bars scale."""
    gen = torch.Generator().manual_seed(seed)
    estimates = [reference_estimate(per_example, draw(gen)) for _ in range(windows)]
    return statistics.stdev(t for t, _ in estimates), statistics.stdev(q for _, q in estimates)


def ema_factor(windows: int, beta: float = EMA_BETA) -> float:
    """The standard error of :func:`bias_corrected_ema` over ``windows`` i.i.d. values, per unit of
    their standard deviation.

    The EMA weighs value t (of T) by beta^(T-t) / sum_s beta^(T-s); a weighted mean of i.i.d.
    values has the variance Var * sum w^2 / (sum w)^2 = Var / T_eff (T_eff = 152 for T = 200 at
    beta = 0.99, 180 for T = 300), against Var / T for the plain mean.
    """
    weights = [beta**i for i in range(windows)]
    return math.sqrt(sum(w * w for w in weights)) / sum(weights)


def within(estimate: float, truth: float, standard_error: float, z: float) -> bool:
    return abs(estimate - truth) <= z * standard_error
