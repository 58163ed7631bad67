"""The seeds' worked numbers, reproduced through the library's own step."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from gradaccum import Accumulator


class Scalar(nn.Module):
    """y_hat = w * x with w a single weight."""

    def __init__(self, w: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(w, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * x


def _sq_loss(model: nn.Module, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = mb
    return ((model(x) - y) ** 2).sum()


def test_scalar_example_large_15_accumulated_15_wrong_10_67() -> None:
    # micro_batches = [[(1, 0)], [(2, 0), (3, 0), (4, 0)]] at w = 1: d/dw mean((wx - y)^2)
    window = [
        (torch.tensor([1.0], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64)),
        (torch.tensor([2.0, 3.0, 4.0], dtype=torch.float64), torch.zeros(3, dtype=torch.float64)),
    ]
    model = Scalar(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    result = Accumulator(model, opt).step(window, _sq_loss, lambda mb: len(mb[0]))
    assert model.w.grad is not None
    assert model.w.grad.item() == pytest.approx(15.0, rel=1e-12)
    assert (result.local_count, result.global_count, result.micro_batches) == (4, 4, 2)

    # the hand-written mean of means (loss / k) the seeds call wrong
    wrong = Scalar(1.0)
    for x, y in window:
        (((wrong(x) - y) ** 2).mean() / len(window)).backward()
    assert wrong.w.grad is not None
    assert wrong.w.grad.item() == pytest.approx(10.6667, abs=1e-4)


class Linear1(nn.Module):
    """loss per token t is g_t * w, so each token's gradient is its g_t."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros((), dtype=torch.float64))


def test_two_micro_batches_token_mean_2_5_not_mean_of_means_2() -> None:
    window = [torch.ones(2, dtype=torch.float64), torch.full((6,), 3.0, dtype=torch.float64)]
    model = Linear1()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    Accumulator(model, opt).step(window, lambda m, g: (g * m.w).sum(), lambda g: g.numel())
    assert model.w.grad is not None
    assert model.w.grad.item() == pytest.approx(2.5, rel=1e-12)

    # per-micro-batch means divided by k: (1 + 3) / 2 = 2
    naive = Linear1()
    for g in window:
        ((g * naive.w).mean() / len(window)).backward()
    assert naive.w.grad is not None
    assert naive.w.grad.item() == pytest.approx(2.0, rel=1e-12)


def test_mean_reduction_option_gives_the_same_token_mean() -> None:
    window = [torch.ones(2, dtype=torch.float64), torch.full((6,), 3.0, dtype=torch.float64)]
    model = Linear1()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    Accumulator(model, opt, loss_reduction="mean").step(
        window, lambda m, g: (g * m.w).mean(), lambda g: g.numel()
    )
    assert model.w.grad is not None
    assert model.w.grad.item() == pytest.approx(2.5, rel=1e-12)
