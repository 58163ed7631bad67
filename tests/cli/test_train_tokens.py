"""``gradaccum train --max-tokens``: micro-batches by a token budget, recorded and replayed."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from gradaccum.cli.main import main
from gradaccum.runcard import read_runcard
from tests.train.common import one_thread


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


def test_max_tokens_trains_prints_rows_and_tokens_and_the_card_replays_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = tmp_path / "first"
    argv = ["train", "--steps", "3", "--global-batch", "16", "--max-tokens", "96", "--run-dir", str(first)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    equation = re.search(
        r"batch equation: global_batch = 16 rows = ([\d,]+) valid tokens in the first window", out
    )
    assert equation is not None, out
    assert "micro-batches of at most max_tokens 96 tokens (rows x longest row)" in out
    assert "completed: 3 boundaries, 3 updates applied" in out
    card = json.loads((first / "runcard.json").read_text())
    assert card["max_tokens"] == 96 and card["global_batch"] == 16
    assert card["tokens_per_step"] == int(equation.group(1).replace(",", ""))
    # the tiny GPT's rows hold 4..32 tokens: 96 tokens hold 3 rows of the longest, more of shorter
    # ones, so 16 rows take a handful of micro-batches (fixed ones of 3 rows would take 6)
    lines = (first / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines if '"kind": "step"' in line]
    assert all(s["applied"] for s in steps)
    assert all(2 <= s["accum_steps"] < 6 for s in steps), [s["accum_steps"] for s in steps]

    again = tmp_path / "again"
    argv = ["train", "--runcard", str(first / "runcard.json"), "--steps", "3", "--run-dir", str(again)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "max_tokens 96" in out
    assert read_runcard(again / "runcard.json").max_tokens == 96
    losses = [
        [
            json.loads(line)["loss"]
            for line in (run / "metrics.jsonl").read_text().splitlines()
            if '"kind": "step"' in line
        ]
        for run in (first, again)
    ]
    assert losses[0] == losses[1]  # the same windows cut the same way: the same run

    argv = [
        "train",
        "--runcard",
        str(first / "runcard.json"),
        "--max-tokens",
        "64",
        "--run-dir",
        str(tmp_path / "x"),
    ]
    assert main(argv) == 2
    assert "--max-tokens 64 (the card has 96)" in capsys.readouterr().err


def test_a_budget_below_the_longest_sequence_exits_2_naming_max_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--steps", "2", "--max-tokens", "16", "--run-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--max-tokens 16" in err and "longer than max_tokens=16" in err, err


def test_max_tokens_replaces_micro_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--micro-batch", "4", "--max-tokens", "64", "--run-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    assert "give one of them" in capsys.readouterr().err


def test_a_token_budget_run_records_what_it_ran_and_says_its_micro_batches_and_padding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradaccum.examples import tiny_gpt
    from gradaccum.tokens.split import split_by_tokens
    from gradaccum.train.data import train_seed

    run = tmp_path / "run"
    argv = ["train", "--steps", "2", "--global-batch", "16", "--max-tokens", "96", "--run-dir", str(run)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    card = json.loads((run / "runcard.json").read_text())
    # no fixed micro-batch or accumulation count: the budget cut each window by its lengths
    assert (card["micro_batch"], card["accum_steps"], card["max_tokens"]) == (None, None, 96)
    assert (card["global_batch"], card["dp"]) == (16, 1)
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["kind"] == "step"]
    computed, padding = 0, 0
    for s in steps:  # the windows cut again, independently: what each computed and its padding
        parts = split_by_tokens(tiny_gpt().make_batch(16, train_seed(0, s["window"])), 96)
        # the tiny GPT marks its tokens by labels != -100 (no attention_mask); each part is trimmed
        mine = sum(p["labels"].shape[0] * p["labels"].shape[1] for p in parts)
        present = sum(int((p["labels"] != -100).sum()) for p in parts)
        assert (s["micro_batches"], s["computed_tokens"]) == (len(parts), mine)
        assert s["padding_tokens"] == mine - present
        share = (mine - present) / mine
        assert f"step {s['window'] + 1}: " in out
        assert f"{len(parts)} micro-batches, padding {share:.1%}" in out
        computed, padding = computed + mine, padding + mine - present
    assert (
        f"padding {padding:,} of the {computed:,} token positions computed ({padding / computed:.1%})" in out
    )
    assert "micro-batches per window" in out


def test_balance_cost_reads_the_model_records_it_and_the_card_replays_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = tmp_path / "first"
    argv = ["train", "--steps", "2", "--global-batch", "16", "--max-tokens", "96", "--balance-cost"]
    assert main([*argv, "--run-dir", str(first)]) == 0
    out = capsys.readouterr().out
    assert "balanced by compute cost (attention included)" in out, out
    card = json.loads((first / "runcard.json").read_text())
    # the bundled tiny GPT: GPTConfig(d_model=32, n_layer=2)
    assert card["balance_cost"] == {"model": "transformer", "d_model": 32, "layers": 2}
    assert card["max_tokens"] == 96

    again = tmp_path / "again"
    assert (
        main(["train", "--runcard", str(first / "runcard.json"), "--steps", "2", "--run-dir", str(again)])
        == 0
    )
    out = capsys.readouterr().out
    assert "from run card: ranks balanced by compute cost (transformer, d_model 32, layers 2" in out, out
    assert read_runcard(again / "runcard.json").balance_cost == card["balance_cost"]
    losses = [
        [
            json.loads(line)["loss"]
            for line in (run / "metrics.jsonl").read_text().splitlines()
            if '"kind": "step"' in line
        ]
        for run in (first, again)
    ]
    assert losses[0] == losses[1]


def test_balance_cost_without_a_token_budget_exits_2_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--steps", "2", "--balance-cost", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--balance-cost" in err and "give --max-tokens N with it" in err, err
    assert not (tmp_path / "run" / "runcard.json").exists()


def test_balance_cost_on_a_model_without_dimensions_exits_2_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--steps", "2", "--workload", "gradaccum.examples:bn_cnn", "--max-tokens", "96"]
    assert main([*argv, "--balance-cost", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--balance-cost prices each row by the model's width and depth" in err, err
    assert "declares neither" in err
