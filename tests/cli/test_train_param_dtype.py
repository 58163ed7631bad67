"""``train --param-dtype``: the parameters' dtype apart from the compute precision, what combinations
are refused before the first window (exit 2, naming the flags), and the run card's field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gradaccum.cli.main import main
from gradaccum.errors import RunCardError
from gradaccum.plan import BatchPlan
from gradaccum.runcard import RunCard
from tests.train.common import one_thread


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


def _train(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["train", *argv])
    out, err = capsys.readouterr()
    return code, out, err.strip()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--param-dtype", "bfloat16", "--precision", "float64"],
            "--precision float64 computes in float64 with float64 parameters; --param-dtype bfloat16 would "
            "store them narrower: drop --param-dtype, or choose another --precision",
        ),
        (
            ["--param-dtype", "float16", "--precision", "float16"],
            "--precision float16's GradScaler cannot unscale float16 gradients, and the parameters are "
            "float16: add --accum-dtype float32 (the gradients sum in float32), or store the parameters in "
            "float32 (--param-dtype float32)",
        ),
        (
            ["--accum-dtype", "float32"],  # the tiny GPT builds float32 parameters
            "--accum-dtype float32 widens the gradients of parameters narrower than float32, but the "
            "parameters are float32 (--param-dtype saved): it would do nothing",
        ),
    ],
)
def test_a_combination_that_cannot_act_exits_2_before_the_first_window(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _train(capsys, *argv, "--steps", "1", "--run-dir", str(tmp_path / "r"))
    assert code == 2 and "step 1:" not in out
    assert err.startswith(f"gradaccum train: error: {message}")
    assert not (tmp_path / "r" / "runcard.json").exists()


def test_bfloat16_parameters_under_bfloat16_autocast_with_float32_sums(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "r"
    argv = [
        "--param-dtype",
        "bfloat16",
        "--precision",
        "bfloat16",
        "--accum-dtype",
        "float32",
        "--steps",
        "1",
    ]
    code, out, _ = _train(capsys, *argv, "--run-dir", str(run))
    assert code == 0, out
    assert (
        "precision bfloat16 (compute), parameters bfloat16 (--param-dtype bfloat16), gradients summed in "
        "float32 (--accum-dtype); workload gradaccum.examples:tiny_gpt" in out
    )
    card = json.loads((run / "runcard.json").read_text())
    assert (card["param_dtype"], card["precision"]) == ("bfloat16", "bfloat16")


def test_the_run_card_field_is_checked_and_optional() -> None:
    plan = BatchPlan(micro_batch=2, accum_steps=2, dp=1)
    card = RunCard(workload="gradaccum.examples:tiny_gpt", plan=plan, param_dtype="bfloat16")
    assert RunCard.from_dict(card.to_dict()).param_dtype == "bfloat16"
    older = {k: v for k, v in card.to_dict().items() if k != "param_dtype"}
    assert RunCard.from_dict(older).param_dtype is None  # a card written before the field
    with pytest.raises(RunCardError, match="'param_dtype' must be null or one of"):
        RunCard(workload="w:f", plan=plan, param_dtype="int8")


def test_resuming_in_another_parameter_dtype_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "r"
    code, out, _ = _train(capsys, "--param-dtype", "bfloat16", "--steps", "1", "--run-dir", str(run))
    assert code == 0, out
    code, _, err = _train(capsys, "--steps", "2", "--run-dir", str(run), "--resume", "auto")
    assert code == 2
    assert err == (
        f"gradaccum train: error: checkpoint {run / 'checkpoints' / 'step-00000001'} holds bfloat16 "
        "parameters, this run stores them in float32; resume with --param-dtype bfloat16, or start a new run"
    )
    code, out, _ = _train(
        capsys, "--param-dtype", "bfloat16", "--steps", "2", "--run-dir", str(run), "--resume", "auto"
    )
    assert code == 0 and "resumed from" in out
