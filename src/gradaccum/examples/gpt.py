"""A tiny character-level causal GPT and padded variable-length sequences from the bundled corpus.

Sequences are cut from the corpus at random offsets with random lengths and right-padded, so
micro-batches hold different numbers of valid tokens: the case where ``loss / k`` is wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

import torch
import torch.nn as nn

from gradaccum.errors import ConfigError
from gradaccum.loss import IGNORE_INDEX

__all__ = [
    "CharVocab",
    "GPTConfig",
    "TinyGPT",
    "corpus_text",
    "parallelize_gpt",
    "sample_sequences",
    "vocab",
]


@lru_cache(maxsize=1)
def corpus_text() -> str:
    """The bundled public-domain corpus (about 7.6 kB of English)."""
    return resources.files("gradaccum.examples").joinpath("data/corpus.txt").read_text("utf-8")


@dataclass(frozen=True)
class CharVocab:
    """Characters of the corpus; id 0 is padding."""

    chars: str

    @property
    def size(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> list[int]:
        index = {c: i + 1 for i, c in enumerate(self.chars)}
        return [index[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i - 1] for i in ids if i > 0)


@lru_cache(maxsize=1)
def vocab() -> CharVocab:
    return CharVocab("".join(sorted(set(corpus_text()))))


def sample_sequences(
    n: int, seed: int, *, max_len: int = 32, min_len: int = 4, text: str | None = None
) -> dict[str, torch.Tensor]:
    """``n`` sequences of random length in [min_len, max_len], right-padded to ``max_len``.

    Returns ``input_ids`` (0 = padding) and ``labels`` aligned with the logits: ``labels[t]`` is the
    character after ``input_ids[t]``, and padded positions are ``IGNORE_INDEX``.
    """
    source = corpus_text() if text is None else text
    ids = torch.tensor(vocab().encode(source), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=gen)
    starts = torch.randint(0, len(ids) - max_len - 1, (n,), generator=gen)
    input_ids = torch.zeros(n, max_len, dtype=torch.long)
    labels = torch.full((n, max_len), IGNORE_INDEX, dtype=torch.long)
    for row, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
        input_ids[row, :length] = ids[start : start + length]
        labels[row, :length] = ids[start + 1 : start + length + 1]
    return {"input_ids": input_ids, "labels": labels}


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int
    """Token ids, padding included."""
    block_size: int = 64
    """Longest sequence the position table holds."""
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 32
    dropout: float = 0.0


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )
        self.drop = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("causal", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_head)
        causal: torch.Tensor = self.causal  # type: ignore[assignment]
        att = att.masked_fill(~causal[:t, :t], float("-inf")).softmax(dim=-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    """A GPT-2-shaped decoder small enough to train on two CPU cores."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.tok(input_ids) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def parallelize_gpt(model: nn.Module, mesh: Any) -> nn.Module:
    """Tensor-parallelize and shard a :class:`TinyGPT` on a named DeviceMesh, in torchtitan's order.

    Where the mesh has ``tp``: each block's MLP in Megatron's layout (the first linear
    column-parallel, the second row-parallel, so each TP rank holds 1/tp of the hidden units and
    the block's output is all-reduced). Attention stays whole on every TP rank: its ``qkv`` is one
    fused linear, which a column split would cut across q, k and v. Then FSDP2 over ``dp_shard``
    (HSDP over ``dp_replicate`` x ``dp_shard`` where the mesh has both), each block and the root.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names = tuple(mesh.mesh_dim_names or ())
    if not isinstance(model, TinyGPT):
        raise ConfigError(f"parallelize_gpt parallelizes a TinyGPT, got {type(model).__name__}")
    if "dp_replicate" in names and "dp_shard" not in names:
        raise ConfigError(
            f"parallelize_gpt shards with FSDP2, over dp_shard (HSDP over dp_replicate x dp_shard); the "
            f"mesh {names} has dp_replicate alone: add dp_shard (e.g. dp_replicate=2,dp_shard=2) or use "
            "dp_shard in place of dp_replicate"
        )
    if "tp" in names:
        hidden = 4 * model.cfg.d_model
        tp = int(mesh["tp"].size())
        if hidden % tp:
            raise ConfigError(f"tp={tp} must divide the MLP's {hidden} hidden units of this TinyGPT")
        plan = {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)
    if "dp_shard" not in names:
        return model
    shard_mesh = mesh["dp_replicate", "dp_shard"] if "dp_replicate" in names else mesh["dp_shard"]
    for block in model.blocks:
        fully_shard(block, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return model
