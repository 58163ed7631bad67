"""Exact accumulation through a DeepSpeed engine, checked against one process: run with torchrun.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 docs/examples/deepspeed_accumulate.py 3

(the last argument is the ZeRO stage, 0-3; on GPUs leave DS_ACCELERATOR unset). Each rank holds a
different number of valid tokens; gradaccum counts the window on every rank before the first
backward, backpropagates each micro-batch's summed loss x W/N through
``engine.backward(..., scale_wrt_gas=False)``, and takes one ``engine.step()``. The engine computes in
float32; the reference is one process's full-batch update in float64.
"""

import sys

import deepspeed
import torch
import torch.distributed as dist

import gradaccum
from gradaccum.distributed.process_exit import exit_process
from gradaccum.integrations.deepspeed import prepare_accumulator


def batch_of(seed: int, rows: int = 8, length: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 32, (rows, length), generator=g)
    labels = input_ids.roll(-1, dims=1)
    lengths = torch.randint(2, length + 1, (rows,), generator=g)
    labels[torch.arange(length) >= lengths[:, None]] = -100  # padding: uneven valid tokens per row
    return {"input_ids": input_ids, "labels": labels}


def new_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 32))


def loss_fn(model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    return gradaccum.summed_cross_entropy(model(mb["input_ids"]), mb["labels"], shift=False)


def main() -> int:
    stage = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = [batch_of(seed) for seed in range(world)]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unless told; clipping is DeepSpeed's
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=new_model(), config=config)
    acc = prepare_accumulator(engine)
    window = gradaccum.split(shards[rank], micro_batch=2)  # 4 micro-batches
    result = acc.step(window, loss_fn, gradaccum.count_tokens("labels", shift=False))
    named = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(named):  # ZeRO-3: every rank reads the full parameters
        got = [p.detach().double().clone() for p in named]

    # the reference: one process, float64, the whole global batch in one backward, one SGD step
    reference = new_model().double()
    start = [p.detach().clone() for p in reference.parameters()]
    full = {key: torch.cat([shard[key] for shard in shards]) for key in shards[0]}
    (loss_fn(reference, full) / (full["labels"] != -100).sum()).backward()
    with torch.no_grad():
        want = [p - 0.5 * p.grad for p in reference.parameters()]
    error = sum(float((a - b).square().sum()) for a, b in zip(got, want, strict=True)) ** 0.5
    error /= sum(float((b - s).square().sum()) for b, s in zip(want, start, strict=True)) ** 0.5
    if rank == 0:
        tokens = f"{result.local_count} tokens here, {result.global_count} in all"
        print(f"ZeRO stage {stage}, {world} ranks: {tokens}")
        steps = f"optimizer steps: {engine.global_steps}"
        print(f"{steps}; update's relative error from the full batch: {error:.1e}")
    dist.destroy_process_group()
    if error > 2e-5:  # float32 parameters: their rounding is ~1e-6 of one update
        print(f"rank {rank}: the update differs from the full batch's by {error:.1e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # gloo's threads can outlive the process group and abort a finished run while Python finalizes
    # (docs/examples/ddp_accumulate.py): end after the atexit handlers and a flush instead
    exit_process(main(), held_process_group=True)
