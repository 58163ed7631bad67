"""Post-scaling's constant c follows a list window's own count (one process).

The backward under pre-scaling sees F/N times the summed loss's gradient; under post-scaling c times
it. c = 2**-round(log2(N'/F)) keeps the two within a factor sqrt(2) while N' is this window's N. An
iterator window only knows the previous window's N; a list window is counted before its first
backward, so its own N chooses c, and a jump in the count between windows (1 to 2**20 units) no
longer leaves the backward 2**20 times larger than pre-scaling's (an fp16 overflow where pre
applies). What the backward sees is read at the model's output by a tensor hook.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from gradaccum import Accumulator

BIG = 2**20


class Probe(nn.Module):
    """A linear model that records the largest gradient reaching its output in each backward."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.lin = nn.Linear(4, 1).double()
        self.seen: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        y.register_hook(lambda g: self.seen.append(float(g.abs().max())))
        return y


def _windows() -> list[list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(1)

    def mb(units: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(2, 4, generator=gen, dtype=torch.float64), "units": torch.tensor(units)}

    return [[mb(1), mb(1)], [mb(BIG), mb(BIG)], [mb(1), mb(1)]]


def loss_fn(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(mb["x"]).square().sum()


def count_fn(mb: dict[str, torch.Tensor]) -> int:
    return int(mb["units"])  # the units a window counts, however few rows carry them here


def _seen(scaling: str, as_list: bool) -> list[float]:
    model = Probe()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), scaling=scaling)
    for window in _windows():
        acc.step(window if as_list else iter(window), loss_fn, count_fn)
    return model.seen


def test_a_list_windows_c_follows_its_own_count() -> None:
    pre, post = _seen("pre", True), _seen("post", True)
    assert len(pre) == len(post) == 6
    for a, b in zip(pre, post, strict=True):
        # c N/F is a power of two within sqrt(2) of 1; here N/F is a power of two itself: exactly 1
        assert b / a == pytest.approx(1.0, rel=1e-12)


def test_an_iterator_window_follows_the_previous_count_as_documented() -> None:
    """The limit the README states: without the window in hand, c comes from the previous N."""
    pre, post = _seen("pre", True), _seen("post", False)
    ratios = [b / a for a, b in zip(pre, post, strict=True)]
    assert ratios[2] == pytest.approx(BIG, rel=1e-12)  # window 2 scaled by window 1's N = 2
    assert ratios[4] == pytest.approx(1 / BIG, rel=1e-12)
    assert all(math.isfinite(r) for r in ratios)
