"""gradaccum.check.equivalence: passes what is exact, fails what is not, and names the cause.

Tolerances: passing cases are held to 1e-12 relative in float64, tighter than verify's declared
1e-10, because the two sides differ only in summation order (~1e-15 at these sizes). Failing cases
must be wrong by more than 1e-2: BatchNorm over micro-batches of 2, changed negatives and a mean of
means move these gradients by tens of percent, so 1e-2 separates them from rounding by 13 orders.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradaccum.batch import split
from gradaccum.check.equivalence import EquivalenceReport, verify, verify_workload
from gradaccum.errors import ConfigError, CountError, EquivalenceError, PlanError, WorkloadError
from gradaccum.examples import bn_cnn, contrastive, tiny_gpt
from gradaccum.loss import count_examples
from tests.helpers import models

EXACT = 1e-12
WRONG = 1e-2


@pytest.mark.parametrize("sizes", [None, [1, 3, 4]])
def test_tiny_gpt_passes(sizes: list[int] | None) -> None:
    report = verify_workload(tiny_gpt(), sizes=sizes)
    assert report.passed, report.summary()
    assert report.grad_max_rel_err < EXACT and report.param_max_abs_diff < EXACT
    assert report.sizes == ((2, 2, 2, 2) if sizes is None else (1, 3, 4))
    assert len(set(report.counts)) > 1, "the check is only meaningful with uneven token counts"
    assert report.dtype == "float64" and report.likely_causes == ()
    assert report.grad_tol.value == 1e-10 and "float64" in report.grad_tol.reason
    assert report.param_tol.value == 1e-10 and "after one update" in report.param_tol.reason
    errors = [row.grad_rel_err for row in report.worst]
    assert errors == sorted(errors, reverse=True)
    assert {row.name for row in report.worst} == {n for n, _ in tiny_gpt().build_model().named_parameters()}
    assert report.raise_if_failed() is report


def test_a_printed_report_is_a_few_lines_with_the_verdict_and_the_causes() -> None:
    passed = verify_workload(tiny_gpt())
    text = str(passed)
    assert text.splitlines() == [
        "tiny_gpt: Accumulator.step over 4 micro-batches of 2 examples against the full batch",
        f"  {passed.summary()}",
        "  denominator: consistent: count_fn counts exactly the 136 tokens the loss sums over in the 8 "
        "examples of the checked batch (the output positions that receive a gradient)",
    ]
    assert "ParamRow" in repr(passed) and "ParamRow" not in text  # the repr keeps every row
    failed = str(verify_workload(bn_cnn()))
    assert "  FAIL: gradient max rel err" in failed
    assert "  likely cause: BatchNorm2d at `layer1.0.bn1` normalizes each micro-batch separately" in failed
    assert len(failed.splitlines()) == 6  # three lines and one per BatchNorm


def test_post_scaling_is_checked_with_the_same_tolerances() -> None:
    # the candidate streams the window and scales the gradients once after it (issue 22): one
    # rounding more than pre-scaling, still far inside EXACT in float64
    report = verify_workload(tiny_gpt(), sizes=[1, 3, 4], scaling="post")
    assert report.passed, report.summary()
    assert report.grad_max_rel_err < EXACT and report.param_max_abs_diff < EXACT
    assert report.candidate == "Accumulator.step (scaling='post')"
    w = tiny_gpt()
    with pytest.raises(ConfigError, match="a candidate_step replaces that Accumulator"):
        verify(w.build_model, w.batch(0), w.loss_fn, w.count_fn, candidate_step=print, scaling="post")
    with pytest.raises(ConfigError, match=r"scaling must be one of \['pre', 'post'\], got 'late'"):
        verify_workload(w, scaling="late")  # type: ignore[arg-type]


def test_bn_cnn_fails_and_names_each_batchnorm() -> None:
    report = verify_workload(bn_cnn())
    assert not report.passed
    assert report.grad_max_rel_err > WRONG
    assert report.likely_causes[:3] == tuple(
        f"BatchNorm2d at `{path}` normalizes each micro-batch separately (micro-batches of 2 examples "
        "instead of the batch of 8)"
        for path in ("bn1", "layer1.0.bn1", "layer1.0.bn2")
    )
    assert report.buffer_max_abs_diff is not None and report.buffer_max_abs_diff > 0
    with pytest.raises(EquivalenceError, match=r"bn_cnn: FAIL.*\n  - BatchNorm2d at `bn1`"):
        report.raise_if_failed()


def test_contrastive_fails_and_names_in_batch_negatives() -> None:
    report = verify_workload(contrastive(), sizes=[1, 3, 4])
    assert not report.passed and report.grad_max_rel_err > WRONG
    assert report.likely_causes == (
        "the loss uses in-batch negatives: each example is contrasted only with the examples of its "
        "own forward",
    )


def _mean_of_means(model: nn.Module, optimizer: torch.optim.Optimizer, micro: list[Any]) -> None:
    """The nanoGPT loop: each micro-batch's token mean divided by k."""
    optimizer.zero_grad(set_to_none=True)
    for mb in micro:
        (models.gpt_loss(model, mb) / models.tokens(mb) / len(micro)).backward()
    optimizer.step()


def _token_sum(model: nn.Module, optimizer: torch.optim.Optimizer, micro: list[Any]) -> None:
    """The same loop with the exact weighting: summed loss over the window's token count."""
    optimizer.zero_grad(set_to_none=True)
    n = sum(models.tokens(mb) for mb in micro)
    for mb in micro:
        (models.gpt_loss(model, mb) / n).backward()
    optimizer.step()


def test_mean_of_means_loop_fails_negative_control() -> None:
    batch = models.gpt_batch(8, seed=3)
    kwargs: dict[str, Any] = {"micro_batch": 2}
    exact = verify(models.gpt, batch, models.gpt_loss, models.tokens, candidate_step=_token_sum, **kwargs)
    assert exact.passed and exact.grad_max_rel_err < EXACT and exact.candidate.endswith("_token_sum")

    wrong = verify(models.gpt, batch, models.gpt_loss, models.tokens, candidate_step=_mean_of_means, **kwargs)
    assert not wrong.passed and wrong.grad_max_rel_err > WRONG
    (cause,) = wrong.likely_causes
    assert cause.startswith("the candidate step (_mean_of_means) does not reproduce the full-batch gradient")
    assert "mean of means" in cause


def test_loss_fn_returning_a_mean_is_named() -> None:
    def mean_loss(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return models.gpt_loss(model, mb) / models.tokens(mb)

    report = verify(models.gpt, models.gpt_batch(8, seed=3), mean_loss, models.tokens, micro_batch=2)
    assert not report.passed
    assert report.likely_causes[0].startswith("loss_fn returns a mean over the micro-batch, not a sum")
    assert "reduction='sum'" in report.likely_causes[0]


def test_count_fn_that_does_not_add_up_is_named() -> None:
    report = verify(models.gpt, models.gpt_batch(8, seed=3), models.gpt_loss, lambda mb: 100, micro_batch=2)
    assert not report.passed
    # the audit names it first (per micro-batch), the additivity probe next (over the window)
    assert report.likely_causes[0].startswith("the denominator is wrong (micro-batch 0): count_fn counts 100")
    assert any(
        c.startswith("count_fn is not additive: the whole batch counts 100 units")
        for c in report.likely_causes
    )


def _mlp_with(*middle: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), *middle, nn.Tanh(), nn.Linear(8, 3)).double()


def _mlp_loss(model: nn.Module, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = mb
    return ((model(x) - y) ** 2).sum()


def _regression(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return torch.randn(n, 5, generator=gen), torch.randn(n, 3, generator=gen)


def test_dropout_is_switched_off_and_batchnorm_keeps_its_training_mode() -> None:
    data = _regression()
    # dropout alone: switched off, so the two partitionings compute the same function
    dropout = verify(lambda: _mlp_with(nn.Dropout(0.5)), data, _mlp_loss, count_examples, micro_batch=2)
    assert dropout.passed and dropout.grad_max_rel_err < EXACT
    assert dropout.disabled == ("1.p=0.5",)
    assert [f.code for f in dropout.findings] == ["random-layer", "verify"]

    # with BatchNorm too: it must stay in training mode (in eval mode at initialization it is the
    # identity and would pass), so the check fails and names it, not the dropout
    both = verify(
        lambda: _mlp_with(nn.Dropout(0.5), nn.BatchNorm1d(8)), data, _mlp_loss, count_examples, micro_batch=2
    )
    assert not both.passed and both.grad_max_rel_err > WRONG
    assert both.likely_causes[0].startswith("BatchNorm1d at `2` normalizes each micro-batch separately")
    assert not any("not reproducible" in c for c in both.likely_causes)

    # a model the user puts in eval mode keeps it: running statistics couple nothing
    evaluated = verify(
        lambda: _mlp_with(nn.BatchNorm1d(8)).eval(), data, _mlp_loss, count_examples, micro_batch=2
    )
    assert evaluated.passed


class FunctionalDropout(nn.Module):
    """Random numbers drawn in forward, invisible to a scan of module types."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, 0.5, training=self.training)


def test_randomness_the_scan_cannot_see_is_reported_as_an_unreproducible_reference() -> None:
    # two dropouts: on one CPU generator a single mask of 8 rows equals two masks of 4 rows drawn
    # in turn, but two layers draw in a different order when the batch is split
    report = verify(
        lambda: _mlp_with(FunctionalDropout(), nn.Linear(8, 8), FunctionalDropout()),
        _regression(),
        _mlp_loss,
        count_examples,
        sizes=[4, 4],
    )
    assert not report.passed
    assert report.likely_causes[0].startswith("the reference is not reproducible")
    assert report.disabled == ()


def test_contrastive_extras_split_the_loss_at_the_representations() -> None:
    workload = contrastive()
    encode, rep_loss = workload.extras["encode_fn"], workload.extras["rep_loss_fn"]
    model = workload.build_model().double()
    batch = {k: v.double() for k, v in workload.batch().items()}
    micro = split(batch, sizes=[1, 3, 4])
    whole = workload.loss_fn(model, batch)
    assert rep_loss(encode(model, batch)).item() == pytest.approx(whole.item(), rel=EXACT)
    # the window's objective from the micro-batches' representations, concatenated in window order
    parts = [encode(model, mb) for mb in micro]
    joined = tuple(torch.cat(side) for side in zip(*parts, strict=True))
    assert rep_loss(joined).item() == pytest.approx(whole.item(), rel=EXACT)


def test_a_gradient_cache_built_from_the_extras_passes_through_candidate_step() -> None:
    workload = contrastive()
    encode, rep_loss = workload.extras["encode_fn"], workload.extras["rep_loss_fn"]

    def cached_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro: list[Any]) -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            parts = [encode(model, mb) for mb in micro]
        reps = tuple(torch.cat(side).requires_grad_() for side in zip(*parts, strict=True))
        n = sum(count_examples(mb) for mb in micro)
        (rep_loss(reps) / n).backward()
        start = 0
        for mb in micro:  # replay each micro-batch with a graph, fed the cached gradients
            b = count_examples(mb)
            torch.autograd.backward(encode(model, mb), [r.grad[start : start + b] for r in reps])
            start += b
        optimizer.step()

    report = verify_workload(workload, sizes=[1, 3, 4], candidate_step=cached_step)
    assert report.passed and report.grad_max_rel_err < EXACT, report.summary()


def test_build_model_must_return_the_same_weights() -> None:
    calls = iter(range(10))

    def drifting() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(next(calls))
            return nn.Linear(5, 3)

    with pytest.raises(
        WorkloadError, match=r"different initial weights on two calls \(first difference: `weight`\)"
    ):
        verify(drifting, _regression(), lambda m, mb: (m(mb[0]) ** 2).sum(), count_examples, micro_batch=2)


def test_bad_inputs_are_refused_before_anything_runs() -> None:
    args = (models.gpt, models.gpt_batch(8), models.gpt_loss, models.tokens)
    with pytest.raises(PlanError, match="micro_batch=3 does not divide the batch of 8 examples"):
        verify(*args, micro_batch=3)
    with pytest.raises(PlanError, match="give exactly one of micro_batch or sizes"):
        verify(*args)
    with pytest.raises(PlanError, match="sum to 7, but the batch holds 8"):
        verify(*args, sizes=[3, 4])
    with pytest.raises(PlanError, match="not torch.bfloat16: half-precision rounding"):
        verify(*args, micro_batch=2, dtype=torch.bfloat16)
    empty = {"input_ids": torch.zeros(4, 8, dtype=torch.long), "labels": torch.full((4, 8), -100)}
    with pytest.raises(CountError, match="counts 0 units in the whole verification batch"):
        verify(models.gpt, empty, models.gpt_loss, models.tokens, micro_batch=2)
    with pytest.raises(WorkloadError, match="returned int; it must return a torch.nn.Module"):
        verify(lambda: 3, models.gpt_batch(8), models.gpt_loss, models.tokens, micro_batch=2)  # type: ignore[arg-type, return-value]


def test_float32_diagnostic_declares_its_own_tolerances() -> None:
    report: EquivalenceReport = verify_workload(tiny_gpt(), dtype=torch.float32)
    assert report.passed and report.dtype == "float32"
    assert report.grad_tol.value == 1e-4 and report.param_tol.value == 1e-5
    # float32 rounding is visible but far below its tolerance on the tiny GPT (~2e-7 measured)
    assert report.grad_max_rel_err < 1e-5


def test_verify_leaves_the_global_generator_alone() -> None:
    before = torch.get_rng_state()
    verify_workload(bn_cnn())
    assert torch.equal(before, torch.get_rng_state())


def _divided_by(extra: str) -> Any:
    """The exact loop with one more division: by k (TRL #5619, ms-swift #10117), by the count
    once more, or by another window's count (TRL #6024: a generation batch's average)."""

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, micro: list[Any]) -> None:
        optimizer.zero_grad(set_to_none=True)
        n = sum(models.tokens(mb) for mb in micro)
        again = {"k": len(micro), "count": n, "other": 0.7}[extra]
        for mb in micro:
            (models.gpt_loss(model, mb) / n / again).backward()
        optimizer.step()

    step.__qualname__ = f"divided_by_{extra}"
    return step


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ("k", "1/k with k = 4 micro-batches: the loss is divided by the accumulation steps once too often"),
        ("count", "counted units: the loss is divided by the count twice"),
        ("other", "divided by the wrong denominator, 0.7 x the window's count"),
    ],
)
def test_a_uniform_factor_is_named_with_its_measured_value(extra: str, named: str) -> None:
    batch = models.gpt_batch(8, seed=3)
    report = verify(
        models.gpt, batch, models.gpt_loss, models.tokens, micro_batch=2, candidate_step=_divided_by(extra)
    )
    assert not report.passed
    (cause,) = report.likely_causes
    assert cause.startswith("the accumulated gradient is ") and " x the full-batch gradient" in cause, cause
    assert named in cause, cause
    if extra == "k":
        assert cause.startswith("the accumulated gradient is 0.25 x"), cause
