"""The training stream's data seeds: one stream per run seed, within the 32 bits generators keep."""

from __future__ import annotations

import itertools

import torch

from gradaccum.examples import tiny_gpt
from gradaccum.train.data import SEED_SPACE, eval_seed, train_seed


def test_seed_0_is_the_documented_stream() -> None:
    assert [train_seed(0, w) for w in range(3)] == [1, 2, 3]
    assert eval_seed(0, 0) == 2**31


def test_every_data_seed_fits_a_torch_generator_and_is_never_the_verification_seed() -> None:
    for seed in (0, 1, 7, 12345, 2**40 + 3):
        for window in (0, 1, 2**31 - 2):
            for value in (train_seed(seed, window), eval_seed(seed, window)):
                assert 1 <= value <= SEED_SPACE


def test_run_seeds_draw_different_examples() -> None:
    # a CPU generator keeps the low 32 bits only: streams laid out above bit 32 would all be seed 0's
    workload = tiny_gpt()
    for draw in (train_seed, eval_seed):
        batches = [workload.make_batch(4, draw(s, 0))["input_ids"] for s in range(3)]
        assert not torch.equal(batches[0], batches[1]) and not torch.equal(batches[1], batches[2])


def test_streams_of_the_first_thousand_seeds_stay_apart() -> None:
    starts = sorted({train_seed(s, 0) for s in range(1001)} | {eval_seed(s, 0) for s in range(1001)})
    assert len(starts) == 2002
    assert min(b - a for a, b in itertools.pairwise(starts)) > 1_500_000
