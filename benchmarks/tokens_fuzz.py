"""How often the token planner leaves a rank without a micro-batch, or refuses ``equal_count``
where an equal plan exists, over seeded random windows.

Each window: 1..6 ranks, ``ranks..ranks+8`` rows of 1..64 tokens, about a quarter of them with no
valid token (prompt-only rows: a length, all labels -100), and a budget of 1..4 times the longest
row plus 0..15. Every window is planned twice, by ``plan_tokens(..., equal_count=False)`` and
``equal_count=True``. Counted: plans where some rank holds no micro-batch; ``equal_count`` refusals
of windows that have an equal plan (one exists iff a multiple of the ranks lies between the
fewest micro-batches the budget allows and the rows; tests/unit/test_tokens_fuzz.py checks that
rule against brute force); plans that break the budget or place a row other than once. Also the
largest distance of the ranks' valid tokens from their mean, as the median over the plans.

    PYTHONPATH=src .venv/bin/python benchmarks/tokens_fuzz.py [--windows 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import statistics

from gradaccum.errors import PlanError
from gradaccum.tokens.balance import cut, plan_tokens


def window(rng: random.Random) -> tuple[list[int], list[int], int, int]:
    world = rng.randint(1, 6)
    rows = rng.randint(world, world + 8)
    lengths = [rng.randint(1, 64) for _ in range(rows)]
    valid = [0 if rng.random() < 0.25 else n for n in lengths]
    budget = max(lengths) * rng.randint(1, 4) + rng.randint(0, 15)
    return lengths, valid, budget, world


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    plans = empty = refused_wrongly = refused = broken = 0
    spread: list[float] = []
    for _ in range(args.windows):
        lengths, valid, budget, world = window(rng)
        fewest = len(cut(lengths, budget))
        equal_exists = -(-fewest // world) * world <= len(lengths)
        for equal in (False, True):
            plans += 1
            try:
                plan = plan_tokens(lengths, budget, world=world, equal_count=equal, valid=valid)
            except PlanError:
                refused += 1
                refused_wrongly += equal and equal_exists
                continue
            empty += any(not rank for rank in plan.ranks)
            placed = sorted(i for rank in plan.ranks for mb in rank for i in mb)
            over = any(plan.computed_tokens(mb) > budget for rank in plan.ranks for mb in rank if mb)
            broken += over or placed != list(range(len(lengths)))
            if sum(valid):
                spread.append(plan.imbalance)
    print(f"{plans} plans of {args.windows} windows (seed {args.seed})")
    print(f"  a rank without a micro-batch           {empty}")
    print(f"  equal_count refused with an equal plan {refused_wrongly} (of {refused} refusals)")
    print(f"  budget broken or a row misplaced       {broken}")
    print(f"  median of the ranks' largest distance from their mean: {statistics.median(spread):.1%}")


if __name__ == "__main__":
    main()
