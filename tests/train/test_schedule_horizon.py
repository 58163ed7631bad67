"""The cosine's horizon when the run's length is stated on the other clock and the batch grows.

With ``--steps`` and the tokens clock, the horizon was the steps times the *first* window's tokens:
once the batch-size schedule grows the batch, the tokens clock passes that horizon before the last
step, and the learning rate sits at its floor early. With ``--tokens`` and the steps clock the run
ends before the converted number of steps: the cosine never reaches its floor. The schedule now
advances on the run's own clock, so the last window (and only it) is at the floor.

The learning rate of each step record is peak x factor x (B / B_0)^(1/2) (the sqrt rule), so the
schedule's factor is read back exactly (float64, relative 1e-12 for the two roundings).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest

from gradaccum.plan import BatchPlan
from gradaccum.step.config import AccumConfig
from gradaccum.train import TrainConfig, read_metrics, train
from gradaccum.train.batch_schedule import CriticalBatchConfig
from gradaccum.train.schedule import ScheduleConfig, resolve_schedule

LR, FLOOR, START = 0.02, 0.1, 8


def _factors(run_dir: Path, clock: str, length: dict[str, int]) -> tuple[list[float], list[dict[str, Any]]]:
    config = TrainConfig(
        plan=BatchPlan(micro_batch=4, accum_steps=2),
        run_dir=run_dir,
        workload="gradaccum.examples.regression:regression",
        optimizer="sgd",
        lr=LR,
        precision="float64",
        schedule=ScheduleConfig(kind="cosine", clock=clock, warmup=0, min_lr_ratio=FLOOR),  # type: ignore[arg-type]
        accum=AccumConfig(noise_scale=True),
        batch_schedule=CriticalBatchConfig(max_global_batch=256, min_updates=10),
        checkpoint_every=None,
        checkpoint_minutes=None,
        **length,  # type: ignore[arg-type]
    )
    train(config)
    records = list(read_metrics(run_dir / "metrics.jsonl"))
    steps = [r for r in records if r["kind"] == "step"]
    changes = [r for r in records if r["kind"] == "batch"]
    return [s["lr"] / (LR * math.sqrt(s["global_batch"] / START)) for s in steps], changes


@pytest.mark.parametrize(
    ("clock", "length"),
    [("tokens", {"steps": 60}), ("steps", {"tokens": 1200})],
    ids=["steps-run-tokens-clock", "tokens-run-steps-clock"],
)
def test_the_cosine_ends_with_the_run_across_a_batch_change(
    tmp_path: Path, clock: str, length: dict[str, int]
) -> None:
    factors, changes = _factors(tmp_path, clock, length)
    assert changes, "the batch never grew: the test needs a change"
    assert factors[-1] == pytest.approx(FLOOR, rel=1e-12)  # at the floor at the end of the run
    assert all(f > FLOOR * (1 + 1e-9) for f in factors[:-1])  # and not before
    assert all(a >= b for a, b in itertools.pairwise(factors))  # decaying throughout


def test_without_a_batch_schedule_the_conversion_stays() -> None:
    config = ScheduleConfig(kind="cosine", clock="tokens", warmup=80)
    fixed = resolve_schedule(config, steps=60, tokens=None, tokens_per_step=8)
    assert (fixed.clock, fixed.horizon, fixed.warmup) == ("tokens", 480, 80)
    grown = resolve_schedule(config, steps=60, tokens=None, tokens_per_step=8, grows=True)
    assert (grown.clock, grown.horizon, grown.warmup) == ("steps", 60, 10)
    stated = resolve_schedule(config, steps=60, tokens=900, tokens_per_step=8, grows=True)
    assert (stated.clock, stated.horizon) == ("tokens", 900)  # the run states its tokens: kept
