"""A compiled model through ``Accumulator.step``: its cost against a compiled hand-written exact loop,
the compile time, and the recompiles of windows of mixed lengths.

One process, CPU, the bundled tiny GPT (AdamW), each runner with its own ``torch.compile``d model
(inductor by default). The step's cost is a paired ratio (benchmarks/paired.py: every round times
each runner once, in a rotating order, against the same round's compiled hand loop), median over
runs (min..max); "hand copy" is a second compiled hand loop (the A/A noise floor) and "eager" the
step on an uncompiled model (what compiling buys here). Target: compiled step <= 1.02x.

Compile time is timed apart, from a reset dynamo: a runner's first window (which compiles) minus
its median warm window. Inductor keeps compiled kernels and graphs in an on-disk cache
(/tmp/torchinductor_$USER), so a second process compiles the same graph in seconds; ``--cold``
turns the caches off (``torch.compiler.config.force_disable_caches``) to time a first compile.
Recompiles per 100 windows: ``StepResult.recompiles`` summed over 100 windows of
2-4 sequences of 8-64 tokens after a 5-window warm-up, once with torch's automatic dynamic shapes
and once with ``dynamic=False`` and ``gradaccum.windows(..., pad_to_multiple=16)`` (4 rows).

    .venv/bin/python benchmarks/compile.py [--runs 3] [--rounds 20] [--backend inductor] [--threads 1]
                                           [--cold]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from overhead import _optimizer, count, hand_loop
from paired import paired_ratios

from gradaccum import Accumulator, split, windows
from gradaccum.examples import build_tiny_gpt, gpt_loss
from gradaccum.examples.gpt import sample_sequences

K, MICRO, SEQ_LEN = 4, 8, 64


def _runners(window: list[Any], backend: str) -> dict[str, Callable[[], object]]:
    """Each runner with a model of its own; the first call of the first compiled one compiles (the
    others reuse its graphs: dynamo guards on the parameters' shapes, not on the module)."""
    runners: dict[str, Callable[[], object]] = {}
    for name in ("hand", "hand copy"):
        model = torch.compile(build_tiny_gpt(0), backend=backend)
        opt = _optimizer(model)
        runners[name] = lambda model=model, opt=opt: hand_loop(model, opt, window)
    fast = torch.compile(build_tiny_gpt(0), backend=backend)
    acc = Accumulator(fast, _optimizer(fast))
    runners["gradaccum"] = lambda: acc.step(window, gpt_loss, count)
    eager = build_tiny_gpt(0)
    eager_acc = Accumulator(eager, _optimizer(eager))
    runners["eager"] = lambda: eager_acc.step(window, gpt_loss, count)
    return runners


def compile_seconds(window: list[Any], backend: str) -> dict[str, float]:
    """Each compiled runner's first window minus its median warm window, from a reset dynamo."""
    out = {}
    for name in ("hand", "gradaccum"):
        torch.compiler.reset()
        run = _runners(window, backend)[name]
        start = time.perf_counter()
        run()
        first = time.perf_counter() - start
        warm = []
        for _ in range(5):
            start = time.perf_counter()
            run()
            warm.append(time.perf_counter() - start)
        out[name] = first - statistics.median(warm)
    return out


def _mixed(rng: random.Random, n: int, rows: list[int]) -> Iterator[dict[str, torch.Tensor]]:
    for i in range(n):
        length = rng.randint(8, 64)
        yield sample_sequences(rng.choice(rows), 10_000 + i, max_len=length, min_len=min(4, length))


def recompiles_per_100(backend: str, dynamic: bool | None, pad: int | None) -> tuple[int, int]:
    """(graphs compiled in the 5 warm-up windows, recompiles in the next 100)."""
    torch.compiler.reset()
    fast = torch.compile(build_tiny_gpt(1), backend=backend, dynamic=dynamic)
    acc = Accumulator(fast, _optimizer(fast))
    rng = random.Random(0)
    rows = [2, 3, 4] if dynamic is None else [4]
    stream = windows(_mixed(rng, 105 * K, rows), K, pad_to_multiple=pad)
    steps = [acc.step(w, gpt_loss, count) for w in stream]
    return sum(r.recompiles for r in steps[:5]), sum(r.recompiles for r in steps[5:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--cold", action="store_true", help="turn inductor's on-disk caches off")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.compiler.config.force_disable_caches = args.cold
    print(
        f"torch {torch.__version__}, backend {args.backend}{' (caches off)' if args.cold else ''}, "
        f"{args.threads} thread(s), {args.runs} runs "
        f"of {args.rounds} rounds, k={K} x {MICRO}x{SEQ_LEN} tokens; paired ratio to the compiled hand "
        "loop, median over runs (min..max)"
    )
    batch = sample_sequences(MICRO * K, seed=0, max_len=SEQ_LEN, min_len=SEQ_LEN // 2)
    window = split(batch, micro_batch=MICRO)
    runs, compiles = [], []
    for _ in range(args.runs):
        compiles.append(compile_seconds(window, args.backend))
        torch.compiler.reset()  # the first round compiles again; paired_ratios drops it as warm-up
        runs.append(paired_ratios(_runners(window, args.backend), "hand", args.rounds))
    cells = []
    for name in runs[0]:
        values = sorted(r[name] for r in runs)
        cells.append(f"{name} {statistics.median(values):.3f}x ({values[0]:.3f}..{values[-1]:.3f})")
    print("step cost: " + "   ".join(cells))
    for name in compiles[0]:
        values = sorted(c[name] for c in compiles)
        print(f"compile time, {name}: {statistics.median(values):.1f} s ({values[0]:.1f}..{values[-1]:.1f})")
    for label, dynamic, pad in (
        ("automatic dynamic shapes, 2-4 rows", None, None),
        ("dynamic=False, pad_to_multiple=16, 4 rows", False, 16),
    ):
        warm, later = recompiles_per_100(args.backend, dynamic, pad)
        print(f"recompiles, {label}: {warm} graphs in the 5 warm-up windows, {later} in the next 100")


if __name__ == "__main__":
    main()
