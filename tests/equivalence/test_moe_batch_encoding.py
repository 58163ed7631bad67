"""MoE exact mode on micro-batches a tokenizer or collator returns: transformers' ``BatchEncoding``.

A ``BatchEncoding`` is a mapping but not a dict; the balancing term must read its attention mask
as it reads a dict's, or the padded positions are routed and counted (the update was then 6.65e-1
from the full batch's, 2.43e-1 through ``split_by_tokens``). Tolerance 1e-10 (relative L2 of the
update), as in test_moe_balance.py: the same float64 sums in a different order, ~1e-15 apart.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from transformers import BatchEncoding

from gradaccum import Accumulator, split_by_tokens
from gradaccum.moe import LoadBalance
from tests.helpers import moe as h

TOL = 1e-10
LENGTHS = (5, 7, 3, 8, 6, 4, 7, 5)


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return h.tiny_moe()


@pytest.fixture(scope="module")
def seqs() -> list[torch.Tensor]:
    return h.sequences(LENGTHS, seed=1)


@pytest.fixture(scope="module")
def reference(model: nn.Module, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    return h.reference_update(model, seqs, coef=0.05)


def _update(model: nn.Module, window: list[Any]) -> list[torch.Tensor]:
    m = copy.deepcopy(model)
    before = [p.detach().clone() for p in m.parameters()]
    acc = Accumulator(m, torch.optim.SGD(m.parameters(), lr=1.0), balance=LoadBalance.from_model(m))
    assert acc.step(window, h.ce_sum, h.tokens).applied
    return h.update_of(m, before)


def test_batch_encoding_micro_batches_are_exact(
    model: nn.Module, seqs: list[torch.Tensor], reference: list[torch.Tensor]
) -> None:
    # every micro-batch padded to the window's longest row: each holds padding the term must mask
    window = [BatchEncoding(h.pad(seqs[i : i + 2], width=max(LENGTHS))) for i in range(0, 8, 2)]
    assert all(not isinstance(mb, dict) for mb in window)
    assert h.rel_l2(_update(model, window), reference) <= TOL


def test_split_by_tokens_over_a_batch_encoding_is_exact(
    model: nn.Module, seqs: list[torch.Tensor], reference: list[torch.Tensor]
) -> None:
    batch = BatchEncoding(h.pad(seqs))
    window = split_by_tokens(batch, 24)
    assert len(window) > 1 and all(isinstance(mb, BatchEncoding) for mb in window)
    # rows of unequal lengths share a micro-batch: some padding is left after trimming
    assert any(bool((mb["attention_mask"] == 0).any()) for mb in window)
    assert h.rel_l2(_update(model, window), reference) <= TOL
