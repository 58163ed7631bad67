"""Items 1-5: what the counts all-reduce and the first-step fingerprint decide on every rank alike.

Each scenario runs on two real gloo ranks (one pair of processes for the module, see common.py).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from gradaccum import Accumulator, split
from gradaccum.batch import take
from gradaccum.step.accumulator import ZERO_COUNT
from tests.faults.common import (
    AGREED_WITHIN_S,
    F64_RTOL,
    Outcome,
    ddp_mlp,
    grads,
    params,
    rel_err,
    scenario_outcomes,
)
from tests.helpers import models
from tests.helpers.reference import full_batch_grads

pytestmark = pytest.mark.distributed

BOUNDS = [0, 6, 10]


def _global() -> dict[str, torch.Tensor]:
    return models.mlp_batch(10, seed=7)


def _local(rank: int) -> dict[str, torch.Tensor]:
    return take(_global(), BOUNDS[rank], BOUNDS[rank + 1])


def _padded(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same examples with every unit masked out: a count of zero."""
    return {**batch, "w": torch.zeros_like(batch["w"])}


def _step(rank: int, window: list[Any], **kwargs: Any) -> dict[str, Any]:
    ddp = ddp_mlp()
    acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), **kwargs)
    before = params(ddp)
    forwards = {"n": 0}

    def loss_fn(model: torch.nn.Module, mb: Any) -> torch.Tensor:
        forwards["n"] += 1
        return models.mlp_loss(model, mb)

    result = acc.step(window, loss_fn, models.count_rows)
    return {
        "result": result,
        "forwards": forwards["n"],
        "grads": grads(ddp),
        "unchanged": all(torch.equal(before[n], p) for n, p in params(ddp).items()),
        "params": params(ddp),
        "finite": all(bool(torch.isfinite(p).all()) for p in params(ddp).values()),
        "counters": (acc.steps_applied, acc.steps_skipped),
    }


def _mismatch(rank: int, **per_rank: Any) -> None:
    """Build an Accumulator whose settings differ on rank 1 and take one step."""
    kwargs = {key: value[rank] for key, value in per_rank.items()}
    ddp = ddp_mlp()
    acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), **kwargs)
    acc.step(split(_local(rank), micro_batch=2), models.mlp_loss, models.count_rows)


def _balance_mismatch(rank: int, coefs: tuple[float, float]) -> None:
    """A load balance whose coefficient differs on rank 1: the same vector size in the counts
    all-reduce, so only the fingerprint tells the ranks apart."""
    from gradaccum.moe import LoadBalance

    ddp = ddp_mlp()
    router = ddp.module[2]  # any module whose output is logits over the "experts"
    balance = LoadBalance(routers=[router], num_experts=3, top_k=1, coef=coefs[rank])
    acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), balance=balance)
    acc.step(split(_local(rank), micro_batch=2), models.mlp_loss, models.count_rows)


def _fsdp2_mismatch(rank: int, world: int, widths: dict[int, tuple[int, ...]]) -> None:
    """FSDP2 does not compare models across ranks when it wraps them; the fingerprint must."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # pragma: no cover - torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    sizes = widths[rank]
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1]).to(torch.float64)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.step(
        split(_local(rank), micro_batch=2),
        lambda m, mb: ((m(mb["x"]) - mb["y"]) ** 2).sum(),
        models.count_rows,
    )


SCENARIOS = {
    "one rank all padding": lambda r, w: _step(
        r, split(_local(r) if r == 0 else _padded(_local(r)), micro_batch=2)
    ),
    "every rank all padding": lambda r, w: _step(r, split(_padded(_local(r)), micro_batch=2)),
    "empty window on one rank": lambda r, w: _step(r, split(_local(r), micro_batch=2) if r == 0 else []),
    "3 vs 2 micro-batches": lambda r, w: _step(r, split(_local(r), sizes={0: [2, 3, 1], 1: [1, 3]}[r])),
    "3 vs 2 without deferral": lambda r, w: _step(
        r, split(_local(r), sizes={0: [2, 3, 1], 1: [1, 3]}[r]), defer_sync=False
    ),
    "loss_reduction differs": lambda r, w: _mismatch(r, loss_reduction=("sum", "mean")),
    "defer_sync differs": lambda r, w: _mismatch(r, defer_sync=(True, False)),
    "max_grad_norm differs": lambda r, w: _mismatch(r, max_grad_norm=(None, 1.0)),
    "scaler on one rank": lambda r, w: _mismatch(r, scaler=(None, torch.amp.GradScaler("cpu"))),
    "load balance differs": lambda r, w: _balance_mismatch(r, (0.01, 0.02)),
    "parameter count differs": lambda r, w: _fsdp2_mismatch(r, w, {0: (5, 16, 3), 1: (5, 16, 16, 3)}),
    "parameter shapes differ": lambda r, w: _fsdp2_mismatch(r, w, {0: (5, 16, 3), 1: (5, 8, 3)}),
    "after all that, a clean step": lambda r, w: _step(
        r, split(_local(r), sizes={0: [2, 3, 1], 1: [1, 3]}[r])
    ),
}


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, Outcome]]:
    return scenario_outcomes(__name__)


def _both(outcomes: list[dict[str, Outcome]], name: str) -> tuple[Outcome, Outcome]:
    r0, r1 = outcomes[0][name], outcomes[1][name]
    assert r0.seconds < AGREED_WITHIN_S and r1.seconds < AGREED_WITHIN_S, (r0.seconds, r1.seconds)
    return r0, r1


def test_item1_all_padding_rank_contributes_zero(outcomes: list[dict[str, Outcome]]) -> None:
    r0, r1 = _both(outcomes, "one rank all padding")
    assert r0.ok and r1.ok, (r0.message, r1.message)
    want = full_batch_grads(models.mlp(), _local(0), models.mlp_loss, models.count_rows)
    for got in (r0.value, r1.value):
        assert got["result"].applied and got["result"].global_count == r0.value["result"].local_count
        assert rel_err(got["grads"], want) < F64_RTOL
    assert r1.value["result"].local_count == 0


def test_item2_zero_units_everywhere_skips_on_every_rank_without_forward_or_nan(
    outcomes: list[dict[str, Outcome]],
) -> None:
    for got in (o.value for o in _both(outcomes, "every rank all padding")):
        result = got["result"]
        assert result.skipped and result.skip_reason == ZERO_COUNT
        assert result.loss is None and result.global_count == 0
        assert got["forwards"] == 0, "the window must be skipped before any forward"
        assert got["unchanged"] and got["finite"]
        assert all(g is None for g in got["grads"].values())
        assert got["counters"] == (0, 1)


def test_item3_empty_window_on_one_rank_is_an_error_on_every_rank(outcomes: list[dict[str, Outcome]]) -> None:
    # Chosen over a silent zero-contribution participation: an empty window is almost always a data
    # bug (a sharder that ran out, a dropped remainder), and the error names the fix.
    for o in _both(outcomes, "empty window on one rank"):
        assert o.error_type == "WindowError", o.message
        assert "1 of 2 data-parallel ranks have an empty window" in o.message
        assert "all-padding one contributes zero" in o.message


def test_item4_three_vs_two_micro_batches_equal_the_reference(outcomes: list[dict[str, Outcome]]) -> None:
    r0, r1 = _both(outcomes, "3 vs 2 micro-batches")
    assert r0.ok and r1.ok, (r0.message, r1.message)
    want = full_batch_grads(models.mlp(), _global(), models.mlp_loss, models.count_rows)
    for got in (r0.value, r1.value):
        assert got["result"].applied and rel_err(got["grads"], want) < F64_RTOL
    # both ranks apply the same all-reduced gradient with the same optimizer: identical parameters
    assert all(torch.equal(p, r1.value["params"][n]) for n, p in r0.value["params"].items())
    assert (r0.value["result"].micro_batches, r1.value["result"].micro_batches) == (3, 2)


def test_item4_unequal_micro_batches_without_deferral_is_an_error_on_every_rank(
    outcomes: list[dict[str, Outcome]],
) -> None:
    for o in _both(outcomes, "3 vs 2 without deferral"):
        assert o.error_type == "WindowError" and "different numbers of micro-batches" in o.message


MISMATCHES = [
    ("loss_reduction differs", "loss_reduction: rank 0='sum', rank 1='mean'"),
    ("defer_sync differs", "defer_sync: rank 0=True, rank 1=False"),
    ("max_grad_norm differs", "max_grad_norm: rank 0=None, rank 1=1.0"),
    ("scaler on one rank", "scaler: rank 0=None, rank 1='GradScaler'"),
    ("load balance differs", "balance: rank 0='exact E=3 k=1 L=1 coef=0.01"),
    ("parameter count differs", "parameters: rank 0=4, rank 1=6"),
    (
        "parameter shapes differ",
        "first differing parameter is #0: rank 0=0.weight (16, 5) float64, rank 1=0.weight (8, 5)",
    ),
]


@pytest.mark.parametrize(("name", "shown"), MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_item5_mismatched_ranks_fail_before_any_gradient_moves(
    outcomes: list[dict[str, Outcome]], name: str, shown: str
) -> None:
    for o in _both(outcomes, name):
        assert o.error_type == "ConfigMismatchError", o.message
        assert "no gradient was exchanged" in o.message
        assert shown in o.message, o.message


def test_the_process_group_is_still_usable_after_every_refusal(outcomes: list[dict[str, Outcome]]) -> None:
    r0, r1 = _both(outcomes, "after all that, a clean step")
    assert r0.ok and r1.ok, (r0.message, r1.message)
    want = full_batch_grads(models.mlp(), _global(), models.mlp_loss, models.count_rows)
    assert rel_err(r0.value["grads"], want) < F64_RTOL and rel_err(r1.value["grads"], want) < F64_RTOL
