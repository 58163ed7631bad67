"""The plain step (:mod:`gradaccum.step.plain`): taken exactly when nothing but the loss's own
features is on, and the same steps, bit for bit, as the engine's full path."""

from __future__ import annotations

import math

import pytest
import torch

from gradaccum import Accumulator, CountError, LossError, split
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


class _Tagged(torch.Tensor):
    """A tensor subclass, as a library's loss may return: the step multiplies it instead."""


class _Recording(torch.optim.SGD):
    """Records the gradients it is handed; moves nothing."""

    def __init__(self, params: object, recorded: list[list[torch.Tensor]]) -> None:
        super().__init__(params, lr=0.0)  # type: ignore[arg-type]
        self.recorded = recorded

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        params = [p for group in self.param_groups for p in group["params"]]
        self.recorded.append([p.grad.clone() for p in params])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tagged", [False, True], ids=["tensor", "subclass"])
def test_the_scale_seeds_the_backward_with_the_products_bits(dtype: torch.dtype, tagged: bool) -> None:
    """The plain step hands W/N to autograd as the loss's gradient instead of backpropagating
    ``loss * (W/N)``. The product's backward hands the loss's graph ``1.0 * (W/N)``, which is W/N
    exactly in every float dtype, so every gradient must be the product's to the bit; a tensor
    subclass takes the product path. Windows of 2, 3 and 5 micro-batches with N = 7, 3 and 11:
    scales that do not round to a power of two."""
    for k, rows in ((2, 7), (3, 3), (5, 11)):
        window = split(models.mlp_batch(rows * k, seed=k, dtype=dtype), micro_batch=rows)

        def loss_fn(model: torch.nn.Module, mb: dict) -> torch.Tensor:
            loss = ((model(mb["x"]) - mb["y"]) ** 2).sum()
            return loss.as_subclass(_Tagged) if tagged else loss

        stepped, by_hand = models.mlp(dtype=dtype), models.mlp(dtype=dtype)
        recorded: list[list[torch.Tensor]] = []

        Accumulator(stepped, _Recording(stepped.parameters(), recorded)).step(window, loss_fn, _rows)
        n = torch.tensor(float(rows * k), dtype=torch.float64)
        scale = torch.reciprocal(n).to(dtype)
        for mb in window:
            (loss_fn(by_hand, mb) * scale).backward()
        for got, param in zip(recorded[0], by_hand.parameters(), strict=True):
            assert param.grad is not None and torch.equal(got, param.grad), (k, dtype)


def test_a_negative_cpu_count_is_refused_before_any_forward() -> None:
    model = models.mlp()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    forwards: list[int] = []

    def loss_fn(model: torch.nn.Module, mb: dict) -> torch.Tensor:
        forwards.append(1)
        return models.mlp_loss(model, mb)

    window = split(models.mlp_batch(4, seed=1), micro_batch=2)
    with pytest.raises(CountError, match="negative count"):
        acc.step(window, loss_fn, lambda mb: torch.tensor(-1) if mb is window[1] else models.count_rows(mb))
    assert forwards == [] and all(p.grad is None for p in model.parameters())


def test_cpu_counts_are_read_on_the_host_and_the_verdict_once() -> None:
    """CPU tensor counts are read on the host (they wait for no device: counted apart, as
    ``cpu_reads``); the device's figures still travel in one read per step."""
    from gradaccum.distributed.comm import count_sync_points

    model = models.mlp()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    window = split(models.mlp_batch(6, seed=1), micro_batch=2)
    for count, cpu_reads in ((models.count_rows, 1), (_rows, 0)):
        acc.step(window, models.mlp_loss, count)
        with count_sync_points() as points:
            acc.step(window, models.mlp_loss, count)
        assert (points.collectives, points.host_reads, points.cpu_reads) == (0, 1, cpu_reads), points.by_name
