"""The seeds' two back-of-envelope models, fitted to or set beside what was measured.

Memory: peak ~ persistent + fixed + per_example x micro_batch. The persistent term (parameters,
gradients, optimizer state) is measured from the tensors and does not depend on the micro-batch;
the activation term is the bytes one micro-batch's forward saves for backward, measured per
configuration and fitted by least squares against the micro-batch (its intercept is ``fixed``).
Real kernels and allocators add working memory on top, which is why CUDA's own peaks are shown
beside the model rather than replaced by it. Accumulation shrinks only the activation term: when
the persistent term alone exceeds a budget, no micro-batch (and no accumulation) can fit it.

Communication: a synchronized backward all-reduces one full gradient set (G bytes). Naive
accumulation synchronizes every micro-batch, k x G per update; deferring sync to the last one moves
G, the same as one large batch would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gradaccum.errors import BenchError
from gradaccum.plan import factorizations

if TYPE_CHECKING:
    from gradaccum.bench.stats import ConfigSummary

__all__ = [
    "CommModel",
    "MemoryModel",
    "comm_model",
    "fit_memory_model",
    "fmt_size",
    "memory_model_of",
    "persistent_wall",
]

MIB = 1024**2


def fmt_size(value: float) -> str:
    """Bytes in the largest binary unit that keeps the figure >= 1, e.g. ``6.0 GiB``."""
    for unit, size in (("GiB", 1024**3), ("MiB", MIB), ("KiB", 1024)):
        if abs(value) >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


_fmt = fmt_size


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryModel:
    """``peak ~ persistent_bytes + fixed_bytes + per_example_bytes x micro_batch``."""

    persistent_bytes: float
    """Parameters + gradients + optimizer state: held whatever the micro-batch."""
    per_example_bytes: float
    """The slope of the activation bytes against the micro-batch (what each example adds)."""
    fixed_bytes: float
    """The activation fit's intercept (saved tensors that do not grow with the micro-batch)."""
    residual_bytes: float
    """Root-mean-square gap between the fitted activation line and the measurements."""
    points: int
    """Configurations fitted."""
    kind: str
    """Which figures were fitted."""
    distinct: int = 0
    """Distinct micro-batches among the points: 1 gives a line through the origin, 2 a line through
    both points (exact by construction), only 3 or more a residual that says how well a line fits."""

    @property
    def fit_words(self) -> str:
        """How the line was found and what its residual can say, in words."""
        if self.distinct <= 1:
            return (
                f"one micro-batch measured ({self.points} configuration(s) of {self.kind}): activations "
                "taken as proportional to it, a line through the origin, not a fit"
            )
        if self.distinct == 2:
            return (
                f"a line through two measured micro-batches ({self.kind}): exact at both by construction, "
                "so there is no residual to judge it by; measure a third to test it"
            )
        return (
            f"least squares over {self.points} configurations ({self.distinct} micro-batches) of "
            f"{self.kind}; rms residual {_fmt(self.residual_bytes)}"
        )

    def predict(self, micro_batch: int) -> float:
        return self.persistent_bytes + self.fixed_bytes + self.per_example_bytes * micro_batch

    def largest_micro_batch(self, budget_bytes: float) -> int | None:
        """The largest micro-batch whose predicted peak fits ``budget_bytes``.

        0 when not even one example fits (or the persistent term alone exceeds the budget);
        ``None`` when the fit found no growth with the micro-batch, so it sets no limit.
        """
        room = budget_bytes - self.persistent_bytes - self.fixed_bytes
        if self.per_example_bytes <= 0:
            return None if room >= 0 else 0
        return max(0, math.floor(room / self.per_example_bytes))

    def advice(self, budget_bytes: float, *, global_batch: int, dp: int) -> str:
        """One sentence, with the figures: which factorization fits, or why none can."""
        wall = persistent_wall(self.persistent_bytes, budget_bytes)
        if wall is not None:
            return wall
        largest = self.largest_micro_batch(budget_bytes)
        if largest is None:
            return (
                f"the fit finds no growth with the micro-batch: every factorization fits {_fmt(budget_bytes)}"
            )
        fitting = [p for p in factorizations(global_batch, dp=dp) if p.micro_batch <= largest]
        if not fitting:
            return (
                f"not even one example per micro-batch fits {_fmt(budget_bytes)}: "
                f"{_fmt(self.persistent_bytes)} persistent + "
                f"{_fmt(self.fixed_bytes + self.per_example_bytes)} for one example's activations; use "
                "activation checkpointing or shard the state"
            )
        best = fitting[0]
        return (
            f"micro-batches up to {largest} fit {_fmt(budget_bytes)} ({_fmt(self.persistent_bytes)} "
            f"persistent + {_fmt(self.per_example_bytes)} per example); the largest factorization of "
            f"global batch {global_batch} that fits is {best.label()} "
            f"({_fmt(self.predict(best.micro_batch))} predicted)"
        )


def persistent_wall(
    persistent_bytes: float, budget_bytes: float, *, sharded_dp: int | None = None
) -> str | None:
    """The sentence for a persistent term that alone exceeds ``budget_bytes``; ``None`` when it fits.

    Accumulation, a smaller micro-batch and activation checkpointing all shrink the activations
    only, so none of them can help: the state must be sharded (over more ranks, if it already is,
    ``sharded_dp`` ranks) or made lighter.
    """
    if persistent_bytes <= budget_bytes:
        return None
    where = "" if sharded_dp is None else f" per rank, already sharded over {sharded_dp} ranks with FSDP2"
    shard = "shard it over more ranks" if sharded_dp is not None else "shard the state (FSDP2, ZeRO)"
    return (
        f"the persistent state alone ({_fmt(persistent_bytes)}{where}: parameters, gradients and "
        f"optimizer state) exceeds the budget of {_fmt(budget_bytes)}: neither a smaller micro-batch nor "
        "more accumulation can fix that, nor can activation checkpointing, since they shrink only the "
        f"activations; {shard} or use a lighter optimizer (SGD, 8-bit or factored Adam)"
    )


def fit_memory_model(
    micro_batches: Sequence[int],
    activation_bytes: Sequence[float],
    persistent_bytes: float,
    *,
    kind: str = "tensors: persistent + bytes saved for backward",
) -> MemoryModel:
    """Least-squares line through (micro_batch, activation) points; with one distinct micro-batch
    the activations are taken as proportional to it (a line through the origin)."""
    if len(micro_batches) != len(activation_bytes) or not micro_batches:
        raise BenchError(
            f"the memory fit needs one activation figure per micro-batch, got {len(micro_batches)} "
            f"micro-batches and {len(activation_bytes)} figures"
        )
    xs = [float(x) for x in micro_batches]
    ys = [float(y) for y in activation_bytes]
    n = len(xs)
    if len(set(xs)) < 2:
        slope, intercept = (sum(ys) / sum(xs), 0.0) if sum(xs) else (0.0, 0.0)
    else:
        mean_x, mean_y = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mean_x) ** 2 for x in xs)
        sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
        slope = sxy / sxx
        intercept = mean_y - slope * mean_x
    rms = math.sqrt(sum((intercept + slope * x - y) ** 2 for x, y in zip(xs, ys, strict=True)) / n)
    return MemoryModel(
        persistent_bytes=float(persistent_bytes),
        per_example_bytes=slope,
        fixed_bytes=intercept,
        residual_bytes=rms,
        points=n,
        kind=kind,
        distinct=len(set(xs)),
    )


def memory_model_of(configs: Sequence[ConfigSummary]) -> MemoryModel | None:
    """The memory model of the plain configurations that measured their memory (None if none did).

    Plain: no activation checkpointing and no FSDP2, whose rows follow other lines (checkpointing
    changes the activation slope, sharding the persistent term); the advisor
    (:mod:`gradaccum.bench.advisor`) compares those rows by their measured figures instead.
    """
    measured = [
        c
        for c in configs
        if c.memory is not None
        and c.spec.checkpointing == "none"
        and not c.spec.fsdp
        and c.spec.max_tokens is None  # a token budget's rows are not a point on the micro-batch line
    ]
    if not measured:
        return None
    return fit_memory_model(
        [c.spec.micro_batch for c in measured],
        [c.memory.activation_bytes for c in measured if c.memory is not None],
        max(c.memory.persistent_bytes for c in measured if c.memory is not None),
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
