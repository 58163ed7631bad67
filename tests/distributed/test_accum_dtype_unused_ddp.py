"""bf16 parameters, ``accum_dtype="float32"``, DDP with ``find_unused_parameters=True``, and a
parameter that only a no-sync micro-batch reaches (gloo, two processes, under a timeout).

DDP with ``find_unused_parameters=True`` records, in no-sync micro-batches too, which parameters
this rank used. Before the synchronizing backward the float32 sums are set aside; a parameter that
backward does not reach is marked ready at once, and DDP refuses an undefined ``.grad`` on a
parameter it recorded as used ("This indicates a bug in DDP implementation"), so rank 0 stopped
there and rank 1 waited in the all-reduce (a CollectiveError). Such a parameter's ``.grad`` is now
a zero of its dtype while its float32 sum is aside: DDP copies the zero into the bucket and the
communication hook adds the sum back.

Exactness is bit for bit: with k = 2 the update is, per element,
bf16( (f32(g_00) + f32(g_01)) / 2 + (f32(g_10) + f32(g_11)) / 2 ) with g_rj the bf16 gradient of
rank r's micro-batch j (its loss times bf16(W/N)): two float32 additions of bf16 values, halving
(a power of two, exact), one float32 all-reduce of two addends (commutative), one rounding. The
reference below computes exactly that by hand, from the same bf16 kernels on the same inputs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum import Accumulator
from gradaccum.check.accumulation import GradientProbe
from tests.helpers.launcher import run_ranks, values

pytestmark = pytest.mark.distributed

ROWS = 3


class _Branchy(nn.Module):
    """``extra`` joins the graph only in the micro-batches that ask for it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 4)
        self.extra = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if use_extra:
            h = h + self.extra(h)
        out: torch.Tensor = self.head(h)
        return out


def _loss(model: nn.Module, mb: dict[str, Any]) -> torch.Tensor:
    return (model(mb["x"], mb["extra"]) - mb["y"]).square().sum()


def _count(mb: dict[str, Any]) -> int:
    return int(mb["x"].shape[0])


def _window(rank: int, step: int) -> list[dict[str, Any]]:
    """Two micro-batches; ``extra`` in rank 0's no-sync micro-batch (window 0), then in rank 0's
    no-sync one and rank 1's synchronizing one (window 1)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    uses = [(True, False), (False, False)] if step == 0 else [(True, False), (False, True)]
    return [
        {
            "x": torch.randn(ROWS, 4, generator=gen).to(torch.bfloat16),
            "y": torch.randn(ROWS, 1, generator=gen).to(torch.bfloat16),
            "extra": uses[rank][j],
        }
        for j in range(2)
    ]


def _by_hand(step: int, world: int) -> list[torch.Tensor]:
    """The float32-accumulated, once-rounded update, from per-micro-batch bf16 gradients."""
    model = _Branchy().to(torch.bfloat16)
    params = list(model.parameters())
    n = world * 2 * ROWS
    scale = torch.tensor(world / n, dtype=torch.float64).to(torch.bfloat16)
    reduced = [torch.zeros(p.shape, dtype=torch.float32) for p in params]
    for rank in range(world):
        summed = [torch.zeros(p.shape, dtype=torch.float32) for p in params]
        for mb in _window(rank, step):
            grads = torch.autograd.grad(_loss(model, mb) * scale, params, allow_unused=True)
            for s, g in zip(summed, grads, strict=True):
                if g is not None:
                    s.add_(g.to(torch.float32))
        for r, s in zip(reduced, summed, strict=True):
            r.add_(s / world)
    return [r.to(torch.bfloat16).to(torch.float64) for r in reduced]


def _ranks(rank: int, world: int) -> dict[bool, list[list[torch.Tensor]]]:
    """Both of DDP's gradient layouts: its own .grad, and .grad as a view of its bucket."""
    out = {}
    for as_view in (False, True):
        model = _Branchy().to(torch.bfloat16)
        ddp = DDP(model, find_unused_parameters=True, gradient_as_bucket_view=as_view)
        probe = GradientProbe(ddp.parameters())
        with Accumulator(ddp, probe, accum_dtype="float32") as acc:
            seen = []
            for step in range(2):
                assert acc.step(_window(rank, step), _loss, _count).applied
                seen.append(probe.seen)
        out[as_view] = seen
    return out


def test_a_parameter_only_a_no_sync_micro_batch_uses_accumulates_exactly() -> None:
    ranks = values(run_ranks(_ranks, timeout_s=120))
    for step in range(2):
        expected = _by_hand(step, 2)
        for seen in [run[as_view] for run in ranks for as_view in (False, True)]:
            assert len(seen[step]) == len(expected)
            for got, want in zip(seen[step], expected, strict=True):
                assert torch.equal(got, want)  # bit for bit: see the module docstring
        extra_weight = expected[2]
        assert extra_weight.abs().sum() > 0  # the no-sync-only parameter did receive its gradient
