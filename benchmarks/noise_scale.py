"""What ``noise_scale=True`` costs per step, and how close its estimate gets to the known answer.

Cost: one process, CPU, the bundled tiny GPT (AdamW), at the sizes of ``benchmarks/overhead.py``
(k=4 micro-batches of 2 x 24 and 8 x 64 tokens, k=64 of 1 x 24). Each round steps an Accumulator
with ``noise_scale=False`` and one with ``noise_scale=True`` (and a second one off: the A/A
control), back to back in an order that rotates, and takes each one's ratio to the *same* round's
"off" step (a paired ratio). A run's figure is the median over its rounds; the table shows the
median over runs and their spread (min..max). Both without and with clipping (with clipping the
step computes the norm anyway, and the estimate reuses it).

Spread: linear regression on 2^14 Gaussian examples (``gradaccum.examples.regression``) at fixed
weights, where tr(Sigma), |G|^2 and B_simple are computed from the per-example gradients. Independent
replicates of the same run (fresh draws) step the Accumulator window after window; after t windows
the table shows, over replicates, the median and the 10th..90th percentiles of each estimate
divided by the truth. The moving average (beta = 0.99) stops narrowing at ~200 effective windows.

    .venv/bin/python benchmarks/noise_scale.py [--runs 5] [--rounds 30] [--replicates 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
from paired import paired_ratios

from gradaccum import Accumulator, split
from gradaccum.examples import build_tiny_gpt, gpt_loss
from gradaccum.examples.gpt import sample_sequences
from gradaccum.examples.regression import RegressionPopulation, regression_count, regression_loss
from gradaccum.loss import count_tokens

count = count_tokens("labels", shift=False)
SIZES = ((4, 2, 24), (4, 8, 64), (64, 1, 24))
"""(k micro-batches, sequences per micro-batch, tokens per sequence), as in benchmarks/overhead.py."""
CHECKPOINTS = (10, 25, 50, 100, 200, 400)
"""Windows after which the spread is shown."""


def _runners(window: list[Any], clip: float | None) -> dict[str, Callable[[], object]]:
    runners: dict[str, Callable[[], object]] = {}
    for name, noise_scale in (("off", False), ("off copy", False), ("on", True)):
        model = build_tiny_gpt(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        acc = Accumulator(model, opt, max_grad_norm=clip, noise_scale=noise_scale)
        runners[name] = lambda acc=acc: acc.step(window, gpt_loss, count)
    return runners


def one_run(window: list[Any], rounds: int, clip: float | None) -> dict[str, float]:
    """Median over rounds of each step's time divided by the same round's ``off`` step."""
    return paired_ratios(_runners(window, clip), "off", rounds)


def cost(runs: int, rounds: int) -> None:
    print("cost: paired ratio to noise_scale=False, median over runs (min..max); off copy = A/A control")
    for k, micro, seq_len in SIZES:
        batch = sample_sequences(micro * k, seed=0, max_len=seq_len, min_len=seq_len // 2)
        window = split(batch, micro_batch=micro)
        for clip in (None, 1.0):
            results = [one_run(window, rounds, clip) for _ in range(runs)]
            cells = []
            for name in results[0]:
                values = sorted(r[name] for r in results)
                cells.append(f"{name} {statistics.median(values):.3f}x ({values[0]:.3f}..{values[-1]:.3f})")
            label = "clipped" if clip is not None else "no clip"
            print(f"  k={k:>2} x {micro}x{seq_len} tokens, {label}: " + "   ".join(cells))


def _unequal(population: RegressionPopulation, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    while True:
        k = int(torch.randint(3, 7, (1,), generator=gen))
        sizes = [(8, 16, 32, 64)[int(i)] for i in torch.randint(0, 4, (k,), generator=gen)]
        window = population.window(sizes, gen, masked=0.25)
        if sum(int(mb["w"].sum()) > 0 for mb in window) >= 2:
            return window


def spread(replicates: int) -> None:
    population = RegressionPopulation.build()
    true_trace, true_grad_sq = population.truth(population.model())
    true_b = true_trace / true_grad_sq
    print(
        f"\nspread: linear regression, {population.x.shape[0]} examples x {population.x.shape[1]} "
        f"features, weights fixed; truth tr(Sigma) {true_trace:.4g}, |G|^2 {true_grad_sq:.4g}, "
        f"B_simple {true_b:.4g} examples"
    )
    print(f"  estimate / truth after t windows over {replicates} replicates: median (10th..90th percentile)")
    designs: dict[str, Callable[[torch.Generator], list[dict[str, torch.Tensor]]]] = {
        "4 x 16 rows": lambda gen: population.window([16] * 4, gen),
        "3-6 x 8-64 rows, 1/4 masked": lambda gen: _unequal(population, gen),
    }
    for label, draw in designs.items():
        table: dict[int, list[tuple[float, float, float]]] = {t: [] for t in CHECKPOINTS}
        for r in range(replicates):
            model = population.model()
            acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_scale=True)
            gen = torch.Generator().manual_seed(1_000 + r)
            for t in range(1, CHECKPOINTS[-1] + 1):
                acc.step(draw(gen), regression_loss, regression_count)
                if t in table:
                    ns = acc.noise_scale
                    b = ns.b_simple if ns.b_simple is not None else float("inf")
                    table[t].append(
                        (b / true_b, (ns.trace_cov or 0) / true_trace, (ns.grad_sq or 0) / true_grad_sq)
                    )
        print(f"  {label}:")
        for t, rows in table.items():
            cells = []
            for i, name in enumerate(("B_simple", "tr(Sigma)", "|G|^2")):
                q = statistics.quantiles([row[i] for row in rows], n=10)
                cells.append(
                    f"{name} {statistics.median(row[i] for row in rows):.2f} ({q[0]:.2f}..{q[-1]:.2f})"
                )
            print(f"    t={t:>3}: " + "   ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--replicates", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-cost", action="store_true", help="only the spread")
    parser.add_argument("--skip-spread", action="store_true", help="only the cost")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    if not args.skip_cost:
        cost(args.runs, args.rounds)
    if not args.skip_spread:
        spread(args.replicates)


if __name__ == "__main__":
    main()
