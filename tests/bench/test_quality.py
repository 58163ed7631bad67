"""The representative quality run: both configurations trained from several seeds through
``gradaccum.train``, their final evaluation losses compared with intervals.

Kept small (a few updates, three seeds): the tiny GPT's two partitionings are exact in arithmetic,
so they must agree within the interval; the BatchNorm CNN's are not, and the report must show both
arms over the seeds with their intervals and say why the run was needed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gradaccum.bench.accept import AcceptSpec, run_accept, with_quality
from gradaccum.bench.quality import (
    QualitySpec,
    mean_interval,
    quality_reasons,
    run_quality,
    welch_interval,
)
from gradaccum.bench.report import accept_markdown
from gradaccum.bench.runfolder import write_accept_folder
from gradaccum.bench.spec import MeasureSettings
from gradaccum.bench.verdict import t975
from gradaccum.check.workload import load_workload
from gradaccum.cli import cmd_accept
from gradaccum.cli.main import main
from gradaccum.errors import BenchError
from gradaccum.plan import BatchPlan
from gradaccum.runcard import environment
from gradaccum.step.config import AccumConfig
from gradaccum.train.data import eval_seed, train_seed
from tests.bench import workloads
from tests.bench.test_accept import in_process
from tests.cli.test_accept_cli import FAST, in_process_launching, only_folder

GPT = "gradaccum.examples:tiny_gpt"
BN = "gradaccum.examples:bn_cnn"


def plan(micro: int, accum: int, dp: int = 1) -> BatchPlan:
    return BatchPlan(micro_batch=micro, accum_steps=accum, dp=dp)


def test_the_intervals_are_student_t_per_arm_and_welch_for_the_difference() -> None:
    mean, low, high = mean_interval([1.0, 2.0, 3.0])  # s = 1, n = 3: half-width t(2) / sqrt(3)
    assert mean == 2.0 and high - mean == pytest.approx(t975(2) / math.sqrt(3), rel=1e-12)
    assert mean - low == pytest.approx(high - mean, rel=1e-12)
    # equal variances 1/3 per mean: Welch df = (2/3)^2 / (2 (1/3)^2 / 2) = 4 exactly
    diff, low, high = welch_interval([1.0, 2.0, 3.0], [2.0, 3.0, 4.0])
    assert diff == 1.0 and high - diff == pytest.approx(t975(4) * math.sqrt(2 / 3), rel=1e-12)
    # unequal spreads: df = 2.36..., rounded down to 2 (wider, never narrower)
    a, b = [1.0, 1.1, 0.9], [1.0, 2.0, 3.0]
    va, vb = 0.01 / 3, 1.0 / 3
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 2)
    assert 2 < df < 3
    diff, low, high = welch_interval(a, b)
    assert high - diff == pytest.approx(t975(2) * math.sqrt(va + vb), rel=1e-12)
    assert welch_interval([1.0, 1.0], [2.0, 2.0]) == (1.0, 1.0, 1.0)  # no spread: the difference itself
    with pytest.raises(BenchError, match="at least 2"):
        mean_interval([1.0])


def test_each_seed_draws_its_own_data() -> None:
    # the quality run trains what train --seed s trains; its seeds must not share examples
    workload = load_workload(GPT)
    for draw in (train_seed, eval_seed):
        batches = [workload.make_batch(4, draw(s, 0))["input_ids"] for s in range(3)]
        assert not torch.equal(batches[0], batches[1]) and not torch.equal(batches[1], batches[2])


def test_the_quality_spec_refuses_what_cannot_give_an_interval() -> None:
    with pytest.raises(BenchError, match="seeds"):
        QualitySpec(workload=GPT, baseline=plan(4, 2), candidate=plan(2, 4), steps=2, seeds=1)
    with pytest.raises(BenchError, match="one global batch"):
        QualitySpec(workload=GPT, baseline=plan(4, 2), candidate=plan(2, 2), steps=2)
    assert QualitySpec.trained_plan(plan(2, 3, dp=2)) == plan(2, 6)


def test_the_scan_says_why_a_quality_run_is_needed() -> None:
    plans = (plan(4, 2), plan(2, 4))
    assert quality_reasons(load_workload(GPT), plans) == ()
    (bn,) = quality_reasons(load_workload(BN), plans)
    assert bn.startswith("BatchNorm2d at `bn1`, `layer1.0.bn1`, `layer1.0.bn2` normalizes each micro-batch")
    assert bn.endswith("the equivalence check could not make it exact")
    (dropout,) = quality_reasons(workloads.dropout_gpt(), plans)
    assert "draws random numbers" in dropout and dropout.endswith("the equivalence check switched it off")


def test_the_tiny_gpt_partitionings_agree_within_the_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cmd_accept, "make_launching", in_process_launching)
    args = ["accept", "--baseline", "4x2", "--candidate", "2x4", "--out-dir", str(tmp_path), *FAST]
    quality = ["--quality-steps", "4", "--seeds", "3", "--quality-eval-examples", "16"]
    assert main([*args, *quality]) in (0, 3)  # a verdict on correct arithmetic
    out = capsys.readouterr().out
    folder = only_folder(tmp_path)
    q = json.loads((folder / "results.json").read_text())["quality"]
    b, c = q["baseline"], q["candidate"]
    assert b["seeds"] == c["seeds"] == [0, 1, 2] and len(b["eval_losses"]) == len(c["eval_losses"]) == 3
    (b_low, b_high), (c_low, c_high) = b["interval"], c["interval"]
    # the seeds draw different data (an interval of positive width) ...
    assert b_high - b_low > 1e-3 and len(set(b["eval_losses"])) == 3
    # ... and the two partitionings of each seed are the same update in exact arithmetic: float32
    # rounding (~6e-8 relative per operation, over 4 updates) leaves them far inside the interval
    assert not q["differ"]
    low, high = q["difference_interval"]
    assert low < 0 < high
    assert max(abs(d) for d in q["paired_differences"]) < 1e-4
    assert b_low <= c["mean"] <= b_high and c_low <= b["mean"] <= c_high
    assert "no difference the seeds can resolve" in q["summary"] and q["summary"] in out
    assert q["reasons"] == [] and q["notes"] == []
    runs = sorted(p.name for p in (folder / "quality").iterdir())
    assert runs == [f"{arm}-seed{s}" for arm in ("baseline", "candidate") for s in range(3)]
    assert all((folder / "quality" / r / "metrics.jsonl").exists() for r in runs)  # train's own records
    report = (folder / "report.md").read_text()
    assert "## Quality run" in report and "Short equivalence checks cannot guarantee" in report


def test_each_arm_trains_with_its_own_scaling(tmp_path: Path) -> None:
    post = AccumConfig(max_grad_norm=1.0, scaling="post")
    spec = QualitySpec(
        workload=GPT,
        baseline=plan(4, 2),
        candidate=plan(4, 2),
        steps=2,
        seeds=2,
        eval_examples=8,
        accum=AccumConfig(max_grad_norm=1.0),
        candidate_accum=post,
        threads=1,
    )
    quality = run_quality(spec, tmp_path)
    assert (quality.baseline.label, quality.candidate.label) == ("4x2 pre", "4x2 post")
    for arm, scaling in (("baseline", "pre"), ("candidate", "post")):
        for seed in (0, 1):
            card = json.loads((tmp_path / f"{arm}-seed{seed}" / "runcard.json").read_text())
            assert card["accum"]["scaling"] == scaling
    # the same update in exact arithmetic: float32 rounding over 2 updates, far below the seeds' spread
    assert max(abs(d) for d in quality.paired_differences) < 1e-4
    assert spec.to_dict()["candidate_accum"]["scaling"] == "post"


def test_accept_on_the_batchnorm_cnn_reports_both_arms_over_the_seeds_with_intervals(tmp_path: Path) -> None:
    workload = load_workload(BN)
    spec = AcceptSpec(
        workload=BN,
        baseline=plan(4, 2),
        candidate=plan(2, 4),
        trace_steps=2,
        settings=MeasureSettings(steps=4, warmup=1, max_grad_norm=1.0, threads=1),
        block_updates=1,
        quality_steps=4,
        quality_seeds=3,
        quality_eval_examples=16,
    )
    result = run_accept(spec, in_process, workload=workload, environment=environment())
    assert not result.equivalence_passed  # BatchNorm: the float64 check fails, as it must
    (reason,) = result.quality_reasons
    assert reason.startswith("BatchNorm2d at `bn1`") and "could not make it exact" in reason
    # without the run, the report asks for it and says why
    asked = accept_markdown(result)
    asked = asked[asked.index("## Quality run") : asked.index("## Files")]
    assert reason in asked and "**A representative quality run is needed**" in asked
    assert "--quality-steps N" in asked
    quality_spec = spec.quality_spec()
    assert quality_spec is not None
    quality = run_quality(
        quality_spec, tmp_path / "quality", workload=workload, reasons=result.quality_reasons
    )
    result = with_quality(result, quality)
    folder = tmp_path / "accept"
    write_accept_folder(result, folder)
    q = json.loads((folder / "results.json").read_text())["quality"]
    assert q["spec"]["steps"] == 4 and q["unit"] == "examples" and q["reasons"] == [reason]
    report = (folder / "report.md").read_text()
    section = report[report.index("## Quality run") : report.index("## Files")]
    assert reason in section and "needed**" not in section
    for arm in ("baseline", "candidate"):
        figures = q[arm]
        assert figures["seeds"] == [0, 1, 2] and len(figures["eval_losses"]) == 3
        low, high = figures["interval"]
        assert low < figures["mean"] < high and all(x > 0 for x in figures["eval_losses"])
        assert f"| {arm} |" in section and f"{figures['mean']:.4f}" in section
        assert f"[{low:.4f}, {high:.4f}]" in section
        assert all(f"{x:.4f}" in section for x in figures["eval_losses"])
    low, high = q["difference_interval"]
    assert q["differ"] == (not low <= 0 <= high) and f"[{low:+.4f}, {high:+.4f}] (Welch)" in section
    assert "t(0.975, S-1)" in section
    card = json.loads((folder / "runcard.json").read_text())
    assert card["extra"]["quality"]["differ"] == q["differ"]
    assert card["extra"]["quality"]["seeds"] == [0, 1, 2]


def test_a_quality_run_from_one_seed_is_refused() -> None:
    with pytest.raises(SystemExit) as exc:  # argparse: exit 2 before anything runs
        main(["accept", "--quality-steps", "2", "--seeds", "1"])
    assert exc.value.code == 2
