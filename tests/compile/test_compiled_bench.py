"""bench/accept with compiled models: compile time kept apart from throughput, recompiles counted.

The measurement uses ``nn.Module.compile()`` with torch's default backend; these tests set that
default to ``aot_eager`` (``torch.compiler.set_default_backend``) so that no C++ is built here.
"""

from __future__ import annotations

import pytest

from gradaccum.bench.measure import measure
from gradaccum.bench.spec import BenchError, Measurement, MeasureSettings, MeasureSpec
from gradaccum.bench.sweep import SweepSpec
from gradaccum.examples import tiny_gpt
from gradaccum.plan import BatchPlan

GPT = "gradaccum.examples:tiny_gpt"


def test_a_compiled_row_reports_its_compile_time_apart_and_no_recompiles(aot_eager_default: None) -> None:
    spec = MeasureSpec(workload=GPT, micro_batch=2, accum_steps=2, steps=3, warmup=2, seed=1, compile=True)
    m = measure(tiny_gpt(), spec)
    assert m.spec.compile and m.spec.row_label == "2x2 compiled"
    # the first warm-up update compiled (seconds of tracing beyond a measured update; no ratio is
    # asserted: timings belong to benchmarks), and the measured updates compiled nothing, so the
    # throughput holds no compile time
    assert m.compile_s is not None and m.compile_s > 0
    assert m.recompiles == 0
    assert Measurement.from_dict(m.to_dict()) == m
    eager = measure(tiny_gpt(), MeasureSpec(workload=GPT, micro_batch=2, accum_steps=2, steps=2, warmup=1))
    assert eager.compile_s is None and eager.recompiles == 0


def test_compiled_and_eager_are_a_sweep_dimension() -> None:
    sweep = SweepSpec(workload=GPT, global_batch=4, compile=(False, True))
    one = (BatchPlan(micro_batch=1, accum_steps=2, dp=2),)
    fsdp = SweepSpec(workload=GPT, global_batch=4, dp=2, plans=one, sharding=("fsdp2",), compile=(True,))
    assert [s.row_label for s in fsdp.measure_specs()] == [
        "1x2x2 fsdp2 compiled",
        "1x2x2 fsdp2 no-defer compiled",
    ]
    labels = [s.row_label for s in sweep.measure_specs()]
    assert labels == ["4x1", "4x1 compiled", "2x2", "2x2 compiled", "1x4", "1x4 compiled"]
    assert sweep.to_dict()["compile"] == [False, True]
    accept_settings = MeasureSettings(compile=True)  # accept compiles both arms
    assert accept_settings.measure_spec(GPT, sweep.measure_specs()[0].plan).compile
    with pytest.raises(BenchError, match="compile must list"):
        SweepSpec(workload=GPT, global_batch=4, compile=())
