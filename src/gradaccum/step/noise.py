"""The gradient noise scale B_simple = tr(Sigma) / |G|^2, from what accumulation computes anyway.

McCandlish, Kaplan, Amodei et al., *An Empirical Model of Large-Batch Training* (2018): G is the
true gradient (the mean of the per-unit gradients), Sigma their covariance, and B_simple, in the
units ``count_fn`` counts, estimates the critical batch. For a batch of B units drawn
independently, its mean gradient G_B satisfies (their appendix A.1)

    E |G_B|^2 = |G|^2 + tr(Sigma) / B.

A window holds K micro-batches with n_j >= 1 units each (every rank's; empty ones are left out)
and N = sum_j n_j units in all. With s_j the *summed* gradient of micro-batch j (what its backward
computes) and g_j = s_j / n_j its mean, the window's gradient is G_N = sum_j s_j / N, and

    E |g_j|^2 = |G|^2 + tr(Sigma) / n_j,        E |G_N|^2 = |G|^2 + tr(Sigma) / N.

Unit-weighted small batches. Weigh each micro-batch by its share of the units, n_j / N:

    A = sum_j (n_j / N) |g_j|^2 = (1/N) sum_j |s_j|^2 / n_j,      E[A] = |G|^2 + K tr(Sigma) / N,

and with b = |G_N|^2 (the big batch)

    E[A - b]   = (K - 1) tr(Sigma) / N    so   tr(Sigma)^ = N (A - b) / (K - 1),
    E[K b - A] = (K - 1) |G|^2            so   |G|^2^    = (K b - A) / (K - 1),

both unbiased, for any counts n_j, whenever K >= 2. With equal counts n_j = n these are
McCandlish's two-batch estimators with B_small = n, B_big = K n (A is then the mean of |g_j|^2):
|G|^2^ = (B_big b - B_small A) / (B_big - B_small), tr(Sigma)^ = (A - b) / (1/B_small - 1/B_big).
Any weights w_j summing to one leave E[sum_j w_j |g_j|^2] = |G|^2 + tr(Sigma) sum_j w_j / n_j;
the unit weights make a micro-batch of 3 tokens count 3/500 of one of 500 instead of the same,
and turn every term into |s_j|^2 / n_j, which needs no division of the gradient itself.

What the step measures, without a copy of any gradient. Micro-batch j's backward adds
Delta_j = c s_j to the gradients, c = sigma W / N (sigma the GradScaler's scale, W / N the step's
scale; :mod:`gradaccum.step.engine`). A hook on every parameter (``Tensor.register_hook``, which
sees the gradient a backward *adds*, before it is accumulated and before DDP's reducer reads it)
records the norm of its part of Delta_j (registered for the window's micro-batches only and
removed with the window: :mod:`gradaccum.step.lifetime`); after the backward the squared norms add
up to |Delta_j|^2. After the window every rank holds sigma G_N (the point of the step). So

    A = (1/N) sum_j |Delta_j|^2 / (c^2 n_j) = N P / (sigma^2 W^2),   P = sum_j |Delta_j|^2 / n_j,
    b = |grad|^2 / sigma^2,

and the loss scale and W/N drop out exactly. Under DDP each rank's micro-batches are small batches
like any other: their increments are local (the hooks fire before the all-reduce), so P and K are
sums over ranks, all-reduced once after the synchronizing backward, in the step's end-of-window
reduction when there is one (``agree_on_failure=False``) and as one more small all-reduce
otherwise; the synchronized gradient gives b on every rank. Nothing extra is read on the host: the
figures ride in the step's one end-of-window read.

Smoothing, as a ratio of averages. Each measured window w gives T_w = tr(Sigma)^ and
Q_w = |G|^2^; exponential moving averages m_T <- beta m_T + (1 - beta) T_w (and m_Q alike),
divided by 1 - beta^t after t windows (Adam's bias correction), give ``trace_cov`` and
``grad_sq``, and B_simple = trace_cov / grad_sq (the corrections cancel in the ratio). The
average of T_w / Q_w would be neither stable nor unbiased: Q_w is noisy and often negative while
the noise dominates. T_w and Q_w are unbiased, so some windows' are negative; they enter the
averages unclamped (clamping each window would bias both averages upward), such windows are
counted (``negative``), and the smoothed figures are clamped at 0 when read; B_simple stays
``None`` while the smoothed |G|^2 is not positive.

Assumptions: units are drawn independently (whole sequences of equal length count as tokens
exactly; unequal lengths make a token-counted figure approximate), the weights move little within
the ~1 / (1 - beta) windows averaged, and each parameter's gradient arrives once per backward
(a reentrant checkpoint that splits a tied weight's gradient into two would count
|a|^2 + |b|^2 for |a + b|^2; non-reentrant checkpointing, the default, is fine).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn

from gradaccum.errors import ConfigError
from gradaccum.fielddocs import document_fields
from gradaccum.values import require_int

__all__ = ["EMA_BETA", "NoiseScale", "NoiseScaleMeter", "noise_meter", "noise_scale_of", "window_estimate"]

EMA_BETA = 0.99
"""Decay of the moving averages: ~100 windows remembered (an effective sample of up to ~199)."""

_FLOAT64 = torch.float64


@document_fields
@dataclass(frozen=True, kw_only=True, slots=True)
class NoiseScale:
    """The gradient noise scale after the windows measured so far, in ``count_fn``'s units."""

    b_simple: float | None
    """tr(Sigma) / |G|^2: where the critical batch lies; ``None`` before the first measured window
    and while the smoothed |G|^2 is not positive (the noise still hides the gradient)."""
    trace_cov: float | None
    """tr(Sigma), the per-unit gradient covariance's trace: bias-corrected average, clamped at 0."""
    grad_sq: float | None
    """|G|^2, the true gradient's squared norm: bias-corrected average, clamped at 0."""
    samples: int
    """Windows used: applied updates with at least two non-empty micro-batches over all ranks."""
    negative: int
    """Windows whose own estimate of tr(Sigma) or of |G|^2 was negative (noise; kept unclamped in
    the averages)."""
    window_trace_cov: float | None = None
    """The last measured window's own estimate of tr(Sigma) (unsmoothed, may be negative)."""
    window_grad_sq: float | None = None
    """The last measured window's own estimate of |G|^2 (unsmoothed, may be negative)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (a run card's, a metrics line's)."""
        return asdict(self)

    def describe(self, global_batch: float, unit: str = "tokens") -> str:
        """Where ``global_batch`` (in ``unit``, what count_fn counts) stands against B_simple, in words.

        By McCandlish et al.'s model (their eq. 2.11), a batch of B units needs 1 + B_noise / B times
        the fewest updates and 1 + B / B_noise times the fewest units to reach a given loss;
        B_simple stands in for B_noise.
        """
        one = unit[:-1] if unit.endswith("s") else unit
        batch = f"global batch {_figure(global_batch)} {unit}"
        if self.b_simple is None:
            if self.samples == 0:
                return (
                    f"{batch}: no noise-scale estimate yet (it needs an applied update over at least "
                    "two non-empty micro-batches)"
                )
            return (
                f"{batch}: B_simple not resolved after {self.samples} windows; the gradient's squared "
                f"norm is not yet above the noise ({self.negative} windows estimated it negative)"
            )
        ratio = global_batch / self.b_simple
        where = f"{batch} is {_figure(ratio)}x B_simple ~ {_figure(self.b_simple)}"
        cost = (
            f"(by McCandlish et al.'s model ~{1 + 1 / ratio:.2g}x the fewest updates and "
            f"~{1 + ratio:.2g}x the fewest {unit})"
        )
        if ratio > 2:
            return f"{where}: past the critical batch, more accumulation buys little per {one} {cost}"
        if ratio < 0.5:
            return (
                f"{where}: below the critical batch, a larger global batch (more accumulation) would "
                f"still cut the updates needed almost in proportion {cost}"
            )
        return f"{where}: near the critical batch, a balance of updates and {unit} {cost}"


def _figure(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.2g}" if value < 10 else f"{value:.0f}"


def window_estimate(
    small_sq_sum: float, small_batches: float, big_sq: float, global_count: float, world: int, scale: float
) -> tuple[float, float] | None:
    """One window's (tr(Sigma), |G|^2) from what the step measured (see the module docstring).

    ``small_sq_sum``: P = sum_j |Delta_j|^2 / n_j over every rank's non-empty micro-batches;
    ``small_batches``: K, their number; ``big_sq``: |grad|^2 of the synchronized gradient;
    ``global_count``: N; ``world``: W; ``scale``: the GradScaler's sigma (1 without one). ``None``
    when the window cannot say anything (K < 2, N = 0, a non-finite figure).
    """
    k, n = small_batches, global_count
    figures = (small_sq_sum, k, big_sq, n, scale)
    if k < 2 or n <= 0 or scale <= 0 or not all(math.isfinite(v) for v in figures):
        return None
    small = small_sq_sum * n / (scale * scale * world * world)  # A
    big = big_sq / (scale * scale)  # b
    return n * (small - big) / (k - 1), (k * big - small) / (k - 1)


def noise_scale_of(meter: NoiseScaleMeter | None) -> NoiseScale:
    """The estimate so far; a :class:`ConfigError` for an accumulator built without the meter."""
    if meter is None:
        raise ConfigError(
            "this accumulator does not measure the gradient noise scale; build it with "
            "noise_scale=True (AccumConfig(noise_scale=True))"
        )
    return meter.result()


def noise_meter(
    model: nn.Module, params: Sequence[torch.Tensor], kind: str, *, device: torch.device, uniform: bool
) -> NoiseScaleMeter:
    """The meter for an engine whose gradients synchronize as ``kind`` says; FSDP is refused."""
    if kind in ("fsdp", "fsdp2"):
        raise ConfigError(
            f"noise_scale=True is not supported under {kind.upper()}: it reads each "
            "micro-batch's gradient through hooks on the parameters the accumulator holds, and "
            "under FSDP those are shards that FSDP fills in its own reduce-scatter (with sync "
            "deferred, only after the last micro-batch). Measure the noise scale under DDP or on "
            "one process (it does not depend on the sharding), or leave noise_scale off."
        )
    return NoiseScaleMeter(model, params, device=device, uniform=uniform)


class NoiseScaleMeter:
    """Records each micro-batch's squared gradient norm through parameter hooks and keeps the
    moving averages; the :class:`~gradaccum.step.engine.WindowEngine` drives it.

    The hooks read and never change a gradient, and are on the parameters only from :meth:`start`
    to :meth:`window_sums` (or :meth:`discard`): between windows the model holds none of them.
    """

    def __init__(
        self, model: nn.Module, params: Sequence[torch.Tensor], *, device: torch.device, uniform: bool
    ) -> None:
        sparse = [
            name
            for name, m in model.named_modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        ]
        if sparse:
            raise ConfigError(
                f"noise_scale=True needs dense gradients, but {', '.join(sparse)} build sparse ones "
                "(sparse=True); build those embeddings with sparse=False, or leave noise_scale off"
            )
        self.device = device
        self._uniform = uniform
        self._zero = torch.zeros((), dtype=_FLOAT64, device=device)
        self._one = torch.ones((), dtype=_FLOAT64, device=device)
        self._armed = False
        self._norms: list[torch.Tensor] = []  # this micro-batch's, one per parameter reached
        self._window: list[torch.Tensor] = []  # |Delta_j|^2 of each micro-batch of the window
        self._params = list(params)
        self._handles: list[Any] = []  # the hooks of the open window (step/lifetime.py)
        self._mean_trace = 0.0
        self._mean_grad_sq = 0.0
        self._samples = 0
        self._negative = 0
        self._last: tuple[float, float] | None = None

    # -- the window ------------------------------------------------------------------------------

    def _record(self, grad: torch.Tensor) -> None:
        if self._armed:
            self._norms.append(torch.linalg.vector_norm(grad))

    def _record_wide(self, grad: torch.Tensor) -> None:
        if self._armed:
            self._norms.append(torch.linalg.vector_norm(grad, dtype=torch.float32))

    def start(self) -> None:
        """Hook the parameters trainable now for a window's micro-batches. A gradient has its
        parameter's dtype: the norm runs in it (allocating nothing of its size), except float16,
        whose norm would overflow past 65504 and reduces in float32."""
        self._remove()
        self._norms, self._window = [], []
        self._handles = [
            p.register_hook(self._record_wide if p.dtype == torch.float16 else self._record)
            for p in self._params
            if p.requires_grad
        ]
        self._armed = True

    def _remove(self) -> None:
        """Disarm, and take the hooks off the parameters: nothing of the meter is on them
        between windows."""
        self._armed = False
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def fold(self) -> None:
        """After a micro-batch's backward: its |Delta_j|^2, summed over parameters in float64."""
        norms, self._norms = self._norms, []
        if not norms:
            self._window.append(self._zero)
            return
        if self._uniform:
            v = torch.stack(norms).to(_FLOAT64)
        else:
            v = torch.stack([t.to(device=self.device, dtype=_FLOAT64) for t in norms])
        self._window.append(torch.dot(v, v))

    def discard(self) -> None:
        """The window was abandoned or skipped: unhook and forget its micro-batches."""
        self._remove()
        self._norms, self._window = [], []

    def close(self) -> None:
        """The accumulator is closed: a window still open is discarded."""
        self.discard()

    def window_sums(
        self,
        counts: Sequence[int | torch.Tensor],
        norm: torch.Tensor | None,
        scaler: Any,
        rescale: torch.Tensor | float | None = None,
    ) -> list[torch.Tensor]:
        """Disarm; [P, K, |grad|^2, sigma] as float64 device scalars for the step's summary: P and
        K are this rank's (the step sums them over ranks), the others the same on every rank.

        ``norm``: the synchronized gradient's norm before unscaling; ``counts``: the window's
        ``count_fn`` values, in micro-batch order; ``rescale``: post-scaling's W/(N c), which turns
        the increments its backwards added (c s_j) into pre-scaling's (W/N s_j) exactly as the
        gradients are turned, so P is the same figure in both modes.
        """
        self._remove()
        squares, self._window = self._window, []
        device = self.device
        n = torch.stack(
            [
                c.to(device=device, dtype=_FLOAT64)
                if isinstance(c, torch.Tensor)
                else torch.full((), float(c), dtype=_FLOAT64, device=device)
                for c in counts
            ]
        )
        nonempty = n > 0
        small = torch.where(nonempty, torch.stack(squares) / n.clamp(min=1), 0.0).sum()
        if rescale is not None:
            small = small * (rescale**2 if isinstance(rescale, float) else rescale.to(_FLOAT64).square())
        big = self._zero if norm is None else norm.detach().to(_FLOAT64).square()
        # sigma as a device tensor through the public API: scale() multiplies by it (1 if disabled)
        sigma = self._one if scaler is None else scaler.scale(self._one)
        return [small, nonempty.sum(dtype=_FLOAT64), big, sigma]

    # -- the averages ----------------------------------------------------------------------------

    def update(self, figures: Sequence[float], global_count: int, world: int) -> None:
        """Fold one applied window's host figures (:meth:`window_sums`, summed over ranks) in."""
        small_sq_sum, small_batches, big_sq, sigma = figures
        estimate = window_estimate(small_sq_sum, small_batches, big_sq, global_count, world, sigma)
        if estimate is None:
            return
        trace, grad_sq = estimate
        self._mean_trace = EMA_BETA * self._mean_trace + (1 - EMA_BETA) * trace
        self._mean_grad_sq = EMA_BETA * self._mean_grad_sq + (1 - EMA_BETA) * grad_sq
        self._samples += 1
        self._negative += int(trace < 0 or grad_sq < 0)
        self._last = estimate

    # -- resume ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The moving averages and tallies (plain floats and ints), so a resumed run continues the
        estimate instead of restarting it; the hooks and the window in flight are not state."""
        return {
            "mean_trace": self._mean_trace,
            "mean_grad_sq": self._mean_grad_sq,
            "samples": self._samples,
            "negative": self._negative,
            "last": None if self._last is None else [self._last[0], self._last[1]],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, refusing a state this meter could not have written."""
        keys = ("mean_trace", "mean_grad_sq", "samples", "negative", "last")
        if not isinstance(state, dict) or set(state) != set(keys):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ConfigError(f"a noise-scale state holds exactly {list(keys)}, got {got}")
        for key in ("samples", "negative"):
            require_int(f"noise-scale state {key}", state[key], low=0, error=ConfigError)
        if state["negative"] > state["samples"]:
            raise ConfigError(
                f"noise-scale state has negative={state['negative']} > samples={state['samples']}: "
                "not a state a run can reach"
            )
        last = state["last"]
        figures = [state["mean_trace"], state["mean_grad_sq"], *(last if isinstance(last, list) else [])]
        if (last is not None and not (isinstance(last, list) and len(last) == 2)) or not all(
            isinstance(v, float) and math.isfinite(v) for v in figures
        ):
            raise ConfigError(
                "a noise-scale state's mean_trace, mean_grad_sq and last (None or two figures) must be "
                f"finite floats, got {state['mean_trace']!r}, {state['mean_grad_sq']!r}, {last!r}"
            )
        self._mean_trace, self._mean_grad_sq = state["mean_trace"], state["mean_grad_sq"]
        self._samples, self._negative = state["samples"], state["negative"]
        self._last = None if last is None else (last[0], last[1])

    def result(self) -> NoiseScale:
        """The estimate so far (frozen)."""
        if self._samples == 0:
            return NoiseScale(b_simple=None, trace_cov=None, grad_sq=None, samples=0, negative=0)
        correction = 1 - EMA_BETA**self._samples
        trace = max(self._mean_trace / correction, 0.0)
        grad_sq = max(self._mean_grad_sq / correction, 0.0)
        last = self._last
        return NoiseScale(
            b_simple=trace / grad_sq if grad_sq > 0 else None,
            trace_cov=trace,
            grad_sq=grad_sq,
            samples=self._samples,
            negative=self._negative,
            window_trace_cov=None if last is None else last[0],
            window_grad_sq=None if last is None else last[1],
        )
