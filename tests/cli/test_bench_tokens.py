"""``gradaccum bench --max-tokens``: a token-budget arm beside fixed micro-batches, at the same
global batch, in fresh processes (one process, and two gloo ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradaccum.cli.main import main
from tests.cli.test_bench_cli import FAST, expected_tokens, sweep, two_rank_sweep


@pytest.mark.slow
def test_a_token_budget_is_one_more_row_at_the_same_global_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the tiny GPT's rows hold up to 32 tokens: 4 rows x 32 and a budget of 128 bound the same activations
    args = ["--global-batch", "16", "--configs", "4x4", "--max-tokens", "128", "--out-dir", str(tmp_path)]
    data = sweep([*args, *FAST], capsys)
    fixed, tokens = data["configs"]
    assert (fixed["label"], tokens["label"]) == ("4x4", "tokens<=128")
    assert fixed["status"] == tokens["status"] == "ok", tokens["error"]
    # the same examples in every update: the same global count in both arms
    assert fixed["tokens_per_update"] == tokens["tokens_per_update"] == expected_tokens(16)
    assert data["spec"]["max_tokens"] == [128]
    assert data["memory_predictions_bytes"][1] is None  # not a point on the micro-batch line
    (folder,) = tmp_path.iterdir()
    assert "tokens<=128" in (folder / "report.md").read_text(encoding="utf-8")


@pytest.mark.distributed
@pytest.mark.slow
def test_a_token_budget_row_on_two_ranks_counts_the_whole_window(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = two_rank_sweep(tmp_path, capsys, "--max-tokens", "64")
    fixed, tokens = data["configs"]
    assert tokens["status"] == "ok", tokens["error"]
    assert tokens["label"] == "tokens<=64" and tokens["dp"] == 2
    assert fixed["tokens_per_update"] == tokens["tokens_per_update"] == expected_tokens(8)


def test_bad_budgets_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--max-tokens", "0"]) == 2
    assert "--max-tokens '0'" in capsys.readouterr().err
    assert main(["bench", "--dp", "1", "--max-tokens", "64,64"]) == 2
    assert "once each" in capsys.readouterr().err
