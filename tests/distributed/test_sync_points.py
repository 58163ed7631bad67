"""What one update costs in small collectives and host reads under DDP (gloo, two processes), asserted
so that it cannot silently grow again; and DDP's static_graph refused on every rank, not hung on.

Counted with :func:`gradaccum.distributed.comm.count_sync_points`: every ``torch.distributed``
collective issued from Python (DDP's own gradient all-reduces run in its C++ reducer and are not
among them) and every read of a tensor's value on the host, during ``Accumulator.step`` alone.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum import AccumConfig, Accumulator, CachedAccumulator, SyncError, split
from gradaccum.distributed.comm import count_sync_points
from tests.equivalence.test_cache import encode_pairs, pairs_batch, retrieval_loss, two_tower
from tests.helpers import models
from tests.helpers.ddp import rank_slice
from tests.helpers.launcher import run_ranks, values

pytestmark = pytest.mark.distributed

BOUNDS = [0, 5, 8]
SIZES = {0: [2, 2, 1], 1: [2, 1]}  # uneven micro-batch counts on purpose


def _counted(rank: int, world: int) -> dict[str, Any]:
    batch = models.gpt_batch(8, seed=11)
    window = split(rank_slice(batch, BOUNDS, rank), sizes=SIZES[rank])
    out: dict[str, Any] = {}
    for name, config in (
        ("default", AccumConfig()),
        ("clipped", AccumConfig(max_grad_norm=1.0)),
        ("no agreement", AccumConfig(agree_on_failure=False)),
        ("noise", AccumConfig(noise_scale=True)),
        ("noise no agreement", AccumConfig(noise_scale=True, agree_on_failure=False)),
    ):
        ddp = DDP(models.gpt())  # no counting comm hook: its all-reduces are Python calls too
        acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), config=config)
        acc.step(window, models.gpt_loss, models.tokens)  # DDP rebuilds its buckets after the first
        per_update = []
        for _ in range(3):
            with count_sync_points() as points:
                result = acc.step(window, models.gpt_loss, models.tokens)
            assert result.applied
            per_update.append((points.collectives, points.host_reads, dict(points.by_name)))
        out[name] = per_update
        out[name + " loss"] = result.loss
    # the gradient cache: what it costs on top (the representations' gather and shapes)
    ddp = DDP(two_tower(learned_scale=False))
    cached = CachedAccumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
    pairs = rank_slice(pairs_batch(8, seed=3), BOUNDS, rank)
    loss_fn = retrieval_loss(two_tower(learned_scale=False))
    cached.step(split(pairs, micro_batch=1), encode_pairs, loss_fn)
    with count_sync_points() as points:
        cached.step(split(pairs, micro_batch=1), encode_pairs, loss_fn)
    out["cached"] = (points.collectives, points.host_reads, dict(points.by_name))
    return out


@pytest.fixture(scope="module")
def counted() -> list[dict[str, Any]]:
    return values(run_ranks(_counted, timeout_s=120))


@pytest.mark.parametrize("config", ["default", "clipped", "no agreement"])
def test_an_update_costs_two_small_collectives(counted: list[dict[str, Any]], config: str) -> None:
    for rank in counted:
        for collectives, _, names in rank[config]:
            # the counts (with flags and the configuration fingerprint), then either the agreement
            # (carrying the loss) or, with agreement off, the loss after the backward
            assert collectives == 2, names
            assert names["all_reduce"] == 2 and "all_gather_object" not in names, names


@pytest.mark.parametrize(("config", "reads"), [("default", 3), ("clipped", 3), ("no agreement", 2)])
def test_the_loss_adds_no_host_read_of_its_own(
    counted: list[dict[str, Any]], config: str, reads: int
) -> None:
    # counts, agreement (which carries the loss) and the end-of-step decision; no agreement: one fewer
    for rank in counted:
        for _, host_reads, names in rank[config]:
            assert host_reads == reads, names
    # the global loss is the same on both ranks, whichever collective carried it
    assert counted[0][config + " loss"] == pytest.approx(counted[1][config + " loss"], rel=1e-12)
    assert counted[0]["default loss"] == pytest.approx(counted[0]["no agreement loss"], rel=1e-12)


@pytest.mark.parametrize(("config", "collectives"), [("noise", 3), ("noise no agreement", 2)])
def test_the_noise_scale_adds_at_most_one_small_all_reduce_and_no_host_read(
    counted: list[dict[str, Any]], config: str, collectives: int
) -> None:
    # its two sums (P, K) travel in the loss's end-of-window reduction when there is one
    # (agreement off), else in one all-reduce of their own; their values ride in the step's one
    # end-of-step read, so the host reads stay those of the same configuration without it
    reads = 3 if config == "noise" else 2
    for rank in counted:
        for got, host_reads, names in rank[config]:
            assert got == collectives and names["all_reduce"] == collectives, names
            assert host_reads == reads, names
    assert counted[0][config + " loss"] == pytest.approx(counted[0]["default loss"], rel=1e-12)


def test_the_cached_step_costs_what_its_gather_needs(counted: list[dict[str, Any]]) -> None:
    for rank in counted:
        collectives, host_reads, names = rank["cached"]
        # counts, the shapes gather, the representations' all-reduce, the agreement (which carries
        # the loss's vetoes); printed by benchmarks/sync_points.py
        assert (names["all_reduce"], names["all_gather_object"]) == (3, 1), names
        assert collectives == 4 and host_reads == 3


def _static_graph(rank: int, world: int) -> dict[str, str]:
    ddp = DDP(models.mlp(), static_graph=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    out: dict[str, str] = {}
    try:
        Accumulator(ddp, opt)
        out["deferred"] = "built"
    except SyncError as exc:
        out["deferred"] = str(exc)
    # the documented way out: every micro-batch synchronizes, which static_graph supports
    acc = Accumulator(ddp, opt, defer_sync=False)
    window = split(models.mlp_batch(4, seed=rank), micro_batch=2)
    out["undeferred"] = str(acc.step(window, models.mlp_loss, models.count_rows).applied)
    return out


def test_static_graph_is_refused_on_every_rank_with_both_fixes() -> None:
    for r in values(run_ranks(_static_graph, timeout_s=60)):
        message = r["deferred"]
        assert message.startswith("DistributedDataParallel was built with static_graph=True")
        assert "cannot defer gradient sync" in message
        assert "build DDP without static_graph" in message and "defer_sync=False" in message
        assert r["undeferred"] == "True"
