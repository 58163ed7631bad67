"""The noise-scale arithmetic on numbers worked by hand, its words, and what ``noise_scale=True`` refuses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from gradaccum import AccumConfig, Accumulator, CachedAccumulator, ConfigError
from gradaccum.errors import CacheError
from gradaccum.examples.regression import RegressionPopulation, regression_count, regression_loss
from gradaccum.step.noise import EMA_BETA, NoiseScale, NoiseScaleMeter, window_estimate


def test_equal_counts_give_mccandlish_two_batch_estimators() -> None:
    # K = 4 micro-batches of n = 5 units: B_small = 5, B_big = 20; |G_small|^2 = A, |G_big|^2 = b
    k, n, a, b = 4, 5, 3.0, 1.2
    big_n = k * n
    # P = sum_j |Delta_j|^2 / n_j with Delta_j = s_j / N (W = 1, sigma = 1) and |s_j|^2 = n^2 |g_j|^2
    p = k * (n * n * a / big_n**2) / n
    trace, grad_sq = window_estimate(p, k, b, big_n, 1, 1.0)  # type: ignore[misc]
    assert trace == pytest.approx((a - b) / (1 / n - 1 / big_n), rel=1e-14)
    assert grad_sq == pytest.approx((big_n * b - n * a) / (big_n - n), rel=1e-14)


def test_the_loss_scale_and_w_over_n_divide_out() -> None:
    # the same window measured under DDP (W = 2, sigma = 1024) scales Delta_j by 2 * 1024 and the
    # synchronized gradient by 1024: the same estimate
    plain = window_estimate(0.3, 3, 1.0, 10, 1, 1.0)
    assert window_estimate(0.3 * (2 * 1024) ** 2, 3, 1024.0**2, 10, 2, 1024.0) == pytest.approx(
        plain, rel=1e-15
    )


@pytest.mark.parametrize(
    "figures",
    [
        (1.0, 1, 1.0, 10, 1, 1.0),
        (1.0, 3, 1.0, 0, 1, 1.0),
        (math.nan, 3, 1.0, 10, 1, 1.0),
        (1.0, 3, math.inf, 10, 1, 1.0),
    ],
    ids=["one micro-batch", "no units", "nan", "inf"],
)
def test_a_window_that_cannot_say_anything_gives_none(figures: tuple[float, ...]) -> None:
    assert window_estimate(*figures) is None  # type: ignore[arg-type]


def _meter() -> NoiseScaleMeter:
    model = nn.Linear(2, 1)
    return NoiseScaleMeter(model, list(model.parameters()), device=torch.device("cpu"), uniform=True)


def test_negative_estimates_enter_the_averages_unclamped_and_are_counted() -> None:
    meter = _meter()
    assert meter.result() == NoiseScale(b_simple=None, trace_cov=None, grad_sq=None, samples=0, negative=0)
    # N = 10, K = 2, W = sigma = 1: A = 10 P. P = 0.3, b = 1: A = 3, T = 10 (3 - 1) = 20, Q = 2 - 3 = -1
    meter.update([0.3, 2, 1.0, 1.0], 10, 1)
    first = meter.result()
    assert (first.window_trace_cov, first.window_grad_sq) == pytest.approx((20.0, -1.0))
    assert first.negative == 1 and first.samples == 1
    assert first.grad_sq == 0.0 and first.trace_cov == pytest.approx(20.0) and first.b_simple is None
    # b = 2: A = 3, T = 10, Q = 4 - 3 = 1; the average of -1 and 1 with weights beta and 1
    meter.update([0.3, 2, 2.0, 1.0], 10, 1)
    second = meter.result()
    correction = 1 - EMA_BETA**2
    trace = (EMA_BETA * (1 - EMA_BETA) * 20 + (1 - EMA_BETA) * 10) / correction
    grad_sq = (EMA_BETA * (1 - EMA_BETA) * -1 + (1 - EMA_BETA) * 1) / correction
    assert grad_sq > 0 and second.negative == 1 and second.samples == 2
    assert second.grad_sq == pytest.approx(grad_sq, rel=1e-12)
    assert second.b_simple == pytest.approx(trace / grad_sq, rel=1e-12)  # a ratio of the averages
    assert second.b_simple != pytest.approx((20 / -1 * EMA_BETA + 10 / 1) / (1 + EMA_BETA), rel=0.5)
    meter.update([0.3, 1, 2.0, 1.0], 10, 1)  # K = 1: not a sample
    assert meter.result().samples == 2


@pytest.mark.parametrize(
    ("b_simple", "batch", "words"),
    [
        (
            62.4,
            256,
            "global batch 256 sequences is 4.1x B_simple ~ 62: past the critical batch, more "
            "accumulation buys little per sequence",
        ),
        (620.0, 256, "global batch 256 sequences is 0.41x B_simple ~ 620: below the critical batch"),
        (200.0, 256, "global batch 256 sequences is 1.3x B_simple ~ 200: near the critical batch"),
    ],
)
def test_reports_say_where_the_global_batch_stands(b_simple: float, batch: int, words: str) -> None:
    ns = NoiseScale(b_simple=b_simple, trace_cov=b_simple, grad_sq=1.0, samples=50, negative=0)
    text = ns.describe(batch, "sequences")
    assert text.startswith(words), text
    ratio = batch / b_simple
    assert f"~{1 + 1 / ratio:.2g}x the fewest updates and ~{1 + ratio:.2g}x the fewest sequences" in text


def test_reports_say_when_there_is_no_estimate() -> None:
    empty = NoiseScale(b_simple=None, trace_cov=None, grad_sq=None, samples=0, negative=0)
    assert "no noise-scale estimate yet" in empty.describe(64, "tokens")
    unresolved = NoiseScale(b_simple=None, trace_cov=3.0, grad_sq=0.0, samples=12, negative=7)
    text = unresolved.describe(64, "tokens")
    assert "not resolved after 12 windows" in text and "7 windows" in text


def test_noise_scale_is_refused_where_it_cannot_be_measured() -> None:
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"build it with noise_scale=True"):
        Accumulator(model, opt).noise_scale  # noqa: B018
    with pytest.raises(CacheError, match="not supported by CachedAccumulator"):
        CachedAccumulator(model, opt, config=AccumConfig(noise_scale=True))
    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    with pytest.raises(ConfigError, match=r"needs dense gradients, but 0 build sparse ones"):
        Accumulator(sparse, torch.optim.SGD(sparse.parameters(), lr=0.1), noise_scale=True)


def test_a_backward_outside_the_step_is_not_measured() -> None:
    population = RegressionPopulation.build(examples=1024)
    estimates = []
    for meddle in (False, True):
        model = population.model()
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.05), noise_scale=True)
        gen = torch.Generator().manual_seed(4)
        for _ in range(6):
            acc.step(population.window([4, 6, 3], gen), regression_loss, regression_count)
            if meddle:  # the user's own backward between steps (hooks fire, and must not record)
                regression_loss(model, population.window([5], gen)[0]).backward()
                model.zero_grad(set_to_none=True)
            else:
                population.window([5], gen)  # the same draws, so the windows match
        estimates.append(acc.noise_scale)
    assert estimates[0] == estimates[1]


@pytest.mark.parametrize("config", [{}, {"max_grad_norm": 1.0}])
def test_one_process_still_reads_the_device_once_per_step(config: dict[str, object]) -> None:
    from gradaccum import split
    from gradaccum.distributed.comm import count_sync_points
    from tests.helpers import models

    window = split(models.gpt_batch(6, seed=2), sizes=[1, 3, 2])
    for noise_scale in (False, True):
        model = models.gpt()
        acc = Accumulator(
            model, torch.optim.SGD(model.parameters(), lr=0.1), noise_scale=noise_scale, **config
        )
        acc.step(window, models.gpt_loss, models.tokens)
        with count_sync_points() as points:
            acc.step(window, models.gpt_loss, models.tokens)
        assert (points.collectives, points.host_reads) == (0, 1), points.by_name
    assert acc.noise_scale.samples == 2
