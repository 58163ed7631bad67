"""Exact accumulation under DDP, checked against one process: run with torchrun.

    torchrun --standalone --nproc-per-node 2 docs/examples/ddp_accumulate.py

Each rank holds a different number of valid tokens (padding differs), so `loss / k` per rank would
weight the ranks' tokens unequally; the Accumulator divides every micro-batch's summed loss by the
global count of the window and DDP's averaging by W / N, and the update equals the full batch's.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gradaccum
from gradaccum.distributed.process_exit import exit_process


def batch_of(seed: int, rows: int = 8, length: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 32, (rows, length), generator=g)
    labels = input_ids.roll(-1, dims=1)
    lengths = torch.randint(2, length + 1, (rows,), generator=g)
    labels[torch.arange(length) >= lengths[:, None]] = -100  # padding: uneven valid tokens per row
    return {"input_ids": input_ids, "labels": labels}


def new_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 32)).double()


def loss_fn(model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    return gradaccum.summed_cross_entropy(model(mb["input_ids"]), mb["labels"], shift=False)


def main() -> int:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = [{k: v.to(device) for k, v in batch_of(seed).items()} for seed in range(world)]

    model = DistributedDataParallel(new_model().to(device))  # rank r trains on shards[r]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = gradaccum.Accumulator(model, optimizer, max_grad_norm=None)
    window = gradaccum.split(shards[rank], micro_batch=2)  # 4 micro-batches: accum_steps = 4
    result = acc.step(window, loss_fn, gradaccum.count_tokens("labels", shift=False))

    # the reference: one process, the whole global batch in one backward, the same SGD step
    reference = new_model().to(device)
    full = {key: torch.cat([shard[key] for shard in shards]) for key in shards[0]}
    loss = loss_fn(reference, full) / (full["labels"] != -100).sum()
    loss.backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.5 * p.grad
    error = max(
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(model.module.parameters(), reference.parameters(), strict=True)
    )
    if rank == 0:
        print(f"{world} ranks: {result.local_count} tokens here, {result.global_count} in the window")
        print(f"largest relative difference from the full batch: {error:.1e}")
    dist.destroy_process_group()
    if error > 1e-12:  # float64: only the summation order differs
        print(
            f"rank {rank}: the accumulated update differs from the full batch by {error:.1e}", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    # torch 2.13's gloo threads outlive destroy_process_group (DDP holds the group from C++), and one
    # still releasing a collective while Python finalizes aborts a finished run (SIGABRT, "terminate
    # called without an active exception"): end after the atexit handlers and a flush, not finalization
    exit_process(main(), held_process_group=True)
