"""Micro-batches by a token budget: ``gradaccum.split_by_tokens`` and token-budget windows.

The window of the issue: 256 sequences of skewed lengths (8 to 512 tokens, median 51), a budget of
2,048 tokens per micro-batch, 4 data ranks.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch

import gradaccum
from gradaccum.errors import PlanError
from gradaccum.tokens.balance import assign, cut, plan_tokens

BUDGET = 2048
WORLD = 4


def skewed_lengths(n: int = 256, seed: int = 1) -> list[int]:
    """Log-normal lengths around 51 tokens, clipped to 8..512: many short rows, a long tail."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.exp(torch.randn(n, generator=g) + math.log(51.0))
    return [int(x) for x in draws.round().clamp(8, 512).tolist()]


def padded_batch(lengths: list[int]) -> dict[str, torch.Tensor]:
    """Right-padded rows: ids 1.. on tokens, 0 on padding; labels -100 on padding; ``row``: each
    row's index (a per-row tensor of one dim, which the cut keeps untrimmed)."""
    longest = max(lengths)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 1000, (len(lengths), longest), generator=g)
    mask = (torch.arange(longest) < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    return {
        "input_ids": ids,
        "labels": ids.masked_fill(mask == 0, -100),
        "attention_mask": mask,
        "row": torch.arange(len(lengths)),
    }


@pytest.fixture(scope="module")
def window() -> dict[str, torch.Tensor]:
    lengths = skewed_lengths()
    assert (min(lengths), max(lengths)) == (8, 512) and sorted(lengths)[128] == 51
    return padded_batch(lengths)


def _ranks(batch: dict[str, torch.Tensor], equal_count: bool = False) -> list[list[dict[str, torch.Tensor]]]:
    return [
        gradaccum.split_by_tokens(batch, BUDGET, rank=r, world=WORLD, equal_count=equal_count)
        for r in range(WORLD)
    ]


@pytest.mark.parametrize("equal_count", [False, True])
def test_every_row_exactly_once_within_the_budget_and_trimmed(
    window: dict[str, torch.Tensor], equal_count: bool
) -> None:
    ranks = _ranks(window, equal_count)
    rows = [int(r) for rank in ranks for mb in rank for r in mb["row"]]
    assert sorted(rows) == list(range(256))
    for rank in ranks:
        assert rank, "every rank gets a micro-batch"
        for mb in rank:
            n, seq = mb["input_ids"].shape
            assert n * seq <= BUDGET
            assert set(mb) == set(window)
            assert mb["labels"].shape == mb["attention_mask"].shape == (n, seq)
            # trimmed to its own longest row: the last column holds a token
            assert mb["attention_mask"][:, -1].any()
            for i, r in enumerate(mb["row"].tolist()):
                for key in ("input_ids", "labels", "attention_mask"):
                    assert torch.equal(mb[key][i], window[key][r, :seq])
                # what was cut off the row is padding only
                assert not window["attention_mask"][r, seq:].any()


@pytest.mark.parametrize("equal_count", [False, True])
def test_little_padding_few_micro_batches_and_balanced_ranks(
    window: dict[str, torch.Tensor], equal_count: bool
) -> None:
    ranks = _ranks(window, equal_count)
    valid = [sum(int(mb["attention_mask"].sum()) for mb in rank) for rank in ranks]
    computed = sum(mb["input_ids"].numel() for rank in ranks for mb in rank)
    total = int(window["attention_mask"].sum())
    assert sum(valid) == total
    assert 1 - total / computed <= 0.12
    fewest = math.ceil(total / BUDGET)  # every valid token computed once, at most BUDGET per micro-batch
    assert sum(len(rank) for rank in ranks) <= 1.5 * fewest
    mean = total / WORLD
    assert max(abs(v - mean) for v in valid) <= 0.05 * mean
    if equal_count:
        assert len({len(rank) for rank in ranks}) == 1


def test_fixed_micro_batches_in_dataset_order_compute_mostly_padding(window: dict[str, torch.Tensor]) -> None:
    """The control: 4 rows per micro-batch (the most that fit 2,048 tokens at 512), in order."""
    lengths = window["attention_mask"].sum(dim=1)
    computed = sum(4 * int(lengths[i : i + 4].max()) for i in range(0, 256, 4))
    assert 1 - int(lengths.sum()) / computed > 0.4


def test_the_cut_is_deterministic(window: dict[str, torch.Tensor]) -> None:
    first, again = _ranks(window), _ranks(window)
    for a, b in zip(first, again, strict=True):
        assert [mb["row"].tolist() for mb in a] == [mb["row"].tolist() for mb in b]


def test_a_sequence_longer_than_the_budget_is_refused_naming_length_and_budget() -> None:
    batch = padded_batch([10, 600, 30, 40])
    with pytest.raises(gradaccum.PlanError, match=r"600 tokens, longer than max_tokens=512"):
        gradaccum.split_by_tokens(batch, 512, world=2)


@pytest.mark.parametrize(
    ("batch", "kwargs", "match"),
    [
        ({"input_ids": torch.ones(4, 3)}, {}, "attention_mask"),
        ({"attention_mask": torch.ones(4)}, {}, r"must be a \(rows, seq\) tensor"),
        (torch.ones(4, 3), {}, "attention_mask"),
        (padded_batch([3, 4]), {"world": 3}, "2 rows for 3 ranks"),
        (padded_batch([3, 4]), {"world": 2, "rank": 2}, "rank=2 is not one of"),
        (padded_batch([3, 4]), {"world": 0}, "world must be a positive integer"),
    ],
)
def test_bad_input_is_refused(batch: Any, kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        gradaccum.split_by_tokens(batch, 64, **kwargs)


def test_equal_count_that_cannot_be_reached_is_refused() -> None:
    # three rows that each fill the budget cannot be dealt equally to two ranks
    with pytest.raises(PlanError, match="equal_count=True"):
        plan_tokens([8, 8, 8], 8, world=2, equal_count=True)


def test_without_an_attention_mask_the_labels_mark_the_tokens() -> None:
    batch = padded_batch([5, 30, 7, 12])
    del batch["attention_mask"]
    micro_batches = gradaccum.split_by_tokens(batch, 32)
    assert [mb["row"].tolist() for mb in micro_batches] == [[1], [3, 2], [0]]
    assert [mb["input_ids"].shape[1] for mb in micro_batches] == [30, 12, 5]


def test_rows_without_a_token_keep_one_position() -> None:
    batch = padded_batch([5, 3, 4])
    batch["attention_mask"][1] = 0
    (mb,) = gradaccum.split_by_tokens(batch, 64)
    assert mb["input_ids"].shape == (3, 5)
    plan = plan_tokens([1, 1], 1, world=2)
    assert plan.ranks == (((0,),), ((1,),))


def test_the_cut_fills_each_micro_batch_until_the_next_row_would_overflow() -> None:
    assert cut([3, 9, 4, 8, 2], 18) == [[1, 3], [2, 0, 4]]


def test_largest_differencing_balances_and_keeps_counts_equal_when_asked() -> None:
    # greedy longest-first placement ends 17 | 13 here; largest differencing 16 | 14
    weights = [8, 7, 6, 5, 4]
    sets = assign(weights, 2)
    assert sorted(sum(weights[i] for i in s) for s in sets) == [14, 16]
    assert sorted(i for s in sets for i in s) == list(range(5))
    sets = assign([10, 1, 1, 1], 2, equal_count=True)
    assert [len(s) for s in sets] == [2, 2]
    assert sorted(sum([10, 1, 1, 1][i] for i in s) for s in sets) == [2, 11]


def _documents(lengths: list[int]) -> list[list[int]]:
    return [[1 + (7 * d + t) % 97 for t in range(n)] for d, n in enumerate(lengths)]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_token_budget_windows_hold_every_document_once(layout: str) -> None:
    lengths = skewed_lengths(100, seed=3)
    docs = _documents(lengths)
    found: list[list[int]] = []
    windows_seen = 0
    for rank in range(2):
        windows = list(
            gradaccum.windows(docs, max_tokens=1024, global_batch=40, rank=rank, world=2, layout=layout)
        )
        windows_seen = len(windows)
        for window in windows:
            for mb in window:
                assert mb["input_ids"].numel() <= 1024
                assert mb["labels"].shape == mb["input_ids"].shape
                found += _read_documents(mb, layout)
    assert windows_seen == 3  # 40 + 40 + the short final window of 20
    assert sorted(found) == sorted(docs)


def _read_documents(mb: dict[str, torch.Tensor], layout: str) -> list[list[int]]:
    out: list[list[int]] = []
    for r in range(mb["input_ids"].shape[0]):
        ids = mb["input_ids"][r].tolist()
        if layout == "padded":
            out.append([t for t, m in zip(ids, mb["attention_mask"][r].tolist(), strict=True) if m])
            continue
        assert "attention_mask" not in mb
        starts = [i for i, p in enumerate(mb["position_ids"][r].tolist()) if p == 0] + [len(ids)]
        docs = [ids[a:b] for a, b in itertools.pairwise(starts)]
        out += [d for d in docs if d and d[0] != 0]  # the row's padding is one id-0 pseudo-document
    return out


def test_packed_windows_compute_less_padding_than_padded_ones() -> None:
    docs = _documents(skewed_lengths(256))

    def padding(layout: str) -> float:
        (window,) = gradaccum.windows(docs, max_tokens=BUDGET, global_batch=256, layout=layout)
        computed = sum(mb["input_ids"].numel() for mb in window)
        return 1 - sum(map(len, docs)) / computed

    assert padding("packed") < 0.02 < padding("padded")


def test_windows_refuse_a_long_document_and_mixed_settings() -> None:
    with pytest.raises(PlanError, match=r"document 3 holds 70 tokens, more than max_tokens=64"):
        next(gradaccum.windows(_documents([5, 6, 7, 70]), max_tokens=64, global_batch=4))
    with pytest.raises(PlanError, match="max_tokens needs global_batch"):
        gradaccum.windows([], max_tokens=64)
    with pytest.raises(PlanError, match="not accum_steps"):
        gradaccum.windows([], 4, max_tokens=64, global_batch=4)
    with pytest.raises(PlanError, match="give max_tokens with them"):
        gradaccum.windows([], 4, world=2)
    with pytest.raises(PlanError, match="accum_steps .* or max_tokens"):
        gradaccum.windows([])
