"""``gradaccum train`` flags: a run card trains what it records (optimizer included) and refuses flags
that would change it, ``--threads``, out-of-memory errors, and the figures and words it prints."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gradaccum.cli.main import main
from gradaccum.plan import BatchPlan
from gradaccum.runcard import RunCard, write_runcard
from gradaccum.step.config import AccumConfig
from gradaccum.train.records import read_metrics
from tests.train.common import one_thread

FLAT = ["--schedule", "constant", "--warmup", "0"]  # every window runs at the peak learning rate


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())


def _card(path: Path, **fields: object) -> Path:
    card = RunCard(
        workload="gradaccum.examples:tiny_gpt",
        plan=BatchPlan(micro_batch=4, accum_steps=2, dp=1),
        accum=AccumConfig(max_grad_norm=0.5, max_consecutive_skips=4),
        precision="float64",
        seed=3,
        **fields,  # type: ignore[arg-type]
    )
    write_runcard(card, path)
    return path


def _lrs(run_dir: Path) -> set[float]:
    return {r["lr"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "step"}


def test_a_card_with_the_workloads_optimizer_trains_with_it_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    card = _card(tmp_path / "card.json")  # optimizer "workload": the tiny GPT's SGD at lr 0.1
    run_dir = tmp_path / "run"
    code, text = _run(
        ["train", "--runcard", str(card), "--steps", "2", *FLAT, "--run-dir", str(run_dir)], capsys
    )
    assert code == 0, text
    assert f"from run card {card}: workload gradaccum.examples:tiny_gpt;" in text
    assert "precision float64; seed 3" in text
    assert "from run card: optimizer the workload's own optimizer_factory" in text
    assert "from run card: accumulation max_grad_norm 0.5, loss_reduction sum, defer_sync yes" in text
    assert "max_consecutive_skips 4" in text and "None" not in text and "True" not in text
    assert _lrs(run_dir) == {0.1}, "the workload's SGD, not train's default AdamW at 1e-2"
    trained = json.loads((run_dir / "runcard.json").read_text())
    assert (trained["optimizer"], trained["lr"], trained["accum"]["max_consecutive_skips"]) == (
        "workload",
        None,
        4,
    )


def test_a_card_with_sgd_trains_at_its_learning_rate_and_weight_decay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    card = _card(tmp_path / "card.json", optimizer="sgd", lr=0.05, weight_decay=0.01)
    run_dir = tmp_path / "run"
    code, text = _run(
        ["train", "--runcard", str(card), "--steps", "2", *FLAT, "--run-dir", str(run_dir)], capsys
    )
    assert code == 0, text
    assert "from run card: optimizer sgd, lr 0.05, weight decay 0.01" in text
    assert _lrs(run_dir) == {0.05}
    trained = json.loads((run_dir / "runcard.json").read_text())
    assert (trained["optimizer"], trained["lr"], trained["weight_decay"]) == ("sgd", 0.05, 0.01)


@pytest.mark.parametrize(
    ("flag", "value", "card_has"),
    [
        ("--lr", "0.1", "(the card has 0.05)"),
        ("--optimizer", "adamw", "(the card has sgd)"),
        ("--weight-decay", "0", "(the card has 0.01)"),
        ("--max-grad-norm", "2", "(the card has 0.5)"),
        ("--max-consecutive-skips", "3", "(the card has 4)"),
        ("--precision", "float32", "(the card has float64)"),
        ("--seed", "1", "(the card has 3)"),
        ("--workload", "gradaccum.examples:tiny_gpt", "(the card has gradaccum.examples:tiny_gpt)"),
    ],
)
def test_a_card_refuses_flags_that_change_what_it_fixes_naming_the_cards_value(
    flag: str, value: str, card_has: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    card = _card(tmp_path / "card.json", optimizer="sgd", lr=0.05, weight_decay=0.01)
    run_dir = tmp_path / "run"
    code, text = _run(["train", "--runcard", str(card), flag, value, "--run-dir", str(run_dir)], capsys)
    assert code == 2, text
    assert (
        f"these flags would change it: {flag} {value} {card_has}. Drop them, or train without --runcard."
        in text
    )
    assert not run_dir.exists()


def test_a_card_accepts_the_settings_that_do_not_change_the_update(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    card = _card(tmp_path / "card.json")
    argv = ["train", "--runcard", str(card), "--steps", "2", "--threads", "1", "--eval-every", "1"]
    argv += [
        "--eval-examples",
        "4",
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "1",
        "--schedule-clock",
        "tokens",
    ]
    code, text = _run([*argv, "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 0, text
    assert "eval at step 2" in text


def test_a_card_naming_an_optimizer_without_its_learning_rate_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    card = _card(tmp_path / "card.json", optimizer="adamw")
    code, text = _run(["train", "--runcard", str(card), "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 2 and "names optimizer adamw but no lr" in text, text


def test_threads_default_to_one_on_cpu_and_are_printed_and_restored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.set_num_threads(2)  # as if the caller had more; the run sets its own and gives them back
    code, text = _run(["train", "--steps", "1", "--run-dir", str(tmp_path / "a")], capsys)
    assert code == 0 and "torch threads per process: 1;" not in text, text
    assert re.search(r"torch threads per process: 1( |$)", text), text
    assert torch.get_num_threads() == 2
    code, text = _run(["train", "--steps", "1", "--threads", "2", "--run-dir", str(tmp_path / "b")], capsys)
    assert code == 0 and "torch threads per process: 2 (--threads)" in text, text
    with pytest.raises(SystemExit) as exc:
        main(["train", "--threads", "0"])
    assert exc.value.code == 2
    assert "argument --threads: expected an integer >= 1, got 0" in capsys.readouterr().err


def test_out_of_memory_in_the_workload_exits_1_naming_the_configuration_and_what_to_try(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", "--workload", "tests.faults.train_workloads:out_of_memory_gpt", "--steps", "2"]
    code, text = _run([*argv, "--micro-batch", "4", "--run-dir", str(run_dir)], capsys)
    assert code == 1, text
    assert "gradaccum train: failed: out of memory (" in text and "can't allocate memory" in text
    assert "with --workload tests.faults.train_workloads:out_of_memory_gpt, --micro-batch 4" in text
    assert "(global_batch = micro_batch 4 x dp 1 x accum_steps 8 = 32, precision float32)" in text
    assert (
        "Try a smaller --micro-batch (the global batch stays: more accumulation steps), activation " in text
    )
    assert "Traceback" not in text
    assert not run_dir.exists() or not any(run_dir.iterdir())


def test_the_summary_rate_is_the_progress_lines_rate_and_the_wall_rate_is_labelled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text = _run(["train", "--steps", "10", "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 0, text
    last = re.findall(r"step 10: .*? ([\d,]+) tok/s", text)[-1]
    assert f"{last} tok/s in training windows" in text, text
    assert re.search(
        r"[\d,]+ tok/s over the [\d.]+ s wall time \(with checkpoints, evaluation and records\)", text
    )
    assert "completed: 10 boundaries, 10 updates applied" in text


def test_one_of_a_thing_is_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, text = _run(["train", "--steps", "1", "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 0, text
    assert "completed: 1 boundary, 1 update applied" in text
    assert "checkpoint (final) after 1 boundary:" in text
    assert "1 process on cpu" in text
    for wrong in ("1 boundaries", "1 updates", "process(es)", "1 steps"):
        assert wrong not in text, wrong
