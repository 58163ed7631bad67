"""Overhead of Accumulator.step against a minimal hand-written exact loop.

One process, CPU, the bundled tiny GPT, k=4 micro-batches per step, at two sizes (2 sequences x 24
tokens and 8 x 64). Rounds interleave the two implementations so that drift in machine load hits
both alike; each prints the median step time and the ratio. Target: <= 1.02x at both sizes.

    .venv/bin/python benchmarks/overhead.py [--rounds 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from gradaccum import Accumulator, split
from gradaccum.examples import build_tiny_gpt, gpt_loss
from gradaccum.examples.gpt import sample_sequences
from gradaccum.loss import count_tokens

K = 4
count = count_tokens("labels")


def hand_loop(model: torch.nn.Module, opt: torch.optim.Optimizer, window: list[Any]) -> None:
    """The minimal exact loop a careful user writes by hand: count, zero once, sum/N, step."""
    n = torch.stack([count(mb) for mb in window]).sum()
    opt.zero_grad(set_to_none=True)
    for mb in window:
        (gpt_loss(model, mb) / n).backward()
    opt.step()


def measure(micro: int, seq_len: int, rounds: int) -> dict[str, float]:
    """Median step time (s) of each implementation, rounds interleaved in alternating order."""
    batch = sample_sequences(micro * K, seed=0, max_len=seq_len, min_len=seq_len // 2)
    window = split(batch, micro_batch=micro)
    runners: dict[str, Callable[[], object]] = {}
    for name, kwargs in (("default", {}), ("no_check", {"skip_nonfinite": False})):
        model = build_tiny_gpt(0)
        acc = Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-3), **kwargs)
        runners[name] = lambda acc=acc: acc.step(window, gpt_loss, count)
    hand_model = build_tiny_gpt(0)
    hand_opt = torch.optim.AdamW(hand_model.parameters(), lr=1e-3)
    runners["hand"] = lambda: hand_loop(hand_model, hand_opt, window)
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(rounds + 3):  # the first 3 rounds warm up allocators and caches
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            runners[name]()
            if r >= 3:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), k={K}, {args.rounds} interleaved rounds")
    print("default = Accumulator as shipped; no_check = skip_nonfinite=False (no gradient-norm check)")
    header = ("micro-batch", "hand ms", "default ms", "ratio", "no_check ms", "ratio")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (14, 9, 11, 7, 12, 7), strict=True)))
    for micro, seq_len in ((2, 24), (8, 64)):
        t = measure(micro, seq_len, args.rounds)
        hand = t["hand"]
        print(
            f"{f'{micro}x{seq_len} tokens':>14} {hand * 1e3:9.2f} {t['default'] * 1e3:11.2f} "
            f"{t['default'] / hand:6.3f}x {t['no_check'] * 1e3:12.2f} {t['no_check'] / hand:6.3f}x"
        )


if __name__ == "__main__":
    main()
