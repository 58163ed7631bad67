"""Overhead of gradaccum.guard around a correct hand-written loop (tiny GPT, CPU, float32).

The loop is exact (summed loss / N counted first), k=4 micro-batches of 8 sequences, clipping once.
Prints the median time per micro-batch bare, under the guard, and under the guard without the
loss-graph reading (inspect_loss=False), with ratios measured in the same run.

    .venv/bin/python benchmarks/guard_overhead.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gradaccum import guard, split
from gradaccum.examples import build_tiny_gpt, gpt_loss
from gradaccum.examples.gpt import sample_sequences
from gradaccum.loss import count_tokens

K, WINDOWS = 4, 6
count = count_tokens("labels", shift=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    windows = [split(sample_sequences(8 * K, seed), micro_batch=8) for seed in range(WINDOWS)]

    def loop() -> None:
        for window in windows:
            n = torch.stack([count(mb) for mb in window]).sum()
            opt.zero_grad()
            for mb in window:
                (gpt_loss(model, mb) / n).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

    def timed(kind: str) -> float:
        start = time.perf_counter()
        if kind == "bare":
            loop()
        else:
            with guard(model, opt, accum_steps=K, inspect_loss=kind == "guard") as g:
                loop()
            assert not g.findings, g.findings  # a correct loop: the guard must stay silent
        return (time.perf_counter() - start) / (WINDOWS * K) * 1e3

    loop()  # warm-up
    times: dict[str, list[float]] = {"bare": [], "guard": [], "guard, inspect_loss=False": []}
    for _ in range(args.rounds):
        for kind in times:
            times[kind].append(timed(kind))
    base = statistics.median(times["bare"])
    for kind, values in times.items():
        median = statistics.median(values)
        print(f"{kind:26s} {median:7.3f} ms/micro-batch  ratio {median / base:.3f}")


if __name__ == "__main__":
    main()
