"""A generation batch over two updates (k = 2 micro-batches each): normalized per update, each
update equals the full-batch reference of its own rows; normalized by the generation batch, each
equals its rows' summed loss over N_gen / 2. Float64, 1e-10 as in test_policy.py."""

from __future__ import annotations

import copy

import pytest
import torch

import gradaccum
from gradaccum.errors import ConfigError, PlanError
from gradaccum.rl import AGGREGATIONS, PolicyLoss, rollout_updates
from tests.rl import common

TOL = 1e-10
UPDATES = 2


def _units(shapes: tuple[tuple[int, int], ...], aggregation: str) -> int:
    if aggregation == "token-mean":
        return sum(r for _, r in shapes)
    return sum(1 for _, r in shapes if r)


@pytest.mark.parametrize("normalize", ["update", "generation"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_each_update_equals_its_own_reference(aggregation: str, normalize: str) -> None:
    batch = common.rollout()
    loss = PolicyLoss(**common.loss_kwargs(aggregation))
    model = common.TinyPolicy()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    updates = rollout_updates(batch, loss, updates=UPDATES, micro_batch=2, normalize=normalize)  # type: ignore[arg-type]
    assert [len(u.micro_batches) for u in updates] == [2, 2]
    total = _units(common.SHAPES, aggregation)
    half = len(common.SHAPES) // UPDATES
    for i, update in enumerate(updates):
        start = copy.deepcopy(model)  # the weights this update starts from
        acc.step(update.micro_batches, update.loss_fn, update.count_fn)
        rows = gradaccum.split(batch, micro_batch=half)[i]
        own = _units(common.SHAPES[i * half : (i + 1) * half], aggregation)
        scale = 1.0 if normalize == "update" else own * UPDATES / total
        max_len = loss.max_response_len
        start.zero_grad(set_to_none=True)
        (common.reference_loss(start, rows, aggregation, max_len) * scale).backward()
        assert common.rel_err(common.grads(model), common.grads(start)) < TOL, (aggregation, normalize, i)
        if normalize == "generation":
            assert abs(scale - 1.0) > 1e-2  # the two normalizations differ on this rollout


def test_bad_plans_are_refused() -> None:
    batch = common.rollout()
    loss = PolicyLoss()
    with pytest.raises(ConfigError, match="normalize must be one of"):
        rollout_updates(batch, loss, updates=2, normalize="batch")  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="8 rows of this rank's rollout do not split into 3"):
        rollout_updates(batch, loss, updates=3)
    with pytest.raises(PlanError, match="micro_batch=3 does not divide the 4 rows"):
        rollout_updates(batch, loss, updates=2, micro_batch=3)
