"""One configuration measured in this process: every figure present, counts and skips exact.

Timings are only checked for being positive and consistent with each other (their values depend on
the machine); counts and bytes are checked exactly. The data-parallel path (DDP, comm-hook counts,
figures combined over ranks) runs in real two-rank gloo workers in tests/cli/test_bench_cli.py.
"""

from __future__ import annotations

import pytest
import torch

from gradaccum.bench.measure import measure, measure_safely, peak_rss_bytes
from gradaccum.bench.spec import BenchError, Measurement, MeasureSpec
from gradaccum.examples import tiny_gpt
from tests.bench import workloads

GPT = "gradaccum.examples:tiny_gpt"


def expected_counts(workload, spec: MeasureSpec) -> list[int]:  # type: ignore[no-untyped-def]
    """The global count of every measured update, recomputed from the data contract alone."""
    first = spec.seed + 1 + spec.warmup
    return [
        int(workload.count_fn(workload.make_batch(spec.plan.global_batch, first + u)))
        for u in range(spec.steps)
    ]


def test_single_process_measurement_has_every_figure_and_exact_counts() -> None:
    spec = MeasureSpec(workload=GPT, micro_batch=2, accum_steps=3, steps=4, warmup=1, seed=5)
    workload = tiny_gpt()
    m = measure(workload, spec)
    assert m.spec == spec and m.unit == "tokens"
    assert len(m.step_ms) == 4 and all(t > 0 for t in m.step_ms)
    assert m.micro_ms > 0 and m.optimizer_ms > 0 and m.count_ms >= 0
    # one update holds 3 micro-batches and an optimizer step: its time exceeds one micro-batch's
    assert m.step_ms_median > m.micro_ms
    assert m.sync_ms is None  # no data parallelism, nothing synchronizes
    assert m.tokens_per_update == expected_counts(workload, spec)
    assert m.examples_per_update == 6 and m.updates == 4 and m.skipped_updates == 0
    # throughput is all measured units over all measured time (float sums: relative 1e-12)
    assert m.units_per_s == pytest.approx(sum(m.tokens_per_update) / (sum(m.step_ms) / 1e3), rel=1e-12)
    params = sum(p.numel() for p in workload.build_model().parameters())
    assert m.gradient_bytes == 4 * params  # float32 gradients
    assert 0 < m.peak_rss_bytes <= peak_rss_bytes() and m.fresh_process is False
    assert m.peak_allocated_bytes is None and m.peak_reserved_bytes is None  # CPU
    assert m.allreduce_calls_per_update is None and m.buckets is None
    assert m.threads == torch.get_num_threads()
    assert Measurement.from_dict(m.to_dict()) == m  # crosses the worker's process boundary as JSON


def test_float64_parameters_and_example_counts() -> None:
    spec = MeasureSpec(
        workload="tests.bench.workloads:tiny_mlp",
        micro_batch=3,
        accum_steps=2,
        precision="float64",
        steps=3,
        warmup=0,
    )
    workload = workloads.tiny_mlp()
    m = measure(workload, spec)
    assert m.unit == "examples"
    assert m.tokens_per_update == expected_counts(workload, spec)
    assert m.gradient_bytes == 8 * sum(p.numel() for p in workload.build_model().parameters())


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_mixed_precision_keeps_float32_parameters(precision: str) -> None:
    spec = MeasureSpec(workload=GPT, micro_batch=2, accum_steps=2, precision=precision, steps=2, warmup=1)
    m = measure(tiny_gpt(), spec)
    assert m.gradient_bytes == 4 * sum(p.numel() for p in tiny_gpt().build_model().parameters())
    assert m.tokens_per_update == expected_counts(tiny_gpt(), spec)
    assert 0 <= m.skipped_updates <= m.updates == 2


def test_skipped_updates_are_counted_exactly() -> None:
    # measured updates draw seeds 2, 3, 4, 5, 6 (seed 0 + 1 + warmup 1 + u): 2, 4 and 6 hold a NaN
    spec = MeasureSpec(
        workload="tests.bench.workloads:nan_mlp", micro_batch=2, accum_steps=2, steps=5, warmup=1
    )
    m = measure(workloads.nan_mlp(), spec)
    assert m.updates == 5 and m.skipped_updates == 3


def test_a_cuda_out_of_memory_error_is_caught_and_reported() -> None:
    spec = MeasureSpec(
        workload="tests.bench.workloads:oom_mlp", micro_batch=workloads.OOM_FROM, accum_steps=1
    )
    record = measure_safely(workloads.oom_mlp(), spec, run_index=2)
    assert record.status == "oom" and record.measurement is None and record.run_index == 2
    assert record.error is not None and "out of memory" in record.error
    ok = measure_safely(
        workloads.oom_mlp(), MeasureSpec(workload=spec.workload, micro_batch=2, accum_steps=2, steps=2)
    )
    assert ok.ok


def test_the_process_group_must_match_dp() -> None:
    spec = MeasureSpec(workload=GPT, micro_batch=2, accum_steps=2, dp=2)
    with pytest.raises(BenchError, match="dp=2 .* 1 rank"):
        measure(tiny_gpt(), spec)
