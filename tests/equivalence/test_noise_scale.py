"""``noise_scale=True`` against a problem with a known answer, on one process.

Linear regression on a population of 2^14 Gaussian examples (:mod:`gradaccum.examples.regression`):
at the model's weights tr(Sigma) and |G|^2 come straight from the per-example gradients. The model
does not move (SGD at lr 0), and every window draws its rows independently with replacement, so
the windows' own estimates T_w, Q_w are independent and identically distributed with means exactly
tr(Sigma) and |G|^2 (the estimator is unbiased, :mod:`gradaccum.step.noise`).

Tolerances. Window by window the step must equal the independent reference of
:mod:`tests.helpers.noise` to float64 rounding (1e-9 relative: a few dozen roundings of 1e-16,
amplified by the cancellation in A - b and K b - A, which is below 10x here). Against the truth,
an average of T windows has a standard error of sd / sqrt(T), and the moving average one of
sd / sqrt(T_eff), T_eff = (sum w)^2 / sum w^2 for its weights (180 for 300 windows); sd is the
per-window spread of the design, from 4000 further windows drawn apart from the tested ones (its
relative error, sqrt((kurtosis - 1) / 4n), is under 3 % at the kurtoses of 5-13 these designs
have). The tests allow 5 standard errors: under normality that fails once in 10^6, and in
simulations of 2000-4000 runs of each design (closed-form gradients, the same draws) |z| stayed
below 4.1. The tails are what the designs avoid: micro-batches of 2 rows and windows of K = 2 (a
single difference) give per-window kurtoses of 100-270 and |z| up to 5.5 in 1000 runs; so does
the tested windows' own sample sd as the error bar (a run that misses the rare large values
shrinks it along with the mean: z = -4.9 once in 1000). The unweighted estimator (the
micro-batches' mean gradients as the small batch at their mean size) misses by more than 5
standard errors on unequal counts, which shows the bound can fail.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gradaccum import Accumulator, split
from gradaccum.examples import build_tiny_gpt, gpt_loss
from gradaccum.examples.gpt import sample_sequences
from gradaccum.examples.regression import RegressionPopulation, regression_count, regression_loss
from gradaccum.loss import count_tokens
from gradaccum.step.noise import NoiseScale
from tests.helpers.noise import bias_corrected_ema, ema_factor, reference_estimate, spread, within

Z = 5.0
WINDOWS = 300
POPULATION = RegressionPopulation.build()


SIZES = (8, 16, 32, 64)


def _equal(gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """4 micro-batches of 16 rows, every row counted."""
    return POPULATION.window([16] * 4, gen)


def _unequal(gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """3-6 micro-batches of 8, 16, 32 or 64 rows, a quarter of the rows not counted, redrawn in
    the (rare) case that fewer than two count something (one alone measures nothing)."""
    while True:
        k = int(torch.randint(3, 7, (1,), generator=gen))
        sizes = [SIZES[int(i)] for i in torch.randint(0, len(SIZES), (k,), generator=gen)]
        window = POPULATION.window(sizes, gen, masked=0.25)
        if sum(int(mb["w"].sum()) > 0 for mb in window) >= 2:
            return window


DESIGNS: dict[str, Callable[[torch.Generator], list[dict[str, torch.Tensor]]]] = {
    "equal counts": _equal,
    "unequal counts": _unequal,
}


def _run(
    design: str, windows: int, *, fitted: bool = False, scaler: Any = None, seed: int = 1
) -> tuple[list[tuple[float, float]], list[tuple[float, float]], NoiseScale, list[NoiseScale]]:
    """(step's per-window estimates, the reference's, the final estimate, the estimate after each)."""
    model = POPULATION.model(fitted=fitted)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), scaler=scaler, noise_scale=True)
    per_example = POPULATION.per_example_grads(model)
    gen = torch.Generator().manual_seed(seed)
    measured, reference, after = [], [], []
    for _ in range(windows):
        window = DESIGNS[design](gen)
        assert acc.step(window, regression_loss, regression_count).applied
        ns = acc.noise_scale
        assert ns.window_trace_cov is not None and ns.window_grad_sq is not None
        measured.append((ns.window_trace_cov, ns.window_grad_sq))
        reference.append(reference_estimate(per_example, window))
        after.append(ns)
    return measured, reference, acc.noise_scale, after


SPREAD_WINDOWS = 4000


@pytest.fixture(scope="module", params=list(DESIGNS))
def run(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return request.param, _run(request.param, WINDOWS)


@pytest.fixture(scope="module")
def spreads() -> dict[str, tuple[float, float]]:
    """Each design's per-window standard deviations of (tr(Sigma)^, |G|^2^), apart from the runs."""
    per_example = POPULATION.per_example_grads(POPULATION.model())
    return {name: spread(per_example, draw, SPREAD_WINDOWS, seed=99) for name, draw in DESIGNS.items()}


def test_each_window_equals_the_reference_from_per_example_gradients(run: tuple[str, Any]) -> None:
    _, (measured, reference, final, _) = run
    for (t, q), (rt, rq) in zip(measured, reference, strict=True):
        assert t == pytest.approx(rt, rel=1e-9, abs=1e-12)
        assert q == pytest.approx(rq, rel=1e-9, abs=1e-12)
    # the smoothed figures are a ratio of bias-corrected moving averages, not an average of ratios
    trace = bias_corrected_ema([t for t, _ in reference])
    grad_sq = bias_corrected_ema([q for _, q in reference])
    assert final.samples == WINDOWS
    assert final.trace_cov == pytest.approx(trace, rel=1e-9)
    assert final.grad_sq == pytest.approx(grad_sq, rel=1e-9)
    assert final.b_simple == pytest.approx(trace / grad_sq, rel=1e-9)
    ratios = [t / q for t, q in reference]
    assert final.b_simple != pytest.approx(bias_corrected_ema(ratios), rel=0.05)


def test_the_estimate_finds_the_known_answer(
    run: tuple[str, Any], spreads: dict[str, tuple[float, float]]
) -> None:
    design, (measured, _, final, _) = run
    true_trace, true_grad_sq = POPULATION.truth(POPULATION.model())
    traces, grad_sqs = [t for t, _ in measured], [q for _, q in measured]
    sd_trace, sd_grad_sq = spreads[design]
    # each window is unbiased: their plain mean, within Z standard errors sd / sqrt(T)
    for values, truth, sd in ((traces, true_trace, sd_trace), (grad_sqs, true_grad_sq, sd_grad_sq)):
        se = sd / len(values) ** 0.5
        assert within(statistics.fmean(values), truth, se, Z), (design, statistics.fmean(values), truth, se)
    # the moving averages, within Z of their own standard errors sd / sqrt(T_eff)
    se_trace, se_grad_sq = sd_trace * ema_factor(WINDOWS), sd_grad_sq * ema_factor(WINDOWS)
    assert final.trace_cov is not None and final.grad_sq is not None and final.b_simple is not None
    assert within(final.trace_cov, true_trace, se_trace, Z), (final, true_trace, se_trace)
    assert within(final.grad_sq, true_grad_sq, se_grad_sq, Z), (final, true_grad_sq, se_grad_sq)
    # B_simple then lies in the interval those two bounds imply (interval arithmetic on the ratio)
    low = (true_trace - Z * se_trace) / (true_grad_sq + Z * se_grad_sq)
    high = (true_trace + Z * se_trace) / (true_grad_sq - Z * se_grad_sq)
    assert low <= final.b_simple <= high, (final.b_simple, low, high, true_trace / true_grad_sq)


def test_the_unweighted_estimator_fails_that_bound_on_unequal_counts(
    spreads: dict[str, tuple[float, float]],
) -> None:
    # the negative control: the mean of the micro-batches' squared mean gradients as |G_small|^2 at
    # their mean size B_small = N/K, i.e. what equal-size implementations compute
    model = POPULATION.model()
    per_example = POPULATION.per_example_grads(model)
    true_trace, _ = POPULATION.truth(model)
    gen = torch.Generator().manual_seed(1)
    traces = []
    for _ in range(WINDOWS):
        window = _unequal(gen)
        sums = [(mb["w"].double()[:, None] * per_example[mb["i"]]).sum(0) for mb in window]
        counts = [float(mb["w"].sum()) for mb in window]
        kept = [(s, c) for s, c in zip(sums, counts, strict=True) if c > 0]
        n, k = sum(c for _, c in kept), len(kept)
        small = statistics.fmean(float(s @ s) / (c * c) for s, c in kept)
        mean = torch.stack([s for s, _ in kept]).sum(0) / n
        big = float(mean @ mean)
        traces.append((small - big) / (k / n - 1 / n))
    # its own spread is wider than the unit-weighted one's; either way it misses by far
    se = max(statistics.stdev(traces), spreads["unequal counts"][0]) / len(traces) ** 0.5
    assert not within(statistics.fmean(traces), true_trace, se, Z)


def test_a_gradscaler_and_w_over_n_leave_the_estimate_unchanged() -> None:
    # the scale changes every window (growth_interval=1 doubles it), and is not a power of two;
    # N, and so W/N, changes every window too (unequal counts)
    scaler = torch.amp.GradScaler("cpu", init_scale=3000.0, growth_interval=1)
    scaled, reference, final, _ = _run("unequal counts", 40, scaler=scaler, seed=5)
    plain, _, plain_final, _ = _run("unequal counts", 40, seed=5)
    assert scaler.get_scale() == 3000.0 * 2**40
    for (t, q), (pt, pq), (rt, rq) in zip(scaled, plain, reference, strict=True):
        assert t == pytest.approx(pt, rel=1e-12, abs=1e-12) and q == pytest.approx(pq, rel=1e-12, abs=1e-12)
        assert t == pytest.approx(rt, rel=1e-9, abs=1e-12) and q == pytest.approx(rq, rel=1e-9, abs=1e-12)
    assert final.b_simple == pytest.approx(plain_final.b_simple, rel=1e-12)


def test_negative_estimates_are_clamped_and_counted() -> None:
    # at the least-squares solution G = 0: each window's |G|^2 estimate is noise around 0
    _, reference, final, after = _run("unequal counts", 60, fitted=True)
    negative = sum(t < 0 or q < 0 for t, q in reference)
    assert negative > 10 and final.negative == negative
    for ns in after:
        assert ns.trace_cov is not None and ns.trace_cov >= 0
        assert ns.grad_sq is not None and ns.grad_sq >= 0
        if ns.grad_sq == 0:  # clamped: the smoothed estimate went negative, and no B_simple then
            assert ns.b_simple is None
            assert "not resolved" in ns.describe(100.0, "examples")
    clamped = [ns for i, ns in enumerate(after) if bias_corrected_ema([q for _, q in reference[: i + 1]]) < 0]
    assert clamped and all(ns.grad_sq == 0 and ns.b_simple is None for ns in clamped)


def test_one_micro_batch_measures_nothing_and_skips_are_not_samples() -> None:
    model = POPULATION.model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), noise_scale=True)
    gen = torch.Generator().manual_seed(2)
    acc.step(POPULATION.window([8], gen), regression_loss, regression_count)
    assert acc.noise_scale.samples == 0 and acc.noise_scale.b_simple is None
    # a window whose only counted micro-batch is one of two: K = 1 as well
    window = POPULATION.window([4, 4], gen)
    window[1]["w"].zero_()
    acc.step(window, regression_loss, regression_count)
    assert acc.noise_scale.samples == 0
    # a non-finite window is skipped, and measured not at all
    window = POPULATION.window([4, 4], gen)
    window[0]["y"] = window[0]["y"].clone()
    window[0]["y"][0] = float("nan")
    assert acc.step(window, regression_loss, regression_count).skipped
    assert acc.noise_scale.samples == 0
    acc.step(POPULATION.window([4, 4], gen), regression_loss, regression_count)
    assert acc.noise_scale.samples == 1
    # an empty micro-batch among others is left out of K and of the small batches
    window = POPULATION.window([4, 6, 5], gen)
    window[1]["w"].zero_()
    per_example = POPULATION.per_example_grads(model)  # at the weights this window sees
    acc.step(window, regression_loss, regression_count)
    ns = acc.noise_scale
    assert ns.samples == 2
    reference = reference_estimate(per_example, window)
    assert (ns.window_trace_cov, ns.window_grad_sq) == pytest.approx(reference, rel=1e-9)


def _params_after(noise_scale: bool, build: Callable[[], torch.nn.Module], steps: Any, **config: Any) -> Any:
    model = build()
    acc = Accumulator(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), noise_scale=noise_scale, **config
    )
    results = [acc.step(window, loss_fn, count_fn) for window, loss_fn, count_fn in steps]
    return [p.detach().clone() for p in model.parameters()], results


@pytest.mark.parametrize("config", [{}, {"max_grad_norm": 0.5}, {"skip_nonfinite": False}])
def test_the_update_is_bitwise_the_same_with_noise_scale_on(config: dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(3)
    regression = [(_unequal(gen), regression_loss, regression_count) for _ in range(5)]
    count = count_tokens("labels", shift=False)
    gpt_batches = [sample_sequences(8, seed=s, max_len=24) for s in range(3)]
    gpt = [(split(b, sizes=[1, 3, 2, 2]), gpt_loss, count) for b in gpt_batches]
    for build, steps in ((POPULATION.model, regression), (lambda: build_tiny_gpt(0), gpt)):
        off, off_results = _params_after(False, build, steps, **config)
        on, on_results = _params_after(True, build, steps, **config)
        assert all(torch.equal(a, b) for a, b in zip(off, on, strict=True))
        assert off_results == on_results
