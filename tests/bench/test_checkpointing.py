"""Activation checkpointing as a sweep dimension: the same float64 update, and an honest activation
figure (the inputs each checkpointed block keeps, plus what its recomputation holds).

Byte counts are exact (shapes and dtypes fix them), so they are compared with ``==``; the float64
tolerance is :data:`CHECKPOINT_TOLERANCE` (1e-12, argued there: the recomputation runs the same
kernels on the same inputs).
"""

from __future__ import annotations

import pytest
import torch

from gradaccum.bench.checkpointing import (
    CHECKPOINT_TOLERANCE,
    apply_checkpointing,
    check_checkpointing,
    checkpoint_blocks,
)
from gradaccum.bench.measure import measure
from gradaccum.bench.memory import SavedBytes, saved_bytes
from gradaccum.bench.spec import MeasureSpec
from gradaccum.errors import BenchError
from gradaccum.examples import bn_cnn, build_tiny_gpt, sample_sequences, tiny_gpt
from gradaccum.loss import summed_cross_entropy
from tests.bench import workloads

GPT = "gradaccum.examples:tiny_gpt"


@pytest.mark.parametrize("make", [tiny_gpt, workloads.dropout_gpt], ids=["tiny_gpt", "dropout_0.1"])
def test_checkpointed_update_equals_the_plain_one_in_float64(make) -> None:  # type: ignore[no-untyped-def]
    # with dropout, the recomputation must redraw the forward's masks (checkpoint restores the RNG)
    check = check_checkpointing(make())
    assert check.blocks == 2 and check.micro_batches == 4  # batch 8 in micro-batches of 2
    assert check.passed and check.buffers_match, check.describe()
    assert check.grad_max_rel_err <= CHECKPOINT_TOLERANCE and check.param_max_rel_err <= CHECKPOINT_TOLERANCE


def test_the_check_fails_when_a_recomputed_block_is_not_the_same_function() -> None:
    # negative control: blocks whose output drifts from call to call are recomputed differently
    check = check_checkpointing(workloads.drifting_gpt())
    assert not check.passed and check.grad_max_rel_err > 1e-4, check.describe()
    assert check.describe().startswith("FAIL")


def test_blocks_are_the_module_list_members_or_the_declared_ones() -> None:
    model = build_tiny_gpt()
    assert checkpoint_blocks(tiny_gpt(), model) == list(model.blocks)
    with pytest.raises(BenchError, match=r"no repeated blocks.*extras\['checkpoint_blocks'\]"):
        checkpoint_blocks(bn_cnn(), bn_cnn().build_model())
    declared = workloads.bn_declared()
    cnn = declared.build_model()
    assert checkpoint_blocks(declared, cnn) == [cnn.layer1]
    # BatchNorm in a checkpointed block: the same gradients, but its running statistics are
    # updated again by the recomputation, which the check reports
    check = check_checkpointing(declared)
    assert check.passed and not check.buffers_match
    assert "buffers differ" in check.describe()


def _block_bytes(micro: int) -> tuple[list[int], list[int]]:
    """Each block's own saved bytes (its inputs and parameters excluded) and its input's bytes, on
    a plain model, counted block by block without any checkpoint."""
    model = build_tiny_gpt()
    ids = sample_sequences(micro, 4)["input_ids"]
    x = model.drop(model.tok(ids) + model.pos(torch.arange(ids.shape[1])))
    internal, inputs = [], []
    for block in model.blocks:
        counter = SavedBytes(exclude=[*model.parameters(), x])
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            y = block(x)
        internal.append(counter.bytes)
        inputs.append(x.numel() * x.element_size())
        x = y
    return internal, inputs


@pytest.mark.parametrize("micro", [2, 4])
def test_activation_bytes_keep_the_block_inputs_and_add_the_recomputation(micro: int) -> None:
    figures = {}
    for mode in ("none", "full"):
        spec = MeasureSpec(
            workload=GPT, micro_batch=micro, accum_steps=2, steps=1, warmup=1, checkpointing=mode
        )
        figures[mode] = measure(tiny_gpt(), spec).memory
    plain, ckpt = figures["none"], figures["full"]
    assert plain is not None and ckpt is not None
    internal, inputs = _block_bytes(micro)
    assert plain.recompute_bytes == 0 and plain.saved_bytes == plain.activation_bytes
    # the outer hooks lose exactly the blocks' own saved tensors: the inputs each block keeps for
    # its recomputation still count (were they lost too, the gap would be larger by sum(inputs))
    assert ckpt.saved_bytes == plain.activation_bytes - sum(internal)
    assert ckpt.saved_bytes > sum(inputs) > 0
    # and the recomputation of the largest block is added back: the honest peak
    assert ckpt.recompute_bytes == max(internal)
    assert ckpt.activation_bytes == ckpt.saved_bytes + max(internal) < plain.activation_bytes
    assert ckpt.persistent_bytes == plain.persistent_bytes  # checkpointing changes no parameter


def test_the_recomputation_probe_leaves_the_update_unchanged() -> None:
    # the probe's extra block forward forks the RNG and drops its graph: one counted update with the
    # probe active equals one without it, in float64, dropout on
    from gradaccum.bench.checkpointing import RecomputeProbe

    batch = sample_sequences(4, 9)
    grads = []
    for active in (False, True):
        model = build_tiny_gpt(dropout=0.1, dtype=torch.float64)
        probe = RecomputeProbe()
        probe.active = active
        apply_checkpointing(list(model.blocks), probe)
        torch.manual_seed(3)
        with saved_bytes(model):
            loss = summed_cross_entropy(model(batch["input_ids"]), batch["labels"], shift=False)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        assert (probe.largest_bytes > 0) == active
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_blocks_inside_other_blocks_are_left_to_the_outer_checkpoint() -> None:
    import torch.nn as nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(2))

    model = Model()
    assert checkpoint_blocks(tiny_gpt(), model) == list(model.layers)  # not the six experts too
