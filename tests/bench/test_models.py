"""The memory and communication models.

The fit is ordinary least squares in float64 over at most a few dozen points: on exact synthetic
data it recovers the coefficients to rounding (relative 1e-9 is ~1e6 ulps of margin for values
near 1e9 bytes); with noise it must land within the noise's reach.
"""

from __future__ import annotations

import random

import pytest

from gradaccum.bench.models import comm_model, fit_memory_model
from gradaccum.bench.spec import BenchError

PERSISTENT = 12 * 1024**3  # the seeds' example: 12 GB persistent,
PER_EXAMPLE = 1024**3  # and 8 GB of activations for 8 examples


def test_the_fit_recovers_known_coefficients_from_exact_measurements() -> None:
    micro = [1, 2, 4, 8]
    activations = [PER_EXAMPLE * m for m in micro]
    model = fit_memory_model(micro, activations, PERSISTENT, kind="synthetic")
    assert model.persistent_bytes == PERSISTENT  # measured, not fitted
    assert model.per_example_bytes == pytest.approx(PER_EXAMPLE, rel=1e-9)
    assert model.fixed_bytes == pytest.approx(0.0, abs=1e-9 * PER_EXAMPLE)
    assert model.residual_bytes == pytest.approx(0.0, abs=1e-3 * PER_EXAMPLE)
    assert model.points == 4 and model.kind == "synthetic"
    # the seeds' worked example: 8 examples peak at 20 GB, micro-batches of 2 at 14 GB
    assert model.predict(8) == pytest.approx(20 * 1024**3, rel=1e-9)
    assert model.predict(2) == pytest.approx(14 * 1024**3, rel=1e-9)


def test_the_fit_recovers_coefficients_through_noise_and_repeats() -> None:
    rng = random.Random(0)
    noise = 4 * 1024**2  # +-4 MiB of jitter on each measurement
    micro = [1, 2, 4, 8, 16, 32] * 3
    activations = [PER_EXAMPLE * m + rng.uniform(-noise, noise) for m in micro]
    model = fit_memory_model(micro, activations, PERSISTENT)
    # 18 points with bounded noise: the slope moves by well under noise / spread(micro)
    assert model.per_example_bytes == pytest.approx(PER_EXAMPLE, abs=noise / 10)
    assert model.fixed_bytes == pytest.approx(0.0, abs=noise)
    assert 0 < model.residual_bytes < noise


def test_largest_micro_batch_that_fits_a_budget() -> None:
    model = fit_memory_model([1, 8], [PER_EXAMPLE, 8 * PER_EXAMPLE], PERSISTENT)
    assert model.largest_micro_batch(16 * 1024**3) == 4  # 12 + 4 x 1 GiB = 16 GiB exactly fits
    assert model.largest_micro_batch(16 * 1024**3 - 1) == 3
    assert model.largest_micro_batch(11 * 1024**3) == 0  # not even the persistent part fits
    flat = fit_memory_model([1, 2, 4], [300.0, 300.0, 300.0], 100.0)
    assert flat.per_example_bytes == pytest.approx(0.0, abs=1e-9)
    assert flat.largest_micro_batch(400.0) is None  # no growth measured: the model sets no limit
    assert flat.largest_micro_batch(200.0) == 0


def test_one_distinct_micro_batch_is_taken_as_proportional_and_mismatched_figures_are_refused() -> None:
    model = fit_memory_model([4, 4, 4], [400.0, 400.0, 400.0], 10.0)
    assert (model.per_example_bytes, model.fixed_bytes, model.points) == (100.0, 0.0, 3)
    with pytest.raises(BenchError, match="one activation figure per micro-batch"):
        fit_memory_model([1, 2], [1.0], 0.0)


def test_comm_model_naive_moves_k_times_the_gradient_and_deferred_once() -> None:
    # the seeds' figures: 7 GB per synchronized backward, 4 micro-batches
    g = 7 * 1024**3
    m = comm_model(g, 4, defer_sync=True, measured_bytes=g)
    assert (m.naive_bytes, m.deferred_bytes) == (4 * g, g)
    assert m.expected_bytes == g and m.matches is True
    naive = comm_model(g, 4, defer_sync=False, measured_bytes=g)
    assert naive.expected_bytes == 4 * g and naive.matches is False
    assert comm_model(g, 4).matches is None  # nothing measured without data parallelism
    with pytest.raises(BenchError):
        comm_model(g, 0)
