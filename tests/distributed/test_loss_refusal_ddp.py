"""A mean-reduced ``loss_fn`` under real DDP (gloo, two processes, under a timeout): refused on every
rank, by name, before any update, and no rank left waiting.

Every rank reads its own first window's losses; the refusal is raised inside the micro-batch, so
the failure agreement before the synchronizing backward (or, with ``agree_on_failure=False``, each
rank on its own) stops every rank. Where only one rank's loss is a mean, the other learns of it
there, as :class:`RankFailedError` naming the refusal.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum import Accumulator
from tests.helpers.launcher import run_ranks, values

pytestmark = pytest.mark.distributed

CASES: dict[str, tuple[dict[str, Any], int]] = {
    "pre, k=2": ({}, 2),
    "pre, k=1 (the first micro-batch synchronizes)": ({}, 1),
    "post-scaling": ({"scaling": "post"}, 2),
    "agree_on_failure=False": ({"agree_on_failure": False}, 2),
    "clipping": ({"max_grad_norm": 1.0}, 2),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _window(rank: int, k: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(rank)
    return [
        {
            "x": torch.randn(4 + rank, 4, generator=gen, dtype=torch.float64),
            "y": torch.randint(0, 3, (4 + rank,)),
        }
        for _ in range(k)
    ]


def _mean(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(mb["x"]), mb["y"])  # the default reduction: a mean


def _sum(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(mb["x"]), mb["y"], reduction="sum")


def _rows(mb: dict[str, torch.Tensor]) -> int:
    return int(mb["y"].numel())


def _attempt(ddp: DDP, settings: dict[str, Any], window: list[Any], loss_fn: Any) -> dict[str, Any]:
    before = [p.detach().clone() for p in ddp.parameters()]
    opt = torch.optim.Adam(ddp.parameters(), lr=0.1)
    out: dict[str, Any] = {"error": None}
    try:
        Accumulator(ddp, opt, **settings).step(window, loss_fn, _rows)
    except Exception as exc:
        out["error"], out["message"] = type(exc).__name__, str(exc)
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, ddp.parameters(), strict=True))
    out["no grad"] = all(p.grad is None or not p.grad.any() for p in ddp.parameters())
    out["no optimizer state"] = not opt.state
    return out


def _ranks(rank: int, world: int) -> dict[str, dict[str, Any]]:
    out = {
        name: _attempt(DDP(_model()), settings, _window(rank, k), _mean)
        for name, (settings, k) in CASES.items()
    }
    out["rank 0 only"] = _attempt(DDP(_model()), {}, _window(rank, 2), _mean if rank == 0 else _sum)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, dict[str, Any]]]:
    return values(run_ranks(_ranks, timeout_s=180, pg_timeout_s=20))


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_refuses_the_mean_by_name(ranks: list[dict[str, dict[str, Any]]], case: str) -> None:
    for rank, outcome in enumerate(ranks):
        got = outcome[case]
        assert got["error"] == "LossError", got
        assert got["message"].startswith(
            f"loss_fn returned a mean-reduced loss for micro-batch 0 (count_fn counts {4 + rank} units in it)"
        )
        assert "reduction='mean' (their default)" in got["message"] and "*summed*" in got["message"]
        assert got["unchanged"] and got["no grad"] and got["no optimizer state"]


def test_a_rank_whose_loss_is_a_sum_stops_with_the_one_that_refused(
    ranks: list[dict[str, dict[str, Any]]],
) -> None:
    refused, told = ranks[0]["rank 0 only"], ranks[1]["rank 0 only"]
    assert refused["error"] == "LossError"
    assert told["error"] == "RankFailedError"
    assert (
        "rank 0 failed in forward of micro-batch 0: LossError: loss_fn returned a mean-reduced loss"
        in told["message"]
    )
    for got in (refused, told):
        assert got["unchanged"] and got["no grad"] and got["no optimizer state"]
