"""Clearing a window's gradients (:mod:`gradaccum.step.zeroing`): what
``optimizer.zero_grad(set_to_none=True)`` does, with torch's own ``zero_grad`` called only where it
adds something (a profiler records its range) and an optimizer's own ``zero_grad`` always kept."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradaccum import Accumulator, split
from tests.helpers import models


def _window(seed: int = 1) -> list[dict[str, torch.Tensor]]:
    return split(models.mlp_batch(6, seed=seed), micro_batch=2)


class _Recorder:
    """A loss_fn that records, at each window's first forward, whether every gradient is None."""

    def __init__(self, model: torch.nn.Module, extra: tuple[torch.Tensor, ...] = ()) -> None:
        self.tensors = [*model.parameters(), *extra]
        self.extra = extra
        self.first: object = None
        self.seen: list[bool] = []

    def __call__(self, model: torch.nn.Module, mb: dict) -> torch.Tensor:
        if mb is self.first:
            self.seen.append(all(p.grad is None for p in self.tensors))
        loss = models.mlp_loss(model, mb)
        return loss + sum((t * t).sum() for t in self.extra) if self.extra else loss

    def step(self, acc: Accumulator, *seeds: int) -> None:
        for seed in seeds:
            window = _window(seed)
            self.first = window[0]
            acc.step(window, self, models.count_rows)


@pytest.fixture
def torch_zero_grads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Calls of torch's own ``Optimizer.zero_grad``, by optimizer class."""
    calls: list[str] = []
    original = torch.optim.Optimizer.zero_grad

    def counted(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        calls.append(type(self).__name__)
        original(self, set_to_none)

    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", counted)
    monkeypatch.setattr("gradaccum.step.zeroing._torch_zero_grad", counted)
    return calls


def test_outside_a_profiler_gradients_are_cleared_without_torchs_zero_grad(
    torch_zero_grads: list[str],
) -> None:
    model = models.mlp()
    frozen_apart = list(model.parameters())[-1]  # a parameter the optimizer does not hold
    opt = torch.optim.SGD([p for p in model.parameters() if p is not frozen_apart], lr=0.1)
    acc = Accumulator(model, opt)
    record = _Recorder(model)
    record.step(acc, 1, 2)
    assert record.seen == [True, True]
    assert torch_zero_grads == []


def test_under_a_profiler_torchs_zero_grad_runs_and_its_range_is_traced(torch_zero_grads: list[str]) -> None:
    model = models.mlp()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    record = _Recorder(model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        record.step(acc, 1, 2)
    assert record.seen == [True, True]
    assert torch_zero_grads == ["SGD", "SGD"]
    assert sum(e.name.startswith("Optimizer.zero_grad#SGD.zero_grad") for e in prof.events()) == 2


class _OwnZeroGrad(torch.optim.SGD):
    """An optimizer that keeps something of its own to clear (as ZeRO and wrappers do)."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.cleared: list[bool] = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.cleared.append(set_to_none)
        super().zero_grad(set_to_none)


def test_an_optimizers_own_zero_grad_is_called_once_per_window() -> None:
    model = models.mlp()
    opt = _OwnZeroGrad(model.parameters(), lr=0.1)
    acc = Accumulator(model, opt)
    record = _Recorder(model)
    record.step(acc, 1, 2)
    assert opt.cleared == [True, True] and record.seen == [True, True]


def test_a_zero_grad_set_on_the_instance_is_called(torch_zero_grads: list[str]) -> None:
    """A wrapper set on the optimizer itself (the hazard sanitizer's, a user's) sees every clear."""
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, opt)  # built before the wrapper is set: it is looked up each window
    wrapped: list[int] = []
    inner = opt.zero_grad

    def wrapper(set_to_none: bool = True) -> None:
        wrapped.append(1)
        inner(set_to_none)

    opt.zero_grad = wrapper  # type: ignore[method-assign]
    record = _Recorder(model)
    record.step(acc, 1, 2)
    del opt.zero_grad
    record.step(acc, 3)
    assert wrapped == [1, 1] and record.seen == [True, True, True]
    assert torch_zero_grads == ["SGD", "SGD"]  # the wrapper's inner call; none once it was removed


def test_a_parameter_group_added_after_construction_is_cleared() -> None:
    """A parameter the loss uses but the model does not hold, added with add_param_group after the
    accumulator was built: if its gradient were not cleared, the second window's update would use
    the sum of two windows' gradients."""
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, opt)
    temperature = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt.add_param_group({"params": [temperature]})
    record = _Recorder(model, (temperature,))
    record.step(acc, 1, 2)
    opt.load_state_dict(opt.state_dict())  # which replaces param_groups
    record.step(acc, 3)
    assert record.seen == [True, True, True]
