"""DDP with a compiled model on two gloo processes, both ways round: ``DDP(torch.compile(m))`` and
``torch.compile(DDP(m))`` (an ``OptimizedModule`` holding the DDP, refused before issue 23); and
FSDP2 with each block compiled after ``fully_shard`` (torchtitan's way, ``wrap_model(compile=True)``).

Each update must cost what the eager step costs: one gradient all-reduce (the tiny GPT fits one
DDP bucket; counted by a comm hook) and the step's two small all-reduces (counted by
``count_sync_points``), and the gradient must equal the full global batch's within 1e-12 (float64,
``aot_eager``: see test_compiled_step.py for the tolerance).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum import Accumulator, split
from gradaccum.distributed.comm import count_allreduces, count_sync_points
from tests.helpers import models
from tests.helpers.ddp import rank_slice
from tests.helpers.launcher import run_ranks, values
from tests.helpers.reference import full_batch_grads, max_rel_err

pytestmark = pytest.mark.distributed

BOUNDS = [0, 5, 8]
SIZES = {0: [2, 3], 1: [1, 2]}  # uneven shards and micro-batches on purpose
WINDOWS = 3


def _plain_names(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name.replace("_orig_mod.", "").replace("module.", ""): g for name, g in grads.items()}


def _compiled_ddp(rank: int, world: int, order: str) -> list[dict[str, Any]]:
    model = models.gpt()
    if order == "DDP(compile(m))":
        ddp = DDP(torch.compile(model, backend="aot_eager"))
        fast: torch.nn.Module = ddp
    else:
        ddp = DDP(model)
        fast = torch.compile(ddp, backend="aot_eager")
    buckets = count_allreduces(ddp)
    acc = Accumulator(fast, torch.optim.SGD(fast.parameters(), lr=0.1))
    out = []
    for w in range(WINDOWS):
        batch = models.gpt_batch(8, seed=20 + w)
        start = {name: p.detach().clone() for name, p in model.named_parameters()}
        buckets.reset()
        with count_sync_points() as points:
            result = acc.step(
                split(rank_slice(batch, BOUNDS, rank), sizes=SIZES[rank]), models.gpt_loss, models.tokens
            )
        ref = models.gpt()
        ref.load_state_dict(start)
        want = full_batch_grads(ref, batch, models.gpt_loss, models.tokens)
        got = _plain_names({n: p.grad.detach().clone() for n, p in fast.named_parameters()})
        out.append(
            {
                "error": max_rel_err(got, want),
                "gradient all-reduces": buckets.calls,
                # the comm hook's all-reduce is a Python call too: the step's own are the rest
                "small collectives": points.collectives - buckets.calls,
                "loss": result.loss,
                "recompiles": result.recompiles,
            }
        )
    return out


@pytest.mark.parametrize("order", ["DDP(compile(m))", "compile(DDP(m))"])
def test_compiled_ddp_syncs_once_per_update_and_is_exact(order: str) -> None:
    ranks = values(run_ranks(_compiled_ddp, order, timeout_s=300))
    for rank in ranks:
        for window in rank:
            assert window["gradient all-reduces"] == 1, window  # deferred: the last micro-batch only
            assert window["small collectives"] == 2, window  # the counts and the agreement, as eager
            assert window["error"] < 1e-12, window
        assert rank[0]["recompiles"] >= 1  # the first window compiled
    assert [w["loss"] for w in ranks[0]] == pytest.approx([w["loss"] for w in ranks[1]], rel=1e-12)


def _fsdp2_compiled(rank: int, world: int) -> list[dict[str, Any]]:
    from gradaccum.distributed.wrap import wrap_model

    torch.compiler.set_default_backend("aot_eager")  # this process only: no C++ build
    model = wrap_model(models.gpt(), torch.device("cpu"), fsdp=True, compile=True)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
    out = []
    for seed in (21, 22):
        local = rank_slice(models.gpt_batch(8, seed=seed), BOUNDS, rank)
        # FSDP2 gathers in every forward: equal micro-batch counts on both ranks
        result = acc.step(split(local, sizes={0: [3, 2], 1: [2, 1]}[rank]), models.gpt_loss, models.tokens)
        got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        want = full_batch_grads(models.gpt(), models.gpt_batch(8, seed=seed), models.gpt_loss, models.tokens)
        out.append({"error": max_rel_err(got, want), "recompiles": result.recompiles})
    return out


def test_fsdp2_with_each_block_compiled_after_sharding_is_exact() -> None:
    for rank in values(run_ranks(_fsdp2_compiled, timeout_s=300)):
        assert all(w["error"] < 1e-12 for w in rank), rank
        assert rank[0]["recompiles"] >= 1 and rank[1]["recompiles"] == 0, rank  # same shapes
