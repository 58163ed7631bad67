"""The step with a compiled model: exact, the scale outside every graph, recompiles counted.

Tolerance 1e-12 relative L2 per parameter, as for the eager float64 tests: ``aot_eager`` captures
the forward with dynamo and runs the traced aten graph (the same kernels in the same order), and
inductor on CPU generates float64 C++ whose fused reductions may sum in another order, which moves
float64 results by ~1e-15 relative; the controls (a mean of means, a scale baked into a graph) are
off by 1e-2 or more. Compiling is slow on this CPU (inductor ~45 s for the tiny GPT unloaded), so
the pure exactness tests use ``backend="aot_eager"`` (dynamo graph capture and AOT autograd's
traced backward, no code generation) on one module-scoped compiled model, and one test compiles
with inductor.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn

from gradaccum import Accumulator, CachedAccumulator, split, windows
from gradaccum.batch import concat
from gradaccum.examples.gpt import sample_sequences
from gradaccum.step.compiled import graphs_compiled
from tests.equivalence.test_cache import encode_pairs, pairs_batch, retrieval_loss, two_tower
from tests.helpers import models
from tests.helpers.reference import full_batch_grads, grads_of, max_rel_err

REL_TOL = 1e-12
MIXED_BOUND = 1
"""Recompiles allowed in windows of mixed lengths after warm-up (gradaccum.step.compiled)."""


def _reference(state: dict[str, torch.Tensor], batch: Any) -> dict[str, torch.Tensor]:
    ref = models.gpt()
    ref.load_state_dict(state)
    return full_batch_grads(ref, batch, models.gpt_loss, models.tokens)


def _unprefixed(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name.removeprefix("_orig_mod."): g for name, g in grads.items()}


@pytest.fixture(scope="module")
def compiled() -> Iterator[tuple[nn.Module, nn.Module, dict[str, torch.Tensor]]]:
    """One tiny GPT compiled once for the module; each test restores the weights it starts from."""
    torch.compiler.reset()  # graphs of other modules' compiled models count towards dynamo's limits
    model = models.gpt()
    state = copy.deepcopy(model.state_dict())
    yield model, torch.compile(model, backend="aot_eager"), state
    torch.compiler.reset()


def test_an_eager_step_reports_no_recompiles() -> None:
    model = models.gpt()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    result = acc.step(split(models.gpt_batch(4, seed=1), micro_batch=2), models.gpt_loss, models.tokens)
    assert result.applied and result.recompiles == 0


def test_the_compiled_update_equals_the_full_batch_reference(compiled: Any) -> None:
    model, fast, state = compiled
    model.load_state_dict(state)
    acc = Accumulator(fast, torch.optim.SGD(fast.parameters(), lr=0.1))
    batch = models.gpt_batch(6, seed=1)
    before = graphs_compiled()
    result = acc.step(split(batch, sizes=[2, 4]), models.gpt_loss, models.tokens)
    assert graphs_compiled() > before or result.recompiles == 0  # compiled now or by an earlier test
    assert result.recompiles == graphs_compiled() - before
    assert max_rel_err(_unprefixed(grads_of(fast)), _reference(state, batch)) < REL_TOL
    # and the update is the eager accumulator's on the same window
    eager = models.gpt()
    eager.load_state_dict(state)
    eager_acc = Accumulator(eager, torch.optim.SGD(eager.parameters(), lr=0.1))
    eager_result = eager_acc.step(split(batch, sizes=[2, 4]), models.gpt_loss, models.tokens)
    assert result.loss == pytest.approx(eager_result.loss, rel=REL_TOL)
    got = {n: p.detach() for n, p in model.named_parameters()}
    assert max_rel_err(got, dict(eager.named_parameters())) < REL_TOL


def _masked(batch: dict[str, torch.Tensor], keep: int) -> dict[str, torch.Tensor]:
    """The same tensors (shapes) with labels past ``keep`` ignored: another N, the same graph."""
    labels = batch["labels"].clone()
    labels[:, keep:] = -100
    return {"input_ids": batch["input_ids"], "labels": labels}


def test_two_windows_with_different_counts_through_one_graph_each_match_a_full_batch(compiled: Any) -> None:
    model, fast, state = compiled
    model.load_state_dict(state)
    acc = Accumulator(fast, torch.optim.SGD(fast.parameters(), lr=0.0))  # lr 0: one weight state
    full = models.gpt_batch(4, seed=2)
    acc.step(split(full, micro_batch=2), models.gpt_loss, models.tokens)  # compile these shapes
    counts = []
    for batch in (full, _masked(full, 6)):
        result = acc.step(split(batch, micro_batch=2), models.gpt_loss, models.tokens)
        # no recompile: the graph holds no N, so the second window ran the first one's graph
        assert result.recompiles == 0
        assert max_rel_err(_unprefixed(grads_of(fast)), _reference(state, batch)) < REL_TOL
        counts.append(result.global_count)
    assert counts[0] > 2 * counts[1]  # the denominators really differ (4 rows of up to 32 vs 6)


def test_model_compile_in_place_is_exact_too() -> None:
    model = models.gpt(seed=3)
    state = copy.deepcopy(model.state_dict())
    model.compile(backend="aot_eager")  # the module itself, compiled in place (no OptimizedModule)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch = models.gpt_batch(6, seed=4)
    before = graphs_compiled()
    result = acc.step(split(batch, sizes=[3, 3]), models.gpt_loss, models.tokens)
    assert result.recompiles == graphs_compiled() - before >= 1
    ref = models.gpt(seed=3)
    ref.load_state_dict(state)
    want = full_batch_grads(ref, batch, models.gpt_loss, models.tokens)
    assert max_rel_err(grads_of(model), want) < REL_TOL


def _mixed_stream(rng: random.Random, n: int, first_seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """Micro-batches of 2-4 rows, each padded to its own random length in 5..32 (fresh tensors, as
    a DataLoader yields them)."""
    for i in range(n):
        rows, length = rng.choice([2, 3, 4]), rng.randint(5, 32)
        yield sample_sequences(rows, first_seed + i, max_len=length, min_len=4)


def test_mixed_lengths_after_warm_up_stay_within_the_recompile_bound(compiled: Any) -> None:
    torch.compiler.reset()
    model, fast, state = compiled
    model.load_state_dict(state)
    acc = Accumulator(fast, torch.optim.SGD(fast.parameters(), lr=0.01))
    rng = random.Random(0)
    warm_up = windows(_mixed_stream(rng, 6, 0), 2)
    warm = [acc.step(w, models.gpt_loss, models.tokens).recompiles for w in warm_up]
    # the first window compiles; a second shape recompiles once with dynamic dimensions
    assert warm[0] >= 1 and sum(warm) >= 2, warm
    counted = [acc.step(w, models.gpt_loss, models.tokens) for w in windows(_mixed_stream(rng, 40, 100), 2)]
    assert len(counted) == 20 and all(r.applied for r in counted)
    assert sum(r.recompiles for r in counted) <= MIXED_BOUND, [r.recompiles for r in counted]


def test_a_cached_accumulator_with_a_compiled_encoder_is_exact() -> None:
    ref, model = two_tower(), two_tower()
    fast = torch.compile(model, backend="aot_eager")
    batch = pairs_batch()
    loss = retrieval_loss(ref)
    ref.zero_grad()
    loss(encode_pairs(ref, batch)).backward()
    want = grads_of(ref)
    acc = CachedAccumulator(fast, torch.optim.SGD(fast.parameters(), lr=0.1))
    result = acc.step(split(batch, sizes=[3, 5]), encode_pairs, retrieval_loss(model))
    assert result.applied and result.recompiles >= 1
    assert max_rel_err(_unprefixed(grads_of(fast)), want) < REL_TOL


def test_padding_to_a_multiple_keeps_counts_and_the_update() -> None:
    lengths = [5, 13, 21, 9]
    stream = [sample_sequences(2, 50 + i, max_len=n, min_len=4) for i, n in enumerate(lengths)]
    padded = [w for w in windows(stream, 2, pad_to_multiple=8)]
    assert [mb["input_ids"].shape[1] for w in padded for mb in w] == [8, 16, 24, 16]
    for w, original in zip(padded, windows(stream, 2), strict=True):
        assert [models.tokens(mb).item() for mb in w] == [models.tokens(mb).item() for mb in original]
    # the padded window's update is the unpadded one's: a causal model, padded labels ignored
    grads = []
    for window in (padded[0], next(iter(windows(stream, 2)))):
        model = models.gpt(seed=5)
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
        acc.step(window, models.gpt_loss, models.tokens)
        grads.append(grads_of(model))
    assert max_rel_err(grads[0], grads[1]) < REL_TOL
    assert concat([padded[0][0], padded[0][0]])["labels"].shape == (4, 8)


def test_a_static_compile_with_padding_builds_one_graph_per_padded_length() -> None:
    torch.compiler.reset()
    model = models.gpt(seed=6)
    fast = torch.compile(model, backend="aot_eager", dynamic=False)
    acc = Accumulator(fast, torch.optim.SGD(fast.parameters(), lr=0.01))
    rng = random.Random(1)
    stream = [sample_sequences(2, 200 + i, max_len=rng.randint(5, 32), min_len=4) for i in range(24)]
    results = [acc.step(w, models.gpt_loss, models.tokens) for w in windows(stream, 2, pad_to_multiple=16)]
    # lengths pad to 16 or 32: two graphs, however many lengths the data has (unpadded: up to 28,
    # past dynamo's recompile_limit of 8, after which it would silently run eager)
    assert sum(r.recompiles for r in results) == 2
    torch.compiler.reset()


@pytest.mark.slow
@pytest.mark.timeout(900)  # inductor's C++ build: ~45 s unloaded, 7 min measured on a loaded 2-core CPU
def test_inductor_compiled_update_equals_the_full_batch_reference_in_float64() -> None:
    torch.compiler.reset()
    model = models.gpt(seed=7)
    state = copy.deepcopy(model.state_dict())
    fast = torch.compile(model)  # the default backend: inductor, float64 C++ kernels on this CPU
    acc = Accumulator(fast, torch.optim.SGD(fast.parameters(), lr=0.0))
    for seed in (8, 9):  # equal micro-batch shapes: one graph, compiled in the first window only
        batch = models.gpt_batch(6, seed=seed)
        result = acc.step(split(batch, micro_batch=3), models.gpt_loss, models.tokens)
        assert result.recompiles == (1 if seed == 8 else 0)
        ref = models.gpt(seed=7)
        ref.load_state_dict(state)
        want = full_batch_grads(ref, batch, models.gpt_loss, models.tokens)
        assert max_rel_err(_unprefixed(grads_of(fast)), want) < REL_TOL
    torch.compiler.reset()
