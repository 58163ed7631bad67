"""Updates and tokens to a target held-out loss: smallest fixed batch, largest fixed batch, and the
batch-size schedule that follows the measured noise scale (``train --batch-schedule critical``).

Arms per problem and seed, on the same data stream and from the same initial weights:

* ``small``: the starting plan's global batch throughout (micro-batch x accum_steps);
* ``large``: ``max_global_batch`` throughout, its learning rate scaled by the lr rule as the schedule
  would scale it at that batch (the fixed batch the schedule could end at);
* ``sched F``: :class:`gradaccum.train.batch_schedule.CriticalBatchSchedule`, starting at the small
  batch, growing toward F x B_simple (``fraction``, ``--batch-fraction``) up to ``max_global_batch``;
  one arm per fraction in ``--fractions`` (default 1, the critical batch itself, and 0.5).

Each arm runs the library's own pieces in the order ``train``'s loop does (the window at the current
plan from :class:`ShardedStream`, the learning rate x the rule's scale, ``Accumulator.step`` with
``noise_scale=True``, then the schedule's decision), and evaluates the held-out loss after every
``--eval-every`` updates: on the regression the exact population loss, on the tiny GPT the mean loss
per token over held-out sequences (the evaluation seed of ``train``). The figure per arm is the
first evaluated update at which the held-out loss is at or below the target, and the valid units
(rows, tokens) its windows held; "-" when not reached within the problem's update budget. Ratios
are each schedule's over the small batch's, per seed (the goal: <= 0.70 updates at <= 1.2x tokens).

    .venv/bin/python benchmarks/batch_schedule.py [--seeds 3] [--problems regression,gpt] [--fractions 1,0.5]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gradaccum import Accumulator
from gradaccum.check.workload import Workload
from gradaccum.examples import tiny_gpt
from gradaccum.examples.regression import _population, regression
from gradaccum.plan import BatchPlan
from gradaccum.train import evaluate
from gradaccum.train.batch_schedule import CriticalBatchConfig, CriticalBatchSchedule
from gradaccum.train.data import ShardedStream, eval_seed
from gradaccum.train.schedule import apply_lr


@dataclass(frozen=True, kw_only=True)
class Problem:
    name: str
    workload: Callable[[], Workload]
    plan: BatchPlan
    """The starting (small) plan."""
    schedule: CriticalBatchConfig
    lr: float
    target: float
    """The held-out loss to reach."""
    max_updates: int
    eval_every: int
    dtype: torch.dtype
    optimizer: str = "adamw"


PROBLEMS = {
    # linear regression, 7 parameters, noise 0.5: the loss floor is 0.125 and B_noise grows without
    # bound as the weights approach the fit (|G|^2 -> 0): the critical batch grows over the run
    "regression": Problem(
        name="regression",
        workload=regression,
        plan=BatchPlan(micro_batch=4, accum_steps=2),
        schedule=CriticalBatchConfig(max_global_batch=128, min_updates=20, lr_rule="linear"),
        lr=0.02,
        target=0.128,
        max_updates=3000,
        eval_every=5,
        dtype=torch.float64,
        optimizer="sgd",
    ),
    "gpt": Problem(
        name="gpt",
        workload=tiny_gpt,
        plan=BatchPlan(micro_batch=8, accum_steps=2),
        schedule=CriticalBatchConfig(max_global_batch=256, min_updates=20),
        lr=3e-3,
        target=2.30,
        max_updates=800,
        eval_every=10,
        dtype=torch.float32,
    ),
}


@dataclass(frozen=True, kw_only=True)
class Reached:
    updates: int | None
    units: int | None
    final_batch: int
    final_loss: float
    wall_s: float


def _held_out(problem: Problem, workload: Workload, seed: int) -> Callable[[torch.nn.Module], float]:
    if problem.name == "regression":
        population = _population()

        def exact(model: torch.nn.Module) -> float:
            with torch.no_grad():
                residual = model(population.x).squeeze(-1) - population.y
            return float(0.5 * residual.square().mean())

        return exact
    batch = workload.make_batch(256, eval_seed(seed, 0))
    micro = [{k: v[i : i + 64] for k, v in batch.items()} for i in range(0, 256, 64)]

    def mean_loss(model: torch.nn.Module) -> float:
        loss, _ = evaluate(model, micro, workload.loss_fn, workload.count_fn, device=torch.device("cpu"))
        return float(loss if loss is not None else math.inf)

    return mean_loss


def run_arm(problem: Problem, arm: str, seed: int, fraction: float | None = None) -> Reached:
    """One arm of one seed: updates until the held-out loss reaches the target (or the budget ends);
    ``fraction`` overrides the schedule's for a ``schedule`` arm."""
    workload = problem.workload()
    torch.manual_seed(seed)
    model = workload.build_model().to(problem.dtype)
    if problem.optimizer == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=problem.lr)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=problem.lr, weight_decay=0.0)
    apply_lr(optimizer, 1.0)
    acc = Accumulator(model, optimizer, max_grad_norm=1.0, noise_scale=True)
    start, config = problem.plan, problem.schedule
    if fraction is not None:
        config = dataclasses.replace(config, fraction=fraction)
    batch = CriticalBatchSchedule(config, start) if arm == "schedule" else None
    fixed = start
    if arm == "large":
        per_pass = start.micro_batch * start.dp
        fixed = BatchPlan(micro_batch=start.micro_batch, accum_steps=config.max_global_batch // per_pass)
    lr_scale = {"keep": 0.0, "sqrt": 0.5, "linear": 1.0}[config.lr_rule]
    fixed_scale = (fixed.accum_steps / start.accum_steps) ** lr_scale
    stream = ShardedStream(
        workload.make_batch,
        workload.count_fn,
        start,
        rank=0,
        seed=seed,
        device=torch.device("cpu"),
        float_dtype=torch.float64 if problem.dtype == torch.float64 else None,
    )
    held_out = _held_out(problem, workload, seed)
    units, loss, t0 = 0, math.inf, time.perf_counter()
    plan = fixed
    reached: tuple[int, int] | tuple[None, None] = (None, None)  # (updates, units) at the target
    for update in range(1, problem.max_updates + 1):
        plan = fixed if batch is None else batch.plan
        window = stream.window(update - 1, plan)
        apply_lr(optimizer, fixed_scale if batch is None else batch.lr_scale)
        result = acc.step(window.micro_batches, workload.loss_fn, workload.count_fn)
        units += result.global_count
        if batch is not None:
            batch.decide(
                step=acc.steps_applied,
                window=update,
                noise=acc.noise_scale,
                units_per_example=result.global_count / plan.global_batch,
            )
        if update % problem.eval_every == 0:
            loss = held_out(model)
            if loss <= problem.target:
                reached = (update, units)
                break
    return Reached(
        updates=reached[0],
        units=reached[1],
        final_batch=plan.global_batch,
        final_loss=loss,
        wall_s=time.perf_counter() - t0,
    )


def _fmt(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _ratio(a: int | None, b: int | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--problems", default="regression,gpt")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fractions", default="1,0.5", help="one schedule arm per fraction of B_simple")
    parser.add_argument("--min-updates", type=int, help="override the schedule's min_updates")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.problems.split(","):
        problem = PROBLEMS[name]
        if args.min_updates is not None:
            schedule = dataclasses.replace(problem.schedule, min_updates=args.min_updates)
            problem = dataclasses.replace(problem, schedule=schedule)
        fractions = [float(f) for f in args.fractions.split(",")]
        config = problem.schedule
        print(
            f"{name}: target held-out loss {problem.target}, start {problem.plan.equation()}, "
            f"max global batch {config.max_global_batch}, growth {config.growth:g}, min_updates "
            f"{config.min_updates}, lr rule {config.lr_rule}, "
            f"{problem.optimizer} lr {problem.lr:g}, eval every {problem.eval_every} updates"
        )
        head = f"  {'seed':>4} {'arm':>10} {'updates':>8} {'units':>10} {'end batch':>9} {'loss':>7}"
        print(f"{head} {'wall s':>7}")
        ratios: dict[str, list[tuple[str, str]]] = {f"sched {f:g}": [] for f in fractions}
        for seed in range(args.seeds):
            arms = [("small", "small", None), ("large", "large", None)]
            arms += [(f"sched {f:g}", "schedule", f) for f in fractions]
            got: dict[str, Reached] = {}
            for label, arm, fraction in arms:
                r = got[label] = run_arm(problem, arm, seed, fraction)
                print(
                    f"  {seed:>4} {label:>10} {_fmt(r.updates):>8} {_fmt(r.units):>10} {r.final_batch:>9} "
                    f"{r.final_loss:>7.4f} {r.wall_s:>7.1f}",
                    flush=True,
                )
            small = got["small"]
            for label, pairs in ratios.items():
                pairs.append(
                    (_ratio(got[label].updates, small.updates), _ratio(got[label].units, small.units))
                )
        for label, pairs in ratios.items():
            print(
                f"  {label} / small per seed: updates "
                + ", ".join(u for u, _ in pairs)
                + "; units "
                + ", ".join(t for _, t in pairs)
                + " (goal: updates <= 0.70 at units <= 1.20)"
            )


if __name__ == "__main__":
    main()
