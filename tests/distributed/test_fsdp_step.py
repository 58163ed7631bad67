"""FSDP2 (fully_shard) on gloo, two CPU processes: the accumulated step equals the full batch.

FSDP2 reduce-scatters gradients with an average over ranks, like DDP, so the same W/N scale applies;
sync is deferred with set_requires_gradient_sync(False) on all but the last micro-batch. Tolerance
1e-12 relative (float64): only the summation order differs from the single-process reference.
"""

from __future__ import annotations

import pytest
import torch

from gradaccum import Accumulator, split
from gradaccum.distributed.sync import sync_kind
from tests.helpers import models
from tests.helpers.ddp import rank_slice
from tests.helpers.launcher import run_ranks, values
from tests.helpers.reference import full_batch_grads, max_rel_err

pytestmark = pytest.mark.distributed

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # pragma: no cover - torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard


def _fsdp2_step(rank: int, world: int, defer: bool, sizes: dict[int, list[int]]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = models.gpt()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert sync_kind(model) == "fsdp2"
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), defer_sync=defer)
    local = rank_slice(models.gpt_batch(8, seed=21), [0, 5, 8], rank)
    result = acc.step(split(local, sizes=sizes[rank]), models.gpt_loss, models.tokens)
    grads = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters()}
    return {"grads": grads, "global": result.global_count, "applied": result.applied}


# FSDP2 all-gathers parameters in every forward, so every rank must run the same number of
# micro-batches; their token counts may differ.
EQUAL_K = {0: [3, 2], 1: [2, 1]}


@pytest.mark.parametrize("defer", [True, False])
def test_fsdp2_uneven_tokens_match_full_batch(defer: bool) -> None:
    r0, r1 = values(run_ranks(_fsdp2_step, defer, EQUAL_K, timeout_s=120))
    want = full_batch_grads(models.gpt(), models.gpt_batch(8, seed=21), models.gpt_loss, models.tokens)
    assert r0["applied"] and r0["global"] == r1["global"]
    assert max_rel_err(r0["grads"], want) < 1e-12
    assert max_rel_err(r1["grads"], want) < 1e-12


def test_fsdp2_unequal_micro_batch_counts_fail_on_every_rank_instead_of_hanging() -> None:
    outcomes = run_ranks(_fsdp2_step, True, {0: [2, 2, 1], 1: [2, 1]}, timeout_s=60)
    assert [o.error_type for o in outcomes] == ["WindowError", "WindowError"]
    assert "fsdp2 gathers parameters in every forward" in outcomes[1].error


def _sync_flags_after_contexts(rank: int, world: int) -> list[tuple[bool, bool]]:
    from torch.distributed.device_mesh import init_device_mesh

    from gradaccum.distributed.sync import fsdp2_sync_flags, sync_deferred

    model = models.gpt()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    seen = [fsdp2_sync_flags(model)]  # FSDP2's default: both on
    with sync_deferred(model, "fsdp2"):
        seen.append(fsdp2_sync_flags(model))
    seen.append(fsdp2_sync_flags(model))  # restored: on
    model.set_requires_gradient_sync(False)  # the caller's own setting, outside the step
    with sync_deferred(model, "fsdp2"):
        pass
    seen.append(fsdp2_sync_flags(model))  # restored: still off, as the caller left it
    model.set_requires_gradient_sync(True)
    model.set_requires_all_reduce(False)
    with sync_deferred(model, "fsdp2", replicate_only=True):
        seen.append(fsdp2_sync_flags(model))
    seen.append(fsdp2_sync_flags(model))
    return seen


def test_fsdp2_sync_context_restores_the_previous_state() -> None:
    for seen in values(run_ranks(_sync_flags_after_contexts, timeout_s=60)):
        on, off = (True, True), (False, False)
        assert seen == [on, off, on, off, (True, False), (True, False)]


def _factor_set_after_construction(rank: int, world: int, where: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    mesh = init_device_mesh("cpu", (world,))
    model = models.gpt()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
    # after the accumulator was built: the reduce-scatter now sums (1.0) instead of averaging over 2
    owners = [m for m in model.modules() if isinstance(m, FSDPModule)] if where == "every" else [model]
    for module in owners:
        module.set_gradient_divide_factor(1.0)
    local = rank_slice(models.gpt_batch(8, seed=21), [0, 5, 8], rank)
    result = acc.step(split(local, sizes=EQUAL_K[rank]), models.gpt_loss, models.tokens)
    grads = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters()}
    return {"grads": grads, "applied": result.applied}


def test_fsdp2_divide_factor_set_after_construction_is_read_by_the_next_window() -> None:
    # the scale read at construction (F = 2) against a reduction that now sums made the update twice
    # the full batch's (relative error 1.0); read per window, only the summation order differs
    outcomes = values(run_ranks(_factor_set_after_construction, "every", timeout_s=120))
    want = full_batch_grads(models.gpt(), models.gpt_batch(8, seed=21), models.gpt_loss, models.tokens)
    for outcome in outcomes:
        assert outcome["applied"]
        assert max_rel_err(outcome["grads"], want) < 1e-10


def test_fsdp2_divide_factor_set_on_the_root_only_after_construction_is_refused_on_every_rank() -> None:
    outcomes = run_ranks(_factor_set_after_construction, "root", timeout_s=120)
    assert [o.error_type for o in outcomes] == ["ConfigError", "ConfigError"]
    assert all("divide by different factors" in o.error and "blocks.0" in o.error for o in outcomes)
