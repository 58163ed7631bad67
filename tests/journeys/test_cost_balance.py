"""A user with long-tailed lengths balances the ranks by compute cost instead of tokens.

The calls a new user makes after reading docs/packing.md: a window of a few long rows and many short
ones, planned for 4 ranks by tokens and by ``transformer_cost``, each rank's cost printed; the
output is asserted line by line.
"""

from __future__ import annotations

import random

import pytest
import torch

import gradaccum
from gradaccum.tokens import transformer_cost
from gradaccum.tokens.split import plan_batch


def _window() -> dict[str, torch.Tensor]:
    r = random.Random(7)
    lengths = [r.randint(1024, 2048) for _ in range(6)] + [r.randint(16, 256) for _ in range(58)]
    mask = (torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(1, 100, mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    return {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask}


def test_balancing_a_long_tailed_window_by_cost(capsys: pytest.CaptureFixture[str]) -> None:
    batch = _window()
    cost = transformer_cost(d_model=64, layers=1)
    for name, plan in (
        ("tokens", plan_batch(batch, 2048, world=4)),
        ("cost", plan_batch(batch, 2048, world=4, cost=cost)),
    ):
        costs = ", ".join(f"{c:,.0f}" for c in plan.rank_cost(cost))
        print(f"{name}: rank costs {costs}; slowest / mean {plan.cost_imbalance(cost):.2f}")
    mine = gradaccum.split_by_tokens(batch, 2048, rank=0, world=4, cost=cost)
    print(
        f"rank 0 runs {len(mine)} micro-batches, each within 2048 tokens:",
        all(mb["input_ids"].numel() <= 2048 for mb in mine),
    )
    assert capsys.readouterr().out.splitlines() == [
        "tokens: rank costs 11,347, 5,144, 15,187, 17,250; slowest / mean 1.41",
        "cost: rank costs 12,467, 12,413, 12,037, 12,011; slowest / mean 1.02",
        "rank 0 runs 3 micro-batches, each within 2048 tokens: True",
    ]
