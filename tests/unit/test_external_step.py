"""The window engine's ``external=`` hook (``gradaccum.step.external``) on one process, float64.

An external step here is a plain SGD update written out by hand, so the engine's part (counting,
W/N scaling, the verdict) is checked apart from DeepSpeed: the update equals the full batch's to
rounding (float64 sums in another order: ~1e-16; asserted below 1e-12), the external step is the
only one taken, and a window it reports as not applied is counted as a skip.
"""

from __future__ import annotations

import torch

from gradaccum import AccumConfig, split
from gradaccum.step.engine import WindowEngine
from gradaccum.step.external import ExternalOutcome
from gradaccum.step.window import Contribution
from tests.helpers import models
from tests.helpers.reference import full_batch_grads, max_rel_err


class HandStep:
    """p -= lr * p.grad, or a refusal that discards the gradients (as ZeRO's overflow path does)."""

    factor = 1.0

    def __init__(self, model: torch.nn.Module, *, holds_gradients: bool, apply: bool = True) -> None:
        self.model = model
        self.holds_gradients = holds_gradients
        self.applies = apply
        self.calls = 0

    def apply(self) -> ExternalOutcome:
        self.calls += 1
        with torch.no_grad():
            for p in self.model.parameters():
                if self.applies:
                    p -= 0.1 * p.grad
                p.grad = None
        return ExternalOutcome(self.applies, 2.5 if self.applies else None)


def _step(engine: WindowEngine, window: list, loss_fn=models.mlp_loss) -> object:
    micro_batches, failure = engine.open(window)
    counted = engine.count(micro_batches, models.count_rows, failure)
    engine.zero_grad()
    scale = counted.scale()

    def contribute(i: int, mb: dict) -> Contribution:
        loss = loss_fn(engine.model, mb)
        return Contribution(loss * scale, loss.detach())

    return engine.conclude(counted, engine.accumulate(micro_batches, contribute))


def test_the_external_step_takes_the_exact_update_once() -> None:
    batch = models.mlp_batch(12)
    model = models.mlp()
    want = {n: p - 0.1 * g for (n, p), g in zip(models.mlp().named_parameters(), _grads(batch), strict=True)}
    hand = HandStep(model, holds_gradients=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e9)  # never stepped: 1e9 would show
    engine = WindowEngine(model, optimizer, AccumConfig(track_grad_norm=True), external=hand)
    result = _step(engine, split(batch, micro_batch=4))
    got = {n: p.detach() for n, p in model.named_parameters()}
    assert hand.calls == 1 and result.applied and result.grad_norm == 2.5  # type: ignore[attr-defined]
    assert max_rel_err(got, want) < 1e-12


def test_a_window_the_external_step_discards_is_a_skip() -> None:
    model = models.mlp()
    hand = HandStep(model, holds_gradients=False, apply=False)
    engine = WindowEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), AccumConfig(), external=hand)
    result = _step(engine, split(models.mlp_batch(8), micro_batch=4))
    assert hand.calls == 1 and not result.applied  # type: ignore[attr-defined]
    assert engine.steps_skipped == 1 and engine.steps_applied == 0


def test_gradients_in_p_grad_are_checked_by_the_engine_before_the_external_step() -> None:
    model = models.mlp()
    hand = HandStep(model, holds_gradients=True)
    engine = WindowEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), AccumConfig(), external=hand)

    def nan_loss(m: torch.nn.Module, mb: dict) -> torch.Tensor:
        return models.mlp_loss(m, mb) * float("nan")

    result = _step(engine, split(models.mlp_batch(8), micro_batch=4), nan_loss)
    assert hand.calls == 0 and not result.applied  # type: ignore[attr-defined]
    assert all(p.grad is None for p in model.parameters())


def _grads(batch: dict) -> list[torch.Tensor]:
    grads = full_batch_grads(models.mlp(), batch, models.mlp_loss, models.count_rows)
    return list(grads.values())
