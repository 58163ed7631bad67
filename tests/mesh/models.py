"""Tiny float64 models for mesh tests, their parallelization, data and single-process references.

``TinyTransformer``: two pre-norm blocks (causal attention of 4 heads, an MLP) over 16 channels;
under tensor parallelism q/k/v and the MLP's first layer are column-parallel and the output
projections row-parallel (Megatron's layout), so each TP rank holds 2 heads and half the MLP.
``PositionLM``: each position's logits depend on that position only, so context parallelism can be
modelled by handing each CP rank some positions of every sequence (no ring attention needed).

The references run the whole batch on one process: one forward, the summed cross-entropy over N
valid targets, divided by N, backward, optional ``clip_grad_norm_``, one SGD step; the update error
is |got - want| / |want - start| over all parameters.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, T = 24, 16, 4, 6
LR = 0.5
IGNORE = -100


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # under TP the column-parallel projections hold HEADS / tp heads: -1 keeps the local count
        q, k, v = (p(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.down(torch.tanh(self.up(self.ln2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.norm = nn.LayerNorm(DIM)
            self.head = nn.Linear(DIM, VOCAB)
        self.to(torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class PositionLM(nn.Module):
    """Logits at a position from that position's token only: a CP rank needs no other positions."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(VOCAB, DIM)
            self.mix = nn.Linear(DIM, DIM)
            self.head = nn.Linear(DIM, VOCAB)
        self.to(torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def tensor_parallel(model: TinyTransformer, tp_mesh: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.o": RowwiseParallel(),
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
    }
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)


def batch(n: int = 8, seed: int = 3, empty_tail_rows: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """``n`` sequences of T tokens with uneven valid targets (right padding of 0..T-1 positions);
    rows in ``empty_tail_rows`` have no valid target in their second half."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, T), generator=gen)
    labels = torch.randint(0, VOCAB, (n, T), generator=gen)
    for row in range(n):
        pad = (row * 5) % T
        if pad:
            labels[row, T - pad :] = IGNORE
        if row in empty_tail_rows:
            labels[row, T // 2 :] = IGNORE
    return {"ids": ids, "labels": labels}


def loss_fn(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(mb["ids"])
    return F.cross_entropy(
        logits.reshape(-1, VOCAB), mb["labels"].reshape(-1), ignore_index=IGNORE, reduction="sum"
    )


def count_fn(mb: dict[str, torch.Tensor]) -> int:
    return int((mb["labels"] != IGNORE).sum())


def rows(data: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {k: v[start:stop] for k, v in data.items()}


def positions(data: dict[str, torch.Tensor], part: int, parts: int) -> dict[str, torch.Tensor]:
    """Context parallelism's split: positions part*T/parts .. (part+1)*T/parts of every row."""
    width = T // parts
    return {k: v[:, part * width : (part + 1) * width] for k, v in data.items()}


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (gathered) parameters: DTensors are gathered with ``full_tensor``."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def reference_update(
    model: nn.Module, data: dict[str, torch.Tensor], max_grad_norm: float | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(parameters after one full-batch SGD step, parameters before) on one process."""
    start = params(model)
    model.zero_grad(set_to_none=True)
    (loss_fn(model, data) / count_fn(data)).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return params(model), start


def update_error(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor]
) -> float:
    num = sum(((got[k] - want[k]) ** 2).sum() for k in want) ** 0.5
    den = sum(((want[k] - start[k]) ** 2).sum() for k in want) ** 0.5
    return float(num / den)


def update_ratio(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor]
) -> float:
    """|got - start| / |want - start|: 2.0 for an update twice the reference (SGD is linear)."""
    num = sum(((got[k] - start[k]) ** 2).sum() for k in want) ** 0.5
    den = sum(((want[k] - start[k]) ** 2).sum() for k in want) ** 0.5
    return float(num / den)


def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
    """torchtitan's order: tensor parallelism inside each block (where the mesh has ``tp``), then
    FSDP2 over ``dp_shard`` (HSDP over ``dp_replicate`` x ``dp_shard`` where it has both)."""
    from torch.distributed.fsdp import fully_shard

    names = mesh.mesh_dim_names
    if "tp" in names:
        tensor_parallel(model, mesh["tp"])  # type: ignore[arg-type]
    shard_mesh = mesh["dp_replicate", "dp_shard"] if "dp_replicate" in names else mesh["dp_shard"]
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return model


def workload() -> Any:
    """The tiny transformer as a Workload that declares how it is parallelized (verify --mesh)."""
    import gradaccum

    return gradaccum.Workload(
        name="tiny-transformer-tp",
        build_model=TinyTransformer,
        make_batch=lambda n, seed: batch(n, seed + 3),
        loss_fn=loss_fn,
        count_fn=count_fn,
        optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=LR, foreach=False),
        batch_size=8,
        micro_batch=2,
        parallelize=parallelize,
    )
