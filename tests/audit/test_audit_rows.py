"""``gradaccum audit``'s rows by name (``--only``/``--skip``), its transformers Trainer row on an
``hf:`` folder, and the reference every row is compared with.

The reference is the whole window in one forward and one backward (as ``verify`` computes it), so
gradaccum's row, which sums the micro-batches, prints its real float64 rounding: above 0 (the old
reference summed the micro-batches in the step's own order and printed a bitwise 0.00e+00) and at
most 1e-10 (O(1) gradient terms, 16 digits, a few hundred additions in another order).

The Trainer row on a tiny Llama folder: transformers 5's Trainer counts the shifted targets of a
causal LM and its loss divides by that count, so its only error is transformers' causal-LM loss in
float32 (``logits.float()``): one ulp (6e-8) per token, bound 1e-6 (audit_trainer's EXACT_BOUND).
The control: the same folder under ``sequence`` normalization is another objective, which the row
reports as not run rather than as an error figure. No DeepSpeed row runs here (``--skip deepspeed``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gradaccum.audit.rows import ROWS, known_names, select_rows
from gradaccum.cli.main import main
from gradaccum.errors import ConfigError
from tests.helpers import hf as h

TRAINER = "transformers-trainer"


def test_select_rows_by_name_and_group() -> None:
    every = tuple(row.name for row in ROWS)
    assert select_rows() == every
    assert select_rows(skip=["deepspeed"]) == tuple(n for n in every if not n.startswith("deepspeed"))
    assert select_rows(only=["gradaccum", "hand-loop"]) == ("hand-loop", "gradaccum")  # table order
    assert "deepspeed" in known_names() and TRAINER in known_names()


def test_an_unknown_name_both_lists_and_an_empty_selection_are_refused() -> None:
    with pytest.raises(ConfigError, match="no audit row is called 'bogus'; the rows are hand-loop"):
        select_rows(only=["gradaccum", "bogus"])
    with pytest.raises(ConfigError, match="were both given; give one of them"):
        select_rows(only=["gradaccum"], skip=["deepspeed"])
    with pytest.raises(ConfigError, match="leaves no audit row to run"):
        select_rows(skip=list(known_names()))


def test_the_command_refuses_an_unknown_row_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["audit", "--skip", "deepspeed,nope", "--out", str(tmp_path / "a")])
    out, err = capsys.readouterr()
    assert code == 2
    assert "--skip deepspeed,nope: no audit row is called 'nope'" in out + err
    assert not (tmp_path / "a").exists()  # refused before any model was built


def _audit(tmp_path: Path, *extra: str) -> dict[str, Any]:
    folder = h.make_model_folder(tmp_path / "llama", weights=False)
    data = h.write_txt(tmp_path / "data.txt", h.texts())
    out = tmp_path / "out"
    argv = ["audit", "--workload", f"hf:{folder}", "--data", str(data), "--out", str(out), *extra]
    assert main(argv) == 0
    result: dict[str, Any] = json.loads((out / "audit.json").read_text())
    return result


@pytest.fixture(scope="module")
def hf_audit(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _audit(tmp_path_factory.mktemp("audit-hf"), "--skip", "deepspeed")


def test_skip_deepspeed_runs_every_other_row(hf_audit: dict[str, Any]) -> None:
    names = [row["name"] for row in hf_audit["rows"]]
    assert names == ["hand-loop", "accelerate", "lightning", TRAINER, "gradaccum"]
    assert hf_audit["skipped"] == ["deepspeed-engine", "deepspeed-gradaccum"]


def test_the_trainer_row_measures_transformers_own_accumulation(hf_audit: dict[str, Any]) -> None:
    row = next(r for r in hf_audit["rows"] if r["name"] == TRAINER)
    assert row["status"] == "measured", row["cause"]
    assert "transformers" in row["recipe"] and "Trainer" in row["recipe"]
    assert 0 < row["error"] <= 1e-6 and "float32 rounding" in row["cause"]


def test_the_gradaccum_row_prints_its_real_error_against_an_independent_reference(
    hf_audit: dict[str, Any],
) -> None:
    row = next(r for r in hf_audit["rows"] if r["name"] == "gradaccum")
    assert 0 < row["error"] <= 1e-10
    assert "whole window in one forward and one backward" in hf_audit["reference"]
    assert "against the whole window's single forward and backward" in row["cause"]


def test_the_trainer_row_is_not_run_where_its_objective_is_another(tmp_path: Path) -> None:
    result = _audit(tmp_path, "--only", TRAINER, "--normalization", "sequence")
    (row,) = result["rows"]
    assert row["status"] == "not run" and row["error"] is None
    assert "'sequence' normalization is another objective" in row["cause"]
