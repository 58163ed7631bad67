"""One reading of a micro-batch's fields (``gradaccum.batch.fields``): any mapping (dict,
transformers' ``BatchEncoding``, ``UserDict``), a namedtuple or a dataclass; and the batch walk
(split, concat, to device, cast) keeps each container's type.

The plain step's token count over dataclass micro-batches is checked against the full batch's
update in float64; tolerance 1e-12 (relative L2): the same summed cross-entropy in a different
order of float64 additions, ~1e-16 relative per term over a few hundred terms.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import UserDict
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import BatchEncoding

import gradaccum
from gradaccum import Accumulator
from gradaccum import batch as B
from gradaccum.moe.spec import attention_mask

TOL = 1e-12


@dataclasses.dataclass
class Record:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor


class Pair(NamedTuple):
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor


def _padded(lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, 20, (len(lengths), width), generator=g)
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    return {
        "input_ids": ids * mask,
        "attention_mask": mask,
        "labels": (ids * mask).masked_fill(mask == 0, -100),
    }


def _as(kind: str, d: dict[str, torch.Tensor]) -> Any:
    return {
        "dict": dict,
        "BatchEncoding": BatchEncoding,
        "UserDict": UserDict,
        "namedtuple": lambda x: Pair(**x),
        "dataclass": lambda x: Record(**x),
    }[kind](d)


KINDS = ["dict", "BatchEncoding", "UserDict", "namedtuple", "dataclass"]


@pytest.mark.parametrize("kind", KINDS)
def test_fields_reads_every_named_container_the_same(kind: str) -> None:
    d = _padded([3, 5])
    named = B.fields(_as(kind, d))
    assert named is not None and set(named) == set(d)
    assert all(named[k] is d[k] for k in d)
    assert attention_mask(_as(kind, d)) is d["attention_mask"]
    assert int(gradaccum.count_tokens(shift=False)(_as(kind, d))) == 8


def test_fields_of_unnamed_containers_is_none() -> None:
    t = torch.ones(2, 3)
    assert B.fields(t) is None and B.fields((t, t)) is None and B.fields([t]) is None
    assert attention_mask((t, t)) is None


@pytest.mark.parametrize("kind", KINDS)
def test_the_batch_walk_keeps_the_container(kind: str) -> None:
    d = _padded([3, 5, 2, 4])
    batch = _as(kind, d)
    parts = B.split(batch, 2)
    assert B.batch_size(batch) == 4
    assert all(type(p) is type(batch) for p in parts)
    for out in (
        B.concat(parts),
        B.to_device(batch, "cpu"),
        B.cast(batch, torch.float64),
        B.pad_length(batch, 8),
    ):
        assert type(out) is type(batch)
        named = B.fields(out)
        assert named is not None and set(named) == set(d)
    assert torch.equal(B.fields(B.concat(parts))["labels"], d["labels"])  # type: ignore[index]
    assert B.fields(B.pad_length(batch, 8))["labels"].shape == (4, 8)  # type: ignore[index]


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.out = nn.Linear(8, 20)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(ids)))


def _loss_fn(model: nn.Module, mb: Any) -> torch.Tensor:
    named = B.fields(mb)
    assert named is not None
    return gradaccum.summed_cross_entropy(model(named["input_ids"]), named["labels"], shift=True)


@pytest.mark.parametrize("kind", ["BatchEncoding", "dataclass", "namedtuple"])
def test_plain_step_counts_tokens_of_named_micro_batches_exactly(kind: str) -> None:
    torch.manual_seed(0)
    model = _LM().to(torch.float64)
    d = _padded([5, 2, 7, 3, 6, 4], seed=1)
    # the full batch: the mean next-token cross-entropy over every valid target, one backward
    ref = copy.deepcopy(model)
    logits = ref(d["input_ids"])
    labels = d["labels"][:, 1:]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 20), labels.reshape(-1), reduction="sum")
    (loss / (labels != -100).sum()).backward()
    want = [-p.grad for p in ref.parameters()]  # type: ignore[operator]

    window = B.split(_as(kind, d), sizes=[1, 3, 2])
    before = [p.detach().clone() for p in model.parameters()]
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=1.0))
    assert acc.step(window, _loss_fn, gradaccum.count_tokens(shift=True)).applied
    got = [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]
    num = sum(float((x - y).pow(2).sum()) for x, y in zip(got, want, strict=True))
    den = sum(float(y.pow(2).sum()) for y in want)
    assert (num / den) ** 0.5 <= TOL
