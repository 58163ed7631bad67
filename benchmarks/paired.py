"""Paired timing for the benchmark scripts: each runner's time divided by a reference's, in rounds.

Run-to-run drift on a shared machine is several percent, far above the 1 % differences these
scripts look for; a ratio taken within one round, with the order rotated every round, cancels it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator

WARMUP_ROUNDS = 3
"""Rounds dropped first: they warm up allocators and caches."""


def _paired_rounds(runners: dict[str, Callable[[], object]], rounds: int) -> Iterator[dict[str, float]]:
    """Each measured round's seconds per runner, the order rotated every round, warm-up dropped."""
    names = list(runners)
    for r in range(rounds + WARMUP_ROUNDS):
        order = names[r % len(names) :] + names[: r % len(names)]
        took: dict[str, float] = {}
        for name in order:
            start = time.perf_counter()
            runners[name]()
            took[name] = time.perf_counter() - start
        if r >= WARMUP_ROUNDS:
            yield took


def paired_times(runners: dict[str, Callable[[], object]], rounds: int) -> list[dict[str, float]]:
    """Each measured round's seconds per runner, for ratios between any two runners of one round."""
    return list(_paired_rounds(runners, rounds))


def paired_ratios(runners: dict[str, Callable[[], object]], reference: str, rounds: int) -> dict[str, float]:
    """Median over ``rounds`` of each runner's time divided by the same round's ``reference`` time."""
    took = list(_paired_rounds(runners, rounds))
    others = [name for name in runners if name != reference]
    return {name: statistics.median(t[name] / t[reference] for t in took) for name in others}


def paired_differences(
    runners: dict[str, Callable[[], object]], reference: str, rounds: int
) -> dict[str, float]:
    """Median over ``rounds`` of each runner's time minus the same round's ``reference`` time, in
    seconds: what a runner adds, where a ratio would hide it behind the work both do."""
    took = list(_paired_rounds(runners, rounds))
    others = [name for name in runners if name != reference]
    return {name: statistics.median(t[name] - t[reference] for t in took) for name in others}


def each_against(
    reference: Callable[[], object], arms: dict[str, Callable[[], object]], rounds: int
) -> dict[str, tuple[float, float, float]]:
    """Per arm, timed in a pair of its own against ``reference``: (median ratio, median difference
    in us, the reference's median in ms). Two arms never share a pair, so one arm's cost cannot
    move another's figure."""
    out = {}
    for name, arm in arms.items():
        took = paired_times({"reference": reference, name: arm}, rounds)
        ratio = statistics.median(t[name] / t["reference"] for t in took)
        diff = statistics.median(t[name] - t["reference"] for t in took) * 1e6
        out[name] = (ratio, diff, statistics.median(t["reference"] for t in took) * 1e3)
    return out
