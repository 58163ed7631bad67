"""``verify`` on a mixture-of-experts workload: the balancing term checked too, and the modes compared.

A workload whose model :meth:`gradaccum.moe.LoadBalance.from_model` recognises (a transformers MoE)
is trained with a balancing term besides its ``loss_fn`` (which returns the cross-entropy only).
The check runs, from one initial model, one SGD(lr=1) update of the verification batch:

* the reference: the full batch's objective in one forward, ``loss / N`` plus the balancing term
  computed from the whole batch's own routing statistics (``coef * E * sum_i f_i P_i``);
* ``Accumulator(..., balance=LoadBalance.from_model(model, mode=...))`` over the micro-batches, for
  each mode. ``exact`` must match the reference to the dtype's tolerance; ``lagged`` runs one
  window of another batch first (learning rate 0: the weights stay), so that its term uses a
  previous window's counts as in training; ``micro-batch`` balances each micro-batch on its own.

The figures say how far ``lagged`` and ``micro-batch`` are from ``exact`` on the user's own model.
The model's own per-forward balancing loss (``output_router_logits``) is turned off in the copies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from gradaccum.batch import batch_size, cast, split
from gradaccum.errors import ConfigError
from gradaccum.moe.capture import RouterCapture
from gradaccum.moe.spec import MODES, BalanceMode, LoadBalance
from gradaccum.moe.stats import balance_term, route
from gradaccum.step.accumulator import Accumulator
from gradaccum.workloads.base import Workload

__all__ = ["BalanceReport", "verify_balance"]

TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-4}
"""Relative L2 of the exact mode's update against the reference: float64 rounds at 1e-16 per
operation and the update sums a few hundred terms per parameter (observed ~1e-15); float32 the same
at 6e-8. Any other dtype uses the float32 bound."""


@dataclass(frozen=True, slots=True)
class BalanceReport:
    """How far each mode's update is from the full batch's objective and from ``exact``'s update."""

    errors: dict[str, float]
    """Mode -> relative L2 of its update against the full batch's objective (balancing included)."""
    from_exact: dict[str, float]
    """Mode -> relative L2 of its update against the ``exact`` mode's update."""
    tolerance: float
    """What ``exact`` must stay within."""
    sizes: tuple[int, ...]
    """The micro-batch sizes of the window."""

    @property
    def passed(self) -> bool:
        """``exact`` equals the full batch's objective's update within the tolerance."""
        return self.errors["exact"] <= self.tolerance

    def summary(self) -> str:
        """One line: the exact mode's error against its tolerance (a FAIL says over or non-finite),
        and how far the other modes are from exact."""
        exact = self.errors["exact"]
        if self.passed:
            verdict = "PASS"
        else:
            verdict = "FAIL (over the tolerance)" if math.isfinite(exact) else "FAIL (a non-finite update)"
        others = ", ".join(f"{mode} {self.from_exact[mode]:.1e}" for mode in MODES if mode != "exact")
        return (
            f"load balance: exact {exact:.1e} from the full batch's objective "
            f"(tolerance {self.tolerance:.0e}) {verdict}; from exact: {others}"
        )

    @property
    def failures(self) -> tuple[str, ...]:
        """What failed, with its figure; empty on a pass."""
        if self.passed:
            return ()
        exact = self.errors["exact"]
        how = "over" if math.isfinite(exact) else "non-finite,"
        return (
            f"load balance: exact mode {exact:.1e} from the full batch's objective "
            f"({how} tol {self.tolerance:.0e})",
        )


def _fresh(workload: Workload, dtype: torch.dtype, device: torch.device) -> nn.Module:
    model = workload.build_model().to(device=device, dtype=dtype)
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", None) is True:
        config.output_router_logits = False  # type: ignore[union-attr]  # the balance adds the term
    return model


def _rel_l2(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    num = sum(float((x - y).double().pow(2).sum()) for x, y in zip(a, b, strict=True))
    den = sum(float(y.double().pow(2).sum()) for y in b)
    return (num / den) ** 0.5 if den else float(num > 0)


def _reference(
    workload: Workload, batch: Any, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Minus the gradient of ``loss / N + balancing term`` over the whole batch in one forward."""
    model = _fresh(workload, dtype, device)
    spec = LoadBalance.from_model(model)
    capture = RouterCapture(spec.routers, spec.logits_index)
    try:
        with capture.recording(graph=True) as records:
            loss = workload.loss_fn(model, batch)
        routed = route(
            records, spec.mask(batch), layers=spec.layers, num_experts=spec.num_experts, top_k=spec.top_k,
            device=device,
        )  # fmt: skip
    finally:
        capture.remove()
    n = torch.as_tensor(workload.count_fn(batch)).to(torch.float64).clamp(min=1)
    term = balance_term(
        routed.probs,
        routed.counts,
        routed.rows,
        num_experts=spec.num_experts,
        coef=spec.coef,
        pooled=spec.pooled,
    )
    (loss / n.to(loss.device) + term.to(loss.dtype)).backward()
    return [
        -p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ]


def _update(
    workload: Workload,
    mode: BalanceMode,
    window: list[Any],
    previous: list[Any],
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    model = _fresh(workload, dtype, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    acc = Accumulator(model, optimizer, balance=LoadBalance.from_model(model, mode=mode))
    if mode == "lagged":  # a previous window, weights unchanged, whose counts this one's term uses
        optimizer.param_groups[0]["lr"] = 0.0
        acc.step(previous, workload.loss_fn, workload.count_fn)
        optimizer.param_groups[0]["lr"] = 1.0
    before = [p.detach().clone() for p in model.parameters()]
    acc.step(window, workload.loss_fn, workload.count_fn)
    return [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]


def verify_balance(
    workload: Workload,
    *,
    micro_batch: int | None = None,
    sizes: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> BalanceReport | None:
    """The balancing term's check on ``workload`` (see the module docstring); ``None`` when its
    model has no routers (a dense model: nothing to balance)."""
    device = torch.device(device)
    try:
        LoadBalance.from_model(workload.build_model())
    except ConfigError:
        return None
    if micro_batch is None and sizes is None:
        micro_batch = workload.micro_batch
    batch = cast(workload.batch(seed), dtype, device)
    window = split(batch, micro_batch, sizes)
    previous = split(cast(workload.batch(seed + 1), dtype, device), micro_batch, sizes)
    want = _reference(workload, batch, dtype, device)
    modes: tuple[BalanceMode, ...] = ("exact", "lagged", "micro-batch")
    updates = {mode: _update(workload, mode, window, previous, dtype, device) for mode in modes}
    return BalanceReport(
        errors={mode: _rel_l2(u, want) for mode, u in updates.items()},
        from_exact={mode: _rel_l2(u, updates["exact"]) for mode, u in updates.items()},
        tolerance=TOLERANCES.get(dtype, TOLERANCES[torch.float32]),
        sizes=tuple(batch_size(mb) for mb in window),
    )
