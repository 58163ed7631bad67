"""Cost of the failure agreement on the DDP path: Accumulator.step with and without it.

Two gloo processes on 127.0.0.1, the bundled tiny GPT in DDP, k=4 micro-batches per step. "agreed"
is the step as shipped: one all-reduce of three numbers and one host read before the synchronizing
backward, plus (with find_unused_parameters=False) a walk of the last micro-batch's autograd graph
to find parameters DDP would wait for. "bare" replaces the agreement with a function that only
re-raises this rank's own failure, i.e. no cross-rank check. Rounds interleave the two so that load
drift hits both alike; rank 0 prints median step times and the ratio. Single-process runs never
reach the agreement (benchmarks/overhead.py measures that path).

    .venv/bin/python benchmarks/fault_checks.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import gradaccum.step.accumulator as step_module
from gradaccum import Accumulator, split
from gradaccum.examples import build_tiny_gpt, gpt_loss
from gradaccum.examples.gpt import sample_sequences
from gradaccum.loss import count_tokens
from gradaccum.step.agreement import raise_alone

K = 4
count = count_tokens("labels", shift=False)
SHIPPED = step_module.agree_before_backward


def _bare(failure: Any, *args: Any, **kwargs: Any) -> None:
    """No agreement: a failure is this rank's alone (the behaviour before issue 7)."""
    if failure is not None:
        raise_alone(failure, recoverable=False)


def _rank(rank: int, port: int, rounds: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        lines = []
        for find_unused in (True, False):
            for micro, seq_len in ((2, 24), (8, 64)):
                batch = sample_sequences(micro * K, seed=rank, max_len=seq_len, min_len=seq_len // 2)
                window = split(batch, micro_batch=micro)
                accs = {}
                for name in ("agreed", "bare"):
                    model = DDP(build_tiny_gpt(0), find_unused_parameters=find_unused)
                    accs[name] = Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
                times: dict[str, list[float]] = {name: [] for name in accs}
                names = list(accs)
                for r in range(rounds + 3):  # 3 warm-up rounds
                    for name in names if r % 2 == 0 else names[::-1]:
                        step_module.agree_before_backward = SHIPPED if name == "agreed" else _bare
                        dist.barrier()
                        start = time.perf_counter()
                        accs[name].step(window, gpt_loss, count)
                        if r >= 3:
                            times[name].append(time.perf_counter() - start)
                step_module.agree_before_backward = SHIPPED
                del accs
                bare, agreed = statistics.median(times["bare"]), statistics.median(times["agreed"])
                lines.append(
                    f"{find_unused!s:>14} {f'{micro}x{seq_len} tokens':>14} {bare * 1e3:9.2f} "
                    f"{agreed * 1e3:11.2f} {agreed / bare:6.3f}x {(agreed - bare) * 1e3:+9.2f}"
                )
        flags = torch.zeros(3, dtype=torch.float64)
        lone = []
        for r in range(rounds * 10 + 10):
            start = time.perf_counter()
            dist.all_reduce(flags)
            flags.tolist()
            if r >= 10:
                lone.append(time.perf_counter() - start)
        if rank == 0:
            print(
                f"torch {torch.__version__}, 2 gloo ranks, 1 thread each, k={K}, {rounds} interleaved rounds"
            )
            header = ("find_unused", "micro-batch", "bare ms", "agreed ms", "ratio", "delta ms")
            print(" ".join(f"{h:>{w}}" for h, w in zip(header, (14, 14, 9, 11, 7, 9), strict=True)))
            print("\n".join(lines))
            print(
                f"one all-reduce of 3 float64 + host read alone: {statistics.median(lone) * 1e3:.3f} ms",
                flush=True,
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, args.rounds), nprocs=2, join=True)


if __name__ == "__main__":
    main()
