"""The options and value parsers the subcommands share (``gradaccum.cli.common``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gradaccum.bench.spec import BenchError, MeasureSettings
from gradaccum.cli.common import (
    DEFAULT_WORKLOAD,
    add_measure_options,
    int_at_least,
    measure_settings,
    parse_plan,
    parse_size,
)
from gradaccum.cli.main import main
from gradaccum.errors import PlanError
from gradaccum.plan import BatchPlan


def plan(micro: int, accum: int, dp: int = 1) -> BatchPlan:
    return BatchPlan(micro_batch=micro, accum_steps=accum, dp=dp)


def test_a_plan_without_dp_runs_on_the_runs_dp_or_one_replica() -> None:
    assert parse_plan("4x8") == plan(4, 8)
    assert parse_plan(" 4 x 8 ", 2) == plan(4, 8, dp=2)
    assert parse_plan("4x2x8") == plan(4, 8, dp=2)
    assert parse_plan("4x2x8", 2) == plan(4, 8, dp=2)


def test_a_plan_naming_another_dp_or_malformed_is_refused_with_the_fix() -> None:
    with pytest.raises(PlanError, match="names dp=4 but the run has dp=2; pass --dp 4"):
        parse_plan("4x4x8", 2)
    for text in ("8 by 4", "4x", "2.5x2", "4x2x"):
        with pytest.raises(PlanError, match=r"MICROxACCUM \(e\.g\. 4x8\) or MICROxDPxACCUM") as exc:
            parse_plan(text)
        assert repr(text) in str(exc.value)


def test_memory_sizes_read_binary_and_decimal_units() -> None:
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("512 mib") == 512 * 1024**2
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    with pytest.raises(BenchError, match="'lots'"):
        parse_size("lots")


def test_int_at_least_is_refused_by_argparse_naming_the_bound(capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser(prog="t")
    p.add_argument("--n", type=int_at_least(1))
    assert p.parse_args(["--n", "3"]).n == 3
    for text, message in (("0", "expected an integer >= 1, got 0"), ("x", "expected an integer, got 'x'")):
        with pytest.raises(SystemExit) as exc:
            p.parse_args(["--n", text])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def parse(args: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="t")
    add_measure_options(p, steps=50)
    return p.parse_args(args)


def test_the_measure_options_build_the_settings_one_thread_per_cpu_worker() -> None:
    args = parse([])
    assert args.workload == DEFAULT_WORKLOAD and args.steps == 50 and args.dp is None
    assert measure_settings(args, "cpu") == MeasureSettings(steps=50, threads=1)
    assert measure_settings(args, "cuda").threads is None  # torch's default off the CPU
    flags = ["--runs", "5", "--warmup", "0", "--precision", "bfloat16", "--no-defer-sync", "--threads", "2"]
    flags += ["--seed", "7", "--bucket-cap-mb", "4"]
    assert measure_settings(parse(flags), "cpu") == MeasureSettings(
        runs=5,
        steps=50,
        warmup=0,
        precision="bfloat16",
        defer_sync=False,
        threads=2,
        bucket_cap_mb=4.0,
        seed=7,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["scan", "--accum-steps", "0"], "expected an integer >= 1, got 0"),
        (["verify", "--seed", "-1"], "expected an integer >= 0, got -1"),
        (["bench", "--steps", "0", "--device", "cpu"], "argument --steps: expected an integer >= 1, got 0"),
        (["accept", "--runs", "2", "--device", "cpu"], "argument --runs: expected an integer >= 3, got 2"),
        (["plan", "4x2x"], "MICROxDPxACCUM"),
    ],
)
def test_the_commands_refuse_bad_shared_options_with_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    try:
        code = main([*argv, *(["--out-dir", str(tmp_path)] if argv[0] in ("bench", "accept") else [])])
    except SystemExit as exc:  # argparse refuses option values before main's handler
        code = int(exc.code or 0)
    assert code == 2 and message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before a run folder was made
