"""``noise_scale=True`` under DDP (gloo, two processes): every rank's micro-batches are small batches.

The ranks hold different numbers of micro-batches (3 and 2) of unequal, partly masked sizes. Each
window's estimate must equal the reference over the union of both ranks' micro-batches, computed
from closed-form per-example gradients (no hooks, no W/N), and a single process stepping that union
as one window (W = 1 instead of 2). The smoothed figures must find the population's tr(Sigma) and
|G|^2 within 5 standard errors of the moving average, sd * sqrt(sum w^2) / sum w, with sd the
design's per-window spread over 4000 further windows (argued in tests/equivalence/test_noise_scale.py).
Both reductions are covered: P and K in the loss's end-of-window all-reduce
(``agree_on_failure=False``) and in one of their own (the default).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum import Accumulator, ConfigError
from gradaccum.examples.regression import RegressionPopulation, regression_count, regression_loss
from tests.helpers import models
from tests.helpers.launcher import run_ranks, values
from tests.helpers.noise import ema_factor, reference_estimate, spread, within

pytestmark = pytest.mark.distributed

WINDOWS = 200
Z = 5.0
MICRO_BATCHES = {0: 3, 1: 2}
SIZES = (8, 16, 32, 64)


def _population() -> RegressionPopulation:
    return RegressionPopulation.build()


def _window(population: RegressionPopulation, index: int) -> dict[int, list[dict[str, torch.Tensor]]]:
    """Both ranks' micro-batches of window ``index`` (each rank draws all and keeps its own)."""
    return _draw(population, torch.Generator().manual_seed(10_000 + index))


def _draw(population: RegressionPopulation, gen: torch.Generator) -> dict[int, list[dict[str, torch.Tensor]]]:
    """Each rank's micro-batches, redrawn until at least two count something."""
    while True:
        out = {}
        for rank, k in MICRO_BATCHES.items():
            sizes = [SIZES[int(i)] for i in torch.randint(0, len(SIZES), (k,), generator=gen)]
            out[rank] = population.window(sizes, gen, masked=0.25)
        if sum(int(mb["w"].sum()) > 0 for mbs in out.values() for mb in mbs) >= 2:
            return out


def _ranks(rank: int, world: int) -> dict[str, Any]:
    population = _population()
    out: dict[str, Any] = {}
    for agree in (True, False):
        ddp = DDP(population.model())
        acc = Accumulator(
            ddp, torch.optim.SGD(ddp.parameters(), lr=0.0), noise_scale=True, agree_on_failure=agree
        )
        estimates = []
        for w in range(WINDOWS):
            assert acc.step(_window(population, w)[rank], regression_loss, regression_count).applied
            ns = acc.noise_scale
            estimates.append((ns.window_trace_cov, ns.window_grad_sq))
        out[f"agree={agree}"] = (estimates, acc.noise_scale)
    # the update is bitwise the same with the estimate on (a model that moves, AdamW, clipping)
    params = {}
    for noise_scale in (False, True):
        ddp = DDP(models.gpt())
        acc = Accumulator(
            ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2), max_grad_norm=0.5, noise_scale=noise_scale
        )
        for seed in range(3):
            batch = models.gpt_batch(8, seed=seed)
            mine = {k: v[:5] if rank == 0 else v[5:] for k, v in batch.items()}
            window = [{k: v[i : i + 2] for k, v in mine.items()} for i in range(0, 5 if rank == 0 else 3, 2)]
            acc.step(window, models.gpt_loss, models.tokens)
        params[noise_scale] = [p.detach().clone() for p in ddp.parameters()]
    out["bitwise"] = all(torch.equal(a, b) for a, b in zip(params[False], params[True], strict=True))
    # FSDP2: refused on every rank when the accumulator is built, not hung on
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # pragma: no cover - torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    sharded = models.mlp()
    fully_shard(sharded, mesh=init_device_mesh("cpu", (world,)))
    try:
        Accumulator(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1), noise_scale=True)
        out["fsdp2"] = "built"
    except ConfigError as exc:
        out["fsdp2"] = str(exc)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return values(run_ranks(_ranks, timeout_s=240))


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    """The reference over each window's union, and one process stepping that union (W = 1)."""
    population = _population()
    model = population.model()
    per_example = population.per_example_grads(model)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_scale=True)
    reference, single = [], []
    for w in range(WINDOWS):
        drawn = _window(population, w)
        union = drawn[0] + drawn[1]
        reference.append(reference_estimate(per_example, union))
        acc.step(union, regression_loss, regression_count)
        single.append((acc.noise_scale.window_trace_cov, acc.noise_scale.window_grad_sq))
    # the design's per-window spread, from 4000 further windows (the error bars' sd)
    union = lambda gen: [mb for mbs in _draw(population, gen).values() for mb in mbs]
    sd = spread(per_example, union, 4000, seed=98)
    return {"reference": reference, "single": single, "truth": population.truth(model), "sd": sd}


@pytest.mark.parametrize("agree", [True, False])
def test_each_window_equals_the_reference_over_both_ranks(
    ranks: list[dict[str, Any]], expected: dict[str, Any], agree: bool
) -> None:
    r0, r1 = (r[f"agree={agree}"] for r in ranks)
    assert r0 == r1  # every rank holds the same estimate
    estimates, final = r0
    for (t, q), (rt, rq), (st, sq) in zip(estimates, expected["reference"], expected["single"], strict=True):
        assert t == pytest.approx(rt, rel=1e-9, abs=1e-12) and q == pytest.approx(rq, rel=1e-9, abs=1e-12)
        # W/N: the same micro-batches in one window on one process, W = 1
        assert t == pytest.approx(st, rel=1e-12, abs=1e-12) and q == pytest.approx(sq, rel=1e-12, abs=1e-12)
    assert final.samples == WINDOWS


def test_the_smoothed_estimate_finds_the_known_answer(
    ranks: list[dict[str, Any]], expected: dict[str, Any]
) -> None:
    estimates, final = ranks[0]["agree=True"]
    true_trace, true_grad_sq = expected["truth"]
    assert len(estimates) == WINDOWS
    se_trace, se_grad_sq = (sd * ema_factor(WINDOWS) for sd in expected["sd"])
    assert within(final.trace_cov, true_trace, se_trace, Z), (final, true_trace, se_trace)
    assert within(final.grad_sq, true_grad_sq, se_grad_sq, Z), (final, true_grad_sq, se_grad_sq)


def test_the_update_is_bitwise_unchanged_under_ddp(ranks: list[dict[str, Any]]) -> None:
    assert all(r["bitwise"] for r in ranks)


def test_fsdp2_is_refused_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["fsdp2"].startswith("noise_scale=True is not supported under FSDP2"), r["fsdp2"]
        assert "Measure the noise scale under DDP or on one process" in r["fsdp2"]
