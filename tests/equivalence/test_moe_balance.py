"""MoE load balancing under accumulation equals the full batch's objective (float64, one process).

Tolerance 1e-10 (relative L2 of the update): the step and the reference evaluate the same float64
sums in different orders (micro-batch parts of S, c and the cross-entropy added up against one
forward over the whole batch), so they differ by a few float64 roundings per term, ~1e-15
relative; the routers' float32 softmax inside the model (top-k weights) is computed row by row from
the same float64 logits in both, so it rounds identically. Per-micro-batch balancing is ~1e-1 away
on the same data (asserted below), so a wrong window statistic cannot pass.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

from gradaccum import Accumulator, ConfigError
from gradaccum.errors import EquivalenceError
from gradaccum.moe import LoadBalance
from tests.helpers import moe as h

TOL = 1e-10
LENGTHS = (5, 7, 3, 8, 6, 4, 7, 5)


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return h.tiny_moe()


@pytest.fixture(scope="module")
def seqs() -> list[torch.Tensor]:
    return h.sequences(LENGTHS, seed=1)


@pytest.fixture(scope="module")
def reference(model: nn.Module, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    return h.reference_update(model, seqs, coef=0.05)


def _step(model: nn.Module, window: list[Any], **balance: Any) -> tuple[list[torch.Tensor], Any]:
    m = copy.deepcopy(model)
    before = [p.detach().clone() for p in m.parameters()]
    acc = Accumulator(
        m, torch.optim.SGD(m.parameters(), lr=1.0), balance=LoadBalance.from_model(m, **balance)
    )
    result = acc.step(window, h.ce_sum, h.tokens)
    assert result.applied
    return h.update_of(m, before), acc


@pytest.mark.parametrize(
    "order, sizes",
    [
        ("equal", (2, 2, 2, 2)),
        ("unequal", (1, 3, 4)),
        ("unequal", (5, 2, 1)),
        ("reordered", (2, 2, 2, 2)),
        ("one micro-batch", (8,)),
    ],
)
def test_exact_mode_equals_the_full_batch(
    model: nn.Module,
    seqs: list[torch.Tensor],
    reference: list[torch.Tensor],
    order: str,
    sizes: tuple[int, ...],
) -> None:
    window = h.window(seqs, sizes)
    if order == "reordered":
        window = window[::-1]
    update, acc = _step(model, window)
    assert h.rel_l2(update, reference) <= TOL
    # the term's value summed over the window is the full batch's balancing term
    batch = h.pad(seqs)
    with torch.no_grad():
        out = model(**{k: batch[k] for k in ("input_ids", "attention_mask")}, output_router_logits=True)
    expected = 0.05 * h.balance_by_hand(out.router_logits, batch["attention_mask"], 4, 2)
    assert float(acc.balance.window_term()) == pytest.approx(float(expected), rel=1e-12)


def test_micro_batch_balancing_is_far_from_the_full_batch(
    model: nn.Module, seqs: list[torch.Tensor], reference: list[torch.Tensor]
) -> None:
    """What the test above rules out: each micro-batch balanced on its own statistics."""
    update, _ = _step(model, h.window(seqs, (2, 2, 2, 2)), mode="micro-batch")
    assert h.rel_l2(update, reference) > 1e-3


def test_exact_under_activation_checkpointing(
    model: nn.Module, seqs: list[torch.Tensor], reference: list[torch.Tensor]
) -> None:
    """The recompute in the backward runs the routers again: it neither counts nor adds a term."""
    m = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old name, deprecated in favour of activation_*
        m.gradient_checkpointing_enable()
    calls = []
    m.model.layers[0].mlp.gate.register_forward_hook(lambda *a: calls.append(1))
    before = [p.detach().clone() for p in m.parameters()]
    acc = Accumulator(m, torch.optim.SGD(m.parameters(), lr=1.0), balance=LoadBalance.from_model(m))
    assert acc.step(h.window(seqs, (3, 1, 4)), h.ce_sum, h.tokens).applied
    assert len(calls) == 3 * 3  # routing pass, forward, and the recompute: checkpointing is on
    assert h.rel_l2(h.update_of(m, before), reference) <= TOL


def test_reentrant_checkpointing_is_refused(model: nn.Module, seqs: list[torch.Tensor]) -> None:
    m = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        acc = Accumulator(m, torch.optim.SGD(m.parameters(), lr=1.0), balance=LoadBalance.from_model(m))
        with pytest.raises(ConfigError, match="use_reentrant"):
            acc.step(h.window(seqs, (4, 4)), h.ce_sum, h.tokens)


def test_router_jitter_is_replayed(seqs: list[torch.Tensor]) -> None:
    """Mixtral's router jitter draws from torch's RNG: the routing pass forks and restores it, so
    the training forwards route exactly as the pass counted (else the step would veto)."""
    m = h.tiny_moe()
    m.config.router_jitter_noise = 0.5
    for layer in m.model.layers:
        layer.mlp.jitter_noise = 0.5
    acc = Accumulator(m, torch.optim.SGD(m.parameters(), lr=0.1), balance=LoadBalance.from_model(m))
    for _ in range(2):
        assert acc.step(h.window(seqs, (2, 2, 4)), h.ce_sum, h.tokens).applied


class _Router(nn.Module):
    def __init__(self, noisy: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3, dtype=torch.float64)
        self.noisy = noisy
        self.draws = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.draws += 1
        noise = (
            10.0 if self.noisy and self.draws <= 2 else 0.0
        )  # the routing pass differs, unseen by torch's RNG
        return self.proj(x) + noise * torch.arange(3, dtype=torch.float64)


class _TinyMoE(nn.Module):
    """A hand-written MoE: two layers, 3 experts, top-1, soft-weighted by the router."""

    def __init__(self, noisy: bool = False) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.routers = nn.ModuleList([_Router(noisy) for _ in range(2)])
        self.experts = nn.ModuleList(
            [nn.ModuleList([nn.Linear(4, 4, dtype=torch.float64) for _ in range(3)]) for _ in range(2)]
        )
        self.head = nn.Linear(4, 1, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for router, experts in zip(self.routers, self.experts, strict=True):
            p = torch.softmax(router(x), -1)
            x = x + sum(p[:, i : i + 1] * experts[i](x) for i in range(3))
        return self.head(x).squeeze(-1)


def _regression(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((model(mb["x"]) - mb["y"]).square() * mb["w"]).sum()


def _rows(mb: dict[str, torch.Tensor]) -> torch.Tensor:
    return mb["w"].sum().long()


def _regression_window(sizes: tuple[int, ...]) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    out = []
    for n in sizes:
        w = (torch.rand(n, generator=gen) > 0.25).to(torch.float64)
        out.append(
            {
                "x": torch.randn(n, 4, generator=gen, dtype=torch.float64),
                "y": torch.randn(n, generator=gen, dtype=torch.float64),
                "w": w,
            }
        )
    return out


@pytest.mark.parametrize("pooled", [True, False])
def test_hand_written_moe_per_layer_and_pooled(pooled: bool) -> None:
    """LoadBalance(routers=..., pooled=, mask_fn=) on a hand-written MoE, against the formula by hand."""
    sizes = (3, 6, 2)
    window = _regression_window(sizes)
    model = _TinyMoE()
    coef, z_coef = 0.3, 0.01
    ref = copy.deepcopy(model)
    batch = {k: torch.cat([mb[k] for mb in window]) for k in ("x", "y", "w")}
    logits: list[torch.Tensor] = []
    for r in ref.routers:
        r.register_forward_hook(lambda mod, args, out: logits.append(out))
    objective = _regression(ref, batch) / batch["w"].sum()
    w = batch["w"]
    per_layer = []
    for lg in logits:
        p = torch.softmax(lg, -1)
        c = (torch.nn.functional.one_hot(p.argmax(-1), 3).to(torch.float64) * w[:, None]).sum(0)
        per_layer.append((c, (p * w[:, None]).sum(0), w.sum(), (torch.logsumexp(lg, -1).square() * w).sum()))
    if pooled:
        c, s, r, z = (sum(t[i] for t in per_layer) for i in range(4))
        objective = objective + coef * 3 * (c * s).sum() / r**2 + z_coef * z / r
    else:
        for c, s, r, z in per_layer:
            objective = objective + coef * 3 * (c * s).sum() / r**2 + z_coef * z / r
    objective.backward()
    expected = [-p.grad for p in ref.parameters()]
    balance = LoadBalance(
        routers=list(model.routers),
        num_experts=3,
        top_k=1,
        coef=coef,
        pooled=pooled,
        z_coef=z_coef,
        mask_fn=lambda mb: mb["w"],
    )
    before = [p.detach().clone() for p in model.parameters()]
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=1.0), balance=balance)
    assert acc.step(window, _regression, _rows).applied
    assert h.rel_l2(h.update_of(model, before), expected) <= TOL


def test_routing_that_does_not_replay_vetoes_the_update() -> None:
    """A router whose noise torch's RNG does not drive routes differently in the training forward:
    the step refuses instead of applying a term computed from other counts."""
    model = _TinyMoE(noisy=True)
    before = [p.detach().clone() for p in model.parameters()]
    balance = LoadBalance(
        routers=list(model.routers), num_experts=3, top_k=1, coef=0.3, mask_fn=lambda mb: mb["w"]
    )
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=1.0), balance=balance)
    with pytest.raises(EquivalenceError, match="routing pass"):
        acc.step(_regression_window((4, 4)), _regression, _rows)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "olmoe"])
def test_other_families_from_model_are_exact(family: str, seqs: list[torch.Tensor]) -> None:
    """Qwen2-MoE (with its shared expert), Qwen3-MoE and OLMoE share Mixtral's formula."""
    model = h.tiny_moe(family)
    balance = LoadBalance.from_model(model)
    assert len(balance.routers) == 2 and (balance.num_experts, balance.top_k) == (4, 2)
    reference = h.reference_update(model, seqs, coef=0.05)
    update, _ = _step(model, h.window(seqs, (3, 4, 1)))
    assert h.rel_l2(update, reference) <= TOL


def test_router_z_loss_is_exact(model: nn.Module, seqs: list[torch.Tensor]) -> None:
    """z_coef * sum over rows and layers of logsumexp^2 / R, R the window's routed rows."""
    reference = h.reference_update(model, seqs, coef=0.05, z_coef=0.01)
    m = copy.deepcopy(model)
    before = [p.detach().clone() for p in m.parameters()]
    balance = dataclasses.replace(LoadBalance.from_model(m), z_coef=0.01)
    acc = Accumulator(m, torch.optim.SGD(m.parameters(), lr=1.0), balance=balance)
    assert acc.step(h.window(seqs, (1, 4, 3)), h.ce_sum, h.tokens).applied
    assert h.rel_l2(h.update_of(m, before), reference) <= TOL
    assert h.rel_l2(h.update_of(m, before), h.reference_update(model, seqs, coef=0.05)) > 1e-6


class _BiasedRouter(_Router):
    """DeepSeek-V3's aux-loss-free router: the bias steers the top-1 choice, not the weights."""

    def __init__(self) -> None:
        super().__init__(noisy=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(3, dtype=torch.float64))
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.e_score_correction_bias.clone())
        return super().forward(x)


@pytest.mark.parametrize("mode", ["exact", "lagged"])
def test_aux_loss_free_bias_moves_once_per_window_from_the_windows_counts(mode: str) -> None:
    model = _TinyMoE()
    model.routers = nn.ModuleList([_BiasedRouter() for _ in range(2)])
    balance = LoadBalance(
        routers=list(model.routers),
        num_experts=3,
        top_k=1,
        coef=0.0,
        mode=mode,
        bias_rate=0.1,
        mask_fn=lambda mb: mb["w"],
    )
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), balance=balance)
    window = _regression_window((4, 4))
    acc.step(window, _regression, _rows)
    counts = (
        acc.balance.window_counts()
    )  # this window's routed slots per router (one process: the agreed ones)
    for router in model.routers:
        assert all(torch.equal(b, torch.zeros(3, dtype=torch.float64)) for b in router.seen)
        router.seen.clear()
    acc.step(window, _regression, _rows)
    for layer, router in enumerate(model.routers):
        load = counts[layer]
        expected = 0.1 * torch.sign(load.mean() - load)
        assert len(router.seen) == (4 if mode == "exact" else 2)  # routing pass + forward, per micro-batch
        assert all(torch.equal(b, expected) for b in router.seen)
    assert counts.sum() == 2 * float(sum(mb["w"].sum() for mb in window))
