"""Exactness of policy and preference losses under accumulation: the plain loop against gradaccum.

Prints the relative L2 error of the gradient against the full-batch update on the same rollout:

1. Per aggregation, on the RL tests' rollout (8 rows, uneven responses, one without any; a float64
   causal toy policy): the plain loop (each micro-batch's own aggregate divided by k, as nanoGPT-style
   loops and TRL's bnpo/grpo do) and ``gradaccum.rl.PolicyLoss`` through ``Accumulator.step``, for
   micro-batches of 3, 1 and 4 rows. DPO's pairs likewise (4 + 2 pairs).
2. Per TRL ``loss_type``: ``trl.GRPOTrainer`` and ``exact_trainer(trl.GRPOTrainer)`` on the same
   rollout (a tiny Llama, 8 completions, 2 updates of 2 micro-batches of 2, steps_per_generation 4),
   each update against ``PolicyLoss`` with the loss type's exact aggregation at that trainer's own
   starting weights ("masked": ``mask_truncated_completions=True``, so truncated completions are
   rows without a response, which grpo's and dr_grpo's row means count); and ``trl.DPOTrainer``
   beside ``exact_trainer(trl.DPOTrainer)``. TRL's fused LM head computes log-probs in float32, so
   an exact TRL update sits at ~2e-7, not 1e-16.

    .venv/bin/python benchmarks/rl.py
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests/

import torch
from tests.rl import common, trl_common

import gradaccum
from gradaccum.rl import AGGREGATIONS, PolicyLoss, PreferenceLoss

SIZES = [3, 1, 4]
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
MASKED = {"mask_truncated_completions": True}
"""A completion cut at max_completion_length trains no token: rows without a response."""


def _plain(loss: Any, batch: dict, sizes: list[int]) -> dict[str, torch.Tensor]:
    model = common.TinyPolicy()
    parts = gradaccum.split(batch, sizes=sizes)
    for part in parts:
        (loss.loss_fn(model, part) / loss.count_fn(part).clamp(min=1) / len(parts)).backward()
    return common.grads(model)


def _exact(loss: Any, batch: dict, sizes: list[int]) -> dict[str, torch.Tensor]:
    model = common.TinyPolicy()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
    acc.step(gradaccum.split(batch, sizes=sizes), loss.loss_fn, loss.count_fn)
    return common.grads(model)


def library_rows() -> list[tuple[str, float, float]]:
    rows = []
    batch = common.rollout()
    for aggregation in AGGREGATIONS:
        loss = PolicyLoss(**common.loss_kwargs(aggregation))
        want = common.reference_grads(batch, aggregation)
        rows.append(
            (
                aggregation,
                common.rel_err(_plain(loss, batch, SIZES), want),
                common.rel_err(_exact(loss, batch, SIZES), want),
            )
        )
    pairs = common.pairs()
    for objective in ("dpo", "ipo"):
        loss = PreferenceLoss(objective, beta=common.BETA)  # type: ignore[arg-type]
        want = common.reference_preference_grads(pairs, objective)
        rows.append(
            (
                f"{objective} (pairs)",
                common.rel_err(_plain(loss, pairs, [4, 2, 2]), want),
                common.rel_err(_exact(loss, pairs, [4, 2, 2]), want),
            )
        )
    return rows


def _grpo_error(run: Any, update: int, aggregation: str) -> float:
    trainer, updates = run
    rows = trl_common.update_rows(trainer, update)
    model = trl_common.start_model(updates, update)
    max_len = trl_common.MAX_COMPLETION if aggregation.endswith("-norm") else None
    loss = PolicyLoss(aggregation, clip_eps=trainer.epsilon_low, max_response_len=max_len)  # type: ignore[arg-type]
    (loss.loss_fn(model, rows) / loss.count_fn(rows)).backward()
    want = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()}
    return common.rel_err(updates.grads[update], want)


def trl_rows(out: Path) -> list[tuple[str, str, float, float]]:
    from trl import DPOTrainer, GRPOTrainer

    from gradaccum.integrations.trl import EXACT_AGGREGATIONS, exact_trainer

    rows = []
    cases = [(t, {}) for t in LOSS_TYPES] + [(t, MASKED) for t in ("grpo", "dr_grpo")]
    for loss_type, extra in cases:
        aggregation = EXACT_AGGREGATIONS[loss_type]
        plain = trl_common.grpo(GRPOTrainer, out, loss_type, **extra)
        exact = trl_common.grpo(exact_trainer(GRPOTrainer), out, loss_type, **extra)
        plain_err = max(_grpo_error(plain, u, aggregation) for u in range(trl_common.UPDATES))
        exact_err = max(_grpo_error(exact, u, aggregation) for u in range(trl_common.UPDATES))
        rows.append((loss_type + (" masked" if extra else ""), aggregation, plain_err, exact_err))
    errors = []
    for cls in (DPOTrainer, exact_trainer(DPOTrainer)):
        trainer, updates = trl_common.dpo(cls, out)
        pairs = trl_common.pairs_batch(trainer)
        model = trl_common.start_model(updates, 0)
        loss = PreferenceLoss("dpo", beta=0.5)
        (loss.loss_fn(model, pairs) / loss.count_fn(pairs)).backward()
        want = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()}
        errors.append(common.rel_err(updates.grads[0], want))
    rows.append(("DPOTrainer sigmoid", "mean over pairs", errors[0], errors[1]))
    return rows


def main() -> None:
    torch.set_num_threads(1)
    print(f"1. the library: gradient error against the full batch, micro-batches {SIZES} (pairs [4, 2, 2])")
    print(f"   {'aggregation':<26} {'plain loop':>12} {'gradaccum':>12}")
    for name, plain, exact in library_rows():
        print(f"   {name:<26} {plain:>12.2e} {exact:>12.2e}")
    print("2. TRL 1.16 (worst of 2 updates; k = 2 micro-batches of 2, steps_per_generation = 4)")
    print(f"   {'loss_type':<20} {'exact aggregation':<26} {'plain TRL':>10} {'gradaccum':>10}")
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("ignore")
        for loss_type, aggregation, plain, exact in trl_rows(Path(tmp)):
            print(f"   {loss_type:<20} {aggregation:<26} {plain:>10.2e} {exact:>10.2e}")


if __name__ == "__main__":
    main()
