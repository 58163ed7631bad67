"""float64 equivalence of Accumulator.step with one full-batch pass.

Tolerance: 1e-12 relative L2 per parameter. The two computations differ only in summation order;
in float64 (unit roundoff 1.1e-16) reordering sums of a few thousand terms moves results by
~1e-15 relative, so 1e-12 leaves a 1000x margin while any real weighting error (the mean-of-means
control below is off by >1%) fails by ten orders of magnitude.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaccum import Accumulator, split
from tests.helpers import models
from tests.helpers.reference import full_batch_grads, grads_of, max_abs_diff, max_rel_err, params_of

REL_TOL = 1e-12


def _accumulated(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: Any,
    count_fn: Any,
    *,
    sizes: list[int],
    opt_factory: Any = None,
) -> tuple[dict, dict]:
    opt = (opt_factory or (lambda p: torch.optim.SGD(p, lr=0.0)))(model.parameters())
    Accumulator(model, opt).step(split(batch, sizes=sizes), loss_fn, count_fn)
    return grads_of(model), params_of(model)


@pytest.mark.parametrize("sizes", [[2, 2, 2, 2], [1, 3, 4], [8], [1] * 8])
def test_gpt_padded_sequences_match_full_batch(sizes: list[int]) -> None:
    batch = models.gpt_batch(8, seed=3)
    counts = [int(models.tokens(mb)) for mb in split(batch, micro_batch=2)]
    assert len(set(counts)) > 1, "the test needs uneven token counts per micro-batch"
    want = full_batch_grads(models.gpt(), batch, models.gpt_loss, models.tokens)
    got, _ = _accumulated(models.gpt(), batch, models.gpt_loss, models.tokens, sizes=sizes)
    assert max_rel_err(got, want) < REL_TOL


def test_mlp_with_masked_examples_matches_full_batch() -> None:
    batch = models.mlp_batch(12)
    want = full_batch_grads(models.mlp(), batch, models.mlp_loss, models.count_rows)
    got, _ = _accumulated(models.mlp(), batch, models.mlp_loss, models.count_rows, sizes=[3, 5, 4])
    assert max_rel_err(got, want) < REL_TOL


def test_mean_of_means_negative_control_is_rejected_by_the_same_check() -> None:
    batch = models.gpt_batch(8, seed=3)
    want = full_batch_grads(models.gpt(), batch, models.gpt_loss, models.tokens)
    model = models.gpt()
    micro = split(batch, micro_batch=2)
    for mb in micro:  # nanoGPT / Accelerate style: mean loss / k
        (models.gpt_loss(model, mb) / models.tokens(mb) / len(micro)).backward()
    err = max_rel_err(grads_of(model), want)
    assert err > 1e-2, f"mean of means should be visibly wrong on uneven tokens, got {err:.2e}"


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_parameters_after_one_update_match(optimizer: str) -> None:
    factory = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),
    }[optimizer]
    batch = models.gpt_batch(8, seed=5)
    ref = models.gpt()
    opt = factory(ref.parameters())
    full_batch_grads(ref, batch, models.gpt_loss, models.tokens)
    opt.step()
    _, got = _accumulated(
        models.gpt(), batch, models.gpt_loss, models.tokens, sizes=[2, 2, 2, 2], opt_factory=factory
    )
    want = params_of(ref)
    # Adam divides by sqrt(v)+eps: a 1e-15 gradient difference moves parameters by <= lr * 1e-12.
    assert max_abs_diff(got, want) < 1e-12


def test_clipping_happens_once_on_the_accumulated_gradient() -> None:
    batch = models.gpt_batch(8, seed=2)
    ref = models.gpt()
    want = full_batch_grads(ref, batch, models.gpt_loss, models.tokens)
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in want.values()])).item()
    model = models.gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    result = Accumulator(model, opt, max_grad_norm=total / 4).step(
        split(batch, micro_batch=2), models.gpt_loss, models.tokens
    )
    assert result.grad_norm == pytest.approx(total, rel=1e-12)  # reported before clipping
    clipped = {k: v * (total / 4) / (total + 1e-6) for k, v in want.items()}
    assert max_rel_err(grads_of(model), clipped) < 1e-9


def test_scheduler_and_hooks_run_once_per_window() -> None:
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    seen: list[int] = []
    acc = Accumulator(model, opt, sched, on_step=[lambda r: seen.append(r.step)])
    for seed in range(3):
        acc.step(split(models.mlp_batch(8, seed=seed), micro_batch=2), models.mlp_loss, models.count_rows)
    assert seen == [1, 2, 3]
    assert sched.last_epoch == 3
    assert opt.param_groups[0]["lr"] == pytest.approx(1 / 4)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=10).filter(lambda s: sum(s) <= 10)
)
def test_any_partition_gives_the_same_gradient(sizes: list[int]) -> None:
    n = sum(sizes)
    batch = models.mlp_batch(n, seed=n)
    if int(models.count_rows(batch)) == 0:
        return  # nothing counts: covered by the zero-count tests
    base = models.mlp()
    want = full_batch_grads(copy.deepcopy(base), batch, models.mlp_loss, models.count_rows)
    got, _ = _accumulated(copy.deepcopy(base), batch, models.mlp_loss, models.count_rows, sizes=sizes)
    assert max_rel_err(got, want) < REL_TOL
