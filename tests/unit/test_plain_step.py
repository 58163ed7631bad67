"""The plain step (:mod:`gradaccum.step.plain`): taken exactly when nothing but the loss's own
features is on, and the same steps, bit for bit, as the engine's full path."""

from __future__ import annotations

import math

import pytest
import torch

from gradaccum import Accumulator, LossError, split
from gradaccum.step.plain import PlainWindow
from gradaccum.step.window import CastScale, WindowCount
from tests.helpers import models
from tests.helpers.reference import params_of


def _pair(
    **kwargs: object,
) -> tuple[tuple[Accumulator, torch.nn.Module], tuple[Accumulator, torch.nn.Module]]:
    """Two accumulators on equal models: one plain; one that the noise meter (which reads the
    gradients but never changes them) sends down the engine's full path."""
    out = []
    for extra in ({}, {"noise_scale": True}):
        model = models.mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        out.append((Accumulator(model, opt, **kwargs, **extra), model))  # type: ignore[arg-type]
    return out[0], out[1]


@pytest.fixture
def plain_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    step = PlainWindow.step

    def counted(self: PlainWindow, *args: object) -> object:
        calls.append(1)
        return step(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(PlainWindow, "step", counted)
    return calls


def _rows(mb: dict) -> int:
    return int(mb["x"].shape[0])


def _mean_loss(model: torch.nn.Module, mb: dict) -> torch.Tensor:
    return models.mlp_loss(model, mb) / _rows(mb)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_plain_and_full_paths_step_alike_bit_for_bit(reduction: str, plain_calls: list[int]) -> None:
    (plain, plain_model), (full, full_model) = _pair(loss_reduction=reduction)
    loss_fn = models.mlp_loss if reduction == "sum" else _mean_loss
    int_count = models.count_rows if reduction == "sum" else _rows
    windows = [
        split(models.mlp_batch(6, seed=1), micro_batch=2),
        split(models.mlp_batch(5, seed=2), sizes=[2, 2, 1]),  # a short last micro-batch
    ]
    for window in windows:
        for count in (lambda mb: int(int_count(mb)), lambda mb: torch.tensor(int(int_count(mb)))):
            a = plain.step(window, loss_fn, count)
            b = full.step(window, loss_fn, count)
            assert (a.loss, a.global_count, a.applied, a.step) == (b.loss, b.global_count, b.applied, b.step)
    assert len(plain_calls) == 4  # the plain accumulator's steps, and none of the other's
    for name, value in params_of(full_model).items():
        assert torch.equal(params_of(plain_model)[name], value), name


def test_plain_step_skips_a_non_finite_window_as_the_full_path_does(plain_calls: list[int]) -> None:
    (plain, plain_model), (full, _) = _pair()
    window = split(models.mlp_batch(4, seed=3), micro_batch=2)
    before = params_of(plain_model)

    def nan_loss(model: torch.nn.Module, mb: dict) -> torch.Tensor:
        return models.mlp_loss(model, mb) * float("nan")

    a = plain.step(window, nan_loss, models.count_rows)
    b = full.step(window, nan_loss, models.count_rows)
    # the skip reason names the norm only where the full path computed one (for the noise meter)
    assert not a.applied and not b.applied and (a.step, a.global_count) == (b.step, b.global_count)
    assert a.skip_reason is not None and a.skip_reason.startswith("non-finite loss or gradient (loss nan")
    assert a.loss is not None and math.isnan(a.loss)
    assert all(torch.equal(before[k], v) for k, v in params_of(plain_model).items())
    assert plain_calls == [1]


def test_a_failing_loss_clears_the_window_on_the_plain_path(plain_calls: list[int]) -> None:
    (plain, plain_model), _ = _pair()
    window = split(models.mlp_batch(6, seed=5), micro_batch=2)

    def fails_last(model: torch.nn.Module, mb: dict) -> torch.Tensor:
        if mb is window[-1]:
            return models.mlp_loss(model, mb).detach()  # refused: no gradient to backpropagate
        return models.mlp_loss(model, mb)

    with pytest.raises(LossError, match="micro-batch 2"):
        plain.step(window, fails_last, models.count_rows)
    assert all(p.grad is None for p in plain_model.parameters())  # the first two backwards' sums are gone
    assert plain_calls == [1]


@pytest.mark.parametrize(
    "settings",
    [
        {"noise_scale": True},
        {"scaling": "post"},
        {"batchnorm_stats": "window"},
        {"accum_dtype": torch.float64},
    ],
    ids=["noise", "post", "batchnorm", "accum_dtype"],
)
def test_a_feature_that_needs_the_window_takes_the_full_path(settings: dict, plain_calls: list[int]) -> None:
    model = models.mlp()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), **settings)
    acc.step(split(models.mlp_batch(4, seed=1), micro_batch=2), models.mlp_loss, models.count_rows)
    assert plain_calls == []


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_a_host_scale_has_the_bits_of_the_device_scale(dtype: torch.dtype) -> None:
    """Int counts on one process give W/N on the host (no device op); each dtype's scale must be
    the tensor path's to the bit: 1/N and its product with W are one correctly rounded float64
    operation each on both paths, and the cast to a narrow dtype rounds the same float64 once."""
    for n in [*range(0, 300), 997, 4_096, 12_345, 1_000_003, 2**40 + 7]:
        for factor in (1.0, 2.0, 3.0, 6.0):
            global_count = torch.tensor(float(n), dtype=torch.float64)
            counted = WindowCount([n], global_count, global_count, n, None, 1, factor)
            host = counted.host_scale()
            assert host is not None
            device_scale = CastScale(counted.scale()).to(dtype)
            host_scale = CastScale(host, torch.device("cpu")).to(dtype)
            assert host_scale.dtype == dtype and host_scale.shape == ()
            assert torch.equal(host_scale, device_scale), (n, factor)
    assert WindowCount([], global_count, global_count, None, None, 1, 1.0).host_scale() is None
