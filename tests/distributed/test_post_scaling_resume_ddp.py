"""Post-scaling resumed on two DDP ranks takes the updates an uninterrupted run takes, bit for bit.

The scenario where the basis of c matters: float16 autocast and a GradScaler (CPU). The first window
under torch.distributed backpropagates with c = 1 (no previous N yet): the summed loss times the
scaler's 2**16 overflows float16, the update is skipped and the scaler backs off. Later windows
take c = 2**-round(log2(N'/F)) from the previous window and apply. A resume that forgot N' would
run its first window with c = 1 again: one more skip, one more back-off, other parameters.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.helpers.launcher import run_ranks, values

pytestmark = pytest.mark.distributed

VOCAB, DIM, ROWS, T = 32, 16, 4, 16
WINDOWS, RESUME_AFTER = 5, 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.embed = nn.Embedding(VOCAB, DIM)
            self.hidden = nn.Linear(DIM, DIM)
            self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(ids))))


def loss_fn(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(mb["ids"])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), mb["labels"].reshape(-1), reduction="sum")


def count_fn(mb: dict[str, torch.Tensor]) -> int:
    return mb["labels"].numel()


def window(rank: int, index: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 * index + rank)
    ids = torch.randint(0, VOCAB, (2 * ROWS, T), generator=gen)
    labels = torch.randint(0, VOCAB, (2 * ROWS, T), generator=gen)
    return [{"ids": ids[i : i + ROWS], "labels": labels[i : i + ROWS]} for i in (0, ROWS)]


def _build() -> tuple[DDP, torch.optim.Optimizer, Any, Any]:
    import gradaccum

    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    acc = gradaccum.Accumulator(model, optimizer, scaler=scaler, scaling="post")
    return model, optimizer, scaler, acc


def _run(rank: int, resume: bool) -> dict[str, Any]:
    model, optimizer, scaler, acc = _build()
    applied: list[bool] = []
    scales: list[float] = []
    for index in range(WINDOWS):
        if resume and index == RESUME_AFTER:  # a checkpoint, and a fresh process's objects
            saved = copy.deepcopy(
                {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(),
                    "acc": acc.state_dict(),
                }
            )
            model, optimizer, scaler, acc = _build()
            model.module.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            scaler.load_state_dict(saved["scaler"])
            acc.load_state_dict(saved["acc"])
        result = acc.step(window(rank, index), loss_fn, count_fn)
        applied.append(bool(result.applied))
        scales.append(float(scaler.get_scale()))
    params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return {"applied": applied, "scales": scales, "params": params, "state": acc.state_dict()}


def _rank(rank: int, world: int) -> dict[str, Any]:
    return {"straight": _run(rank, resume=False), "resumed": _run(rank, resume=True)}


def test_post_scaling_resume_is_bitwise_on_two_ddp_ranks() -> None:
    ranks = values(run_ranks(_rank, world=2, timeout_s=120))
    for r in ranks:
        straight, resumed = r["straight"], r["resumed"]
        assert straight["applied"] == [False, True, True, True, True]  # the scenario: one skip, c = 1
        assert resumed["applied"] == straight["applied"]
        assert resumed["scales"] == straight["scales"]
        assert resumed["state"] == straight["state"]
        for name, value in straight["params"].items():
            assert torch.equal(resumed["params"][name], value), name


def test_the_basis_of_c_is_saved_and_refused_when_impossible() -> None:
    import gradaccum

    model = Net()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), scaling="post")
    assert acc.state_dict()["post"] == {"expected": None}
    acc.step(window(0, 0), loss_fn, count_fn)
    assert acc.state_dict()["post"] == {"expected": float(2 * ROWS * T)}
    state = acc.state_dict()
    for bad in ({"expected": -1.0}, {"expected": float("nan")}, {"n": 1.0}, 3):
        with pytest.raises(gradaccum.ConfigError, match="post-scaling state"):
            acc.load_state_dict({**state, "post": bad})
    assert acc.state_dict()["post"] == {"expected": float(2 * ROWS * T)}
