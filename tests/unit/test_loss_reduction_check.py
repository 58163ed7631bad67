"""The first window's losses read for a mean passed as a sum (:mod:`gradaccum.step.reduction`).

Each refused form is run through the three one-process paths a window can take: the plain window
(no optional feature), the engine's full path (``noise_scale=True`` takes it) and post-scaling.
A refusal must leave the parameters, their gradients and the optimizer as they were. The
accepted forms are sums (or graphs the reader does not judge); the declared forms step exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gradaccum
from gradaccum.check.accumulation import GradientProbe
from gradaccum.errors import LossError

PATHS: dict[str, dict[str, Any]] = {"plain": {}, "engine": {"noise_scale": True}, "post": {"scaling": "post"}}
IGNORE = -100

Batch = dict[str, torch.Tensor]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _window() -> list[Batch]:
    gen = torch.Generator().manual_seed(1)
    window = []
    for rows in (5, 3, 4):  # uneven micro-batches: a mean of means differs from the mean
        y = torch.randint(0, 3, (rows,), generator=gen)
        y[0] = IGNORE  # one ignored target per micro-batch: cross_entropy's mean is over the rest
        window.append({"x": torch.randn(rows, 4, generator=gen, dtype=torch.float64), "y": y})
    return window


def _count(mb: Batch) -> torch.Tensor:
    return (mb["y"] != IGNORE).sum()


def _one(mb: Batch) -> int:
    return 1


def _logits(model: nn.Module, mb: Batch) -> torch.Tensor:
    out: torch.Tensor = model(mb["x"])
    return out


def _ce(model: nn.Module, mb: Batch, reduction: str = "sum") -> torch.Tensor:
    return F.cross_entropy(_logits(model, mb), mb["y"], ignore_index=IGNORE, reduction=reduction)


class _SumOf(torch.autograd.Function):
    """A custom autograd function: a graph the reader does not judge."""

    @staticmethod
    def forward(ctx: Any, per_unit: torch.Tensor) -> torch.Tensor:
        ctx.shape = per_unit.shape
        return per_unit.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.expand(ctx.shape)


def _per_target(model: nn.Module, mb: Batch) -> torch.Tensor:
    return F.cross_entropy(_logits(model, mb), mb["y"], ignore_index=IGNORE, reduction="none")


MEANS: dict[str, tuple[Callable[[nn.Module, Batch], torch.Tensor], str]] = {
    "cross_entropy default": (
        lambda m, mb: F.cross_entropy(_logits(m, mb), mb["y"], ignore_index=IGNORE),
        "cross_entropy/nll_loss with reduction='mean'",
    ),
    "nll_loss default": (
        lambda m, mb: F.nll_loss(F.log_softmax(_logits(m, mb), -1), mb["y"], ignore_index=IGNORE),
        "cross_entropy/nll_loss with reduction='mean'",
    ),
    ".mean()": (lambda m, mb: _logits(m, mb).square().sum(1).mean(), ".mean()"),
    "torch.mean": (lambda m, mb: torch.mean(_logits(m, mb).square()), ".mean()"),
    "mse_loss default": (
        lambda m, mb: F.mse_loss(_logits(m, mb), torch.zeros(len(mb["y"]), 3, dtype=torch.float64)),
        "MseLossBackward0 with reduction='mean'",
    ),
    "sum / count_fn": (
        lambda m, mb: _ce(m, mb) / _count(mb),
        "a sum divided by",
    ),
    "mean times a constant": (
        lambda m, mb: 2.0 * F.cross_entropy(_logits(m, mb), mb["y"], ignore_index=IGNORE),
        "a mean over",
    ),
}

SUMS: dict[str, Callable[[nn.Module, Batch], torch.Tensor]] = {
    "reduction='sum'": _ce,
    "mean times its count": lambda m, mb: (
        F.cross_entropy(_logits(m, mb), mb["y"], ignore_index=IGNORE) * _count(mb)
    ),
    "a scaled sum": lambda m, mb: 0.5 * _ce(m, mb),
    "a sum over a temperature": lambda m, mb: _ce(m, mb) / 7.0,
    "per-row means, summed": lambda m, mb: _logits(m, mb).square().mean(dim=1).sum(),
    "label smoothing (not judged)": lambda m, mb: F.cross_entropy(
        _logits(m, mb), mb["y"], ignore_index=IGNORE, reduction="sum", label_smoothing=0.1
    ),
    "custom autograd (not judged)": lambda m, mb: _SumOf.apply(_per_target(m, mb)),
}


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("form", list(MEANS))
def test_a_mean_passed_as_a_sum_is_refused_and_nothing_changes(form: str, path: str) -> None:
    loss_fn, names = MEANS[form]
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    before = _snapshot(model)
    acc = gradaccum.Accumulator(model, opt, **PATHS[path])
    with pytest.raises(LossError) as raised:
        acc.step(_window(), loss_fn, _count)
    message = str(raised.value)
    assert message.startswith(
        "loss_fn returned a mean-reduced loss for micro-batch 0 (count_fn counts 4 units"
    )
    assert names in message
    assert "loss_reduction='sum' (the default)" in message and "*summed*" in message
    for fix in ("reduction='sum'", "loss_reduction='mean'", "check_loss_reduction=False"):
        assert fix in message
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    assert not opt.state  # the optimizer never stepped
    with pytest.raises(LossError):  # refused again: a refused window does not end the reading
        acc.step(_window(), loss_fn, _count)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("form", list(SUMS))
def test_sums_and_unjudged_graphs_step(form: str, path: str) -> None:
    model = _model()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), **PATHS[path])
    assert acc.step(_window(), SUMS[form], _count).applied


def _reference(scale: Callable[[Batch], float]) -> list[torch.Tensor]:
    """The full-batch gradient of sum_j scale(B_j) * CE_sum(B_j) / N, in float64, by hand."""
    model = _model()
    window = _window()
    n = sum(int(_count(mb)) for mb in window)
    total = sum(_ce(model, mb) * scale(mb) for mb in window)
    return list(torch.autograd.grad(total / n, list(model.parameters())))


@pytest.mark.parametrize("path", list(PATHS))
def test_declared_mean_is_exact(path: str) -> None:
    model = _model()
    probe = GradientProbe(model.parameters())
    acc = gradaccum.Accumulator(model, probe, loss_reduction="mean", **PATHS[path])
    loss_fn = MEANS["cross_entropy default"][0]
    assert acc.step(_window(), loss_fn, _count).applied
    # float64 throughout: the means times their counts and the reference's sums differ by a few
    # roundings of values near 1 (~1e-16 each); 1e-12 leaves room and catches any count off by one
    for got, want in zip(probe.seen, _reference(lambda mb: 1.0), strict=True):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("path", list(PATHS))
def test_declared_per_micro_batch_loss_steps_as_declared(path: str) -> None:
    # a mean per micro-batch, one unit per micro-batch: the window's objective is the mean of the
    # micro-batches' means, stated by check_loss_reduction=False
    model = _model()
    probe = GradientProbe(model.parameters())
    acc = gradaccum.Accumulator(model, probe, check_loss_reduction=False, **PATHS[path])
    loss_fn = MEANS["cross_entropy default"][0]
    assert acc.step(_window(), loss_fn, _one).applied
    window = _window()
    ref_model = _model()
    objective = sum(_ce(ref_model, mb) / int(_count(mb)) for mb in window) / len(window)
    for got, want in zip(
        probe.seen, torch.autograd.grad(objective, list(ref_model.parameters())), strict=True
    ):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)


def test_only_the_first_window_is_read() -> None:
    model = _model()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert acc.step(_window(), _ce, _count).applied
    assert not acc._reduction.pending  # later windows cost no graph walk
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_reduction="mean")
    assert not acc._reduction.pending  # a declared mean is not read at all


def test_a_mean_over_no_units_is_refused() -> None:
    model = _model()
    window = _window()
    window[0]["y"][:] = IGNORE  # cross_entropy's mean over zero targets: NaN
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(
        LossError, match=r"micro-batch 0 \(count_fn counts 0 units in it\).*a mean over 0 units"
    ):
        acc.step(window, MEANS["cross_entropy default"][0], _count)
