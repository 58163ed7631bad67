"""MoE load balancing under DDP (gloo, two processes): the window's routing counts are summed over
the ranks in the count all-reduce, and each rank's term is scaled by W like its loss.

Rank 0 holds 5 sequences in 2 micro-batches, rank 1 holds 3 in 3 (uneven tokens and uneven
micro-batch counts). The update must equal the full batch's objective over all 8 sequences on one
process (tests/helpers/moe.py) within 1e-10, relative L2: float64 sums in another order (see
tests/equivalence/test_moe_balance.py), plus DDP's averaging of two float64 gradients. Both ranks
must hold the same parameters afterwards, bitwise (DDP averages one gradient).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum import Accumulator
from gradaccum.moe import LoadBalance
from tests.helpers import moe as h
from tests.helpers.launcher import run_ranks, values

pytestmark = pytest.mark.distributed

LENGTHS = (5, 7, 3, 8, 6, 4, 7, 5)
SIZES = {0: (2, 3), 1: (1, 1, 1)}
TOL = 1e-10


def _ranks(rank: int, world: int) -> dict[str, Any]:
    seqs = h.sequences(LENGTHS, seed=1)
    mine = seqs[:5] if rank == 0 else seqs[5:]
    out: dict[str, Any] = {}
    for mode in ("exact", "lagged"):
        model = h.tiny_moe()
        ddp = DDP(model, find_unused_parameters=True, broadcast_buffers=False)
        before = [p.detach().clone() for p in model.parameters()]
        acc = Accumulator(
            ddp, torch.optim.SGD(ddp.parameters(), lr=1.0), balance=LoadBalance.from_model(ddp, mode=mode)
        )
        calls: list[int] = []
        model.register_forward_pre_hook(lambda *a, calls=calls: calls.append(1))  # forwards started
        assert acc.step(h.window(mine, SIZES[rank]), h.ce_sum, h.tokens).applied
        out[mode] = ([p.detach() - b for p, b in zip(model.parameters(), before, strict=True)], len(calls))
    out["bias"] = _bias(rank, mine)
    out["failure"] = _failing_routing_pass(rank, mine)
    return out


def _bias(rank: int, mine: list[torch.Tensor]) -> list[torch.Tensor]:
    """Aux-loss-free balancing: every rank moves its bias from the same agreed counts."""
    model = h.tiny_moe()
    for layer in model.model.layers:
        layer.mlp.gate.register_buffer("e_score_correction_bias", torch.zeros(4, dtype=torch.float64))
    ddp = DDP(model, find_unused_parameters=True, broadcast_buffers=False)
    balance = dataclasses.replace(LoadBalance.from_model(ddp), bias_rate=0.01)
    acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), balance=balance)
    for _ in range(3):
        acc.step(h.window(mine, SIZES[rank]), h.ce_sum, h.tokens)
    return [layer.mlp.gate.e_score_correction_bias.clone() for layer in model.model.layers]


def _failing_routing_pass(rank: int, mine: list[torch.Tensor]) -> tuple[str, bool]:
    """A routing pass that raises on rank 1 stops every rank in the count all-reduce, unchanged."""
    model = h.tiny_moe()
    ddp = DDP(model, find_unused_parameters=True, broadcast_buffers=False)
    before = [p.detach().clone() for p in model.parameters()]
    acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=1.0), balance=LoadBalance.from_model(ddp))

    def loss_fn(m: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        if rank == 1 and not torch.is_grad_enabled():
            raise RuntimeError("broken routing pass")
        return h.ce_sum(m, mb)

    try:
        acc.step(h.window(mine, SIZES[rank]), loss_fn, h.tokens)
    except Exception as exc:  # the test reads which error each rank raised
        unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        return f"{type(exc).__name__}: {exc}", unchanged
    return "no error", False


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, Any]]:
    return values(run_ranks(_ranks, timeout_s=180))


def test_exact_mode_under_ddp_equals_the_full_batch(outcomes: list[dict[str, Any]]) -> None:
    model = h.tiny_moe()
    reference = h.reference_update(model, h.sequences(LENGTHS, seed=1), coef=0.05)
    for rank, out in enumerate(outcomes):
        update, forwards = out["exact"]
        assert h.rel_l2(update, reference) <= TOL
        assert forwards == 2 * len(
            SIZES[rank]
        )  # the routing pass on the inner module, and the training forward
    assert all(
        torch.equal(a, b) for a, b in zip(outcomes[0]["exact"][0], outcomes[1]["exact"][0], strict=True)
    )


def test_lagged_mode_forwards_once_and_its_first_window_balances_each_micro_batch(
    outcomes: list[dict[str, Any]],
) -> None:
    model = h.tiny_moe()
    reference = h.reference_update(model, h.sequences(LENGTHS, seed=1), coef=0.05)
    for rank, out in enumerate(outcomes):
        update, forwards = out["lagged"]
        assert forwards == len(SIZES[rank])
        assert h.rel_l2(update, reference) > 1e-3  # nothing carried yet: each micro-batch's own statistics
    assert all(
        torch.equal(a, b) for a, b in zip(outcomes[0]["lagged"][0], outcomes[1]["lagged"][0], strict=True)
    )


def test_the_bias_moves_identically_on_every_rank(outcomes: list[dict[str, Any]]) -> None:
    first, second = outcomes[0]["bias"], outcomes[1]["bias"]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert any(bool(b.abs().sum() > 0) for b in first)  # it moved (two updates applied of three windows)


def test_a_failing_routing_pass_stops_every_rank_before_any_change(outcomes: list[dict[str, Any]]) -> None:
    (peer, peer_unchanged), (own, own_unchanged) = outcomes[0]["failure"], outcomes[1]["failure"]
    assert own == "RuntimeError: broken routing pass"  # the failing rank raises its own error
    assert peer.startswith("RankFailedError") and "the routing pass" in peer and "broken routing pass" in peer
    assert peer_unchanged and own_unchanged
