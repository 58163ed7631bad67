"""What accept and bench print about their own figures: the estimate, the memory fit, the plots.

Each test builds the figures by hand (or probes a tiny model), so it is fast and deterministic.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn as nn

from gradaccum.bench.estimate import estimate, probe
from gradaccum.bench.memory import MemoryFigures
from gradaccum.bench.models import fit_memory_model
from gradaccum.bench.report import memory_lines, phase_lines
from gradaccum.bench.spec import MeasureSpec
from gradaccum.bench.stats import ConfigSummary, Spread
from gradaccum.check.workload import Workload
from gradaccum.plan import BatchPlan
from tests.helpers import models

MASK = 256  # a fixed (MASK x MASK) float32 buffer saved for backward once per forward: 256 KiB


class Masked(nn.Module):
    """An MLP whose output passes through a fixed matrix, like a causal mask: saved once per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = models.mlp(0, torch.float32)
        self.proj = nn.Linear(3, MASK)
        self.register_buffer("fixed", torch.eye(MASK))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.inner(x)) @ self.fixed


def _loss(model: nn.Module, mb: dict[str, Any]) -> torch.Tensor:
    return model(mb["x"].float()).square().sum()


def masked() -> Workload:
    return Workload(
        name="masked",
        build_model=Masked,
        make_batch=lambda n, seed: models.mlp_batch(n, seed, torch.float32),
        loss_fn=_loss,
        count_fn=models.count_rows,
        unit="examples",
    )


def test_the_estimate_counts_a_buffer_that_does_not_grow_with_the_batch_once() -> None:
    figures = probe(masked())
    mask_bytes = MASK * MASK * 4
    assert figures.fixed_activation_bytes >= mask_bytes  # the fixed matrix, once
    assert figures.activation_bytes_per_example < mask_bytes / 16  # not in every example's share
    big = estimate(figures, BatchPlan(micro_batch=1000, accum_steps=1))
    # a million examples' worth of the mask would be 256 GiB; the estimate stays near the real size
    assert big.training_bytes < figures.persistent_bytes + 2 * mask_bytes + 1000 * mask_bytes / 16


def _summary(micro_batch: int, memory: MemoryFigures | None, **changes: Any) -> ConfigSummary:
    spec = MeasureSpec(workload="w:f", micro_batch=micro_batch, accum_steps=8 // micro_batch)
    values: dict[str, Any] = dict(
        spec=spec, status="ok", error=None, runs=3, runs_ok=3, unit="tokens",
        units_per_s=Spread.of([1000.0]), step_ms=Spread.of([440.6]), micro_ms=46.75, sync_ms=None,
        optimizer_ms=1.58, tokens_per_update=[10], tokens_identical_across_runs=True, updates=3,
        skipped_updates=0, peak_rss_bytes=None, peak_allocated_bytes=None, peak_reserved_bytes=None,
        gradient_bytes=None, allreduce_calls_per_update=None, allreduce_bytes_per_update=None,
        buckets=None, per_run_units_per_s=[1000.0], memory=memory, count_ms=0.3, other_ms=64.1,
        phase_means_ms=(0.3, 374.0, 1.6, 64.7, 440.6),
    )  # fmt: skip
    values.update(changes)
    return ConfigSummary(**values)


def test_a_step_s_phases_add_up_with_what_they_leave_named() -> None:
    (head, row) = phase_lines([_summary(1, None)])
    assert "other: the rest, not broken down" in head and "means add up" in head
    assert row == (
        "- 1x8: count 0.30 + micro-batches 374.00 (8 x 46.75) + optimizer 1.60 + other 64.70 = step 440.60 ms"
    )


def test_a_line_through_two_points_claims_no_residual() -> None:
    two = fit_memory_model([2, 4], [200.0, 400.0], 1000.0)
    (line,) = memory_lines(two, None, None)
    assert "rms residual" not in line and "exact at both by construction" in line
    one = fit_memory_model([4, 4], [400.0, 400.0], 1000.0)
    assert "not a fit" in memory_lines(one, None, None)[0]
    three = fit_memory_model([1, 2, 4], [100.0, 210.0, 400.0], 1000.0)
    assert "rms residual" in memory_lines(three, None, None)[0]


def test_a_failed_memory_probe_is_not_plotted_as_zero() -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from gradaccum.bench.plots import _memory_bars

    figures = MemoryFigures(
        parameter_bytes=1 << 20,
        gradient_bytes=1 << 20,
        optimizer_state_bytes=2 << 20,
        activation_bytes=1 << 19,
    )
    arms = [_summary(4, figures), dataclasses.replace(_summary(2, None), status="oom")]
    ax = Figure().subplots()
    _memory_bars(ax, ["baseline 4x2", "candidate 2x4"], arms, None)
    xs = sorted({round(p.get_x() + p.get_width() / 2) for p in ax.patches})
    assert xs == [0]  # bars for the measured arm only
    texts = [t.get_text() for t in ax.texts]
    assert "not measured\n(oom)" in texts and "0.00" not in texts


def test_every_measured_row_is_in_the_throughput_plot_a_token_budget_included() -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from gradaccum.bench.plots import _throughput

    budget = dataclasses.replace(
        _summary(8, None, units_per_s=Spread.of([1500.0, 1600.0, 1400.0])),
        spec=MeasureSpec(workload="w:f", micro_batch=8, accum_steps=1, max_tokens=256),
    )
    failed_budget = dataclasses.replace(
        budget, spec=dataclasses.replace(budget.spec, max_tokens=64), status="oom", units_per_s=None
    )
    ax = Figure().subplots()
    _throughput(ax, [_summary(1, None), _summary(2, None), budget, failed_budget])
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(text.startswith("tokens<=256 (a token budget)") for text in legend)
    assert "tokens<=64: oom" in legend
    lines = [line for line in ax.get_lines() if list(line.get_ydata()) == [1500.0, 1500.0]]
    assert len(lines) == 1  # the budget row's median, across the plot
    assert {t.get_text() for t in ax.texts} >= {"1x8", "2x4"}


def test_the_advisor_names_a_token_budget_row_by_its_budget() -> None:
    from gradaccum.bench.advisor import Row

    figures = MemoryFigures(
        parameter_bytes=1 << 20,
        gradient_bytes=1 << 20,
        optimizer_state_bytes=2 << 20,
        activation_bytes=1 << 19,
    )
    budget = dataclasses.replace(
        _summary(8, figures), spec=MeasureSpec(workload="w:f", micro_batch=8, accum_steps=1, max_tokens=256)
    )
    row = Row.of(budget)
    assert row is not None
    assert row.words() == "micro-batches of at most 256 tokens (tokens<=256)"
    assert (row.to_dict()["micro_batch"], row.to_dict()["accum_steps"]) == (None, None)
    fixed = Row.of(_summary(2, figures))
    assert fixed is not None and fixed.words() == "micro-batch 2 (2x4)"
