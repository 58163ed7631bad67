"""Memory from the tensors: persistent bytes are parameters + gradients + optimizer state, counted
once per storage; activation bytes are what a forward saves for backward and follow the micro-batch.

Exact where the arithmetic is exact (an MLP whose every saved tensor has the micro-batch as its first
dimension doubles exactly); the tiny GPT also saves tensors that do not grow with the micro-batch
(its causal mask, position embeddings' indices), so there the ratio is 2 within 10 %.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from gradaccum import Accumulator, split
from gradaccum.bench.measure import measure
from gradaccum.bench.memory import MemoryFigures, persistent_bytes, saved_bytes
from gradaccum.bench.models import fit_memory_model
from gradaccum.bench.spec import MeasureSpec
from gradaccum.check.workload import load_workload

FLOAT = 4  # bytes of a float32 element


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def test_persistent_bytes_are_parameters_gradients_and_adam_state_each_once() -> None:
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = Accumulator(model, optimizer)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    acc.step(split((x, y), micro_batch=4), lambda m, mb: ((m(mb[0]) - mb[1]) ** 2).sum(), lambda mb: 4)
    elements = sum(p.numel() for p in model.parameters())  # 6*16 + 16 + 16*3 + 3 = 163
    tensors = len(list(model.parameters()))
    param, grad, state = persistent_bytes(model, optimizer)
    assert param == grad == FLOAT * elements
    # AdamW: two moments per parameter element and a 0-dim float32 step counter per parameter
    assert state == 2 * FLOAT * elements + FLOAT * tensors
    # a view of a parameter, or the same parameter twice, is not counted again
    tied = nn.ModuleDict({"a": model, "b": model})
    assert persistent_bytes(tied, optimizer) == (param, grad, state)


def test_a_sparse_gradient_counts_its_indices_and_values() -> None:
    """nn.Embedding(sparse=True)'s gradient has no storage of its own: its bytes are those of its
    indices (int64, one row per looked-up token) and values (one embedding row per token)."""
    model = nn.Embedding(10, 4, sparse=True)
    tokens = torch.tensor([1, 3, 3, 7, 0])
    model(tokens).sum().backward()
    param, grad, _ = persistent_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert param == FLOAT * 10 * 4
    assert model.weight.grad is not None and model.weight.grad.is_sparse
    assert grad == 8 * len(tokens) + FLOAT * len(tokens) * 4  # indices (1 x 5 int64) + values (5 x 4)


@pytest.mark.parametrize("micro", [1, 2, 4, 8])
def test_activation_bytes_are_exactly_proportional_to_the_micro_batch_of_an_mlp(micro: int) -> None:
    model = _mlp()
    x = torch.randn(micro, 6)
    with saved_bytes(model) as saved:
        loss = model(x).square().sum()
    loss.backward()  # the hooks handed every tensor back: the backward runs as without them
    # the first Linear saves its input (6 floats per example); Tanh saves its output (16), which is
    # the second Linear's saved input too: one storage, counted once; square saves its input (3)
    assert saved.bytes == FLOAT * micro * (6 + 16 + 3)


def test_the_tiny_gpt_activation_term_halves_and_the_persistent_term_stays() -> None:
    workload = load_workload("gradaccum.examples:tiny_gpt")
    figures = {}
    for micro, accum in ((8, 2), (4, 4)):
        spec = MeasureSpec(
            workload="gradaccum.examples:tiny_gpt", micro_batch=micro, accum_steps=accum, steps=1, warmup=1
        )
        memory = measure(workload, spec).memory
        assert isinstance(memory, MemoryFigures)
        figures[micro] = memory
    assert figures[8].persistent_bytes == figures[4].persistent_bytes
    assert 1.8 < figures[8].activation_bytes / figures[4].activation_bytes < 2.0
    model = fit_memory_model([8, 4], [figures[8].activation_bytes, figures[4].activation_bytes], 1000.0)
    assert model.per_example_bytes == pytest.approx(
        (figures[8].activation_bytes - figures[4].activation_bytes) / 4
    )


def test_the_budget_advice_names_the_fitting_micro_batch_or_the_persistent_wall() -> None:
    mib = 1024**2
    model = fit_memory_model([1, 2, 4], [1 * mib, 2 * mib, 4 * mib], 10 * mib)
    assert model.largest_micro_batch(16 * mib) == 6
    fits = model.advice(16 * mib, global_batch=32, dp=1)
    assert "micro-batches up to 6 fit 16.0 MiB" in fits and "4x8" in fits
    wall = model.advice(8 * mib, global_batch=32, dp=1)
    assert "persistent state alone (10.0 MiB" in wall and "exceeds the budget of 8.0 MiB" in wall
    assert "neither a smaller micro-batch nor more accumulation can fix that" in wall and "shard" in wall
    none = model.advice(10.5 * mib, global_batch=32, dp=1)
    assert none.startswith("not even one example per micro-batch fits")
