"""MeasureSettings: the measurement settings a sweep and an acceptance run share, checked once.

The specs hold one ``settings`` object, but results.json keeps its flat ``spec`` record: the key
lists below are the ones results.json had before the settings were factored out.
"""

from __future__ import annotations

import math
from dataclasses import fields

import pytest

from gradaccum.bench.accept import ACCEPT_SETTINGS, AcceptSpec
from gradaccum.bench.spec import BenchError, MeasureSettings, MeasureSpec
from gradaccum.bench.sweep import SweepSpec
from gradaccum.plan import BatchPlan

SWEEP_KEYS = [
    "workload", "global_batch", "dp", "plans", "runs", "steps", "warmup", "precision", "defer_sync",
    "device", "threads", "bucket_cap_mb", "seed", "max_grad_norm", "memory_budget_bytes",
    "checkpointing", "sharding",  # issue 15: appended, the earlier keys unchanged
    "compile",  # issue 23: appended (the sweep's eager/compiled dimension)
    "max_tokens",  # issue 34: appended (token-budget arms)
    "balance",  # issue 41: appended (a routing model's load balance)
]  # fmt: skip
ACCEPT_KEYS = [
    "workload", "baseline", "candidate", "margin", "block_updates", "blocks", "max_consecutive_skips",
    "memory_budget_bytes", "runs", "steps", "warmup", "trace_steps", "precision", "defer_sync", "device",
    "threads", "bucket_cap_mb", "seed", "max_grad_norm",
    "quality_steps", "quality_seeds", "quality_eval_examples",  # issue 15: appended
    "compile",  # issue 23: appended
    "baseline_scaling", "candidate_scaling",  # issue 22: appended (each arm's AccumConfig.scaling)
    "candidate_max_tokens",  # issue 34: appended (a token-budget candidate)
    "balance",  # issue 41: appended (a routing model's load balance)
]  # fmt: skip
SETTINGS = MeasureSettings(
    runs=4, steps=20, warmup=2, precision="float64", defer_sync=False, threads=2, bucket_cap_mb=5.0, seed=9
)


def plan(micro: int, accum: int, dp: int = 1) -> BatchPlan:
    return BatchPlan(micro_batch=micro, accum_steps=accum, dp=dp)


BAD = [
    ("runs", 0, "runs must be a positive integer"),
    ("runs", True, "runs must be a positive integer"),
    ("steps", 0, "steps must be a positive integer"),
    ("warmup", -1, "warmup must be a non-negative integer"),
    ("seed", -1, "seed must be a non-negative integer"),
    ("threads", 0, "threads must be a positive integer"),
    ("bucket_cap_mb", 0.0, "bucket_cap_mb must be a positive number of MiB"),
    ("bucket_cap_mb", math.inf, "bucket_cap_mb must be a positive number of MiB"),
    ("precision", "fp8", "precision must be one of"),
]


@pytest.mark.parametrize(("name", "value", "message"), BAD)
def test_a_bad_setting_is_refused_naming_it_and_its_value(name: str, value: object, message: str) -> None:
    with pytest.raises(BenchError, match=message) as exc:
        MeasureSettings(**{name: value})
    assert repr(value) in str(exc.value)


@pytest.mark.parametrize(("name", "value", "message"), [b for b in BAD if b[0] != "runs"])
def test_a_single_run_refuses_the_same_values_in_the_same_words(
    name: str, value: object, message: str
) -> None:
    with pytest.raises(BenchError, match=message):
        MeasureSpec(workload="m:f", micro_batch=1, accum_steps=1, **{name: value})


def test_every_setting_but_runs_reaches_the_measured_configuration() -> None:
    spec = SETTINGS.measure_spec("m:f", plan(4, 2, dp=2))
    assert (spec.workload, spec.micro_batch, spec.accum_steps, spec.dp) == ("m:f", 4, 2, 2)
    shared = [f.name for f in fields(MeasureSettings) if f.name != "runs"]
    assert {n: getattr(spec, n) for n in shared} == {n: getattr(SETTINGS, n) for n in shared}


def test_a_token_budget_arm_holds_the_window_as_rows_per_rank() -> None:
    sweep = SweepSpec(workload="m:f", global_batch=8, dp=2, plans=(plan(2, 2, dp=2),), max_tokens=(64,))
    fixed, tokens = sweep.measure_specs()
    assert (fixed.label, fixed.max_tokens) == ("2x2x2", None)
    assert (tokens.label, tokens.micro_batch, tokens.accum_steps, tokens.max_tokens) == (
        "tokens<=64",
        4,
        1,
        64,
    )
    assert MeasureSpec.from_dict(tokens.to_dict()) == tokens
    with pytest.raises(BenchError, match="accum_steps 1"):
        MeasureSpec(workload="m:f", micro_batch=4, accum_steps=2, max_tokens=64)
    with pytest.raises(BenchError, match="multiple of dp=2"):
        SweepSpec(workload="m:f", global_batch=7, dp=2, plans=(plan(7, 1),), max_tokens=(64,))


def test_sweep_results_keep_their_flat_spec_record() -> None:
    sweep = SweepSpec(workload="m:f", global_batch=8, plans=(plan(4, 2),), settings=SETTINGS)
    data = sweep.to_dict()
    assert list(data) == SWEEP_KEYS
    assert data["plans"] == [{"micro_batch": 4, "accum_steps": 2, "dp": 1}]
    assert (data["runs"], data["steps"], data["precision"], data["seed"]) == (4, 20, "float64", 9)
    assert [s.label for s in sweep.measure_specs()] == ["4x2"]
    assert SweepSpec(workload="m:f", global_batch=4).settings == MeasureSettings()


def test_accept_results_keep_their_flat_spec_record_and_its_defaults() -> None:
    spec = AcceptSpec(baseline=plan(4, 2), candidate=plan(2, 4), trace_steps=3, settings=SETTINGS)
    data = spec.to_dict()
    assert list(data) == ACCEPT_KEYS
    assert (data["baseline"], data["candidate"], data["trace_steps"], data["warmup"]) == ("4x2", "2x4", 3, 2)
    assert spec.measure_spec(plan(2, 4)) == SETTINGS.measure_spec(spec.workload, plan(2, 4))
    default = AcceptSpec(baseline=plan(4, 2), candidate=plan(2, 4))
    assert default.settings == ACCEPT_SETTINGS and (ACCEPT_SETTINGS.runs, ACCEPT_SETTINGS.steps) == (3, 50)
    assert (data["baseline_scaling"], data["candidate_scaling"]) == ("pre", "pre")


def test_a_measured_configuration_carries_its_scaling_through_json() -> None:
    pre = SETTINGS.measure_spec("m:f", plan(4, 2))
    post = SETTINGS.measure_spec("m:f", plan(4, 2), scaling="post")
    assert (pre.scaling, post.scaling) == ("pre", "post")
    assert (pre.row_label, post.row_label) == ("4x2 no-defer", "4x2 no-defer post")
    assert MeasureSpec.from_dict(post.to_dict()) == post
    old = pre.to_dict()
    del old["scaling"]  # a record written before issue 22 reads as pre-scaling
    assert MeasureSpec.from_dict(old) == pre
    with pytest.raises(BenchError, match="scaling must be 'pre' .* or 'post' .*, got 'late'"):
        MeasureSpec(workload="m:f", micro_batch=1, accum_steps=1, scaling="late")  # type: ignore[arg-type]


def test_accept_needs_three_runs_and_a_workload_it_can_name() -> None:
    with pytest.raises(BenchError, match=r"runs must be an integer >= 3 \(the protocol's minimum\), got 2"):
        AcceptSpec(baseline=plan(4, 2), candidate=plan(2, 4), settings=MeasureSettings(runs=2))
    with pytest.raises(BenchError, match="MODULE:FUNCTION"):
        AcceptSpec(workload="tiny_gpt", baseline=plan(4, 2), candidate=plan(2, 4))
