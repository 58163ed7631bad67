"""Bad input to Accumulator.step: clear errors, and no update written."""

from __future__ import annotations

import math

import pytest
import torch

from gradaccum import Accumulator, CountError, LossError, SyncError, TooManySkipsError, WindowError, split
from tests.helpers import models
from tests.helpers.reference import params_of


def _acc(**kwargs: object) -> tuple[Accumulator, torch.nn.Module]:
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Accumulator(model, opt, **kwargs), model  # type: ignore[arg-type]


def _window(n: int = 4) -> list:
    return split(models.mlp_batch(n, seed=4), micro_batch=2)


def test_empty_window_is_refused() -> None:
    acc, _ = _acc()
    with pytest.raises(WindowError, match="window is empty"):
        acc.step([], models.mlp_loss, models.count_rows)


@pytest.mark.parametrize(
    ("count", "match"),
    [
        (-1, "cannot be negative"),
        (2.0, "got float"),
        (float("nan"), "got float"),
        (torch.tensor(2.5), "integer tensor"),
        (torch.tensor([1, 2]), "single number"),
        (True, "got bool"),
        ("3", "got str"),
    ],
)
def test_bad_counts_are_refused_before_any_update(count: object, match: str) -> None:
    acc, model = _acc()
    before = params_of(model)
    with pytest.raises(CountError, match=match):
        acc.step(_window(), models.mlp_loss, lambda mb: count)
    assert all(torch.equal(before[k], v) for k, v in params_of(model).items())


def test_negative_tensor_count_is_refused_without_update() -> None:
    acc, model = _acc()
    before = params_of(model)
    with pytest.raises(CountError, match="negative"):
        acc.step(_window(), models.mlp_loss, lambda mb: torch.tensor(-3))
    assert all(torch.equal(before[k], v) for k, v in params_of(model).items())
    assert all(p.grad is None for p in model.parameters())


def test_non_scalar_loss_is_refused() -> None:
    acc, _ = _acc()
    with pytest.raises(LossError, match=r"shape \(2,\).*scalar"):
        acc.step(_window(), lambda m, mb: ((m(mb["x"]) - mb["y"]) ** 2).sum(dim=1), models.count_rows)


def test_loss_without_grad_and_non_tensor_are_refused() -> None:
    acc, _ = _acc()
    with pytest.raises(LossError, match="does not require grad"):
        acc.step(_window(), lambda m, mb: models.mlp_loss(m, mb).detach(), models.count_rows)
    with pytest.raises(LossError, match="returned float"):
        acc.step(_window(), lambda m, mb: 1.0, models.count_rows)


def test_zero_count_window_skips_without_nan() -> None:
    acc, model = _acc()
    before = params_of(model)
    result = acc.step(_window(), models.mlp_loss, lambda mb: 0)
    assert result.skipped and "zero valid units" in (result.skip_reason or "")
    assert result.loss is None
    assert all(torch.equal(before[k], v) for k, v in params_of(model).items())
    assert all(p.grad is None for p in model.parameters())


def test_non_finite_loss_skips_and_clears_gradients() -> None:
    model = models.mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    acc = Accumulator(model, opt, sched)
    before = params_of(model)
    result = acc.step(_window(), lambda m, mb: models.mlp_loss(m, mb) * float("nan"), models.count_rows)
    assert result.skipped and "non-finite" in (result.skip_reason or "")
    assert all(torch.equal(before[k], v) for k, v in params_of(model).items())
    assert all(p.grad is None for p in model.parameters())
    assert sched.last_epoch == 0 and not opt.state and acc.steps_applied == 0


def test_too_many_consecutive_skips_stop_with_a_message() -> None:
    acc, _ = _acc(max_consecutive_skips=2)
    inf_loss = lambda m, mb: models.mlp_loss(m, mb) * float("inf")
    acc.step(_window(), inf_loss, models.count_rows)
    acc.step(_window(), inf_loss, models.count_rows)
    with pytest.raises(TooManySkipsError, match="3 consecutive updates were skipped"):
        acc.step(_window(), inf_loss, models.count_rows)


def test_mean_reduction_refuses_zero_count_micro_batch() -> None:
    acc, _ = _acc(loss_reduction="mean")
    with pytest.raises(CountError, match="loss_reduction='mean'"):
        acc.step(_window(), lambda m, mb: models.mlp_loss(m, mb), lambda mb: 0)


def test_step_inside_callers_no_sync_is_refused() -> None:
    # DDP needs a process group; a single-rank gloo group is enough to build one.
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.helpers.launcher import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    model = DDP(models.mlp())
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with model.no_sync(), pytest.raises(SyncError, match="inside DistributedDataParallel.no_sync"):
        acc.step(_window(), models.mlp_loss, models.count_rows)


def test_plain_model_in_a_multi_rank_group_is_refused() -> None:
    from tests.helpers.launcher import run_ranks

    outcomes = run_ranks(_build_plain_accumulator)
    assert all(not o.ok and o.error_type == "SyncError" for o in outcomes)
    assert "plain Sequential" in outcomes[0].error


def _build_plain_accumulator(rank: int, world: int) -> None:
    model = models.mlp()
    Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize(
    "settings",
    [{}, {"max_grad_norm": 1.0}, {"track_grad_norm": True}],
    ids=["fused check", "clipping norm", "tracked norm"],
)
def test_a_non_finite_gradient_under_a_finite_loss_skips(settings: dict[str, object], bad: float) -> None:
    """A gradient hook poisons one element of one parameter's gradient; the loss stays finite. Every
    way the step takes finiteness (a fused check by default, the norm when clipping or reporting)
    must catch it."""
    acc, model = _acc(**settings)
    before = [p.detach().clone() for p in model.parameters()]

    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[3] = bad
        return grad

    model[2].weight.register_hook(poison)
    result = acc.step(_window(), models.mlp_loss, models.count_rows)
    assert result.skipped and "non-finite loss or gradient" in (result.skip_reason or "")
    assert result.loss is not None and math.isfinite(result.loss)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
