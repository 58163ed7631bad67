"""float64 equivalence of CachedAccumulator.step with the full-batch computation.

Tolerance 1e-12 relative L2 per parameter. The cached step and the reference compute the same
vector-Jacobian products, only summed in a different order (per micro-batch, then accumulated in
.grad, versus one backward through the whole batch); float64 rounds at 1.1e-16 and these sums have
at most a few hundred terms, so reordering moves results by ~1e-15 relative. 1e-12 leaves a 1000x
margin, while the plain-accumulation control (fewer negatives per query) is off by more than 1e-2.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradaccum import Accumulator, split
from gradaccum.batch import batch_size, to_device
from gradaccum.cache.accumulator import CachedAccumulator
from gradaccum.cache.candidate import cached_candidate, cached_candidate_for
from gradaccum.check.equivalence import verify_workload
from gradaccum.errors import CacheError, LossError, WorkloadError
from gradaccum.examples import contrastive
from gradaccum.loss import count_examples
from tests.helpers.reference import grads_of, max_rel_err, params_of

REL_TOL = 1e-12
LR = 0.1
N = 8


# -- one tower: both views of an example in one forward, one tensor of representations ----------


class StreamDropout(nn.Module):
    """Dropout whose mask is ``rand_like(x) >= p``: uniform draws are consumed serially, so one
    forward over examples 0..7 draws the same per-example masks as consecutive forwards over
    0..1, 2..4, 5..7 from the same starting state. That makes a true full-batch pass with the
    cached step's masks possible (nn.Dropout's Bernoulli kernel gives no such guarantee)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return x * (torch.rand_like(x) >= self.p).to(x.dtype) / (1 - self.p)


class OneTower(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), StreamDropout(dropout), nn.Linear(16, 4))

    def forward(self, views: torch.Tensor) -> torch.Tensor:
        return self.net(views)  # (n, 2 views, 6) -> (n, 2, 4)


def one_tower(seed: int = 0, dropout: float = 0.0) -> OneTower:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return OneTower(dropout).double()


def views_batch(n: int = N, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    anchor = torch.randn(n, 1, 6, generator=gen, dtype=torch.float64)
    return anchor + 0.5 * torch.randn(n, 2, 6, generator=gen, dtype=torch.float64)


def encode_views(model: nn.Module, views: torch.Tensor) -> torch.Tensor:
    return model(views)


def simclr_loss(reps: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE between the two views, mean over examples: every other example is a negative."""
    z = F.normalize(reps, dim=-1)
    logits = z[:, 0] @ z[:, 1].T / 0.5
    target = torch.arange(z.shape[0])
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


# -- two towers: queries against a positive and a hard negative each, learned temperature --------


class TwoTower(nn.Module):
    def __init__(self, dropout: float = 0.0, learned_scale: bool = True) -> None:
        super().__init__()
        self.query = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Dropout(dropout), nn.Linear(12, 4))
        self.doc = nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Dropout(dropout), nn.Linear(12, 4))
        self.log_scale = nn.Parameter(torch.tensor(1.0)) if learned_scale else None

    def forward(self, q: torch.Tensor, docs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.query(q), self.doc(docs.reshape(-1, docs.shape[-1]))  # 2 doc rows per example


def two_tower(seed: int = 0, dropout: float = 0.0, learned_scale: bool = True) -> TwoTower:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TwoTower(dropout, learned_scale).double()


def pairs_batch(n: int = N, seed: int = 2) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(n, 6, generator=gen, dtype=torch.float64),
        "docs": torch.randn(n, 2, 5, generator=gen, dtype=torch.float64),  # positive, hard negative
    }


def encode_pairs(model: nn.Module, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return model(mb["q"], mb["docs"])


def retrieval_loss(model: nn.Module) -> Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Each query against all 2n documents of the window; its positive is row 2i."""
    log_scale = getattr(model, "log_scale", None)

    def loss_fn(reps: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, d = reps
        scale = log_scale.exp() if log_scale is not None else 2.0
        logits = scale * (F.normalize(q, dim=-1) @ F.normalize(d, dim=-1).T)
        return F.cross_entropy(logits, 2 * torch.arange(q.shape[0], device=q.device))

    return loss_fn


# -- references -------------------------------------------------------------------------------


def full_batch_step(model: nn.Module, batch: Any, encode_fn: Any, loss_fn: Any) -> tuple[dict, dict, float]:
    """One forward over the whole batch, one backward, one SGD update."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(encode_fn(model, batch))
    loss.backward()
    grads = grads_of(model)
    opt.step()
    return grads, params_of(model), float(loss.detach())


def cached_step(model: nn.Module, batch: Any, encode_fn: Any, loss_fn: Any, sizes: list[int], **kwargs: Any):
    acc = CachedAccumulator(model, torch.optim.SGD(model.parameters(), lr=LR), **kwargs)
    result = acc.step(split(batch, sizes=sizes), encode_fn, loss_fn)
    return grads_of(model), params_of(model), result  # SGD leaves .grad as accumulated


SIZES = [[2, 3, 1, 2], [1] * 8, [8]]


@pytest.mark.parametrize("sizes", SIZES)
def test_one_tower_matches_full_batch(sizes: list[int]) -> None:
    want_g, want_p, want_loss = full_batch_step(one_tower(), views_batch(), encode_views, simclr_loss)
    got_g, got_p, result = cached_step(one_tower(), views_batch(), encode_views, simclr_loss, sizes)
    assert max_rel_err(got_g, want_g) < REL_TOL
    assert max_rel_err(got_p, want_p) < REL_TOL
    assert result.applied and result.micro_batches == len(sizes)
    assert result.local_count == result.global_count == N
    assert result.loss == pytest.approx(want_loss, rel=REL_TOL)


@pytest.mark.parametrize("sizes", SIZES)
def test_two_towers_with_hard_negatives_and_learned_scale_match_full_batch(sizes: list[int]) -> None:
    ref = two_tower()
    want_g, want_p, _ = full_batch_step(ref, pairs_batch(), encode_pairs, retrieval_loss(ref))
    model = two_tower()
    got_g, got_p, _ = cached_step(model, pairs_batch(), encode_pairs, retrieval_loss(model), sizes)
    assert "log_scale" in got_g, "the loss's own parameter must get its gradient from loss_fn"
    assert max_rel_err(got_g, want_g) < REL_TOL
    assert max_rel_err(got_p, want_p) < REL_TOL


@pytest.mark.parametrize(
    ("build", "batch", "encode_fn", "loss_of"),
    [
        (one_tower, views_batch, encode_views, lambda m: simclr_loss),
        (two_tower, pairs_batch, encode_pairs, retrieval_loss),
    ],
    ids=["one_tower", "two_towers"],
)
def test_plain_accumulation_is_measurably_wrong(build: Any, batch: Any, encode_fn: Any, loss_of: Any) -> None:
    """Negative control: the per-micro-batch loss sees only its own negatives."""
    ref = build()
    want_g, _, _ = full_batch_step(ref, batch(), encode_fn, loss_of(ref))
    model = build()
    rep_loss = loss_of(model)

    def summed(m: nn.Module, mb: Any) -> torch.Tensor:  # the mean over mb times its size
        return rep_loss(encode_fn(m, mb)) * batch_size(mb)

    Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0)).step(
        split(batch(), micro_batch=2), summed, count_examples
    )
    assert max_rel_err(grads_of(model), want_g) > 1e-2


def test_clipping_scaler_and_scheduler_apply_once_to_the_window_gradient() -> None:
    ref = one_tower()
    want_g, _, _ = full_batch_step(ref, views_batch(), encode_views, simclr_loss)
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in want_g.values()])).item()
    max_norm = total / 4  # clipping must bite: one clip of the window's gradient, by 4

    model = one_tower()
    start = params_of(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # powers of two: exact in float64
    acc = CachedAccumulator(model, opt, sched, max_norm, scaler, track_grad_norm=True)
    result = acc.step(split(views_batch(), sizes=[3, 5]), encode_views, simclr_loss)

    assert result.applied and result.grad_norm == pytest.approx(total, rel=REL_TOL)
    coef = max_norm / (total + 1e-6)  # torch's clip_grad_norm_ coefficient, epsilon included
    want_p = {n: start[n] - LR * g * coef for n, g in want_g.items()}
    assert max_rel_err(params_of(model), want_p) < REL_TOL
    assert opt.param_groups[0]["lr"] == pytest.approx(LR / 2), "the scheduler steps once per window"
    assert scaler.get_scale() == 2.0**10, "no overflow: the scale is unchanged after one update"


def test_non_finite_objective_skips_the_update() -> None:
    model = one_tower()
    start = params_of(model)
    acc = CachedAccumulator(model, torch.optim.SGD(model.parameters(), lr=LR))
    result = acc.step(split(views_batch(), micro_batch=4), encode_views, lambda r: simclr_loss(r) / 0.0)
    assert not result.applied and "non-finite" in (result.skip_reason or "")
    assert all(p.grad is None for p in model.parameters())
    assert max_rel_err(params_of(model), start) == 0.0


# -- dropout: the second pass must draw the first pass's masks ----------------------------------


def test_dropout_replay_equals_one_full_batch_pass_with_the_same_masks() -> None:
    """StreamDropout: a single full-batch forward from the same seed draws the same masks."""
    ref = one_tower(dropout=0.3)
    torch.manual_seed(5)
    want_g, want_p, _ = full_batch_step(ref, views_batch(), encode_views, simclr_loss)
    rng_after_reference = torch.get_rng_state()

    model = one_tower(dropout=0.3)
    torch.manual_seed(5)
    got_g, got_p, _ = cached_step(model, views_batch(), encode_views, simclr_loss, [2, 3, 1, 2])
    assert max_rel_err(got_g, want_g) < REL_TOL
    assert max_rel_err(got_p, want_p) < REL_TOL
    # the window advances the generator once, as one pass does, not twice
    assert torch.equal(torch.get_rng_state(), rng_after_reference)

    # the masks matter: without dropout the gradient is a different one
    no_dropout = one_tower().eval()
    plain_g, _, _ = full_batch_step(no_dropout, views_batch(), encode_views, simclr_loss)
    assert max_rel_err(plain_g, want_g) > 1e-2


def replayed_masks_reference(model: nn.Module, micro: list[Any], loss_fn: Any) -> dict:
    """The window's loss in one backward, each micro-batch's forward drawing from the RNG stream in
    the cached step's first-pass order: the full-batch objective with the cached step's masks."""
    reps = [encode_pairs(model, mb) for mb in micro]
    loss_fn(tuple(torch.cat(t) for t in zip(*reps, strict=True))).backward()
    return grads_of(model)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_two_towers_nn_dropout_replay_equals_the_replayed_masks_reference(device: str) -> None:
    """nn.Dropout, whose masks come from the CPU generator or, on CUDA, the device's generator."""
    micro = split(to_device(pairs_batch(), device), sizes=[3, 1, 4])
    ref = two_tower(dropout=0.3).to(device)
    torch.manual_seed(6)
    want = replayed_masks_reference(ref, micro, retrieval_loss(ref))
    model = two_tower(dropout=0.3).to(device)
    torch.manual_seed(6)
    CachedAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.0)).step(
        micro, encode_pairs, retrieval_loss(model)
    )
    assert max_rel_err(grads_of(model), want) < REL_TOL


@contextlib.contextmanager
def _no_replay(state: Any) -> Iterator[None]:
    yield


def test_without_rng_replay_the_masks_differ_and_the_step_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control for the RNG alignment: break it, and the replay check must catch it."""
    monkeypatch.setattr("gradaccum.cache.accumulator.replaying", _no_replay)
    micro = split(pairs_batch(), sizes=[3, 1, 4])
    ref = two_tower(dropout=0.3)
    torch.manual_seed(6)
    want = replayed_masks_reference(ref, micro, retrieval_loss(ref))

    model = two_tower(dropout=0.3)
    start = params_of(model)
    acc = CachedAccumulator(model, torch.optim.SGD(model.parameters(), lr=LR))
    with pytest.raises(CacheError, match="did not reproduce the first"):
        acc.step(micro, encode_pairs, retrieval_loss(model))
    assert all(p.grad is None for p in model.parameters())
    assert max_rel_err(params_of(model), start) == 0.0

    unchecked = two_tower(dropout=0.3)
    torch.manual_seed(6)
    CachedAccumulator(unchecked, torch.optim.SGD(unchecked.parameters(), lr=0.0), replay_rtol=None).step(
        micro, encode_pairs, retrieval_loss(unchecked)
    )
    assert max_rel_err(grads_of(unchecked), want) > 1e-2


# -- gradaccum verify on the bundled contrastive workload ---------------------------------------


def test_contrastive_workload_passes_verify_through_the_cache_and_fails_without() -> None:
    workload = contrastive()
    cached = verify_workload(workload, candidate_step=cached_candidate_for(workload))
    assert cached.passed, cached
    assert cached.grad_max_rel_err < REL_TOL
    uneven = verify_workload(workload, sizes=[1, 3, 4], candidate_step=cached_candidate_for(workload))
    assert uneven.passed, uneven
    plain = verify_workload(workload)
    assert not plain.passed and plain.grad_max_rel_err > 1e-2


def test_cached_candidate_takes_an_objective_or_a_summed_loss() -> None:
    """Both conventions give the full-batch mean InfoNCE update."""
    ref = one_tower()
    want_g, _, _ = full_batch_step(ref, views_batch(), encode_views, simclr_loss)
    micro = split(views_batch(), micro_batch=4)
    for candidate in (
        cached_candidate(encode_views, simclr_loss),
        cached_candidate(encode_views, lambda r: simclr_loss(r) * r.shape[0], count_fn=count_examples),
    ):
        model = one_tower()
        candidate(model, torch.optim.SGD(model.parameters(), lr=LR), micro)
        assert max_rel_err(grads_of(model), want_g) < REL_TOL


# -- misuse is refused with the setting named ---------------------------------------------------


def test_misuse_is_refused_before_any_update() -> None:
    model = one_tower()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    micro = split(views_batch(), micro_batch=4)
    acc = CachedAccumulator(model, opt)
    with pytest.raises(CacheError, match="encode_fn returned list"):
        acc.step(micro, lambda m, mb: [], simclr_loss)
    with pytest.raises(CacheError, match="floating-point tensors"):
        acc.step(micro, lambda m, mb: mb.argmax(-1), simclr_loss)
    with pytest.raises(LossError, match="scalar"):
        acc.step(micro, encode_views, lambda r: r.sum(0))
    with pytest.raises(LossError, match="does not depend"):
        acc.step(micro, encode_views, lambda r: r.detach().sum())
    calls = iter(range(10))
    with pytest.raises(CacheError, match="same towers"):
        acc.step(micro, lambda m, mb: (m(mb),) * (1 + next(calls)), lambda r: r[0].sum())
    with pytest.raises(CacheError, match="loss_reduction='mean'"):
        CachedAccumulator(model, opt, loss_reduction="mean")
    with pytest.raises(WorkloadError, match="rep_loss_fn"):
        cached_candidate_for(dataclasses.replace(contrastive(), extras={}))
    assert all(p.grad is None for p in model.parameters())
