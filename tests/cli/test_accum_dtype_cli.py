"""``accum_dtype`` on the command line: a run card records it and ``train`` replays it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gradaccum.cli.main import main
from gradaccum.plan import BatchPlan
from gradaccum.runcard import read_runcard
from gradaccum.step.config import AccumConfig
from tests.train.common import train_from_accum_card


def test_a_run_card_records_accum_dtype_and_train_replays_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = BatchPlan(micro_batch=4, accum_steps=2, dp=1)
    accum = AccumConfig(accum_dtype="float32")
    card, built, trained = train_from_accum_card(  # bfloat16 parameters: accum_dtype widens them
        tmp_path, monkeypatch, "tests.helpers.moe_workloads:bf16_gpt", plan, accum, steps=1
    )
    assert read_runcard(card).accum.accum_dtype == "float32"
    assert [acc.config.accum_dtype for acc in built] == ["float32"]
    assert trained["accum_dtype"] == "float32"


def test_verify_in_bf16_reports_the_accumulation_error_at_k_beside_k1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # the default workload (tiny GPT, 8 examples, micro-batch 2): k = 4
    code = main(["verify", "--precision", "bfloat16", "--trace-steps", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "accumulation precision" in out
    assert "bfloat16 parameters, relL2" in out
    assert re.search(r"k=1: \d", out)
    assert re.search(r"k=4, \.grad in bfloat16: \S+ \(x\d\.\d\d\)", out)
    assert re.search(r"k=4, accum_dtype='float32': \S+ \(x\d\.\d\d\)", out)


def test_verify_in_float32_does_not_measure_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--trace-steps", "0"]) == 0
    assert "accumulation precision" not in capsys.readouterr().out
