"""Real DDP on gloo, two processes, uneven ranks: every normalization on padded and packed rows
gives the single-process full-batch update.

The ranks hold different numbers of rows in different numbers of micro-batches, so their counts of
tokens, rows and documents differ; the step agrees on the global count before the first backward
and scales by W/N. The reference is the independent one of tests/helpers/lm.py. Tolerance 1e-12
relative (float64): DDP sums the ranks' partial gradients in another order (~1e-15). The control,
each rank normalizing by its own count, is off by more than 1e-2.
"""

from __future__ import annotations

import pytest
import torch

import gradaccum
from tests.helpers import lm
from tests.helpers.ddp import rank_slice, wrap
from tests.helpers.launcher import run_ranks, values
from tests.helpers.reference import max_rel_err

pytestmark = pytest.mark.distributed

NORMALIZATIONS = ("token", "sequence", "document")
# rows per rank and micro-batch sizes per rank (packed: 9 rows, padded: 15 rows)
BOUNDS = {"packed": [0, 3, 9], "padded": [0, 5, 15]}
SIZES = {"packed": {0: [1, 2], 1: [2, 1, 3]}, "padded": {0: [3, 2], 1: [1, 4, 5]}}


def _ranks_step(rank: int, world: int) -> dict:
    out: dict = {}
    for name, layout in lm.layouts().items():
        local = rank_slice(layout.batch, BOUNDS[name], rank)
        window = gradaccum.split(local, sizes=SIZES[name][rank])
        for normalization in NORMALIZATIONS:
            loss = gradaccum.CausalLMLoss(normalization)
            ddp, _ = wrap(lm.PositionWise())
            acc = gradaccum.Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
            result = acc.step(window, loss.loss_fn, loss.count_fn)
            # the control: this rank's own mean, averaged over ranks by DDP
            control, _ = wrap(lm.PositionWise())
            (loss.loss_fn(control, local) / loss.count_fn(local)).backward()
            out[name, normalization] = {
                "grads": {n: p.grad.clone() for n, p in ddp.module.named_parameters()},
                "control": {n: p.grad.clone() for n, p in control.module.named_parameters()},
                "local_count": result.local_count,
                "global_count": result.global_count,
            }
    return out


def test_every_normalization_and_layout_matches_the_full_batch_under_ddp() -> None:
    r0, r1 = values(run_ranks(_ranks_step))
    for name, layout in lm.layouts().items():
        for normalization in NORMALIZATIONS:
            key = (name, normalization)
            want = lm.reference_grads(lm.PositionWise(), layout, normalization)
            whole = int(gradaccum.CausalLMLoss(normalization).count_fn(layout.batch))
            assert r0[key]["global_count"] == r1[key]["global_count"] == whole, key
            assert r0[key]["local_count"] != r1[key]["local_count"], key
            assert max_rel_err(r0[key]["grads"], want) < 1e-12, key
            assert max_rel_err(r1[key]["grads"], want) < 1e-12, key
            assert max_rel_err(r0[key]["control"], want) > 1e-2, key
