"""``gradaccum bench``: a real sweep in fresh processes; its JSON holds every figure, sanely.

Few steps and one run per configuration keep it to a few seconds; the data-parallel sweep starts
two gloo workers per configuration on 127.0.0.1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradaccum.cli.main import main
from gradaccum.examples import tiny_gpt

FAST = ["--runs", "1", "--steps", "2", "--warmup", "1", "--no-progress"]
CONFIG_FIELDS = {
    "label", "micro_batch", "accum_steps", "dp", "global_batch", "status", "error", "runs", "runs_ok", "unit",
    "units_per_s", "step_ms", "micro_ms", "sync_ms", "optimizer_ms", "tokens_per_update",
    "tokens_identical_across_runs", "updates", "skipped_updates", "skip_rate", "peak_memory_kind",
    "peak_rss_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "gradient_bytes",
    "allreduce_calls_per_update", "allreduce_bytes_per_update", "buckets", "per_run_units_per_s",
    "fresh_process", "memory",
    # issue 15: the row's dimensions and FSDP2's collectives
    "row_label", "checkpointing", "sharding", "defer_sync", "allgather_calls_per_update",
    "allgather_bytes_per_update", "reduce_scatter_calls_per_update", "reduce_scatter_bytes_per_update",
    "reduce_scatter_bytes_per_sync", "comm_bytes_per_update",
    # issue 25: the step's phases that add up
    "count_ms", "other_ms", "phase_means_ms",
    "compile", "compile_s", "recompiles",  # issue 23: eager or compiled rows
    "scaling",  # issue 22: the row's AccumConfig.scaling (accept's arms may differ in it)
    "straggler",  # the slowest rank's window over the mean (DDP)
}  # fmt: skip


def expected_tokens(global_batch: int, steps: int = 2, warmup: int = 1, seed: int = 0) -> list[int]:
    w = tiny_gpt()
    return [int(w.count_fn(w.make_batch(global_batch, seed + 1 + warmup + u))) for u in range(steps)]


def sweep(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    code = main(["bench", "--json", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def two_rank_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    """``bench`` of the 2x2 row at global batch 8 on two gloo ranks, with ``extra`` arms."""
    args = ["--dp", "2", "--global-batch", "8", "--configs", "2x2", *extra]
    return sweep([*args, "--out-dir", str(tmp_path), *FAST], capsys)


@pytest.mark.slow
def test_bench_sweeps_every_factorization_with_every_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = sweep(
        ["--global-batch", "2", "--memory-budget", "4GiB", "--out-dir", str(tmp_path), *FAST], capsys
    )
    (folder,) = tmp_path.iterdir()
    files = {"results.json", "report.md", "throughput.png", "memory.png", "runcard.json"}
    assert {p.name for p in folder.iterdir()} == files  # the budget's advised row has its card
    configs = data["configs"]
    assert [c["label"] for c in configs] == ["2x1", "1x2"]
    want = expected_tokens(2)
    for c in configs:
        assert set(c) == CONFIG_FIELDS
        assert c["status"] == "ok" and c["global_batch"] == 2 and c["fresh_process"]
        assert c["tokens_per_update"] == want  # exact, and the same in every configuration
        assert c["units_per_s"]["median"] > 0 and c["step_ms"]["median"] > 0
        count_ms, micro, optim, other, step = c["phase_means_ms"]
        assert count_ms + micro + optim + other == pytest.approx(step, rel=1e-9)
        assert c["micro_ms"] > 0 and c["optimizer_ms"] > 0 and c["sync_ms"] is None
        # a fresh process with torch and a tiny model: well above 10 MiB, far below 4 GiB
        assert 10 * 1024**2 < c["peak_rss_bytes"] < 4 * 1024**3
        assert c["peak_memory_kind"] == "CPU process peak RSS (fresh process)"
        assert c["peak_allocated_bytes"] is None and c["allreduce_calls_per_update"] is None
        assert c["skipped_updates"] == 0 and c["updates"] == 2
    mm = data["memory_model"]
    assert mm["points"] == 2 and mm["kind"] == "tensors: persistent + bytes saved for backward"
    # the activation term grows with the micro-batch, the persistent term does not
    big, small = (c["memory"] for c in configs)
    assert big["persistent_bytes"] == small["persistent_bytes"] == mm["persistent_bytes"]
    assert big["activation_bytes"] > small["activation_bytes"] > 0 and mm["per_example_bytes"] > 0
    assert data["memory_budget_bytes"] == 4 * 1024**3
    assert data["memory_budget_advice"].startswith("micro-batches up to")
    assert len(data["memory_predictions_bytes"]) == 2
    comm = data["comm_model"]
    assert [m["naive_bytes"] // m["gradient_bytes"] for m in comm] == [1, 2]
    assert all(m["deferred_bytes"] == m["gradient_bytes"] and m["measured_bytes"] is None for m in comm)
    report = (folder / "report.md").read_text()
    assert "## Memory model" in report and "## Communication model" in report


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("defer", [True, False])
def test_data_parallel_bench_counts_one_all_reduce_per_bucket_or_k(
    defer: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # ~10 KiB buckets: the tiny GPT's 124 KiB of gradients fill several
    buckets = ["--bucket-cap-mb", "0.01"]
    data = two_rank_sweep(tmp_path, capsys, *buckets, *([] if defer else ["--no-defer-sync"]))
    (c,) = data["configs"]
    assert c["status"] == "ok", c["error"]
    assert c["label"] == "2x2x2" and c["dp"] == 2 and c["accum_steps"] == 2
    assert c["tokens_per_update"] == expected_tokens(8)  # both ranks' tokens: the global count
    k = 1 if defer else 2
    assert c["buckets"] > 1, "bucket_cap_mb is meant to force several buckets"
    assert c["allreduce_calls_per_update"] == k * c["buckets"]  # once per bucket, k times without deferral
    assert c["allreduce_bytes_per_update"] == k * c["gradient_bytes"]
    assert c["sync_ms"] is not None
    (comm,) = data["comm_model"]
    assert comm["measured_bytes"] == (comm["deferred_bytes"] if defer else comm["naive_bytes"])
    assert comm["matches"] is True


def test_bench_bad_input_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--global-batch", "8", "--configs", "3x2"]) == 2
    assert "global batch 8" in capsys.readouterr().err
    assert main(["bench", "--memory-budget", "lots"]) == 2
    assert "memory size" in capsys.readouterr().err


@pytest.mark.slow
def test_checkpointing_is_a_dimension_and_the_budget_is_advised_with_a_run_card(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the tensors' peak at 4x2: ~0.9 MiB plainly, ~0.6 MiB checkpointed; 800 KiB admits one of them
    args = [
        "--global-batch",
        "8",
        "--configs",
        "4x2",
        "--checkpointing",
        "none,full",
        "--memory-budget",
        "800KiB",
    ]
    data = sweep([*args, "--out-dir", str(tmp_path), *FAST], capsys)
    (folder,) = tmp_path.iterdir()
    plain, ckpt = data["configs"]
    assert (plain["row_label"], ckpt["row_label"]) == ("4x2", "4x2 ckpt")
    assert (plain["checkpointing"], ckpt["checkpointing"]) == ("none", "full")
    for c in (plain, ckpt):
        assert c["status"] == "ok" and c["tokens_per_update"] == expected_tokens(8)
        assert c["sharding"] == "none" and c["units_per_s"]["median"] > 0
    pm, cm = plain["memory"], ckpt["memory"]
    assert cm["activation_bytes"] < pm["activation_bytes"]  # at the same micro-batch
    assert cm["recompute_bytes"] > 0 and pm["recompute_bytes"] == 0
    assert cm["activation_bytes"] == cm["saved_bytes"] + cm["recompute_bytes"]
    assert cm["persistent_bytes"] == pm["persistent_bytes"]
    assert cm["tensor_peak_bytes"] <= 800 * 1024 < pm["tensor_peak_bytes"]
    # the memory model fits the plain row only (checkpointing changes the line)
    assert data["memory_model"]["points"] == 1
    assert data["checkpointing_check"]["passed"] and data["checkpointing_check"]["grad_max_rel_err"] <= 1e-12
    advice = data["advice"]
    assert advice["outcome"] == "fits" and advice["fitting"] == ["4x2 ckpt"]
    assert advice["sentence"].startswith(
        "micro-batch 4 with checkpointing (4x2) is the only measured configuration within 800.0 KiB"
    )
    card = json.loads((folder / "runcard.json").read_text())
    assert (card["micro_batch"], card["accum_steps"], card["dp"]) == (4, 2, 1)
    assert card["extra"]["advice"] == advice["sentence"] == data["runcard"]["extra"]["advice"]
    assert card["extra"]["checkpointing"] == "full"
    report = (folder / "report.md").read_text()
    assert "## Advice" in report and advice["sentence"] in report
    assert "## Activation checkpointing" in report and "PASS" in report


def test_checkpointing_a_workload_without_blocks_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["bench", "--workload", "gradaccum.examples:bn_cnn", "--checkpointing", "full", "--no-progress"]
    )
    assert code == 2
    assert "no repeated blocks to checkpoint" in capsys.readouterr().err
    assert main(["bench", "--sharding", "fsdp2", "--no-progress"]) == 2  # one rank: nothing to shard
    assert "needs data parallelism" in capsys.readouterr().err


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_rows_come_in_pairs_with_deferral_on_and_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = two_rank_sweep(tmp_path, capsys, "--sharding", "fsdp2")
    deferred, every = data["configs"]
    assert (deferred["row_label"], every["row_label"]) == ("2x2x2 fsdp2", "2x2x2 fsdp2 no-defer")
    for c in (deferred, every):
        assert c["status"] == "ok", c["error"]
        assert c["sharding"] == "fsdp2" and c["tokens_per_update"] == expected_tokens(8)
    per_sync = deferred["reduce_scatter_bytes_per_sync"]
    assert deferred["reduce_scatter_bytes_per_update"] == per_sync
    assert every["reduce_scatter_bytes_per_update"] == 2 * per_sync  # k = 2
    # deferral holds the whole unsharded gradient set on every rank; sync every micro-batch, a shard
    assert deferred["memory"]["held_gradient_bytes"] == deferred["gradient_bytes"]
    assert every["memory"]["held_gradient_bytes"] == every["memory"]["gradient_bytes"] < per_sync
    assert all(m["matches"] for m in data["comm_model"])
    (folder,) = tmp_path.iterdir()
    assert "## FSDP2: sync deferral" in (folder / "report.md").read_text()
