"""The noise scale's moving averages travel in the accumulator's state: a resumed run continues the
estimate exactly (issue 25), and an older state without them still loads."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch

from gradaccum import Accumulator, ConfigError
from gradaccum.examples.regression import RegressionPopulation, regression_count, regression_loss


def _windows(count: int) -> list[list[dict[str, torch.Tensor]]]:
    population = RegressionPopulation.build(examples=1024)
    gen = torch.Generator().manual_seed(3)
    return [population.window([8, 8, 8], gen) for _ in range(count)]


def _fresh(model: torch.nn.Module) -> Accumulator:
    return Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.05), noise_scale=True)


def test_a_resumed_estimate_equals_the_uninterrupted_one_bitwise() -> None:
    windows = _windows(8)
    model = RegressionPopulation.build(examples=1024).model()
    straight = _fresh(copy.deepcopy(model))
    for w in windows:
        straight.step(w, regression_loss, regression_count)
    first_model = copy.deepcopy(model)
    first = _fresh(first_model)
    for w in windows[:5]:
        first.step(w, regression_loss, regression_count)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores, through JSON
    assert state["noise"]["samples"] == 5
    resumed = _fresh(copy.deepcopy(first_model))
    resumed.load_state_dict(state)
    assert resumed.noise_scale == first.noise_scale
    for w in windows[5:]:
        resumed.step(w, regression_loss, regression_count)
    assert resumed.noise_scale == straight.noise_scale  # every field, bitwise (floats compare exactly)
    assert resumed.noise_scale.samples == 8


def test_a_state_without_the_averages_still_loads_and_starts_the_estimate_afresh() -> None:
    acc = _fresh(RegressionPopulation.build(examples=64).model())
    acc.load_state_dict({"steps_applied": 4, "steps_skipped": 0, "consecutive_skips": 0})
    assert acc.steps_applied == 4 and acc.noise_scale.samples == 0
    plain = Accumulator(RegressionPopulation.build(examples=64).model(), torch.optim.SGD([torch.zeros(1)]))
    plain.load_state_dict(_fresh(RegressionPopulation.build(examples=64).model()).state_dict())
    assert "noise" not in plain.state_dict()


_GOOD: dict[str, Any] = {
    "mean_trace": 1.0,
    "mean_grad_sq": 2.0,
    "samples": 3,
    "negative": 1,
    "last": [1.0, 2.0],
}


@pytest.mark.parametrize(
    ("noise", "match"),
    [
        ({"mean_trace": 1.0}, "holds exactly"),
        ({**_GOOD, "samples": -1}, "non-negative integer"),
        ({**_GOOD, "negative": 4}, "not a state a run can reach"),
        ({**_GOOD, "mean_trace": float("nan")}, "finite floats"),
        ({**_GOOD, "last": [1.0]}, "finite floats"),
    ],
)
def test_a_bad_noise_state_is_refused_and_changes_nothing(noise: dict[str, Any], match: str) -> None:
    acc = _fresh(RegressionPopulation.build(examples=64).model())
    with pytest.raises(ConfigError, match=match):
        acc.load_state_dict({"steps_applied": 2, "steps_skipped": 0, "consecutive_skips": 0, "noise": noise})
    assert acc.steps_applied == 0 and acc.noise_scale.samples == 0
