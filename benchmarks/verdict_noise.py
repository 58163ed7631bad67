"""Does accept's verdict survive noise? A/A comparisons and a large real difference, in both directions.

Each comparison is what ``gradaccum accept`` measures: ``--runs`` paired runs, each a fresh process
holding both configurations and alternating them in blocks, then the adoption rule with its 95 %
interval. The float64 equivalence checks and the traces are run once per pair of plans (they do not
depend on the machine's noise) and reused. Printed, not asserted:

* A/A (``8x4`` against ``8x4``): how often the rule adopts a configuration against itself (target
  at most 5 %), and how often it is inconclusive;
* ``8x4`` against ``1x32`` and back: the slower candidate must never be adopted; the faster one must
  be adopted or at worst INCONCLUSIVE, never KEEP BASELINE.

    .venv/bin/python benchmarks/verdict_noise.py [--comparisons 20] [--repeats 5] [--runs 3] [--steps 20]
"""

from __future__ import annotations

import argparse
import collections
import time

from gradaccum.bench.accept import AcceptSpec, check_equivalence
from gradaccum.bench.runner import run_isolated
from gradaccum.bench.spec import MeasureSettings
from gradaccum.bench.verdict import ADOPT, INCONCLUSIVE, KEEP, ArmFigures, decide
from gradaccum.check.workload import load_workload
from gradaccum.plan import BatchPlan

WORKLOAD = "gradaccum.examples:tiny_gpt"


def _plan(text: str) -> BatchPlan:
    micro, accum = (int(x) for x in text.split("x"))
    return BatchPlan(micro_batch=micro, accum_steps=accum)


def _arm(label: str, records: list, which: str) -> ArmFigures:
    ms = [getattr(r, which) for r in records if r.ok]
    return ArmFigures(
        label=label,
        global_batch=32,
        tokens_per_update=tuple(ms[0].tokens_per_update) if ms else (),
        updates=sum(m.updates for m in ms),
        skipped_updates=sum(m.skipped_updates for m in ms),
        units_per_s_per_run=tuple(m.units_per_s for m in ms),
        runs_failed=len(records) - len(ms),
    )


def compare(
    baseline: str, candidate: str, settings: MeasureSettings, equivalence
) -> tuple[str, float | None]:  # type: ignore[no-untyped-def]
    spec = AcceptSpec(
        workload=WORKLOAD, baseline=_plan(baseline), candidate=_plan(candidate), settings=settings
    )
    paired = spec.paired_spec()
    records = [run_isolated(paired, r, timeout_s=600) for r in range(settings.runs)]
    verdict = decide(
        baseline=_arm(baseline, records, "baseline"),
        candidate=_arm(candidate, records, "candidate"),
        params=equivalence.params,
        trace=equivalence.trace,
        paired=[r.ratios for r in records if r.ok],
        margin=spec.margin,
    )
    return verdict.decision, verdict.throughput_gain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--comparisons", type=int, default=20, help="A/A comparisons (default 20; 0 skips them)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="8x4 vs 1x32 comparisons per direction (default 5)"
    )
    parser.add_argument("--runs", type=int, default=3, help="paired runs per comparison (default 3)")
    parser.add_argument(
        "--steps", type=int, default=20, help="updates per configuration per run (default 20)"
    )
    args = parser.parse_args()
    settings = MeasureSettings(runs=args.runs, steps=args.steps, warmup=2, threads=1, max_grad_norm=1.0)
    workload = load_workload(WORKLOAD)
    started = time.perf_counter()
    print(f"{WORKLOAD}, global batch 32, {args.runs} paired runs of {args.steps} updates each,", end=" ")
    print("blocks of 5, margin 3%")
    for name, baseline, candidate, n in (
        ("A/A", "8x4", "8x4", args.comparisons),
        ("slower candidate", "8x4", "1x32", args.repeats),
        ("faster candidate", "1x32", "8x4", args.repeats),
    ):
        if n < 1:
            continue  # e.g. --comparisons 0: only the two directions
        spec = AcceptSpec(
            workload=WORKLOAD, baseline=_plan(baseline), candidate=_plan(candidate), settings=settings
        )
        equivalence = check_equivalence(spec, workload)
        outcomes = [compare(baseline, candidate, settings, equivalence) for _ in range(n)]
        counts = collections.Counter(d for d, _ in outcomes)
        gains = sorted(g for _, g in outcomes if g is not None)
        spread = f"gains {gains[0]:+.1%}..{gains[-1]:+.1%}" if gains else "no gain measured"
        rates = ", ".join(f"{d} {counts[d]}/{n} ({counts[d] / n:.0%})" for d in (ADOPT, KEEP, INCONCLUSIVE))
        print(f"{name:17s} {baseline} -> {candidate}: {rates}; {spread}")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
