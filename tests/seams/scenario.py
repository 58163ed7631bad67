"""One cell's scenario: a toy MoE (optionally with BatchNorm) built from names, its windows in the
input form the cell names, the library's step, and the objective by hand in float64.

The model: ``x [rows, T, 4] -> Linear -> (BatchNorm1d over the channels) -> tanh -> a router of 4
experts, top-2 of softmax(logits) -> the chosen experts' Linear(8, 2) weighted by their
probabilities``. The loss is the masked squared error summed over the counted positions; N is the
window's count of ``attention_mask`` ones; the routers see every position, padding masked.

The reference never calls the library: it runs the window's micro-batches through a float64 copy
of the model (each forward its own micro-batch, as the step does: BatchNorm normalizes per
micro-batch), sums the squared error over the window, divides by N, adds the balancing term of the
cell's mode written out below, and backpropagates once. The update of SGD(lr=1) is minus that
gradient.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

E, TOP_K, COEF, T = 4, 2, 0.05, 6


class Toy(nn.Module):
    def __init__(self, bn: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8) if bn else None
        self.router = nn.Linear(8, E)
        self.experts = nn.ModuleList(nn.Linear(8, 2) for _ in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_parts(self, x)[0]


def run_parts(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward through the submodules one by one (what a loss_fn that calls them does)."""
    h = model.lin(x)
    if model.bn is not None:
        h = model.bn(h.transpose(1, 2)).transpose(1, 2)
    h = torch.tanh(h)
    logits = model.router(h)
    p = torch.softmax(logits, dim=-1)
    chosen = torch.topk(p, TOP_K, dim=-1).indices
    weights = torch.zeros_like(p).scatter(-1, chosen, p.gather(-1, chosen))
    out = sum(weights[..., i : i + 1] * e(h) for i, e in enumerate(model.experts))
    return out, logits


def build(bn: bool, dtype: torch.dtype = torch.float64) -> Toy:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Toy(bn).to(dtype)
        with torch.no_grad():
            model.router.weight.mul_(3.0)  # routing far from ties
    return model


def global_batch(rows: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (rows,), generator=gen)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    x = torch.randn(rows, T, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(rows, T, 2, generator=gen, dtype=torch.float64)
    return {"x": x, "y": y, "attention_mask": mask}


@dataclass
class Rows:
    x: torch.Tensor
    y: torch.Tensor
    attention_mask: torch.Tensor


def wrap(mb: dict[str, torch.Tensor], form: str) -> Any:
    """A micro-batch in the form the cell names."""
    if form == "BatchEncoding":
        from transformers import BatchEncoding

        return BatchEncoding(dict(mb))
    if form == "tuple":
        return (mb["x"], mb["y"], mb["attention_mask"])
    if form == "dataclass":
        return Rows(mb["x"], mb["y"], mb["attention_mask"])
    return dict(mb)


def fields(mb: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if isinstance(mb, tuple):
        return mb
    if isinstance(mb, Rows):
        return mb.x, mb.y, mb.attention_mask
    return mb["x"], mb["y"], mb["attention_mask"]


def squared_error(out: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (((out - y.to(out.dtype)) ** 2).sum(-1) * mask.to(out.dtype)).sum()


def loss_via_model(model: nn.Module, mb: Any) -> torch.Tensor:
    x, y, mask = fields(mb)
    return squared_error(model(x.to(next(model.parameters()).dtype)), y, mask)


def loss_via_submodules(model: nn.Module, mb: Any) -> torch.Tensor:
    x, y, mask = fields(mb)
    return squared_error(run_parts(model, x.to(model.lin.weight.dtype))[0], y, mask)


def count(mb: Any) -> torch.Tensor:
    return fields(mb)[2].sum()


def routing(logits: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(c, S, R) of one micro-batch, padding masked, in float64 (S carries the gradient)."""
    m = mask.reshape(-1).to(torch.float64)
    p = torch.softmax(logits.reshape(-1, E).to(torch.float64), dim=-1)
    chosen = torch.topk(p, TOP_K, dim=-1).indices
    c = (F.one_hot(chosen, E).sum(1).to(torch.float64) * m[:, None]).sum(0)
    return c.detach(), (p * m[:, None]).sum(0), m.sum()


@dataclass(frozen=True)
class Reference:
    grads: list[torch.Tensor]
    counts: torch.Tensor
    rows: torch.Tensor
    bn_mean: torch.Tensor | None
    bn_var: torch.Tensor | None


def reference(
    model: nn.Module, window: list[dict[str, torch.Tensor]], mode: str | None, carried: Any = None
) -> Reference:
    """The float64 objective's gradient for one window (``mode``: the load balance, or None);
    ``carried``: the previous window's ``(c, R)`` for ``lagged``. Also BatchNorm's running
    statistics as one training forward over the window's rows leaves them."""
    ref = copy.deepcopy(model).to(torch.float64)
    n = sum(int(mb["attention_mask"].sum()) for mb in window)
    ce = torch.zeros((), dtype=torch.float64)
    stats = []
    for mb in window:
        out, logits = run_parts(ref, mb["x"])
        ce = ce + squared_error(out, mb["y"], mb["attention_mask"])
        stats.append(routing(logits, mb["attention_mask"]))
    objective = ce / n
    counts = sum(s[0] for s in stats)
    rows = sum(s[2] for s in stats)
    if mode == "exact":  # the window's c and S: coef * E * sum_i (c_i / R) (S_i / R)
        probs = sum(s[1] for s in stats)
        objective = objective + COEF * E * ((counts / rows) * (probs / rows)).sum()
    elif mode == "micro-batch" or (mode == "lagged" and carried is None):  # the mean of per-m terms
        terms = [E * ((c / r) * (s / r)).sum() for c, s, r in stats]
        objective = objective + COEF * sum(terms) / len(stats)
    elif mode == "lagged":  # the previous window's (c', R'): coef * E * sum_i c'_i S_i / R'^2
        probs = sum(s[1] for s in stats)
        objective = objective + COEF * E * (carried[0] * probs).sum() / carried[1] ** 2
    objective.backward()
    grads = [p.grad.detach().clone() for p in ref.parameters()]
    mean = var = None
    if model.bn is not None:  # one forward over the window's positions, from the same weights
        bn = copy.deepcopy(model.bn).to(torch.float64)
        with torch.no_grad():
            h = torch.cat([ref.lin(mb["x"]).reshape(-1, 8) for mb in window])
            bn(h)
        mean, var = bn.running_mean, bn.running_var
    return Reference(grads, counts, rows, mean, var)


def rel_l2(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x.double() - y).pow(2).sum()) for x, y in zip(a, b, strict=True))
    den = sum(float(y.pow(2).sum()) for y in b)
    return math.sqrt(num / den)
