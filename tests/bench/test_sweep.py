"""The sweep: interleaved runs, summaries with medians and spread, OOM marked not fatal, models fitted.

Runs go through an in-process launcher here (fast); the fresh-process launcher is exercised by
tests/bench/test_runner.py and the CLI tests.
"""

from __future__ import annotations

import pytest

from gradaccum.bench.measure import measure_safely
from gradaccum.bench.spec import BenchError, MeasureSettings, MeasureSpec, RunRecord
from gradaccum.bench.sweep import ProgressEvent, SweepSpec, interleave, run_sweep
from gradaccum.check.workload import load_workload
from gradaccum.plan import BatchPlan
from tests.bench import workloads


def in_process(spec: MeasureSpec, run_index: int) -> RunRecord:
    return measure_safely(load_workload(spec.workload), spec, run_index=run_index)


def test_runs_interleave_one_round_at_a_time() -> None:
    specs = [MeasureSpec(workload="m:f", micro_batch=m, accum_steps=4 // m) for m in (4, 2, 1)]
    order = [(s.micro_batch, r) for s, r in interleave(specs, 2)]
    assert order == [(4, 0), (2, 0), (1, 0), (4, 1), (2, 1), (1, 1)]


def test_sweep_of_every_factorization_summarizes_each_configuration() -> None:
    spec = SweepSpec(
        workload="tests.bench.workloads:tiny_mlp",
        global_batch=8,
        settings=MeasureSettings(runs=2, steps=3, warmup=1),
        memory_budget_bytes=10 * 1024**3,
    )
    events: list[ProgressEvent] = []
    result = run_sweep(spec, in_process, on_progress=events.append)
    assert [c.spec.label for c in result.configs] == ["8x1", "4x2", "2x4", "1x8"]
    assert len(result.records) == 8 and len(events) == 16  # a start and an end event per run
    assert [e.done for e in events if e.record is not None] == list(range(1, 9))
    tokens = result.configs[0].tokens_per_update
    for c in result.configs:
        assert c.ok and c.runs == c.runs_ok == 2
        assert c.units_per_s is not None and c.units_per_s.low <= c.units_per_s.median <= c.units_per_s.high
        assert c.tokens_per_update == tokens and c.tokens_identical_across_runs  # same data, every config
        assert c.updates == 6 and c.skipped_updates == 0
        assert c.peak_memory_kind.startswith("CPU process peak RSS (shared process")
    assert [m.accum_steps if m else None for m in result.comm] == [1, 2, 4, 8]
    assert result.memory_model is not None and result.memory_model.points == 4
    data = result.to_dict()
    assert data["kind"] == "sweep" and len(data["runs"]) == 8
    assert data["memory_predictions_bytes"][0] == pytest.approx(result.memory_model.predict(8))


def test_out_of_memory_configurations_are_marked_and_the_sweep_goes_on() -> None:
    spec = SweepSpec(
        workload="tests.bench.workloads:oom_mlp",
        global_batch=8,
        settings=MeasureSettings(runs=1, steps=2, warmup=0),
    )
    result = run_sweep(spec, in_process)
    status = {c.spec.micro_batch: c.status for c in result.configs}
    assert status == {m: "oom" if m >= workloads.OOM_FROM else "ok" for m in (8, 4, 2, 1)}
    assert list(status.values()) == ["oom", "oom", "ok", "ok"]
    oom = result.configs[0]
    assert oom.units_per_s is None and oom.runs_ok == 0 and "out of memory" in (oom.error or "")
    assert result.comm[0] is None
    assert result.memory_model is not None and result.memory_model.points == 2  # fitted on the rest


def test_an_explicit_list_must_hold_the_global_batch() -> None:
    plans = (BatchPlan(micro_batch=4, accum_steps=2), BatchPlan(micro_batch=2, accum_steps=2))
    with pytest.raises(BenchError, match="global batch 8"):
        SweepSpec(workload="m:f", global_batch=8, plans=plans)
    with pytest.raises(BenchError, match="twice"):
        SweepSpec(workload="m:f", global_batch=8, plans=(plans[0], plans[0]))
    with pytest.raises(BenchError, match="runs"):
        SweepSpec(workload="m:f", global_batch=8, settings=MeasureSettings(runs=0))


def test_one_micro_batch_gives_a_proportional_memory_model() -> None:
    spec = SweepSpec(
        workload="tests.bench.workloads:tiny_mlp",
        global_batch=4,
        plans=(BatchPlan(micro_batch=2, accum_steps=2),),
        settings=MeasureSettings(runs=1, steps=2, warmup=0),
    )
    result = run_sweep(spec, in_process)
    model = result.memory_model
    assert model is not None and model.points == 1 and model.fixed_bytes == 0.0
    (config,) = result.configs
    assert config.memory is not None
    assert model.per_example_bytes == config.memory.activation_bytes / 2
