"""FSDP2 rows of a sweep, measured for real on two gloo processes: persistent bytes per rank, the
bytes communicated per update, and the gradients held with sync deferral on and off.

Every figure is a byte count fixed by shapes, so the assertions are exact. FSDP2 pads each
parameter's dim 0 to a multiple of the world size, so its gradient set per synchronizing backward
is P = sum over parameters of ceil(d0 / W) * W * (the other dims) * 4 bytes, which for the tiny GPT on
W = 2 is 127,240 bytes against the 126,980 of the unpadded gradients G.
"""

from __future__ import annotations

import math

import pytest

from gradaccum.bench.measure import measure
from gradaccum.bench.spec import BenchError, MeasureSpec
from gradaccum.examples import build_tiny_gpt, tiny_gpt
from tests.helpers.launcher import run_ranks, values

GPT = "gradaccum.examples:tiny_gpt"
K = 3  # micro-batches per update


def _rows(rank: int, world: int) -> dict:
    out = {}
    for ckpt, defer in (("none", True), ("none", False), ("full", True)):  # checkpointing inside FSDP2 too
        spec = MeasureSpec(
            workload=GPT,
            micro_batch=2,
            accum_steps=K,
            dp=world,
            steps=1,
            warmup=1,
            fsdp=True,
            defer_sync=defer,
            checkpointing=ckpt,
            threads=1,
        )
        out[(ckpt, defer)] = measure(tiny_gpt(), spec).to_dict()
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_rows_show_communication_and_gradient_memory_with_deferral_on_and_off() -> None:
    r0, r1 = values(run_ranks(_rows, timeout_s=180))
    assert r0 == r1  # every rank returns the combined figures
    model = build_tiny_gpt()
    unpadded = sum(4 * p.numel() for p in model.parameters())
    padded = sum(4 * math.ceil(p.shape[0] / 2) * 2 * (p.numel() // p.shape[0]) for p in model.parameters())
    single = {
        ckpt: measure(
            tiny_gpt(),
            MeasureSpec(
                workload=GPT, micro_batch=2, accum_steps=2 * K, steps=1, warmup=1, checkpointing=ckpt
            ),
        ).memory
        for ckpt in ("none", "full")
    }
    for (ckpt, defer), m in r0.items():
        memory = m["memory"]
        assert m["gradient_bytes"] == unpadded
        assert m["reduce_scatter_bytes_per_sync"] == padded
        # persistent per rank: one shard of the padded parameters and of their gradients (SGD: no state)
        assert memory["parameter_bytes"] == memory["gradient_bytes"] == padded // 2
        assert memory["optimizer_state_bytes"] == 0
        # reduce-scatter once per update with deferral, once per micro-batch without
        assert m["reduce_scatter_bytes_per_update"] == (1 if defer else K) * padded
        assert m["reduce_scatter_calls_per_update"] == (1 if defer else K) * 3  # 3 units: 2 blocks + root
        # deferral keeps the unsharded gradients (the whole set) on every rank until the last
        # micro-batch; without it a rank holds its shard only
        assert memory["held_gradient_bytes"] == (unpadded if defer else padded // 2)
        # the same activations as one process running both ranks' micro-batches (the loss keeps
        # only valid positions, so the figure depends on the data): the parameters FSDP2 gathers
        # for a forward are not counted as activations
        assert memory["activation_bytes"] == single[ckpt].activation_bytes
        assert memory["recompute_bytes"] == single[ckpt].recompute_bytes
        assert m["allreduce_bytes_per_update"] is None
    # deferral changes no parameter gather: forward of every unit, backward of the blocks, per micro-batch
    gathers = {m["allgather_bytes_per_update"] for m in r0.values()}
    assert len(gathers) == 1 and gathers.pop() > K * padded


def test_fsdp2_needs_data_parallelism() -> None:
    with pytest.raises(BenchError, match="needs dp > 1"):
        MeasureSpec(workload=GPT, micro_batch=2, accum_steps=2, fsdp=True)
