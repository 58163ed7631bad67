"""``batchnorm_stats="window"`` under DDP (gloo, two processes): the running statistics of one
forward over every rank's rows, the same on both ranks.

The ranks hold different numbers of micro-batches (3 and 2) of unequal sizes. The model has a
SyncBatchNorm and a plain BatchNorm side by side, each fed by its own branch, so that each one's
input rows do not depend on how the other normalized them and the reference is exact: one process,
one training forward over the union of both ranks' rows, per window. SyncBatchNorm's own forward
needs a GPU once a process group exists, and DDP refuses it on CPU when it is built; on gloo the
layer becomes the test's subclass after DDP is built, whose forward normalizes each rank's rows
alone (the running statistics, the subject here, are the step's own either way). Both carriers of
the moments are covered: the meeting before the synchronizing backward (the default), the
end-of-window all-reduce (``agree_on_failure=False``), post-scaling's one meeting, and a meeting
at every micro-batch (``defer_sync=False``), where only the last one follows every forward.
Tolerance 1e-12: as in tests/equivalence/test_batchnorm_window.py, plus the shifted sums' rounding,
~1e-16 (1 + (mu - K)^2 / var) relative with |mu - K| ~ sigma here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum import Accumulator
from tests.helpers.launcher import run_ranks, values

pytestmark = pytest.mark.distributed

EXACT = 1e-12
SIZES = {0: [3, 5, 2], 1: [4, 6]}
# sync on every micro-batch needs equally many on every rank: the same rows, cut in three
EQUAL_COUNTS = {0: [3, 5, 2], 1: [4, 2, 4]}
WINDOWS = 2
SETTINGS = {
    "meeting": {},
    "summary": {"agree_on_failure": False},
    "post": {"scaling": "post"},
    "every": {"defer_sync": False},  # a meeting at every micro-batch: the last one holds them all
}


class CpuSyncBatchNorm(nn.SyncBatchNorm):
    """SyncBatchNorm whose forward runs on CPU (each rank's rows alone)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.modules.batchnorm._BatchNorm.forward(self, x)


class TwoNorms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 4)
        self.sync = nn.BatchNorm1d(4)  # a SyncBatchNorm once DDP is built: see _wrapped
        self.plain = nn.BatchNorm1d(3, momentum=None)
        self.head = nn.Linear(7, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.sync(self.lin(x)), self.plain(x)], dim=1)).squeeze(1)


def _wrapped() -> DDP:
    ddp = DDP(TwoNorms().double())
    sync = ddp.module.sync
    sync.__class__ = CpuSyncBatchNorm  # same parameters and buffers, SyncBatchNorm's type
    sync.process_group = None
    assert isinstance(ddp.module.sync, nn.SyncBatchNorm)
    return ddp


def _rows(window: int) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + window)
    return {r: torch.randn(sum(s), 3, generator=gen, dtype=torch.float64) * 2 + 0.5 for r, s in SIZES.items()}


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) ** 2).sum()


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_buffers()}


def _ranks(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, settings in SETTINGS.items():
        ddp = _wrapped()
        # lr=0: the weights stay, so the reference's forward sees the same BatchNorm inputs
        sgd = torch.optim.SGD(ddp.parameters(), lr=0.0)
        acc = Accumulator(ddp, sgd, batchnorm_stats="window", **settings)
        after = []
        for w in range(WINDOWS):
            sizes = (EQUAL_COUNTS if name == "every" else SIZES)[rank]
            window = list(_rows(w)[rank].split(sizes))
            assert acc.step(window, _loss, lambda x: x.shape[0]).applied
            after.append(_buffers(ddp.module))
        out[name] = after
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return values(run_ranks(_ranks, timeout_s=180))


@pytest.fixture(scope="module")
def expected() -> list[dict[str, torch.Tensor]]:
    model = TwoNorms().double()
    after = []
    with torch.no_grad():
        for w in range(WINDOWS):
            model(torch.cat([_rows(w)[0], _rows(w)[1]]))  # one forward over both ranks' rows
            after.append(_buffers(model))
    return after


@pytest.mark.parametrize("carrier", list(SETTINGS))
def test_both_ranks_hold_the_statistics_of_one_forward_over_all_rows(
    ranks: list[dict[str, Any]], expected: list[dict[str, torch.Tensor]], carrier: str
) -> None:
    r0, r1 = (r[carrier] for r in ranks)
    for w in range(WINDOWS):
        for name, value in expected[w].items():
            assert torch.equal(r0[w][name], r1[w][name]), (w, name)  # the same on every rank
            assert (r0[w][name].double() - value.double()).abs().max().item() <= EXACT, (w, name)
        assert int(r0[w]["sync.num_batches_tracked"]) == w + 1  # once per window
        assert int(r0[w]["plain.num_batches_tracked"]) == w + 1
