"""CachedAccumulator under real DDP on gloo, two processes: negatives gathered from both ranks.

Tolerance 1e-12 relative (float64): the two ranks' partial gradients are summed by DDP in another
order than one process sums its micro-batches, and the gather itself is exact (zeros added), so
the results differ by rounding only, ~1e-15 relative; see tests/equivalence/test_cache.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradaccum import split
from gradaccum.cache.accumulator import CachedAccumulator
from tests.equivalence.test_cache import encode_pairs, pairs_batch, retrieval_loss, two_tower
from tests.helpers.ddp import rank_slice, wrap
from tests.helpers.launcher import run_ranks, values
from tests.helpers.reference import max_rel_err

pytestmark = pytest.mark.distributed

# rank 0 holds 5 examples in 3 micro-batches, rank 1 holds 3 in 2: uneven rows and uneven k
BOUNDS = [0, 5, 8]
SIZES = {0: [2, 2, 1], 1: [2, 1]}
SEED = 21


def _error_of(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _failing_on_rank_1(rank: int, when_grad_enabled: bool) -> Any:
    def encode_fn(model: torch.nn.Module, mb: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if rank == 1 and torch.is_grad_enabled() == when_grad_enabled:
            raise ValueError("boom on rank 1")
        return encode_pairs(model, mb)

    return encode_fn


def _cached_ranks(rank: int, world: int) -> dict[str, Any]:
    batch = pairs_batch(8, seed=SEED)
    ddp, counter = wrap(two_tower(learned_scale=False), bucket_cap_mb=0.0005)  # several buckets
    acc = CachedAccumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
    window = split(rank_slice(batch, BOUNDS, rank), sizes=SIZES[rank])
    loss_fn = retrieval_loss(ddp.module)
    # a first step: DDP rebuilds its buckets after the first iteration; then count the buckets
    # one plain synchronized backward all-reduces
    acc.step(window, encode_pairs, loss_fn)
    ddp.zero_grad()
    counter.calls = 0
    q, d = encode_pairs(ddp, window[0])
    (q.sum() * 0 + d.sum() * 0).backward()
    buckets = counter.calls
    # the measured step, from the initial weights again
    with torch.no_grad():
        for p, init in zip(ddp.module.parameters(), two_tower(learned_scale=False).parameters(), strict=True):
            p.copy_(init)
    counter.calls = 0
    result = acc.step(window, encode_pairs, loss_fn)
    out: dict[str, Any] = {
        "grads": {n: p.grad.clone() for n, p in ddp.module.named_parameters()},  # SGD leaves .grad
        "params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
        "calls": counter.calls,
        "buckets": buckets,
        "loss": result.loss,
        "local_count": result.local_count,
        "global_count": result.global_count,
    }

    # misuse must stop both ranks together, not leave one waiting in a collective
    scale = ddp.module.query[0].weight  # a DDP parameter used by the loss itself
    out["loss_uses_ddp_parameter"] = _error_of(
        lambda: acc.step(window, encode_pairs, lambda reps: loss_fn(reps) * scale.sum())
    )
    width = 4 if rank == 0 else 3  # rank 1's towers are one feature narrower
    out["towers_differ"] = _error_of(
        lambda: acc.step(window, lambda m, mb: tuple(r[:, :width] for r in encode_pairs(m, mb)), loss_fn)
    )
    # a failure on one rank only, in the first pass or in the replay: every rank stops together
    for where, grad_enabled in (("first_pass", False), ("replay", True)):
        out[f"rank1_fails_in_{where}"] = _error_of(
            lambda g=grad_enabled: acc.step(window, _failing_on_rank_1(rank, g), loss_fn)
        )
        out[f"grads_cleared_after_{where}"] = all(p.grad is None for p in ddp.parameters())
    # and the wrapper is still usable afterwards
    out["after_errors"] = acc.step(window, encode_pairs, loss_fn).applied
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return values(run_ranks(_cached_ranks, timeout_s=120))


def _one_process_full_batch() -> tuple[dict[str, torch.Tensor], float]:
    model = two_tower(learned_scale=False)
    loss = retrieval_loss(model)(encode_pairs(model, pairs_batch(8, seed=SEED)))
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, float(loss.detach())


def test_gathered_negatives_give_the_one_process_full_batch_gradient(ranks: list[dict[str, Any]]) -> None:
    want, want_loss = _one_process_full_batch()
    for r in ranks:
        assert max_rel_err(r["grads"], want) < 1e-12
        assert r["loss"] == pytest.approx(want_loss, rel=1e-12)
    r0, r1 = ranks
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), f"ranks' parameters differ at {name}"
    assert (r0["local_count"], r1["local_count"]) == (5, 3)
    assert r0["global_count"] == r1["global_count"] == 8


def test_gradients_are_all_reduced_once_per_window(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["buckets"] > 1, "bucket_cap_mb is meant to force several buckets"
        assert r["calls"] == r["buckets"], (r["calls"], r["buckets"])


def test_misuse_stops_every_rank_alike(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["loss_uses_ddp_parameter"].startswith("CacheError: loss_fn(reps) uses parameters")
        assert r["towers_differ"].startswith("CacheError: ranks' representations cannot be concatenated")
        assert "rank 1: tower 0 3 rows x [3]" in r["towers_differ"]
        assert r["after_errors"]


@pytest.mark.parametrize(
    ("where", "phase"), [("first_pass", "encode_fn (first pass)"), ("replay", "forward (second pass)")]
)
def test_a_failure_on_one_rank_stops_every_rank_without_hanging(
    ranks: list[dict[str, Any]], where: str, phase: str
) -> None:
    r0, r1 = ranks
    assert r1[f"rank1_fails_in_{where}"] == "ValueError: boom on rank 1"
    assert r0[f"rank1_fails_in_{where}"].startswith(
        f"RankFailedError: rank 1 failed in {phase} of micro-batch 0: ValueError: boom on rank 1"
    )
    assert r0[f"grads_cleared_after_{where}"] and r1[f"grads_cleared_after_{where}"]
