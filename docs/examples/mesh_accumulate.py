"""Exact accumulation on a 2-D mesh (FSDP2 over dp_shard x tensor parallel), checked against one
process: run with torchrun on 4 ranks (CPU and gloo work).

    torchrun --standalone --nproc-per-node 4 docs/examples/mesh_accumulate.py

The two TP ranks of a data shard hold the same tokens: the window's count N is summed over the
dp_shard dimension only, and FSDP2's reduce-scatter averages over the 2 shards, so each micro-batch
backpropagates its summed loss times 2 / N.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import gradaccum
from gradaccum.distributed.process_exit import exit_process


class MLPLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 16)
        self.up = torch.nn.Linear(16, 64)
        self.down = torch.nn.Linear(64, 16)
        self.head = torch.nn.Linear(16, 32)
        self.double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(x + self.down(torch.tanh(self.up(x))))


def batch_of(seed: int, rows: int = 6, length: int = 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (rows, length), generator=g)
    labels = ids.roll(-1, dims=1)
    lengths = torch.randint(2, length + 1, (rows,), generator=g)
    labels[torch.arange(length) >= lengths[:, None]] = -100  # uneven valid tokens per row
    return {"ids": ids, "labels": labels}


def loss_fn(model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    return gradaccum.summed_cross_entropy(model(mb["ids"]), mb["labels"], shift=False)


def main() -> int:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = MLPLM()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp_shard"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, foreach=False)
    acc = gradaccum.Accumulator(model, optimizer, mesh=mesh, max_grad_norm=1.0)

    shard = mesh.get_coordinate()[0]  # TP ranks of one data shard get the same rows
    window = gradaccum.split(batch_of(seed=shard), micro_batch=2)  # 3 micro-batches
    result = acc.step(window, loss_fn, gradaccum.count_tokens("labels", shift=False))

    # the reference: one process, both shards' rows in one backward, clipped, one SGD step
    reference = MLPLM()
    full = {k: torch.cat([batch_of(0)[k], batch_of(1)[k]]) for k in ("ids", "labels")}
    (loss_fn(reference, full) / (full["labels"] != -100).sum()).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.5 * p.grad
    error = max(
        ((p.full_tensor() - q).abs().max() / q.abs().max()).item()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
    if dist.get_rank() == 0:
        print(
            f"mesh dp_shard=2 x tp=2: {result.local_count} tokens here, {result.global_count} in the window"
        )
        print(f"largest relative difference from the full batch: {error:.1e}")
    dist.destroy_process_group()
    if error > 1e-12:  # float64: only the summation order differs
        print(
            f"rank {os.environ.get('RANK')}: the update differs from the full batch by {error:.1e}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    # gloo's threads can outlive the process group and abort a finished run while Python finalizes
    # (docs/examples/ddp_accumulate.py): end after the atexit handlers and a flush instead
    exit_process(main(), held_process_group=True)
