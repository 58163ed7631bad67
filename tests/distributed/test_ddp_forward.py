"""A ``loss_fn`` that calls the DDP-wrapped module's submodules runs no DDP forward: its
synchronizing backward would all-reduce nothing, and each rank would step on its own gradient
(0.95 relL2 off the full batch's update in tests/seams). The step refuses it, on every rank, before
any parameter changes; a ``loss_fn`` that calls the wrapped model steps exactly as before."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradaccum import Accumulator, split
from gradaccum.errors import GradAccumError
from tests.helpers import models
from tests.helpers.ddp import rank_slice, wrap
from tests.helpers.launcher import run_ranks, values

pytestmark = pytest.mark.distributed


def _inner_loss(model: Any, mb: dict[str, Any]) -> torch.Tensor:
    return models.mlp_loss(model.module, mb)  # DDP's forward never runs


def _steps(rank: int, world: int, scaling: str) -> dict[str, Any]:
    batch = models.mlp_batch(8, seed=3)
    ddp, _ = wrap(models.mlp())
    acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), scaling=scaling)
    window = split(rank_slice(batch, [0, 4, 8], rank), sizes=[2, 2])
    before = [p.detach().clone() for p in ddp.parameters()]
    try:
        acc.step(window, _inner_loss, models.count_rows)
        refused = ""
    except GradAccumError as exc:
        refused = f"{type(exc).__name__}: {exc}"
    unchanged = all(torch.equal(p, b) for p, b in zip(ddp.parameters(), before, strict=True))
    applied = acc.step(window, models.mlp_loss, models.count_rows).applied  # the wrapped model: fine
    return {"refused": refused, "unchanged": unchanged, "applied": applied}


@pytest.mark.parametrize("scaling", ["pre", "post"])
def test_a_loss_fn_that_skips_ddps_forward_is_refused_on_every_rank(scaling: str) -> None:
    outcomes = values(run_ranks(_steps, scaling, timeout_s=120))
    for out in outcomes:
        assert out["refused"], "the step accepted a window whose synchronizing forward skipped DDP"
        assert out["unchanged"] and out["applied"]
    assert any("never called the DistributedDataParallel model" in o["refused"] for o in outcomes)
