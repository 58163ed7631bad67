"""``gradaccum train``: defaults that learn, the batch equation, run cards, resume and signals."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaccum.check.workload import Workload
from gradaccum.cli.main import main
from gradaccum.examples import tiny_gpt
from gradaccum.plan import BatchPlan
from gradaccum.runcard import RunCard, write_runcard
from gradaccum.step.config import AccumConfig
from tests.train.common import one_thread, train_from_runcard


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


def signalling_gpt() -> Workload:
    """The tiny GPT, sending itself SIGUSR1 mid-window 1 and SIGTERM mid-window 3 (accum 4)."""
    workload = tiny_gpt()
    calls = [0]
    signals = {1 * 4 + 1: signal.SIGUSR1, 3 * 4 + 2: signal.SIGTERM}

    def loss_fn(model: torch.nn.Module, micro_batch: Any) -> torch.Tensor:
        if calls[0] in signals:
            os.kill(os.getpid(), signals[calls[0]])
        calls[0] += 1
        return workload.loss_fn(model, micro_batch)

    return dataclasses.replace(workload, loss_fn=loss_fn)


def test_default_run_lowers_the_loss_and_writes_the_run_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--steps", "40", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (
        "global_batch = micro_batch 8 x dp 1 x accum_steps 4 = 32 (checked against --global-batch 32)" in out
    )
    start, end = map(float, re.search(r"start loss ([\d.]+) -> end loss ([\d.]+)", out).groups())  # type: ignore[union-attr]
    # measured 4.05 -> 2.65 nats (means of the first and last five updates); the margin is far
    # above window noise (~0.2) and fails a run that does not learn
    assert end < start - 0.8, out
    assert "completed: 40 boundaries, 40 updates applied, 0 skipped" in out
    for name in ("runcard.json", "metrics.jsonl", "loss.png", "checkpoints/latest"):
        assert (tmp_path / name).is_file(), name
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines if '"kind": "step"' in line]
    assert len(steps) == 40
    assert {"loss", "grad_norm", "lr", "tokens", "skipped", "step_time_ms", "tokens_per_s"} <= steps[0].keys()


def test_token_budget_and_token_clock(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--tokens", "2000", "--schedule-clock", "tokens", "--run-dir", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "clock tokens, warmup 200 and horizon 2,000 tokens" in out
    schedule = json.loads((tmp_path / "runcard.json").read_text())["extra"]["schedule"]
    assert (schedule["clock"], schedule["horizon"]) == ("tokens", 2000)
    assert "tokens are not consumed" in schedule["skipped_updates"]
    consumed = int(re.search(r"([\d,]+) tokens consumed", out).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert consumed >= 2000
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s["kind"] == "step"][-2]["tokens"] < 2000, (
        "stops at the first boundary past it"
    )


def test_unreachable_global_batch_names_the_nearest(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--global-batch", "30", "--micro-batch", "8", "--steps", "1"]) == 2
    assert "the nearest reachable global batches are 24 or 32" in capsys.readouterr().err


def _card(path: Path, plan: BatchPlan) -> Path:
    card = RunCard(
        workload="gradaccum.examples:tiny_gpt",
        plan=plan,
        accum=AccumConfig(max_grad_norm=0.5),
        precision="float64",
        seed=3,
    )
    write_runcard(card, path)
    return path


def test_runcard_trains_exactly_the_recorded_configuration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    card = _card(tmp_path / "card.json", BatchPlan(micro_batch=4, accum_steps=2, dp=1))
    assert main(["train", "--runcard", str(card), "--steps", "2", "--run-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert f"global_batch = micro_batch 4 x dp 1 x accum_steps 2 = 8 (from run card {card})" in out
    assert "precision float64" in out
    trained = json.loads((tmp_path / "run" / "runcard.json").read_text())
    assert (trained["micro_batch"], trained["accum_steps"], trained["precision"], trained["seed"]) == (
        4,
        2,
        "float64",
        3,
    )
    assert trained["accum"]["max_grad_norm"] == 0.5


def test_a_post_scaling_runcard_trains_with_a_post_scaling_accumulator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # what accept writes when a post-scaling arm is chosen; train must build that accumulator
    card = tmp_path / "card.json"
    plan = BatchPlan(micro_batch=4, accum_steps=2, dp=1)
    write_runcard(
        RunCard(workload="gradaccum.examples:tiny_gpt", plan=plan, accum=AccumConfig(scaling="post")), card
    )
    built = train_from_runcard(card, tmp_path / "run", monkeypatch)
    assert "scaling post" in capsys.readouterr().out  # the start banner says what the card fixed
    assert [acc.config.scaling for acc in built] == ["post"]
    trained = json.loads((tmp_path / "run" / "runcard.json").read_text())
    assert trained["accum"]["scaling"] == "post"
    # --scaling is not one of the fields a card fixes (both modes give the same update): it overrides
    again = [
        "train",
        "--runcard",
        str(card),
        "--scaling",
        "pre",
        "--steps",
        "1",
        "--run-dir",
        str(tmp_path / "pre"),
    ]
    assert main(again) == 0
    assert [acc.config.scaling for acc in built] == ["post", "pre"]


def test_runcard_with_another_dp_or_conflicting_flags_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    card = _card(tmp_path / "card.json", BatchPlan(micro_batch=4, accum_steps=2, dp=2))
    assert main(["train", "--runcard", str(card), "--steps", "1", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "was verified with dp=2 (global_batch = micro_batch 4 x dp 2 x accum_steps 2 = 16)" in err
    assert "this job has 1 process. Launch with torchrun --nproc-per-node 2" in err
    assert main(["train", "--runcard", str(card), "--micro-batch", "2", "--steps", "1"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (
        f"--runcard {card} fixes what was verified, and these flags would change it: --micro-batch 2 " in err
    )
    assert "(the card has 4 (global_batch = micro_batch 4 x dp 2 x accum_steps 2 = 16))" in err


@pytest.mark.parametrize(("key", "value"), [("skip_nonfinite", "false"), ("defer_sync", "no")])
def test_runcard_with_string_booleans_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, value: str
) -> None:
    """``bool("false")`` is true: a card edited by hand this way would mean the opposite of what it says."""
    card = _card(tmp_path / "card.json", BatchPlan(micro_batch=4, accum_steps=2, dp=1))
    data = json.loads(card.read_text())
    data["accum"][key] = value
    card.write_text(json.dumps(data))
    run_dir = tmp_path / "run"
    assert main(["train", "--runcard", str(card), "--steps", "1", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"{key} must be True or False, got {value!r} (str)" in err and "Traceback" not in err
    assert not run_dir.exists()


def test_resume_with_another_global_batch_is_refused_showing_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--steps", "2", "--run-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path), "--global-batch", "16", "--steps", "4"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "with global batch 32 (global_batch = micro_batch 8 x dp 1 x accum_steps 4 = 32)" in err
    assert "this run has global batch 16 (global_batch = micro_batch 8 x dp 1 x accum_steps 2 = 16)" in err
    # another micro-batch is another cut of the same global batch: it resumes (docs/elastic.md)
    assert main(["train", "--resume", str(tmp_path), "--micro-batch", "4", "--steps", "4"]) == 0


def test_signals_checkpoint_and_stop_at_boundaries_then_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    workload = f"{__name__}:signalling_gpt"
    argv = ["train", "--workload", workload, "--steps", "6", "--run-dir", str(tmp_path)]
    assert main(argv) == 143, "stopped by SIGTERM, after a checkpoint: what a scheduler expects"
    out = capsys.readouterr().out
    # SIGUSR1 during window 1 -> checkpoint after it; SIGTERM during window 3 -> checkpoint, stop
    assert f"checkpoint (requested) after 2 boundaries: {tmp_path}/checkpoints/step-00000002" in out
    assert "checkpoint (stop) after 4 boundaries" in out
    assert "stop requested: 4 boundaries, 4 updates applied" in out
    assert (
        f"resume with: gradaccum train --workload {workload} --steps 6 --run-dir {tmp_path} --resume auto"
        in out
    )
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before

    # the same workload (another one is refused); its signals now land in the final window
    assert main(["train", "--workload", workload, "--resume", str(tmp_path), "--steps", "6"]) == 0
    out = capsys.readouterr().out
    assert "at boundary 4" in out and "completed: 6 boundaries, 6 updates applied" in out
    assert "note:" not in out, "same flags, same schedule"
    # a longer run moves the derived horizon: said, not silently applied
    assert main(["train", "--workload", workload, "--resume", str(tmp_path), "--steps", "8"]) == 0
    assert "the checkpoint's schedule was cosine, clock steps, warmup 1, horizon 6" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_device_without_cuda_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--device", "cuda", "--steps", "1"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err
