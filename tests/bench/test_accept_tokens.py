"""``accept`` with a token-budget candidate: the float64 check and the traces run the budget's
micro-batches, the paired runs measure them, and the run card of an adopted candidate records
``max_tokens`` so that ``train --runcard`` trains it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from gradaccum.bench.accept import AcceptResult, AcceptSpec, Arm, make_runcard, run_accept
from gradaccum.bench.accept_checks import token_partition
from gradaccum.bench.accept_report import verdict_lines
from gradaccum.bench.runfolder import new_run_folder, write_accept_folder
from gradaccum.bench.spec import MeasureSettings
from gradaccum.check.workload import load_workload
from gradaccum.cli.main import main
from gradaccum.errors import BenchError
from gradaccum.plan import BatchPlan
from gradaccum.runcard import environment, read_runcard, write_runcard
from tests.bench.test_accept import GPT, in_process, plan
from tests.train.common import one_thread

BUDGET = 128  # 4 rows of the tiny GPT's longest (32 tokens): the baseline 4x4's activation bound


@pytest.fixture(scope="module")
def accepted(tmp_path_factory: pytest.TempPathFactory) -> tuple[AcceptResult, Path]:
    spec = AcceptSpec(
        workload=GPT,
        baseline=plan(4, 4),
        candidate=plan(16, 1),
        candidate_max_tokens=BUDGET,
        trace_steps=2,
        settings=MeasureSettings(steps=4, warmup=1, max_grad_norm=1.0),
        block_updates=1,
    )
    with one_thread():
        result = run_accept(spec, in_process, workload=load_workload(GPT), environment=environment())
    folder = new_run_folder(tmp_path_factory.mktemp("runs"), "accept")
    write_accept_folder(result, folder)
    return result, folder


def test_the_checks_and_the_runs_take_the_budgets_micro_batches(accepted: tuple[AcceptResult, Path]) -> None:
    result, folder = accepted
    assert result.equivalence_passed
    assert [p.label for p in result.equivalence.params] == ["baseline 4x4", f"candidate tokens<={BUDGET}"]
    assert all(c.passed for c in result.verdict.criteria[:5]), result.verdict.criteria
    assert result.baseline.tokens_per_update == result.candidate.tokens_per_update
    assert all(r.spec.candidate.max_tokens == BUDGET for r in result.records)
    assert [r.spec.max_tokens for r in result.memory_records] == [None, BUDGET]
    report = (folder / "report.md").read_text(encoding="utf-8")
    assert "No quality run is offered for a token-budget candidate" in report


def test_an_adopted_token_budget_is_in_the_card_and_train_replays_it(
    accepted: tuple[AcceptResult, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result, _ = accepted
    spec = result.spec
    arms: tuple[Arm, Arm] = ("baseline", "candidate")
    summaries = {arm: dataclasses.replace(getattr(result, arm), spec=spec.arm_spec(arm)) for arm in arms}
    for decision, arm, budget in (("ADOPT", "candidate", BUDGET), ("KEEP BASELINE", "baseline", None)):
        verdict = dataclasses.replace(result.verdict, decision=decision)
        card = make_runcard(spec, verdict, summaries[arm], environment(), "tokens")
        assert card.max_tokens == budget and card.extra["candidate"] == f"tokens<={BUDGET}"
    adopted = make_runcard(
        spec,
        dataclasses.replace(result.verdict, decision="ADOPT"),
        summaries["candidate"],
        environment(),
        "t",
    )
    # the verdict names the arm by its budget, not by a plan it did not run (16x1)
    adopt = dataclasses.replace(result.verdict, decision="ADOPT")  # whatever this machine measured
    (first, *_) = verdict_lines(dataclasses.replace(result, card=adopted, verdict=adopt))
    assert first.startswith(f"ADOPT: the run card records tokens<={BUDGET} (global_batch = 16 rows")
    assert "16x1" not in first and "accum_steps" not in first
    write_runcard(adopted, tmp_path / "runcard.json")
    recorded = json.loads((tmp_path / "runcard.json").read_text())
    assert (recorded["micro_batch"], recorded["accum_steps"], recorded["max_tokens"]) == (None, None, BUDGET)
    assert read_runcard(tmp_path / "runcard.json").plan == BatchPlan(micro_batch=16, accum_steps=1)
    with one_thread():
        code = main(
            [
                "train",
                "--runcard",
                str(tmp_path / "runcard.json"),
                "--steps",
                "2",
                "--run-dir",
                str(tmp_path / "t"),
            ]
        )
    assert code == 0, capsys.readouterr().err
    assert read_runcard(tmp_path / "t" / "runcard.json").max_tokens == BUDGET


def test_the_float64_check_reorders_the_batch_into_every_ranks_micro_batches() -> None:
    workload = load_workload(GPT)
    batch = workload.make_batch(16, 0)
    rows, sizes = token_partition(batch, BUDGET, 2)
    assert sum(sizes) == 16 and all(s >= 1 for s in sizes)
    # a permutation of the batch's rows: the same examples, so the same full-batch update
    assert sorted(map(tuple, rows["input_ids"].tolist())) == sorted(map(tuple, batch["input_ids"].tolist()))
    assert int(workload.count_fn(rows)) == int(workload.count_fn(batch))
    assert isinstance(rows["input_ids"], torch.Tensor)


@pytest.mark.parametrize(
    ("candidate", "quality_steps", "match"),
    [
        ((4, 4), None, "one window of rows per rank"),
        ((16, 1), 2, "--quality-steps does not train a token-budget candidate"),
    ],
)
def test_a_token_budget_candidate_is_refused_where_it_cannot_run(
    candidate: tuple[int, int], quality_steps: int | None, match: str
) -> None:
    with pytest.raises(BenchError, match=match):
        AcceptSpec(
            baseline=plan(4, 4),
            candidate=plan(*candidate),
            candidate_max_tokens=BUDGET,
            settings=MeasureSettings(steps=4, warmup=1),
            block_updates=1,
            quality_steps=quality_steps,
        )


def test_the_command_refuses_both_candidates(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["accept", "--candidate", "2x8", "--candidate-max-tokens", "128"]) == 2
    assert "give one of them" in capsys.readouterr().err


def test_the_command_runs_a_token_budget_candidate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradaccum.cli import cmd_accept
    from tests.cli.test_accept_cli import FAST, in_process_launching

    monkeypatch.setattr(cmd_accept, "make_launching", in_process_launching)
    args = ["accept", "--baseline", "4x4", "--candidate-max-tokens", str(BUDGET), "--margin", "1000000"]
    assert main([*args, "--out-dir", str(tmp_path), *FAST]) == 0  # no gain of 10^6: KEEP BASELINE
    out = capsys.readouterr().out
    assert f"baseline 4x4 vs candidate tokens<={BUDGET} on" in out
    assert f"16 rows over dp 1 in micro-batches of at most {BUDGET} tokens" in out
    assert "KEEP BASELINE" in out
