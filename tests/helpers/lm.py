"""Documents, a position-wise language model and an independent reference for the normalizations.

The reference walks the rows' documents in Python (from the lengths the layout reports, checked
against the raw documents in tests/unit/test_packing.py) and computes each normalization's mean
from log-softmax directly: it shares no code with ``CausalLMLoss``.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.nn as nn

from gradaccum.packing import Packed, pack, pad

VOCAB = 23
SEQ_LEN = 16


def documents(n: int = 14, seed: int = 0) -> list[list[int]]:
    """Token-id documents of uneven lengths: one of a single token (no target), one longer than a
    row (cut into two documents by the layouts)."""
    rng = random.Random(seed)
    docs = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 11))] for _ in range(n)]
    docs[2] = [5]
    docs[5] = [rng.randrange(1, VOCAB) for _ in range(SEQ_LEN + 5)]
    return docs


def layouts(docs: list[list[int]] | None = None) -> dict[str, Packed]:
    docs = documents() if docs is None else docs
    return {"packed": pack(docs, SEQ_LEN), "padded": pad(docs, SEQ_LEN)}


class PositionWise(nn.Module):
    """Logits from each token and its position alone: attends to nothing, so it computes the same
    for a document whichever row holds it, as long as positions restart per document."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.tok = nn.Embedding(VOCAB, 8)
            self.pos = nn.Embedding(SEQ_LEN, 8)
            self.out = nn.Linear(8, VOCAB)
        self.double()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        return self.out(torch.tanh(self.tok(input_ids) + self.pos(position_ids)))


def reference_loss(logits: torch.Tensor, layout: Packed, normalization: str) -> torch.Tensor:
    """The full batch's mean loss under ``normalization``, from first principles.

    Each document of L tokens at offset o of its row predicts tokens o+1..o+L-1 from the logits at
    o..o+L-2; token: the mean over all such targets; sequence: the mean over rows (with a target)
    of each row's target mean; document: the mean over documents (with a target) of theirs.
    """
    logp = torch.log_softmax(logits, dim=-1)
    rows: list[list[torch.Tensor]] = []
    for r, lengths in enumerate(layout.row_lengths):
        row: list[torch.Tensor] = []
        offset = 0
        for length in lengths:
            doc = [-logp[r, t - 1, int(layout.input_ids[r, t])] for t in range(offset + 1, offset + length)]
            row.append(torch.stack(doc) if doc else logits.new_zeros(0))
            offset += length
        rows.append(row)
    if normalization == "token":
        return torch.cat([d for row in rows for d in row]).mean()
    if normalization == "sequence":
        means = [torch.cat(row).mean() for row in rows if sum(d.numel() for d in row)]
        return torch.stack(means).mean()
    means = [d.mean() for row in rows for d in row if d.numel()]
    return torch.stack(means).mean()


def reference_grads(model: nn.Module, layout: Packed, normalization: str) -> dict[str, torch.Tensor]:
    batch: dict[str, Any] = layout.batch
    model.zero_grad(set_to_none=True)
    logits = model(**{k: v for k, v in batch.items() if k != "labels"})
    reference_loss(logits, layout, normalization).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
