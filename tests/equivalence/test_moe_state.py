"""What a load balance leaves behind, bitwise: the model's buffers and RNG after exact mode's routing
pass, and the aux-loss-free bias and carried counts across skipped windows (float64, one process).

The reference is always the same run without the thing under test: a step with no balance (no
routing pass), or the same windows with the skipped one left out. A skipped window changes nothing
(neither parameters nor buffers nor the balance's carried state), so both runs compute the same
floating-point operations in the same order and must agree to the bit.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

from gradaccum import Accumulator
from gradaccum.moe import LoadBalance

Batch = dict[str, torch.Tensor]
WIDTH, EXPERTS = 4, 3


class _Tracker(nn.Module):
    """State a forward writes outside BatchNorm: a buffer moved in place, one replaced."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("last", torch.zeros(WIDTH, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls.add_(1)
            self.last = x.detach().mean(0)
        return x


class _Router(nn.Module):
    """A linear router; with ``bias``, DeepSeek-V3's: the bias steers the top-1 choice, not the weights."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, EXPERTS, dtype=torch.float64)
        if bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(EXPERTS, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class _Net(nn.Module):
    """Two MoE layers (top-1 of 3 experts, soft-weighted) behind BatchNorms and dropout; the layers
    after the last router (a BatchNorm, dropout, the head) draw random numbers too."""

    def __init__(self, *, bias: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.norms = nn.ModuleList([nn.BatchNorm1d(WIDTH, dtype=torch.float64) for _ in range(3)])
        self.tracker = _Tracker()
        self.drop = nn.Dropout(dropout)
        self.routers = nn.ModuleList([_Router(bias) for _ in range(2)])
        self.experts = nn.ModuleList(
            [
                nn.ModuleList([nn.Linear(WIDTH, WIDTH, dtype=torch.float64) for _ in range(EXPERTS)])
                for _ in range(2)
            ]
        )
        self.head = nn.Linear(WIDTH, 1, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tracker(x)
        for norm, router, experts in zip(self.norms, self.routers, self.experts, strict=False):
            x = self.drop(norm(x))  # the second BatchNorm sees the first layer's output
            p = torch.softmax(router(x), -1)
            x = x + sum(p[:, i : i + 1] * experts[i](x) for i in range(EXPERTS))
        return self.head(self.drop(self.norms[2](x))).squeeze(-1)


def _loss(model: nn.Module, mb: Batch) -> torch.Tensor:
    return ((model(mb["x"]) - mb["y"]).square() * mb["w"]).sum()


def _units(mb: Batch) -> torch.Tensor:
    return (mb["w"].sum() * mb["units"]).long()


def _window(
    seed: int, sizes: tuple[int, ...] = (4, 3, 5), *, nan: bool = False, empty: bool = False
) -> list[Batch]:
    """``nan``: a non-finite loss (the step skips after the forwards); ``empty``: no counted units
    (it skips before them), with rows the routers still see."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        y = torch.randn(n, generator=gen, dtype=torch.float64)
        out.append(
            {
                "x": torch.randn(n, WIDTH, generator=gen, dtype=torch.float64) * 2 + 1,
                "y": y * float("nan") if nan else y,
                "w": (torch.rand(n, generator=gen) > 0.2).to(torch.float64),
                "units": torch.tensor(0 if empty else 1),
            }
        )
    return out


def _balance(model: _Net, mode: str, *, coef: float = 0.3, bias_rate: float | None = None) -> LoadBalance:
    return LoadBalance(
        routers=list(model.routers),
        num_experts=EXPERTS,
        top_k=1,
        coef=coef,
        mode=mode,  # type: ignore[arg-type]
        bias_rate=bias_rate,
        mask_fn=lambda mb: mb["w"],
    )


def _state(model: nn.Module, *, skips: bool = False) -> dict[str, Any]:
    """``skips``: compared across runs that differ by skipped windows, whose forwards still ran, so
    the tracker (written by every training forward) is left out."""
    return {k: v.clone() for k, v in model.state_dict().items() if not (skips and k.startswith("tracker."))}


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


# -- the routing pass leaves the model's state and the RNG as found -----------------------------


@pytest.mark.parametrize("stats", ["micro-batch", "window"])
def test_routing_pass_leaves_buffers_as_the_step_without_it(stats: str) -> None:
    """BatchNorm's running statistics and num_batches_tracked, a buffer moved in place and one
    replaced: after two exact-mode steps, bitwise those of the same steps with no balance. (Before,
    the pass's training-mode forwards moved them too: 4 updates per step instead of 1 with
    batchnorm_stats='window', 6 instead of 3 with PyTorch's own.)"""
    windows = [_window(1), _window(2)]
    plain, balanced = _Net(), _Net()
    runs = [
        Accumulator(plain, torch.optim.SGD(plain.parameters(), lr=0.1), batchnorm_stats=stats),
        Accumulator(
            balanced,
            torch.optim.SGD(balanced.parameters(), lr=0.1),
            batchnorm_stats=stats,
            balance=_balance(balanced, "exact", coef=0.0),
        ),
    ]
    for window in windows:
        for acc in runs:
            assert acc.step(window, _loss, _units).applied
    per_step = 1 if stats == "window" else len(windows[0])
    assert int(balanced.norms[0].num_batches_tracked) == 2 * per_step
    assert int(balanced.tracker.calls) == 2 * len(windows[0])
    _assert_same(_state(balanced), _state(plain))  # coef 0: the parameters too, to the bit


def test_routing_pass_replays_dropout_on_both_sides_of_the_last_router() -> None:
    """Dropout before the routers (the routing depends on it) and after the last one: the pass must
    not shift the stream the training forwards draw from (it then runs whole forwards: a forward
    stopped at the last router would leave the generator short of the tail's draws). With coef=0
    the step is bitwise the step without a balance: parameters, buffers and the RNG state after it;
    and it is never vetoed."""
    windows = [_window(1), _window(2), _window(3)]
    plain, balanced = _Net(dropout=0.3), _Net(dropout=0.3)
    ends = []
    for model, balance in ((plain, None), (balanced, _balance(balanced, "exact", coef=0.0))):
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), balance=balance)
        torch.manual_seed(11)
        for window in windows:
            assert acc.step(window, _loss, _units).applied
        ends.append(torch.get_rng_state())
    assert torch.equal(ends[0], ends[1])
    _assert_same(_state(balanced), _state(plain))


def test_routing_pass_stops_at_the_last_router() -> None:
    """Without random draws after the last router, the pass's forwards end there: the head runs
    once per micro-batch (its training forward), except in the run's first pass, which runs one
    whole forward to learn where the routers end."""
    model = _Net()
    heads: list[int] = []
    model.head.register_forward_hook(lambda *a: heads.append(1))
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), balance=_balance(model, "exact"))
    for index, window in enumerate([_window(1), _window(2)]):
        heads.clear()
        assert acc.step(window, _loss, _units).applied
        assert len(heads) == len(window) + (1 if index == 0 else 0)


# -- the aux-loss-free bias and the carried counts across skipped windows -----------------------


def _accumulator(model: _Net, mode: str) -> Accumulator:
    """batchnorm_stats='window': a skipped window leaves BatchNorm's statistics as they were."""
    return Accumulator(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        batchnorm_stats="window",
        balance=_balance(model, mode, bias_rate=0.1),
    )


def _run(mode: str, windows: list[list[Batch]]) -> tuple[_Net, Accumulator, list[bool]]:
    model = _Net(bias=True)
    acc = _accumulator(model, mode)
    return model, acc, [acc.step(window, _loss, _units).applied for window in windows]


def _biases(model: _Net) -> list[torch.Tensor]:
    return [r.e_score_correction_bias.clone() for r in model.routers]


@pytest.mark.parametrize("skip", ["nan", "empty"])
@pytest.mark.parametrize("mode", ["exact", "lagged"])
def test_a_skipped_window_moves_neither_the_bias_nor_the_carried_counts(mode: str, skip: str) -> None:
    """Windows A, S (skipped), B, C against A, B, C: the same parameters, buffers and biases to the
    bit after every applied step. The bias moves once per applied step, from that window's counts
    (never the skipped one's); lagged mode's window after a skip balances on the last applied
    window's counts, which the skipped one used too."""
    a, b, c = _window(1), _window(2), _window(3)
    skipped = _window(4, nan=skip == "nan", empty=skip == "empty")
    model, acc, applied = _run(mode, [a, skipped])
    assert applied == [True, False]
    straight, straight_acc, _ = _run(mode, [a])
    if mode == "exact":  # lagged moves A's bias at the next window's agreement: S's here, B's there
        _assert_same(_state(model, skips=True), _state(straight, skips=True))
    moves = []
    for window in (b, c):
        before = _biases(model)
        assert acc.step(window, _loss, _units).applied
        assert straight_acc.step(window, _loss, _units).applied
        _assert_same(_state(model, skips=True), _state(straight, skips=True))
        moves.append(any(not torch.equal(x, y) for x, y in zip(before, _biases(model), strict=True)))
    # the routers' loads are uneven, so every applied window's counts move the bias: exact mode's
    # with its update; lagged mode's at the next agreement (A's already in S, B's in C)
    assert moves == ([True, True] if mode == "exact" else [False, True])


@pytest.mark.parametrize("mode", ["exact", "lagged"])
def test_bias_moves_once_per_applied_step_by_the_rate(mode: str) -> None:
    """Each applied step moves every bias entry by exactly -rate, 0 or +rate; over A, S, B the total
    move is a sum of two such steps (exact: one per applied window so far; lagged: the move for a
    window comes at the next window's agreement, so one)."""
    model, _, applied = _run(mode, [_window(1), _window(4, nan=True), _window(2)])
    assert applied == [True, False, True]
    moves = 2 if mode == "exact" else 1
    for bias in _biases(model):
        steps = bias / 0.1
        assert torch.equal(steps, steps.round()) and float(steps.abs().max()) <= moves


@pytest.mark.parametrize("mode", ["exact", "lagged"])
def test_resume_across_a_skip_is_bitwise(mode: str) -> None:
    """The balance's state saved after A and a skipped S, loaded into a rebuilt run: B and C as in
    the run that never stopped."""
    a, s, b, c = _window(1), _window(4, nan=True), _window(2), _window(3)
    straight, _, _ = _run(mode, [a, s, b, c])
    first, acc, _ = _run(mode, [a, s])
    saved = copy.deepcopy((first.state_dict(), acc.state_dict()))
    resumed = _Net(bias=True)
    resumed.load_state_dict(saved[0])
    acc = _accumulator(resumed, mode)
    acc.load_state_dict(saved[1])
    for window in (b, c):
        assert acc.step(window, _loss, _units).applied
    _assert_same(_state(resumed), _state(straight))
