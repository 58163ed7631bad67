"""The model left as found: ``close()``, ``with``, and an accumulator dropped without either.

What the step puts on the model (``grad_dtype`` and the float32 sums of ``accum_dtype``, the noise
meter's parameter hooks, BatchNorm's forward pre-hooks) must not change what the user's own
forward and backward do once the accumulator is closed or gone: ``.grad`` in the parameter's
dtype, no hook left on any module or parameter (:mod:`gradaccum.step.lifetime`).
"""

from __future__ import annotations

import contextlib
import copy
import gc
from typing import Any

import pytest
import torch
import torch.nn as nn

from gradaccum import Accumulator, CachedAccumulator, split
from gradaccum.errors import WindowError
from tests.helpers import models


def _hooked(model: nn.Module) -> list[str]:
    """Every module and parameter of ``model`` that holds a hook."""
    found = [
        f"module {name}"
        for name, m in model.named_modules()
        if m._forward_pre_hooks or m._forward_hooks or m._backward_hooks or m._backward_pre_hooks
    ]
    found += [
        f"parameter {name}"
        for name, p in model.named_parameters()
        if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)
    ]
    return found


def _bf16() -> tuple[nn.Module, list[Any]]:
    model = models.mlp(dtype=torch.bfloat16)
    return model, split(models.mlp_batch(16, dtype=torch.bfloat16), sizes=[2] * 8)


def _plain_backward(model: nn.Module, window: list[Any]) -> set[torch.dtype]:
    """The user's own backward, outside any step: the dtypes of the gradients it leaves."""
    model.zero_grad(set_to_none=True)
    models.mlp_loss(model, window[0]).backward()
    return {p.grad.dtype for p in model.parameters()}


def _wide(model: nn.Module, **settings: Any) -> Accumulator:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return Accumulator(model, optimizer, accum_dtype="float32", noise_scale=True, **settings)


def test_between_windows_the_model_holds_nothing_of_the_step() -> None:
    model, window = _bf16()
    acc = _wide(model)
    for _ in range(2):
        assert acc.step(window, models.mlp_loss, models.count_rows).applied
        assert _hooked(model) == []
        assert {p.grad_dtype for p in model.parameters()} == {torch.bfloat16}
        assert {p.grad.dtype for p in model.parameters()} == {torch.bfloat16}
    assert _plain_backward(model, window) == {torch.bfloat16}
    assert acc.step(window, models.mlp_loss, models.count_rows).applied  # and the next window still runs


@pytest.mark.parametrize("how", ["close", "with", "drop"])
def test_closed_or_dropped_the_model_is_as_found(how: str) -> None:
    model, window = _bf16()
    if how == "with":
        with _wide(model) as acc:
            acc.step(window, models.mlp_loss, models.count_rows)
    else:
        acc = _wide(model)
        acc.step(window, models.mlp_loss, models.count_rows)
        if how == "close":
            acc.close()
        else:
            del acc
            gc.collect()
    assert _hooked(model) == []
    assert {p.grad_dtype for p in model.parameters()} == {torch.bfloat16}
    assert _plain_backward(model, window) == {torch.bfloat16}


def test_a_step_after_close_is_refused_naming_close_and_close_is_idempotent() -> None:
    model, window = _bf16()
    before = copy.deepcopy(model.state_dict())
    acc = _wide(model)
    acc.close()
    acc.close()
    for scaling in ("pre", "post"):
        closed = _wide(model, scaling=scaling)
        closed.close()
        with pytest.raises(WindowError, match=r"was closed \(close\(\), or the end of its with-block\)"):
            closed.step(window, models.mlp_loss, models.count_rows)
    cached = CachedAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with cached:
        pass
    with pytest.raises(WindowError, match=r"close\(\)"):
        cached.step(window, lambda m, mb: m(mb["x"]), lambda reps: reps.sum())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing stepped


class _Interrupt(BaseException):
    """An exit the step does not catch (a KeyboardInterrupt's kind)."""


def _interrupting(after: int, loss: Any = models.mlp_loss) -> Any:
    calls = []

    def loss_fn(model: nn.Module, mb: dict[str, Any]) -> torch.Tensor:
        calls.append(1)
        if len(calls) > after:
            raise _Interrupt
        return loss(model, mb)

    return loss_fn


def test_close_ends_a_window_left_open_with_its_grad_in_the_parameters_dtype() -> None:
    model, window = _bf16()
    acc = _wide(model)
    with pytest.raises(_Interrupt):
        acc.step(window, _interrupting(3), models.count_rows)
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}  # the open window's sums
    acc.close()
    assert {p.grad.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.grad_dtype for p in model.parameters()} == {torch.bfloat16}
    assert _hooked(model) == []


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.lin(x)))


def _bn_loss(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((model(mb["x"]) - mb["y"]) ** 2).sum()


def _bn_count(mb: dict[str, torch.Tensor]) -> int:
    return mb["x"].shape[0]


def _bn_window() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    batch = {"x": torch.randn(12, 3, generator=gen, dtype=torch.float64)}
    batch["y"] = torch.randn(12, 1, generator=gen, dtype=torch.float64)
    return split(batch, sizes=[4, 5, 3])


def _buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b.clone() for b in model.bn.buffers()]


@pytest.mark.parametrize("how", ["close", "with", "drop"])
def test_batchnorm_window_statistics_are_exact_and_their_hooks_go_with_the_accumulator(how: str) -> None:
    model = _Net().double()
    window = _bn_window()
    # the statistics one training forward over the window's rows leaves (with no step taken)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin(torch.cat([mb["x"] for mb in window]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = Accumulator(model, optimizer, batchnorm_stats="window", noise_scale=True)
    with acc if how == "with" else contextlib.nullcontext():
        assert acc.step(window, _bn_loss, _bn_count).applied
        # float64, a handful of rows: Chan's merge differs from one var_mean by rounding only
        for got, want in zip(model.bn.buffers(), twin.bn.buffers(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert acc.noise_scale.samples == 1
        assert _hooked(model) == ["module bn"]  # BatchNorm's hook lives until close (lifetime.py)
    if how == "close":
        acc.close()
    elif how == "drop":
        del acc
        gc.collect()
    assert _hooked(model) == []
    before = _buffers(model)
    with torch.no_grad():
        model(window[0]["x"])  # the user's own training forward: PyTorch's update, nothing else
    assert not torch.equal(before[2], model.bn.num_batches_tracked)


def test_close_gives_batchnorm_back_its_statistics_from_before_an_interrupted_window() -> None:
    model = _Net().double()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), batchnorm_stats="window")
    acc.step(_bn_window(), _bn_loss, _bn_count)
    before = _buffers(model)
    with pytest.raises(_Interrupt):
        acc.step(_bn_window(), _interrupting(2, _bn_loss), _bn_count)
    assert not torch.equal(before[2], model.bn.num_batches_tracked)  # two forwards updated them
    acc.close()
    assert all(torch.equal(a, b) for a, b in zip(before, model.bn.buffers(), strict=True))
