"""CUDA graphs through the step (``mode="reduce-overhead"``): not run on the CPU machines so far.

CUDA graphs replay fixed shapes and fixed memory: each padded length is one graph, and the step's
scale (a 0-dim tensor multiplied outside the model) never enters one. float32 on the GPU: TF32 is
switched off so that the tolerance can be that of float32 reordering (1e-5 relative).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from gradaccum import Accumulator, windows
from gradaccum.examples.gpt import sample_sequences
from tests.helpers import models
from tests.helpers.reference import full_batch_grads, grads_of, max_rel_err

pytestmark = pytest.mark.cuda


def test_reduce_overhead_with_padded_windows_is_exact_and_stops_recompiling() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.compiler.reset()
    model = models.gpt(seed=11).float().cuda()
    state = copy.deepcopy(model.state_dict())
    fast = torch.compile(model, mode="reduce-overhead", dynamic=False)
    acc = Accumulator(fast, torch.optim.SGD(fast.parameters(), lr=0.0))
    rng = random.Random(0)
    stream = [
        {k: v.cuda() for k, v in sample_sequences(4, 300 + i, max_len=rng.randint(5, 32), min_len=4).items()}
        for i in range(40)
    ]
    results = []
    for window in windows(stream, 2, pad_to_multiple=16):
        results.append(acc.step(window, models.gpt_loss, models.tokens))
        ref = models.gpt(seed=11).float().cuda()
        ref.load_state_dict(state)
        batch = {key: torch.cat([mb[key] for mb in window]) for key in window[0]}
        if window[0]["input_ids"].shape == window[1]["input_ids"].shape:
            want = full_batch_grads(ref, batch, models.gpt_loss, models.tokens)
            got = {n.removeprefix("_orig_mod."): g for n, g in grads_of(fast).items()}
            assert max_rel_err(got, want) < 1e-5
    assert sum(r.recompiles for r in results[10:]) == 0  # lengths 16 and 32 only: compiled early
    torch.compiler.reset()
