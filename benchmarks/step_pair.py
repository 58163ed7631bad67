"""The default step against the hand-written exact loop, the two alone, side by side.

``overhead.py`` rotates ten implementations through every round, so each one runs after a
different other; here the step and the hand loop alternate with nothing between them (the order
swapped every round), as a test that times the two side by side would run them. Then the same for
``pre by hand`` (the default step's features written by hand, no engine: its floor). One process,
CPU, the bundled tiny GPT (AdamW), k=4 micro-batches of 2 sequences x 24 tokens, one shared model
and optimizer (as in ``overhead.py``). Each run prints the median paired ratio and difference over
its rounds; the last line gives the median over runs.

    .venv/bin/python benchmarks/step_pair.py [--runs 3] [--rounds 600] [--threads 1]
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from options import parse_counts
from overhead import count, hand_loop, pre_by_hand
from paired import each_against

from gradaccum import Accumulator, split
from gradaccum.examples import build_tiny_gpt, gpt_loss
from gradaccum.examples.gpt import sample_sequences


def one_run(rounds: int) -> dict[str, tuple[float, float]]:
    """(median ratio, median difference in us) to the hand loop, per arm, each timed in a pair
    of its own."""
    window = split(sample_sequences(8, seed=0, max_len=24, min_len=12), micro_batch=2)
    model = build_tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = Accumulator(model, opt)
    floor = pre_by_hand(model, opt)
    hand = lambda: hand_loop(model, opt, window)
    arms: dict[str, Callable[[], object]] = {
        "gradaccum": lambda: acc.step(window, gpt_loss, count),
        "pre by hand": lambda: floor(window),
    }
    return {name: (ratio, diff) for name, (ratio, diff, _) in each_against(hand, arms, rounds).items()}


def main() -> None:
    args = parse_counts(__doc__, runs=3, rounds=600)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.runs} runs of {args.rounds} rounds")
    runs = []
    for r in range(args.runs):
        got = one_run(args.rounds)
        runs.append(got)
        cells = "   ".join(f"{name} {ratio:.4f}x ({diff:+.0f} us)" for name, (ratio, diff) in got.items())
        print(f"run {r + 1}: {cells}")
    medians = "   ".join(f"{name} {statistics.median(run[name][0] for run in runs):.4f}x" for name in runs[0])
    print(f"median over runs: {medians}")


if __name__ == "__main__":
    main()
