"""AccumConfig checks every field's type; the accumulator's counters round-trip; the API is narrow
and lazy; step_adaptive refuses what it cannot drive."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

import gradaccum
from gradaccum import AccumConfig, Accumulator, AdaptiveMicroBatch, CachedAccumulator, split, step_adaptive
from gradaccum.errors import ConfigError
from tests.helpers import models
from tests.helpers.imports import loaded_after

# one value of the wrong type (or out of range) for every field, and what the error must name
WRONG: list[tuple[str, Any, str]] = [
    ("max_grad_norm", "1.0", "max_grad_norm must be a positive finite number"),
    ("max_grad_norm", True, "max_grad_norm must be a positive finite number"),
    ("max_grad_norm", float("inf"), "max_grad_norm must be a positive finite number"),
    ("max_grad_norm", 0, "max_grad_norm must be a positive finite number"),
    ("loss_reduction", "avg", "loss_reduction must be 'sum' or 'mean'"),
    ("loss_reduction", None, "loss_reduction must be 'sum' or 'mean'"),
    ("defer_sync", "no", "defer_sync must be True or False, got 'no'"),
    ("defer_sync", 1, "defer_sync must be True or False, got 1"),
    ("track_grad_norm", "true", "track_grad_norm must be True or False"),
    ("skip_nonfinite", "false", "skip_nonfinite must be True or False, got 'false'"),
    ("skip_nonfinite", None, "skip_nonfinite must be True or False"),
    ("agree_on_failure", 0, "agree_on_failure must be True or False"),
    ("noise_scale", "yes", "noise_scale must be True or False, got 'yes'"),
    ("check_loss_reduction", "off", "check_loss_reduction must be True or False, got 'off'"),
    ("noise_scale", None, "noise_scale must be True or False"),
    ("max_consecutive_skips", "3", "max_consecutive_skips must be a positive integer"),
    ("max_consecutive_skips", 2.0, "max_consecutive_skips must be a positive integer"),
    ("max_consecutive_skips", True, "max_consecutive_skips must be a positive integer"),
    ("max_consecutive_skips", 0, "max_consecutive_skips must be a positive integer"),
    ("sync_policy", "lazy", r"sync_policy must be one of \['defer', 'defer_replicate', 'every'\]"),
    ("sync_policy", None, "sync_policy must be one of"),
    ("scaling", "late", "scaling must be 'pre' .* or 'post' .*, got 'late'"),
    ("scaling", None, "scaling must be 'pre'"),
    ("batchnorm_stats", "batch", r"batchnorm_stats must be one of \['micro-batch', 'window'\]"),
    ("batchnorm_stats", None, "batchnorm_stats must be one of"),
    ("accum_dtype", "int8", "accum_dtype must be None .* got 'int8'"),
    ("accum_dtype", torch.bfloat16, "accum_dtype must be None .* got torch.bfloat16"),
]


def test_every_field_has_a_wrong_value_case() -> None:
    assert {name for name, _, _ in WRONG} == {f.name for f in dataclasses.fields(AccumConfig)}


@pytest.mark.parametrize(("name", "value", "match"), WRONG, ids=[f"{n}={v!r}" for n, v, _ in WRONG])
def test_accum_config_refuses_a_wrong_type_naming_the_field_and_value(
    name: str, value: Any, match: str
) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        AccumConfig(**{name: value})
    assert isinstance(err.value, TypeError) and isinstance(err.value, ValueError)  # callers catch either
    # the accumulator's keywords go through the same checks
    model = models.mlp()
    with pytest.raises(ConfigError, match=match):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), **{name: value})


def test_config_round_trips_through_json_and_refuses_unknown_keys() -> None:
    config = AccumConfig(
        max_grad_norm=0.5, defer_sync=False, max_consecutive_skips=3, agree_on_failure=False, noise_scale=True
    )
    assert AccumConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ConfigError, match=r"unknown settings \['clip'\]"):
        AccumConfig.from_dict({"clip": 1.0})


def test_config_and_keywords_are_one_or_the_other() -> None:
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = AccumConfig(max_grad_norm=2.0, track_grad_norm=True)
    acc = Accumulator(model, opt, config=config)
    assert acc.config is config
    assert Accumulator(model, opt, None, 2.0, track_grad_norm=True).config == config  # the contract's order
    with pytest.raises(ConfigError, match="not both; got config and max_grad_norm"):
        Accumulator(model, opt, max_grad_norm=1.0, config=config)
    with pytest.raises(ConfigError, match="config must be a gradaccum.AccumConfig"):
        Accumulator(model, opt, config={"max_grad_norm": 1.0})  # type: ignore[arg-type]


def _window(seed: int) -> list[Any]:
    return split(models.mlp_batch(6, seed=seed), micro_batch=2)


def _counters(acc: Accumulator) -> tuple[int, int, int]:
    return acc.steps_applied, acc.steps_skipped, acc.consecutive_skips


def test_a_resumed_accumulator_counts_exactly_like_an_uninterrupted_one() -> None:
    """Windows 0-5 with skips at 2, 3 and 5 (a non-finite loss); the resumed copy takes over after 3."""
    skip = {2, 3, 5}

    def loss_of(w: int) -> Any:
        factor = float("inf") if w in skip else 1.0
        return lambda m, mb: models.mlp_loss(m, mb) * factor

    def run(acc: Accumulator, ws: range) -> list[tuple[int, int, int]]:
        out = []
        for w in ws:
            result = acc.step(_window(w), loss_of(w), models.count_rows)
            assert result.step == acc.steps_applied
            out.append(_counters(acc))
        return out

    def fresh() -> Accumulator:
        model = models.mlp()
        return Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), max_consecutive_skips=5)

    straight = fresh()
    want = run(straight, range(6))
    first = fresh()
    got = run(first, range(4))
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    assert state == {"steps_applied": 2, "steps_skipped": 2, "consecutive_skips": 2}
    resumed = fresh()
    resumed.load_state_dict(state)
    got += run(resumed, range(4, 6))
    assert got == want and want[-1] == (3, 3, 1)


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"steps_applied": 1}, "holds exactly"),
        ({"steps_applied": 1, "steps_skipped": 0, "consecutive_skips": 0, "x": 1}, "holds exactly"),
        ({"steps_applied": -1, "steps_skipped": 0, "consecutive_skips": 0}, "non-negative integer"),
        ({"steps_applied": "1", "steps_skipped": 0, "consecutive_skips": 0}, "non-negative integer"),
        ({"steps_applied": 1, "steps_skipped": 1, "consecutive_skips": 2}, "not a state a run can reach"),
    ],
)
def test_a_bad_state_dict_is_refused(state: dict[str, Any], match: str) -> None:
    model = models.mlp()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match=match):
        acc.load_state_dict(state)
    assert _counters(acc) == (0, 0, 0)


def test_step_adaptive_refuses_a_cached_accumulator_saying_what_to_do() -> None:
    model = models.mlp()
    cached = CachedAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch = models.mlp_batch(4)
    with pytest.raises(TypeError, match=r"a CachedAccumulator steps with \(window, encode_fn, loss_fn\)"):
        step_adaptive(cached, batch, 2, models.mlp_loss, models.count_rows)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Retry its window yourself on WindowOutOfMemoryError"):
        AdaptiveMicroBatch(cached, micro_batch=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a gradaccum.Accumulator, got str"):
        step_adaptive("acc", batch, 2, models.mlp_loss, models.count_rows)  # type: ignore[arg-type]


def test_the_public_api_is_narrow_and_every_name_resolves() -> None:
    assert 25 <= len(gradaccum.__all__) <= 41
    for name in gradaccum.__all__:
        assert getattr(gradaccum, name) is not None
    assert callable(gradaccum.verify) and gradaccum.verify.__module__ == "gradaccum.check.equivalence"
    for internal in ("decide", "fit_memory_model", "MeasureSettings", "sync_kind", "batching"):
        assert not hasattr(gradaccum, internal)
    with pytest.raises(AttributeError, match="has no attribute 'decide'"):
        gradaccum.decide  # noqa: B018


def test_import_gradaccum_is_lazy() -> None:
    heavy = ["matplotlib", "rich", "gradaccum.bench", "gradaccum.train", "torch.distributed.checkpoint"]
    snippet = "from gradaccum import Accumulator, BatchPlan, verify, scan, guard, CachedAccumulator"
    assert loaded_after(snippet, heavy) == []
