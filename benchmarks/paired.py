"""Paired timing for the benchmark scripts: each runner's time divided by a reference's, in rounds.

Run-to-run drift on a shared machine is several percent, far above the 1 % differences these
scripts look for; a ratio taken within one round, with the order rotated every round, cancels it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

WARMUP_ROUNDS = 3
"""Rounds dropped first: they warm up allocators and caches."""


def paired_ratios(runners: dict[str, Callable[[], object]], reference: str, rounds: int) -> dict[str, float]:
    """Median over ``rounds`` of each runner's time divided by the same round's ``reference`` time."""
    names = list(runners)
    ratios: dict[str, list[float]] = {name: [] for name in names if name != reference}
    for r in range(rounds + WARMUP_ROUNDS):
        order = names[r % len(names) :] + names[: r % len(names)]
        took: dict[str, float] = {}
        for name in order:
            start = time.perf_counter()
            runners[name]()
            took[name] = time.perf_counter() - start
        if r >= WARMUP_ROUNDS:
            for name in ratios:
                ratios[name].append(took[name] / took[reference])
    return {name: statistics.median(values) for name, values in ratios.items()}


def paired_differences(
    runners: dict[str, Callable[[], object]], reference: str, rounds: int
) -> dict[str, float]:
    """Median over ``rounds`` of each runner's time minus the same round's ``reference`` time, in
    seconds: what a runner adds, where a ratio would hide it behind the work both do."""
    names = list(runners)
    extra: dict[str, list[float]] = {name: [] for name in names if name != reference}
    for r in range(rounds + WARMUP_ROUNDS):
        order = names[r % len(names) :] + names[: r % len(names)]
        took: dict[str, float] = {}
        for name in order:
            start = time.perf_counter()
            runners[name]()
            took[name] = time.perf_counter() - start
        if r >= WARMUP_ROUNDS:
            for name in extra:
                extra[name].append(took[name] - took[reference])
    return {name: statistics.median(values) for name, values in extra.items()}
