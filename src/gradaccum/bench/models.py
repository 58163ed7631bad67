"""The seeds' two back-of-envelope models, fitted to or set beside what was measured.

Memory: peak = persistent + per_example x micro_batch. The persistent part (weights, gradients,
optimizer state, the runtime) does not depend on the micro-batch; activations grow with it. Real
kernels and allocators bend the line, which is why the fit reports its residual and the prediction
is printed next to each measurement rather than instead of it.

Communication: a synchronized backward all-reduces one full gradient set (G bytes). Naive
accumulation synchronizes every micro-batch, k x G per update; deferring sync to the last one moves
G, the same as one large batch would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gradaccum.errors import BenchError

__all__ = ["CommModel", "MemoryModel", "comm_model", "fit_memory_model"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryModel:
    """``peak = persistent_bytes + per_example_bytes x micro_batch``, fitted by least squares."""

    persistent_bytes: float
    """The intercept: memory held whatever the micro-batch."""
    per_example_bytes: float
    """The slope: memory each example of a micro-batch adds (activations)."""
    residual_bytes: float
    """Root-mean-square gap between the fitted line and the measurements."""
    points: int
    """Measurements fitted."""
    kind: str
    """Which figure was fitted (e.g. "CPU process peak RSS", "CUDA max_memory_allocated")."""

    def predict(self, micro_batch: int) -> float:
        return self.persistent_bytes + self.per_example_bytes * micro_batch

    def largest_micro_batch(self, budget_bytes: float) -> int | None:
        """The largest micro-batch whose predicted peak fits ``budget_bytes``.

        0 when even the persistent part does not fit; ``None`` when the fit found no growth with
        the micro-batch (slope <= 0), so the model sets no limit.
        """
        if self.per_example_bytes <= 0:
            return None if self.persistent_bytes <= budget_bytes else 0
        room = budget_bytes - self.persistent_bytes
        return max(0, math.floor(room / self.per_example_bytes))


def fit_memory_model(
    micro_batches: Sequence[int], peaks_bytes: Sequence[float], *, kind: str = "peak memory"
) -> MemoryModel:
    """Least-squares line through (micro_batch, peak) points; needs two distinct micro-batches."""
    if len(micro_batches) != len(peaks_bytes):
        raise BenchError(
            f"the memory fit needs one peak per micro-batch, got {len(micro_batches)} micro-batches "
            f"and {len(peaks_bytes)} peaks"
        )
    xs = [float(x) for x in micro_batches]
    ys = [float(y) for y in peaks_bytes]
    if len(set(xs)) < 2:
        raise BenchError(
            "the memory fit needs measurements at two or more distinct micro-batches, got "
            f"{sorted(set(xs))}; sweep more factorizations of the global batch"
        )
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    intercept = mean_y - slope * mean_x
    rms = math.sqrt(sum((intercept + slope * x - y) ** 2 for x, y in zip(xs, ys, strict=True)) / n)
    return MemoryModel(
        persistent_bytes=intercept, per_example_bytes=slope, residual_bytes=rms, points=n, kind=kind
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class CommModel:
    """Gradient bytes all-reduced per optimizer update, per rank, by the seeds' model."""

    gradient_bytes: int
    """G: one full gradient set, what one synchronized backward all-reduces."""
    accum_steps: int
    """k: micro-batches per update."""
    naive_bytes: int
    """Synchronizing every micro-batch: k x G."""
    deferred_bytes: int
    """Synchronizing the last micro-batch only: 1 x G."""
    measured_bytes: int | None
    """What the DDP comm hook counted per update (``None`` without data parallelism)."""
    defer_sync: bool
    """Which of the two the measurement used."""

    @property
    def expected_bytes(self) -> int:
        """The model's figure for the measured mode."""
        return self.deferred_bytes if self.defer_sync else self.naive_bytes

    @property
    def matches(self) -> bool | None:
        """Whether the measured bytes equal the model's; ``None`` when nothing was measured."""
        return None if self.measured_bytes is None else self.measured_bytes == self.expected_bytes


def comm_model(
    gradient_bytes: int, accum_steps: int, *, defer_sync: bool = True, measured_bytes: int | None = None
) -> CommModel:
    """k x G for naive accumulation, 1 x G with deferred sync, beside the measured figure."""
    if gradient_bytes < 0 or accum_steps < 1:
        raise BenchError(
            f"gradient_bytes must be >= 0 and accum_steps >= 1, got {gradient_bytes} and {accum_steps}"
        )
    return CommModel(
        gradient_bytes=gradient_bytes,
        accum_steps=accum_steps,
        naive_bytes=accum_steps * gradient_bytes,
        deferred_bytes=gradient_bytes,
        measured_bytes=measured_bytes,
        defer_sync=defer_sync,
    )
