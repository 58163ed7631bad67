"""Real DDP on gloo, two processes on 127.0.0.1: the step equals the single-process full batch.

Tolerance 1e-12 relative (float64): DDP sums the ranks' partial gradients in a different order than
one process does, which moves float64 results by ~1e-15; see tests/equivalence for the argument.
"""

from __future__ import annotations

import pytest
import torch

from gradaccum import Accumulator, split
from tests.helpers import models
from tests.helpers.ddp import rank_slice, wrap
from tests.helpers.launcher import run_ranks, values
from tests.helpers.reference import full_batch_grads, max_rel_err

pytestmark = pytest.mark.distributed

# Rank 0 holds 5 sequences in 3 micro-batches, rank 1 holds 3 in 2: counts and lengths differ.
BOUNDS = [0, 5, 8]
SIZES = {0: [2, 2, 1], 1: [2, 1]}


def _uneven_step(rank: int, world: int, defer: bool, sizes: dict[int, list[int]]) -> dict:
    batch = models.gpt_batch(8, seed=11)
    ddp, counter = wrap(models.gpt(), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    acc = Accumulator(ddp, opt, defer_sync=defer)
    local = rank_slice(batch, BOUNDS, rank)
    window = split(local, sizes=sizes[rank])
    # one plain synchronized backward first: DDP rebuilds its buckets after the first iteration,
    # and it tells how many buckets one synchronized backward all-reduces
    acc.step(window, models.gpt_loss, models.tokens)
    counter.calls = 0
    ddp.zero_grad()
    (models.gpt_loss(ddp, local) * 0).backward()
    buckets = counter.calls
    # the measured step, from the initial weights again
    with torch.no_grad():
        for p, q in zip(ddp.module.parameters(), models.gpt().parameters(), strict=True):
            p.copy_(q)
    counter.calls = 0
    result = acc.step(window, models.gpt_loss, models.tokens)
    grads = {n: p.grad.clone() for n, p in ddp.module.named_parameters()}
    return {
        "grads_before_update": grads,  # SGD lr leaves .grad as accumulated (no clipping)
        "params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
        "calls": counter.calls,
        "buckets": buckets,
        "micro_batches": len(window),
        "local_count": result.local_count,
        "global_count": result.global_count,
    }


@pytest.mark.parametrize(
    ("defer", "sizes"),
    [(True, SIZES), (False, {0: [3, 2], 1: [2, 1]})],  # without deferral, k must match across ranks
)
def test_ddp_uneven_ranks_match_full_batch_and_sync_once(defer: bool, sizes: dict) -> None:
    r0, r1 = values(run_ranks(_uneven_step, defer, sizes))
    want = full_batch_grads(models.gpt(), models.gpt_batch(8, seed=11), models.gpt_loss, models.tokens)
    assert max_rel_err(r0["grads_before_update"], want) < 1e-12
    assert max_rel_err(r1["grads_before_update"], want) < 1e-12
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), f"ranks' parameters differ at {name}"
    assert r0["local_count"] != r1["local_count"]
    assert r0["global_count"] == r1["global_count"] == r0["local_count"] + r1["local_count"]
    assert r0["buckets"] > 1, "bucket_cap_mb is meant to force several buckets"
    for r in (r0, r1):
        expected = r["buckets"] if defer else r["buckets"] * r["micro_batches"]
        assert r["calls"] == expected, (defer, r["calls"], r["buckets"], r["micro_batches"])


def _padding_rank(rank: int, world: int) -> dict:
    batch = models.gpt_batch(8, seed=12)
    local = rank_slice(batch, [0, 4, 8], rank)
    if rank == 1:
        local = {"input_ids": local["input_ids"], "labels": torch.full_like(local["labels"], -100)}
    ddp, _ = wrap(models.gpt())
    acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.0))
    result = acc.step(split(local, micro_batch=2), models.gpt_loss, models.tokens)
    return {
        "grads": {n: p.grad.clone() for n, p in ddp.module.named_parameters()},
        "local": result.local_count,
        "global": result.global_count,
        "applied": result.applied,
    }


def test_all_padding_rank_contributes_zero_without_hanging() -> None:
    r0, r1 = values(run_ranks(_padding_rank, timeout_s=60))
    want = full_batch_grads(
        models.gpt(), rank_slice(models.gpt_batch(8, seed=12), [0, 4, 8], 0), models.gpt_loss, models.tokens
    )
    assert r1["local"] == 0 and r0["global"] == r0["local"] > 0
    assert r0["applied"] and r1["applied"]
    assert max_rel_err(r0["grads"], want) < 1e-12
    assert max_rel_err(r1["grads"], want) < 1e-12


def test_without_deferral_unequal_micro_batch_counts_fail_on_every_rank_instead_of_hanging() -> None:
    outcomes = run_ranks(_uneven_step, False, SIZES, timeout_s=60)
    assert [o.error_type for o in outcomes] == ["WindowError", "WindowError"]
    assert "different numbers of micro-batches (5 in all over 2 ranks" in outcomes[0].error
