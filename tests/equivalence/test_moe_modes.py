"""The ``lagged`` and ``micro-batch`` load-balance modes against their objectives by hand, the
forwards each mode runs, and a bitwise resume of the lagged counts (float64, one process).

``micro-batch``: CE/N + coef/M * sum_m aux_m, aux_m on micro-batch m's own statistics.
``lagged``: the first window as ``micro-batch``; then CE/N + coef*E/R'^2 * sum_i c'_i S_i with
(c', R') the previous window's counts, observed in its training forwards. Tolerance 1e-10 as in
tests/equivalence/test_moe_balance.py (the same sums in another order).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradaccum import Accumulator
from gradaccum.moe import LoadBalance
from tests.helpers import moe as h

TOL = 1e-10
COEF = 0.05


@pytest.fixture(scope="module")
def windows() -> list[list[dict[str, torch.Tensor]]]:
    return [h.window(h.sequences((5, 7, 3, 8, 6), seed=s), (2, 1, 2)) for s in (1, 2, 3)]


def _ce(model: nn.Module, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], output_router_logits=True)
    logits = out.logits[:, :-1]
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), mb["labels"][:, 1:].reshape(-1), reduction="sum"
    )
    return ce, out.router_logits


def _update(model: nn.Module, objective: torch.Tensor) -> list[torch.Tensor]:
    objective.backward()
    return [-p.grad.detach().clone() for p in model.parameters()]


def _micro_batch_reference(model: nn.Module, window: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    ref = copy.deepcopy(model)
    n = sum(int(h.tokens(mb)) for mb in window)
    objective = torch.zeros((), dtype=torch.float64)
    for mb in window:
        ce, logits = _ce(ref, mb)
        objective = (
            objective + ce / n + COEF * h.balance_by_hand(logits, mb["attention_mask"], 4, 2) / len(window)
        )
    return _update(ref, objective)


def _lagged_reference(
    model: nn.Module,
    previous: list[dict[str, torch.Tensor]],
    window: list[dict[str, torch.Tensor]],
    before: nn.Module,
) -> list[torch.Tensor]:
    """``before``: the model as the previous window's forwards saw it (its counts are the carried ones)."""
    counts = torch.zeros(4, dtype=torch.float64)
    rows = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for mb in previous:
            c, _, r = h.routing_by_hand(_ce(before, mb)[1], mb["attention_mask"], 4, 2)
            counts, rows = counts + c, rows + r
    ref = copy.deepcopy(model)
    n = sum(int(h.tokens(mb)) for mb in window)
    objective = torch.zeros((), dtype=torch.float64)
    for mb in window:
        ce, logits = _ce(ref, mb)
        _, s, _ = h.routing_by_hand(logits, mb["attention_mask"], 4, 2)
        objective = objective + ce / n + COEF * 4 * (counts * s).sum() / rows**2
    return _update(ref, objective)


def _accumulator(model: nn.Module, mode: str) -> Accumulator:
    return Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=1.0), balance=LoadBalance.from_model(model, mode=mode)
    )


def test_micro_batch_mode_is_the_mean_of_per_micro_batch_terms(windows: list[Any]) -> None:
    model = h.tiny_moe()
    expected = _micro_batch_reference(model, windows[0])
    before = [p.detach().clone() for p in model.parameters()]
    assert _accumulator(model, "micro-batch").step(windows[0], h.ce_sum, h.tokens).applied
    assert h.rel_l2(h.update_of(model, before), expected) <= TOL


def test_lagged_mode_uses_the_previous_windows_counts(windows: list[Any]) -> None:
    model = h.tiny_moe()
    acc = _accumulator(model, "lagged")
    previous = copy.deepcopy(model)
    for index, window in enumerate(windows):
        if index == 0:
            expected = _micro_batch_reference(model, window)
        else:
            expected = _lagged_reference(model, windows[index - 1], window, previous)
        previous = copy.deepcopy(model)
        before = [p.detach().clone() for p in model.parameters()]
        assert acc.step(window, h.ce_sum, h.tokens).applied
        assert h.rel_l2(h.update_of(model, before), expected) <= TOL, index


@pytest.mark.parametrize("mode, per_micro_batch", [("exact", 2), ("lagged", 1), ("micro-batch", 1)])
def test_forwards_per_micro_batch(windows: list[Any], mode: str, per_micro_batch: int) -> None:
    """Forwards started per micro-batch: exact mode's routing pass starts one more, which ends at
    the last router: neither the LM head nor the loss runs in it (after the run's first pass, whose
    first forward runs whole to learn where the routers end)."""
    model = h.tiny_moe()
    started: list[int] = []
    heads: list[int] = []
    losses: list[int] = []
    model.register_forward_pre_hook(lambda *a: started.append(1))
    model.lm_head.register_forward_hook(lambda *a: heads.append(1))

    def loss_fn(m: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = h.ce_sum(m, mb)
        losses.append(1)
        return loss

    acc = _accumulator(model, mode)
    for index, window in enumerate(windows[:2]):
        for seen in (started, heads, losses):
            seen.clear()
        assert acc.step(window, loss_fn, h.tokens).applied
        assert len(started) == per_micro_batch * len(window)
        whole = 1 if (mode == "exact" and index == 0) else 0
        assert len(heads) == len(losses) == len(window) + whole


@pytest.mark.parametrize("mode", ["lagged", "exact"])
def test_resume_is_bitwise(windows: list[Any], mode: str) -> None:
    """The carried counts are the accumulator state's ``balance`` part: stop after a window, rebuild
    everything from the saved states, and the next windows' updates are the same bits."""
    straight = h.tiny_moe()
    acc = _accumulator(straight, mode)
    for window in windows:
        acc.step(window, h.ce_sum, h.tokens)
    first = h.tiny_moe()
    acc = _accumulator(first, mode)
    acc.step(windows[0], h.ce_sum, h.tokens)
    saved = copy.deepcopy((first.state_dict(), acc.state_dict()))
    resumed = h.tiny_moe(seed=7)
    resumed.load_state_dict(saved[0])
    acc = _accumulator(resumed, mode)
    acc.load_state_dict(saved[1])
    for window in windows[1:]:
        acc.step(window, h.ce_sum, h.tokens)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters(), strict=True))
    if mode == "lagged":  # without the carried counts the second window would balance per micro-batch
        fresh = h.tiny_moe(seed=7)
        fresh.load_state_dict(saved[0])
        _accumulator(fresh, mode).step(windows[1], h.ce_sum, h.tokens)
        other = h.tiny_moe(seed=7)
        other.load_state_dict(saved[0])
        acc = _accumulator(other, mode)
        acc.load_state_dict(saved[1])
        acc.step(windows[1], h.ce_sum, h.tokens)
        assert not all(torch.equal(a, b) for a, b in zip(fresh.parameters(), other.parameters(), strict=True))
