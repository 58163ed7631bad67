"""Real DDP on gloo, two processes: every aggregation, DPO, and a generation-normalized rollout
give the single-process full-batch update.

Two layouts of the same eight rows: "uneven" (5 rows in micro-batches of 2 and 3 on rank 0, 3 rows
in 1 and 2 on rank 1, uneven responses on both) and "masked" (rank 1 holds only rows without a
response: it counts zero units yet must take part in the update). Tolerance 1e-10 relative
(float64; DDP sums the ranks' gradients in another order, ~1e-16). The control, each rank
normalizing by its own count, is off by more than 1e-2 in the uneven layout.
"""

from __future__ import annotations

import pytest
import torch

import gradaccum
from gradaccum.rl import AGGREGATIONS, PolicyLoss, PreferenceLoss, rollout_updates
from tests.helpers.ddp import rank_slice, wrap
from tests.helpers.launcher import run_ranks, values
from tests.rl import common

pytestmark = pytest.mark.distributed

TOL = 1e-10
MASKED_SHAPES = ((3, 6), (4, 2), (2, 9), (3, 4), (5, 5), (2, 1), (4, 0), (3, 0))
LAYOUTS = {
    "uneven": (common.SHAPES, [0, 5, 8], {0: [2, 3], 1: [1, 2]}),
    "masked": (MASKED_SHAPES, [0, 6, 8], {0: [4, 2], 1: [2]}),
}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _ranks(rank: int, world: int) -> dict:
    out: dict = {}
    for name, (shapes, bounds, sizes) in LAYOUTS.items():
        local = rank_slice(common.rollout(shapes=shapes), bounds, rank)
        window = gradaccum.split(local, sizes=sizes[rank])
        for aggregation in AGGREGATIONS:
            loss = PolicyLoss(**common.loss_kwargs(aggregation))
            ddp, _ = wrap(common.TinyPolicy())
            acc = gradaccum.Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.0))
            result = acc.step(window, loss.loss_fn, loss.count_fn)
            entry = {"grads": _grads(ddp.module), "local": result.local_count}
            if name == "uneven":  # the control: this rank's own mean, averaged by DDP
                control, _ = wrap(common.TinyPolicy())
                (loss.loss_fn(control, local) / loss.count_fn(local)).backward()
                entry["control"] = _grads(control.module)
            out[name, aggregation] = entry
    # DPO, uneven pairs per rank and micro-batch
    pairs = rank_slice(common.pairs(), [0, 5, 8], rank)
    loss = PreferenceLoss("dpo", beta=common.BETA)
    ddp, _ = wrap(common.TinyPolicy())
    acc = gradaccum.Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.0))
    acc.step(gradaccum.split(pairs, sizes=[[2, 3], [3]][rank]), loss.loss_fn, loss.count_fn)
    out["dpo"] = {"grads": _grads(ddp.module)}
    # a rollout over two updates normalized by the generation batch: 4 rows per rank, 2 per update
    local = rank_slice(common.rollout(), [0, 4, 8], rank)
    loss = PolicyLoss(**common.loss_kwargs("token-mean"))
    ddp, _ = wrap(common.TinyPolicy())
    acc = gradaccum.Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.0))
    first = rollout_updates(local, loss, updates=2, micro_batch=1, normalize="generation")[0]
    acc.step(first.micro_batches, first.loss_fn, first.count_fn)
    out["generation"] = {"grads": _grads(ddp.module)}
    return out


def test_policy_and_preference_losses_are_exact_under_ddp() -> None:
    r0, r1 = values(run_ranks(_ranks, timeout_s=150))
    for name, (shapes, _, _) in LAYOUTS.items():
        batch = common.rollout(shapes=shapes)
        for aggregation in AGGREGATIONS:
            key = (name, aggregation)
            want = common.reference_grads(batch, aggregation)
            assert common.rel_err(r0[key]["grads"], want) < TOL, key
            assert common.rel_err(r1[key]["grads"], want) < TOL, key
            if name == "masked":
                assert r1[key]["local"] == 0, key
            else:
                assert common.rel_err(r0[key]["control"], want) > 1e-2, key
    want = common.reference_preference_grads(common.pairs(), "dpo")
    assert common.rel_err(r0["dpo"]["grads"], want) < TOL
    assert common.rel_err(r1["dpo"]["grads"], want) < TOL
    # update 1 holds rows 0, 1 (rank 0) and 4, 5 (rank 1): its tokens over N_gen / 2
    batch = common.rollout()
    rows = {k: torch.cat([v[0:2], v[4:6]]) for k, v in batch.items()}
    own = sum(common.SHAPES[i][1] for i in (0, 1, 4, 5))
    total = sum(r for _, r in common.SHAPES)
    model = common.TinyPolicy()
    (common.reference_loss(model, rows, "token-mean") * own * 2 / total).backward()
    assert common.rel_err(r0["generation"]["grads"], common.grads(model)) < TOL
