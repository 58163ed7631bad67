"""The acceptance protocol end to end in this process, and the run card it writes.

Measurements run in-process (fast); the verdict's throughput criterion depends on the machine, so
only the five criteria that do not are asserted to pass on a correct workload.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from gradaccum.batch import split
from gradaccum.bench.accept import AcceptResult, AcceptSpec, Arm, make_runcard, partition, run_accept
from gradaccum.bench.measure import measure_paired_safely, measure_safely
from gradaccum.bench.runfolder import new_run_folder, write_accept_folder
from gradaccum.bench.spec import MeasureSettings, MeasureSpec, PairedRecord, PairedSpec, RunRecord
from gradaccum.check.workload import load_workload
from gradaccum.errors import BenchError, PlanError, RunCardError
from gradaccum.plan import BatchPlan, windows
from gradaccum.runcard import environment, read_runcard, write_runcard
from gradaccum.step.accumulator import Accumulator

GPT = "gradaccum.examples:tiny_gpt"


def in_process(spec: MeasureSpec | PairedSpec, run_index: int) -> RunRecord | PairedRecord:
    if isinstance(spec, PairedSpec):
        return measure_paired_safely(load_workload(spec.baseline.workload), spec, run_index=run_index)
    return measure_safely(load_workload(spec.workload), spec, run_index=run_index)


def plan(micro: int, accum: int, dp: int = 1) -> BatchPlan:
    return BatchPlan(micro_batch=micro, accum_steps=accum, dp=dp)


def test_mismatched_global_batches_are_refused_naming_both() -> None:
    with pytest.raises(PlanError) as exc:
        AcceptSpec(baseline=plan(8, 4), candidate=plan(4, 4))
    text = str(exc.value)
    assert "baseline 8x4 has global batch 32" in text and "candidate 4x4 has global batch 16" in text
    assert "use accumulation 8 (4x8)" in text  # the fix, when there is one
    with pytest.raises(PlanError, match="candidate 3x2 has global batch 6"):
        AcceptSpec(baseline=plan(8, 4), candidate=plan(3, 2))


def test_fewer_than_three_runs_are_refused() -> None:
    with pytest.raises(BenchError, match=">= 3"):
        AcceptSpec(baseline=plan(4, 2), candidate=plan(2, 4), settings=MeasureSettings(runs=2))


def test_the_check_partitions_the_whole_global_batch() -> None:
    assert partition(plan(4, 2)) == [4, 4]
    assert partition(plan(2, 3, dp=2)) == [2] * 6  # every rank's micro-batches, one process


def test_each_arm_carries_its_own_scaling() -> None:
    settings = MeasureSettings(steps=4, warmup=1)
    spec = AcceptSpec(
        baseline=plan(4, 2),
        candidate=plan(4, 2),
        candidate_scaling="post",
        settings=settings,
        block_updates=1,
    )
    assert spec.scalings == ("pre", "post")
    assert (spec.label_of("baseline"), spec.label_of("candidate")) == ("4x2 pre", "4x2 post")
    assert (spec.accum_of("baseline").scaling, spec.accum_of("candidate").scaling) == ("pre", "post")
    assert spec.accum == spec.accum_of("baseline")  # the shared settings, as before, with pre
    paired = spec.paired_spec()
    assert (paired.baseline.scaling, paired.candidate.scaling) == ("pre", "post")
    assert spec.arm_spec("candidate") == spec.measure_spec(plan(4, 2), scaling="post")
    quality = AcceptSpec(
        baseline=plan(4, 2),
        candidate=plan(2, 4),
        baseline_scaling="post",
        quality_steps=2,
        settings=settings,
        block_updates=1,
    ).quality_spec()
    assert quality is not None
    assert (quality.accum_of("baseline").scaling, quality.accum_of("candidate").scaling) == ("post", "pre")
    # with both arms pre (the default) the labels stay the plans, as results.json has always had them
    plain = AcceptSpec(baseline=plan(4, 2), candidate=plan(2, 4), settings=settings, block_updates=1)
    assert (plain.label_of("baseline"), plain.label_of("candidate")) == ("4x2", "2x4")
    # an A/A run (same plan, same scaling) stays allowed as a noise check
    AcceptSpec(baseline=plan(4, 2), candidate=plan(4, 2), settings=settings, block_updates=1)


def test_a_scaling_that_cannot_run_is_refused_before_anything_runs() -> None:
    with pytest.raises(BenchError, match="scaling must be 'pre' .* or 'post' .*, got 'late'"):
        AcceptSpec(baseline=plan(4, 2), candidate=plan(2, 4), candidate_scaling="late")  # type: ignore[arg-type]
    undeferred = MeasureSettings(defer_sync=False)
    with pytest.raises(BenchError, match=r"scaling 'post' under data parallelism \(dp=2\)"):
        AcceptSpec(
            baseline=plan(4, 2, dp=2),
            candidate=plan(4, 2, dp=2),
            candidate_scaling="post",
            settings=undeferred,
        )
    AcceptSpec(baseline=plan(4, 2), candidate=plan(4, 2), candidate_scaling="post", settings=undeferred)


def accept_tiny(root: Path, workload: str = GPT) -> tuple[AcceptResult, Path, list[Path]]:
    spec = AcceptSpec(
        workload=workload,
        baseline=plan(4, 2),
        candidate=plan(2, 4),
        trace_steps=2,
        settings=MeasureSettings(steps=4, warmup=1, max_grad_norm=1.0),
        block_updates=1,
    )
    result = run_accept(spec, in_process, workload=load_workload(workload), environment=environment())
    folder = new_run_folder(root, "accept")
    return result, folder, write_accept_folder(result, folder)


@pytest.fixture(scope="module")
def accepted(tmp_path_factory: pytest.TempPathFactory) -> tuple[AcceptResult, Path, list[Path]]:
    """One acceptance run of the tiny GPT, shared by the tests that read it."""
    return accept_tiny(tmp_path_factory.mktemp("runs"))


def test_accept_verifies_measures_decides_and_writes_the_run_folder(
    accepted: tuple[AcceptResult, Path, list[Path]],
) -> None:
    result, folder, files = accepted
    names = [c.name for c in result.verdict.criteria]
    assert len(names) == 7
    # everything but the machine-dependent throughput criteria holds on a correct workload
    assert all(c.passed for c in result.verdict.criteria[:5]), result.verdict.criteria
    assert result.equivalence_passed
    assert result.baseline.tokens_per_update == result.candidate.tokens_per_update
    # three paired runs of four block pairs each, and one memory run per configuration
    assert [r.spec.label for r in result.records] == ["4x2 vs 2x4"] * 3
    assert all(r.ok and len(r.ratios) == 4 for r in result.records)
    assert [r.spec.micro_batch for r in result.memory_records] == [4, 2]
    assert result.verdict.interval is not None
    assert sorted(p.name for p in files) == sorted(
        ["results.json", "runcard.json", "report.md", "throughput.png", "memory.png"]
    )
    data = json.loads((folder / "results.json").read_text())
    assert data["verdict"]["decision"] == result.verdict.decision
    assert len(data["verdict"]["interval"]) == 2
    for arm in ("baseline", "candidate"):
        memory = data[arm]["memory"]
        assert memory["persistent_bytes"] > 0 and memory["activation_bytes"] > 0
        assert memory["max_allocated_bytes"] is None  # a CPU: no allocator figures
    # the activation term halves with the micro-batch; the persistent term does not move
    assert data["baseline"]["memory"]["persistent_bytes"] == data["candidate"]["memory"]["persistent_bytes"]
    ratio = data["baseline"]["memory"]["activation_bytes"] / data["candidate"]["memory"]["activation_bytes"]
    assert 1.7 < ratio < 2.1, ratio
    assert data["equivalence"]["details"]["trace"]["steps"] == 2
    assert result.verdict.decision in (folder / "report.md").read_text()
    chosen = result.candidate if result.verdict.adopt else result.baseline
    assert result.card.plan == chosen.plan


def test_the_run_card_round_trips_into_a_plan_and_an_accumulator(
    accepted: tuple[AcceptResult, Path, list[Path]],
) -> None:
    result, folder, _ = accepted
    card = read_runcard(folder / "runcard.json")
    assert card == result.card
    assert card.plan in (plan(4, 2), plan(2, 4)) and card.global_batch == 8
    assert card.precision == "float32" and card.denominator == "tokens" and card.seed == 0
    assert card.verdict == result.verdict.decision
    assert card.tokens_per_step == result.baseline.tokens_per_update[0]
    assert set(card.versions) == {"gradaccum", "torch", "python"}
    workload = load_workload(card.workload)
    model = workload.build_model()
    acc = Accumulator.from_config(model, workload.optimizer_factory(model.parameters()), card.accum)
    assert acc.config == card.accum and acc.config.defer_sync
    # what was measured is what train will run: the clipping and skip limit, the workload's optimizer
    assert card.accum.max_grad_norm == 1.0 and card.accum.max_consecutive_skips == 10
    assert card.optimizer == "workload" and card.precision == "float32"
    # the card's plan drives a real step: its window holds accum_steps micro-batches of micro_batch
    batch = workload.make_batch(card.plan.local_batch, 1)
    (window,) = windows(split(batch, micro_batch=card.plan.micro_batch), card.plan.accum_steps)
    step = acc.step(window, workload.loss_fn, workload.count_fn)
    assert step.applied and step.micro_batches == card.plan.accum_steps
    assert step.global_count == int(workload.count_fn(batch))


def test_the_run_card_records_the_chosen_arms_scaling(
    accepted: tuple[AcceptResult, Path, list[Path]], tmp_path: Path
) -> None:
    result, _, _ = accepted
    spec = dataclasses.replace(result.spec, candidate_scaling="post")
    arms: tuple[Arm, Arm] = ("baseline", "candidate")
    summaries = {arm: dataclasses.replace(getattr(result, arm), spec=spec.arm_spec(arm)) for arm in arms}
    env = environment()
    for decision, arm, scaling in (("ADOPT", "candidate", "post"), ("KEEP BASELINE", "baseline", "pre")):
        verdict = dataclasses.replace(result.verdict, decision=decision)
        card = make_runcard(spec, verdict, summaries[arm], env, "tokens")
        assert card.accum.scaling == scaling and card.extra["chosen"] == arm
        assert (card.extra["baseline_scaling"], card.extra["candidate_scaling"]) == ("pre", "post")
        write_runcard(card, tmp_path / "runcard.json")
        replayed = read_runcard(tmp_path / "runcard.json")
        assert replayed == card
        workload = load_workload(replayed.workload)
        model = workload.build_model()
        acc = Accumulator.from_config(model, workload.optimizer_factory(model.parameters()), replayed.accum)
        assert acc.config.scaling == scaling


def test_broken_arithmetic_fails_the_equivalence_criterion(tmp_path: Path) -> None:
    result, folder, _ = accept_tiny(tmp_path, "tests.bench.workloads:mean_mlp")
    assert not result.equivalence_passed and not result.verdict.adopt
    params = next(c for c in result.verdict.criteria if c.name.startswith("parameter delta"))
    assert not params.passed and "likely cause" in params.figure
    assert result.card.plan == plan(4, 2)  # nothing adopted: the card keeps the baseline
    assert "FAILED" in (folder / "report.md").read_text()


@pytest.mark.parametrize(
    ("key", "value"), [("versions", "2.13"), ("extra", [1, 2]), ("git_commit", 7), ("verdict", ["ADOPT"])]
)
def test_a_run_card_edited_into_the_wrong_shape_is_refused(
    accepted: tuple[AcceptResult, Path, list[Path]], tmp_path: Path, key: str, value: object
) -> None:
    _, folder, _ = accepted
    data = json.loads((folder / "runcard.json").read_text())
    data[key] = value
    edited = tmp_path / "runcard.json"
    edited.write_text(json.dumps(data))
    with pytest.raises(RunCardError, match=f"'{key}' must be"):
        read_runcard(edited)
