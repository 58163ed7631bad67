"""``batchnorm_stats="window"``: BatchNorm's running statistics once per window, from the pooled
moments of what each BatchNorm saw (see :mod:`gradaccum.step.batchnorm`).

For a BatchNorm whose input no other BatchNorm normalized, that is what one forward over the
window's rows would leave, and the reference is PyTorch itself: a copy of the model runs one
training forward over the concatenation of the window's micro-batches (a BatchNorm after another
one is checked against its own recorded inputs, at the end). Tolerance 1e-12 on float64 buffers: both sides
compute a per-channel mean and variance of at most a few hundred values (relative rounding
~1e-16 each, times the rows, ~1e-14), then the same two multiply-adds; the figures observed are
~1e-16. Without the feature the running statistics move k times and differ at ~1e-2.
"""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from gradaccum import AccumConfig, Accumulator, CachedAccumulator, ConfigError
from gradaccum.errors import CacheError
from gradaccum.hazards.scanner import scan
from gradaccum.step.batchnorm import window_batchnorm

EXACT = 1e-12

Batch = tuple[torch.Tensor, torch.Tensor]


class Net(nn.Module):
    """A layer, a BatchNorm of the given flavour, a head; ``ckpt``: the first two under
    torch.utils.checkpoint (reentrant or not), whose recompute runs the BatchNorm again."""

    def __init__(
        self, dims: int, *, affine: bool = True, momentum: float | None = 0.1, ckpt: str = ""
    ) -> None:
        super().__init__()
        norm = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims]
        self.dims = dims
        self.lin = nn.Linear(3, 4)
        self.bn = norm(4, affine=affine, momentum=momentum)
        self.head = nn.Linear(4, 1)
        self.ckpt = ckpt

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x.movedim(1, -1)).movedim(-1, 1)  # channels at dim 1, as BatchNorm reads them
        return torch.tanh(self.bn(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reentrant = self.ckpt == "reentrant"
        h = checkpoint(self.body, x, use_reentrant=reentrant) if self.ckpt else self.body(x)
        return self.head(h.movedim(1, -1)).flatten(1).sum(1)


def _rows(n: int, dims: int, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    shape = (n, 3) + (2,) * dims  # (N, C, L), (N, C, H, W), (N, C, D, H, W): 2 per spatial dim
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 1.5 + 0.7
    return x, torch.randn(n, generator=gen, dtype=torch.float64)


def _loss(model: nn.Module, mb: Batch) -> torch.Tensor:
    return ((model(mb[0]) - mb[1]) ** 2).sum()


def _count(mb: Batch) -> int:
    return int(mb[0].shape[0])


def _split(batch: Batch, sizes: list[int]) -> list[Batch]:
    xs, ys = batch[0].split(sizes), batch[1].split(sizes)
    return list(zip(xs, ys, strict=True))


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_buffers()}


def _reference(model: nn.Module, windows: list[Batch]) -> dict[str, torch.Tensor]:
    """PyTorch's buffers after one training forward over each window's rows (weights fixed)."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for x, _ in windows:
            ref(x)
    return _buffers(ref)


def _step(model: nn.Module, windows: list[list[Batch]], **settings: Any) -> list[bool]:
    # lr=0: the weights stay, so the reference's forward sees the same BatchNorm inputs
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), **settings)
    return [acc.step(w, _loss, _count).applied for w in windows]


def _assert_window(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = _buffers(model)
    for name in ("bn.running_mean", "bn.running_var"):
        assert (got[name] - expected[name]).abs().max().item() <= EXACT, name
    assert int(got["bn.num_batches_tracked"]) == int(expected["bn.num_batches_tracked"])


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("sizes", [[4, 4, 4], [2, 7, 3]], ids=["equal", "unequal"])
def test_one_window_equals_one_forward_over_its_rows(dims: int, affine: bool, sizes: list[int]) -> None:
    model = Net(dims, affine=affine).double()
    batches = [_rows(sum(sizes), dims, seed) for seed in (1, 2)]
    expected = [_reference(model, batches[:1]), _reference(model, batches)]
    assert _step(model, [_split(batches[0], sizes)], batchnorm_stats="window") == [True]
    _assert_window(model, expected[0])
    assert int(model.bn.num_batches_tracked) == 1  # advanced once, not once per micro-batch
    # the second window starts from the first's statistics
    assert _step(model, [_split(batches[1], sizes[::-1])], batchnorm_stats="window") == [True]
    _assert_window(model, expected[1])


@pytest.mark.cuda
def test_on_cuda_one_window_equals_one_forward_over_its_rows() -> None:
    model = Net(2, momentum=None).double().cuda()
    x, y = _rows(10, 2, 13)
    batch = (x.cuda(), y.cuda())
    expected = _reference(model, [batch])
    assert _step(model, [_split(batch, [3, 7])], batchnorm_stats="window") == [True]
    _assert_window(model, expected)


def test_momentum_none_is_the_cumulative_average_over_windows() -> None:
    model = Net(2, momentum=None).double()
    batches = [_rows(9, 2, seed) for seed in (3, 4, 5)]
    expected = _reference(model, batches)
    applied = _step(model, [_split(b, [2, 3, 4]) for b in batches], batchnorm_stats="window")
    assert applied == [True] * 3
    _assert_window(model, expected)
    assert int(model.bn.num_batches_tracked) == 3


@pytest.mark.parametrize("ckpt", ["non-reentrant", "reentrant"])
def test_recompute_under_checkpointing_is_not_counted(ckpt: str) -> None:
    model = Net(2, ckpt=ckpt).double()
    batch = _rows(10, 2, 6)
    expected = _reference(model, [batch])
    assert _step(model, [_split(batch, [3, 3, 4])], batchnorm_stats="window") == [True]
    _assert_window(model, expected)


def test_default_micro_batch_is_pytorchs_update_per_forward() -> None:
    model = Net(2).double()
    batch = _rows(9, 2, 7)
    mbs = _split(batch, [3, 2, 4])
    expected = copy.deepcopy(model)
    with torch.no_grad():
        for x, _ in mbs:  # k forwards, k updates: PyTorch's behaviour
            expected(x)
    assert AccumConfig().batchnorm_stats == "micro-batch"
    assert _step(model, [mbs]) == [True]
    for name, value in _buffers(expected).items():
        assert torch.equal(_buffers(model)[name], value), name
    assert int(model.bn.num_batches_tracked) == 3
    # and the window's statistics are measurably different from these
    window = Net(2).double()
    _step(window, [mbs], batchnorm_stats="window")
    assert (window.bn.running_var - model.bn.running_var).abs().max().item() > 1e-3


def test_post_scaling_takes_the_same_update() -> None:
    model = Net(1).double()
    batch = _rows(11, 1, 8)
    expected = _reference(model, [batch])
    assert _step(model, [iter(_split(batch, [5, 6]))], batchnorm_stats="window", scaling="post") == [True]
    _assert_window(model, expected)


def _nan_loss(model: nn.Module, mb: Batch) -> torch.Tensor:
    return _loss(model, mb) * math.nan


@pytest.mark.parametrize(
    "case", ["non-finite", "zero-count", "failed"], ids=["skipped-nonfinite", "skipped-zero", "abandoned"]
)
def test_skipped_and_abandoned_windows_leave_the_statistics_as_they_were(case: str) -> None:
    model = Net(2).double()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), batchnorm_stats="window")
    first, second = _rows(8, 2, 9), _rows(8, 2, 10)
    acc.step(_split(first, [4, 4]), _loss, _count)
    before = _buffers(model)
    window = _split(second, [3, 5])
    if case == "non-finite":
        assert acc.step(window, _nan_loss, _count).skipped
    elif case == "zero-count":
        assert acc.step(window, _loss, lambda mb: 0).skipped
    else:
        calls = []

        def failing(model: nn.Module, mb: Batch) -> torch.Tensor:
            calls.append(1)
            if len(calls) == 2:  # after the second forward ran through BatchNorm
                model(mb[0])
                raise RuntimeError("boom")
            return _loss(model, mb)

        with pytest.raises(Exception, match="boom"):
            acc.step(window, failing, _count)
    for name, value in before.items():
        assert torch.equal(_buffers(model)[name], value), name
    # the next window goes on from there, as one forward over its rows
    expected = _reference(model, [second])
    assert acc.step(window, _loss, _count).applied
    _assert_window(model, expected)


def test_eval_mode_and_untracked_batchnorm_are_left_alone() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4, track_running_stats=False))
    model = model.double()
    model[1].eval()  # normalizes with its running estimates: nothing to pool
    before = _buffers(model)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), batchnorm_stats="window")
    x = torch.randn(8, 3, dtype=torch.float64)
    result = acc.step([x[:4], x[4:]], lambda m, mb: m(mb).sum(), lambda mb: mb.shape[0])
    assert result.applied
    for name, value in before.items():
        assert torch.equal(_buffers(model)[name], value), name


def test_a_compiled_model_pools_the_same_moments() -> None:
    model = Net(2).double()
    batch = _rows(10, 2, 12)
    expected = _reference(model, [batch])
    compiled = torch.compile(model, backend="eager")
    acc = Accumulator(compiled, torch.optim.SGD(model.parameters(), lr=0.0), batchnorm_stats="window")
    assert acc.step(_split(batch, [4, 6]), _loss, _count).applied
    _assert_window(model, expected)


def test_the_setting_is_validated_and_refused_where_rows_would_count_twice() -> None:
    with pytest.raises(ConfigError, match=r"batchnorm_stats must be one of \['micro-batch', 'window'\]"):
        AccumConfig(batchnorm_stats="global")  # type: ignore[arg-type]
    model = Net(1).double()
    with pytest.raises(CacheError, match="batchnorm_stats='window' is not supported by CachedAccumulator"):
        CachedAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), batchnorm_stats="window")
    config = AccumConfig(batchnorm_stats="window")
    for where, pipeline, layout in (("PipelineAccumulator", True, None), ("a DeviceMesh", False, "mesh")):
        engine = SimpleNamespace(model=model, config=config, layout=layout, _pipeline=pipeline)
        with pytest.raises(ConfigError, match=f"batchnorm_stats='window'.* is not supported with {where}"):
            window_batchnorm(engine)
    plain = SimpleNamespace(model=model, config=AccumConfig(), layout="mesh", _pipeline=True)
    assert window_batchnorm(plain) is None


def test_the_setting_survives_the_run_cards_json() -> None:
    # train's replay from a run card: tests/cli/test_train_batchnorm.py
    config = AccumConfig(batchnorm_stats="window")
    assert config.to_dict()["batchnorm_stats"] == "window"
    assert AccumConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_scan_points_to_the_window_statistics() -> None:
    (finding,) = [f for f in scan(nn.Sequential(nn.BatchNorm1d(4)), 4) if f.code == "batch-norm"]
    assert "batchnorm_stats='window') updates them once per optimizer step" in finding.fix
    assert "does not change the normalization inside each forward" in finding.fix
    assert "without it, set momentum=0.0260 per forward" in finding.fix
    # nothing to point to when the layer keeps no running statistics
    untracked_bn = nn.Sequential(nn.BatchNorm1d(4, track_running_stats=False))
    (untracked,) = [f for f in scan(untracked_bn, 4) if f.code == "batch-norm"]
    assert "batchnorm_stats" not in untracked.fix


class _Stacked(nn.Module):
    """BatchNorm, a layer, a second BatchNorm: the second normalizes what the first normalized per
    micro-batch, so what it sees over a window differs from what a whole-window forward shows it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.bn1 = nn.BatchNorm1d(3, dtype=torch.float64)
        self.lin = nn.Linear(3, 4, dtype=torch.float64)
        self.bn2 = nn.BatchNorm1d(4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.lin(self.bn1(x))).sum(1)


def test_a_batchnorm_after_another_takes_the_pooled_moments_of_what_it_saw() -> None:
    """What the setting is, for every BatchNorm: the pooled moments of the inputs of its training
    forwards over the window (independently: its inputs recorded and pooled by ``torch.var``), not
    one forward over the window's rows, which the second BatchNorm would see differently (~1e-3
    apart here). Tolerance 1e-12: the same few dozen values summed in two orders."""
    torch.manual_seed(0)
    x = torch.randn(12, 3, dtype=torch.float64) * 2 + 1
    window = [(x[:4], x[:4, 0]), (x[4:7], x[4:7, 0]), (x[7:], x[7:, 0])]
    model = _Stacked()
    whole = copy.deepcopy(model)
    seen: list[torch.Tensor] = []
    handle = model.bn2.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), batchnorm_stats="window")
    acc.step(window, _loss, _count)
    handle.remove()
    acc.close()
    rows = torch.cat(seen)
    momentum = model.bn2.momentum
    assert momentum is not None
    running_mean = model.bn2.running_mean
    running_var = model.bn2.running_var
    assert running_mean is not None and running_var is not None
    pooled_mean = momentum * rows.mean(0)
    pooled_var = (1 - momentum) + momentum * rows.var(0, unbiased=True)
    assert (running_mean - pooled_mean).abs().max().item() < EXACT
    assert (running_var - pooled_var).abs().max().item() < EXACT
    whole(x)  # one forward over the window's rows: the first BatchNorm agrees, the second does not
    assert torch.allclose(model.bn1.running_var, whole.bn1.running_var, rtol=0, atol=EXACT)
    assert whole.bn2.running_var is not None
    assert (running_var - whole.bn2.running_var).abs().max().item() > 1e-4


def test_the_settings_words_say_pooled_moments_not_one_forward() -> None:
    """The field's documentation says what the statistic is for every BatchNorm."""
    from gradaccum.fielddocs import field_docs

    words = " ".join(field_docs(AccumConfig)["batchnorm_stats"].split())
    assert "pooled moments of what each BatchNorm saw" in words
