"""Shared pieces of the integration tests: tiny models built from configs, padded data written here,
independent full-batch references, and the environment a spawned rank gives Accelerate/Trainer.

Nothing is downloaded: GPT-2 is built from a ``GPT2Config`` of one layer, 16 channels, 32 tokens.
The references are computed here, on one process, from the whole batch in one forward and
backward, then one SGD step written out by hand (``p - lr * grad``), in float64.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 32
LR = 0.1
LENGTHS = (3, 9, 5, 12, 2, 7, 11, 4, 6, 10, 1, 8, 12, 3, 5, 9)
"""Sequence lengths (padded to the longest in each collated batch): uneven token counts on purpose."""


def gpt2(
    seed: int = 0, dropout: float = 0.0, *, layers: int = 1, vocab: int = VOCAB, positions: int = 32
) -> nn.Module:
    """A tiny GPT-2 (width 16, 2 heads; one layer unless told) in float64, from a config (nothing
    downloaded), the same weights for the same seed."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers,
        n_embd=16,
        n_head=2,
        vocab_size=vocab,
        n_positions=positions,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(config).to(torch.float64)


class TinyLM(nn.Module):
    """A plain ``nn.Module`` that returns logits only (no loss, no loss kwargs)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(VOCAB, 12)
            self.mix = nn.Linear(12, 12)
            self.head = nn.Linear(12, VOCAB)
        self.to(torch.float64)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(input_ids))))


def sequences(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``n`` token sequences of the lengths above (cycled), as a dataset of examples."""
    gen = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(1, VOCAB, (LENGTHS[i % len(LENGTHS)],), generator=gen)} for i in range(n)
    ]


def collate(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right padding to the longest example; ``labels`` = the inputs, -100 on padding (a causal LM's
    unshifted labels, as transformers' language-modelling collator writes them)."""
    longest = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        ids[row, :n] = example["input_ids"]
        mask[row, :n] = 1
        labels[row, :n] = example["input_ids"]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def collate_aligned(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Labels already aligned with the logits (the next token at each position; the last is -100)."""
    batch = collate(examples)
    labels = torch.full_like(batch["labels"], -100)
    labels[:, :-1] = batch["labels"][:, 1:]
    batch["labels"] = labels
    return batch


def causal_mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The token-mean cross-entropy of a causal LM over the whole batch, in float64."""
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, labels[:, 1:].reshape(-1), ignore_index=-100)


def aligned_mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def sgd_reference(
    model: nn.Module, batch: dict[str, torch.Tensor], mean_loss: Any
) -> dict[str, torch.Tensor]:
    """Parameters after one SGD step (lr ``LR``) on the mean loss of the whole batch."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits = out if isinstance(out, torch.Tensor) else out["logits"]
    mean_loss(logits, batch["labels"]).backward()
    with torch.no_grad():
        return {n: (p - LR * p.grad).detach().clone() for n, p in model.named_parameters()}


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def update_error(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor]
) -> float:
    """|got - want| / |want - start| over all parameters: the update's relative L2 error (the
    parameters after one SGD step differ from ``want`` by lr x the gradient error)."""
    assert got.keys() == want.keys()
    num = sum(float(((got[k] - want[k]) ** 2).sum()) for k in want)
    den = sum(float(((want[k] - start[k]) ** 2).sum()) for k in want)
    return (num / den) ** 0.5


def distributed_env(rank: int, world: int) -> None:
    """What ``torchrun`` would set: Accelerate (and so Trainer) reads it to see the process group
    that the test launcher already initialized."""
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": os.environ.get("MASTER_PORT", "29500"),
        }
    )
