"""Gradient caching against a full-batch pass of the same examples: time and peak memory.

A residual MLP pair encoder (queries and positives through one tower) with the bundled in-batch
InfoNCE loss, one process. The full-batch pass is ``Accumulator.step`` on one micro-batch holding
every example (one forward and one backward); the cached step is ``CachedAccumulator.step`` at
several micro-batch sizes (a first pass without a graph, the loss, a second pass with one). Both
apply the same update; the script checks that too.

Time: rounds interleave all configurations in alternating order so that drift in machine load
hits each alike; medians are printed with the ratio to the full-batch pass, next to the ratio
that "one extra forward" predicts, 1 + (no-grad forward of the batch) / (full-batch step).

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` during one step. On CPU, each
configuration runs in a fresh subprocess and reports its *peak RSS* (``VmHWM``: everything
the process holds, the torch runtime included) and the *step's peak RSS above its RSS after
setup* (model, optimizer state and batch resident): the gradients plus the activations, the part
the micro-batch size controls.

    .venv/bin/python benchmarks/gradcache.py [--batch 1024] [--micro 16 64 256 1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradaccum import Accumulator, split
from gradaccum.cache.accumulator import CachedAccumulator
from gradaccum.examples.contrastive import encode_pairs, info_nce_sum, synthetic_pairs
from gradaccum.loss import count_examples

FULL = "full batch"


class ResidualEncoder(nn.Module):
    """LayerNorm -> Linear(h, 2h) -> GELU -> Dropout -> Linear(2h, h) blocks, L2-normalized output."""

    def __init__(self, d_in: int, hidden: int, depth: int, d_out: int, dropout: float) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(hidden),
                nn.Linear(hidden, 2 * hidden),
                nn.GELU(),
                nn.Dropout(dropout),
                nn.Linear(2 * hidden, hidden),
            )
            for _ in range(depth)
        )
        self.out = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return F.normalize(self.out(h), dim=-1)


class Setup:
    """One configuration's model, optimizer, accumulator and data, built from the arguments."""

    def __init__(self, args: argparse.Namespace, config: str, device: torch.device) -> None:
        torch.manual_seed(0)
        self.model = ResidualEncoder(args.d_in, args.hidden, args.depth, 128, args.dropout).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        batch = synthetic_pairs(args.batch, seed=0, d_in=args.d_in)
        self.batch = {key: value.to(device) for key, value in batch.items()}
        n = args.batch
        self.step: Callable[[], Any]
        if config == FULL:
            acc = Accumulator(self.model, self.optimizer)
            window = [self.batch]
            self.step = lambda: acc.step(
                window, lambda m, mb: info_nce_sum(encode_pairs(m, mb)), count_examples
            )
        else:
            cached = CachedAccumulator(self.model, self.optimizer)
            window = split(self.batch, micro_batch=int(config))
            self.step = lambda: cached.step(window, encode_pairs, lambda reps: info_nce_sum(reps) / n)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_times(args: argparse.Namespace, configs: list[str], device: torch.device) -> dict[str, float]:
    """Median seconds per step of each configuration, rounds interleaved in alternating order."""
    setups = {config: Setup(args, config, device) for config in configs}
    times: dict[str, list[float]] = {config: [] for config in configs}
    for r in range(args.rounds + args.warmup):
        for config in configs if r % 2 == 0 else configs[::-1]:
            _sync(device)
            start = time.perf_counter()
            setups[config].step()
            _sync(device)
            if r >= args.warmup:
                times[config].append(time.perf_counter() - start)
    return {config: statistics.median(ts) for config, ts in times.items()}


def forward_time(args: argparse.Namespace, device: torch.device) -> float:
    """Median seconds of one no-grad forward over the whole batch: the extra cost caching predicts."""
    setup = Setup(args, FULL, device)
    samples = []
    with torch.no_grad():
        for r in range(args.rounds + args.warmup):
            _sync(device)
            start = time.perf_counter()
            encode_pairs(setup.model, setup.batch)
            _sync(device)
            if r >= args.warmup:
                samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def same_update(args: argparse.Namespace, configs: list[str], device: torch.device) -> float:
    """Largest relative L2 difference of the first step's gradients, cached against full batch."""
    grads: dict[str, list[torch.Tensor]] = {}
    for config in configs:
        setup = Setup(args, config, device)
        setup.step()
        grads[config] = [p.grad.detach().clone() for p in setup.model.parameters() if p.grad is not None]
    want = grads[FULL]
    return max(
        float((g - w).norm() / w.norm().clamp(min=1e-30))
        for config in configs[1:]
        for g, w in zip(grads[config], want, strict=True)
    )


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_rss_bytes() -> int:
    """This process's peak RSS (VmHWM). Not ru_maxrss: a child inherits its parent's across exec."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status: peak RSS needs Linux")


def memory_child(args: argparse.Namespace, config: str) -> None:
    """In a fresh process: memory after setup (model, optimizer, batch), then the peak of a step."""
    device = torch.device(args.device)
    setup = Setup(args, config, device)
    if device.type == "cuda":
        _sync(device)
        after = torch.cuda.memory_allocated(device)
        setup.step()  # warm-up: kernels, workspaces
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        setup.step()
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        # freed heap memory may stay resident, so the baseline is taken before the first step
        after = _rss_bytes()
        setup.step()
        setup.step()
        peak = _peak_rss_bytes()
    print(json.dumps({"peak": peak, "after_setup": after}))


def measure_memory(args: argparse.Namespace, configs: list[str]) -> dict[str, dict[str, int]]:
    out = {}
    for config in configs:
        cmd = [sys.executable, __file__, "--memory-child", config, *_passthrough(args)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[config] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def _passthrough(args: argparse.Namespace) -> list[str]:
    return [
        f"--batch={args.batch}",
        f"--d-in={args.d_in}",
        f"--hidden={args.hidden}",
        f"--depth={args.depth}",
        f"--dropout={args.dropout}",
        f"--threads={args.threads}",
        f"--device={args.device}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024, help="examples (pairs) per optimizer step")
    parser.add_argument("--micro", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--d-in", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child is not None:
        memory_child(args, args.memory_child)
        return

    device = torch.device(args.device)
    configs = [FULL, *(str(m) for m in args.micro)]
    params = sum(p.numel() for p in Setup(args, FULL, device).model.parameters())
    print(
        f"torch {torch.__version__}, {device}, {args.threads} thread(s); encoder {params / 1e6:.2f}M "
        f"parameters (hidden {args.hidden}, depth {args.depth}, dropout {args.dropout}), "
        f"{args.batch} pairs per step, {args.rounds} interleaved rounds after {args.warmup} warm-up"
    )
    if args.dropout == 0:
        print(f"same update: largest relative gradient difference {same_update(args, configs, device):.1e}")
    times = measure_times(args, configs, device)
    forward = forward_time(args, device)
    memory = measure_memory(args, configs)
    full_time, full_mem = times[FULL], memory[FULL]
    predicted = 1 + forward / full_time
    kind = "peak allocated" if device.type == "cuda" else "peak RSS"
    print(f"one extra forward predicts {predicted:.2f}x (no-grad forward {forward * 1e3:.1f} ms)")
    print(
        f"{'micro-batch':>12} {'k':>4} {'step ms':>9} {'time':>7} {kind + ' MiB':>17} {'ratio':>7} "
        f"{'step peak MiB':>14} {'ratio':>7}"
    )
    for config in configs:
        t, mem = times[config], memory[config]
        step_peak = mem["peak"] - mem["after_setup"]
        full_step_peak = full_mem["peak"] - full_mem["after_setup"]
        k = 1 if config == FULL else args.batch // int(config)
        print(
            f"{config:>12} {k:>4} {t * 1e3:9.1f} {t / full_time:6.2f}x {mem['peak'] / 2**20:17.1f} "
            f"{mem['peak'] / full_mem['peak']:6.2f}x {step_peak / 2**20:14.1f} "
            f"{step_peak / max(full_step_peak, 1):6.2f}x"
        )
    print(
        "step peak = the step's peak above what was resident after setup (model, optimizer, batch); "
        "it holds the gradients and the activations"
        + (" (allocated bytes)" if device.type == "cuda" else " (RSS, a fresh process per row)")
    )


if __name__ == "__main__":
    main()
