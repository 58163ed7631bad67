"""verify, train and the run card with a compiled model (the library side of the --compile flags).

``nn.Module.compile()`` uses torch's default backend; these tests set it to ``aot_eager`` so that
no C++ is built (inductor itself is exercised in test_compiled_step.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gradaccum.check.equivalence import verify_workload
from gradaccum.errors import RunCardError, TrainError
from gradaccum.examples import tiny_gpt
from gradaccum.plan import BatchPlan
from gradaccum.runcard import RunCard, read_runcard
from gradaccum.train import StepRecord, TrainEvent, train
from tests.train.common import config, one_thread


def test_verify_compiles_the_candidate_and_passes_in_float64(aot_eager_default: None) -> None:
    report = verify_workload(tiny_gpt(), compile=True)
    assert report.passed, report
    assert report.candidate == "Accumulator.step (compiled model)"
    assert report.grad_max_rel_err < 1e-12


def test_verify_compile_says_what_the_scan_of_the_compiled_model_found(
    aot_eager_default: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradaccum.cli.main import main

    code = main(["verify", "--compile", "--trace-steps", "0"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    (scan,) = [line for line in lines if "scan for accum_steps=4" in line]
    # one line with what was found, not a heading followed by the scan's note to run verify
    found = "no layer or loss that couples examples found (the compiled forwards' source read too)"
    assert scan.endswith(found)
    assert lines[lines.index(scan) + 1].startswith("verdict: PASS")


def test_train_compiled_records_recompiles_and_its_run_card_says_compile(
    aot_eager_default: None, tmp_path: Path
) -> None:
    records: list[StepRecord] = []

    def keep(event: TrainEvent) -> None:
        if isinstance(event, StepRecord):
            records.append(event)

    with one_thread():
        result = train(config(tmp_path, steps=3, compile=True), on_event=keep)
    assert result.progress.steps_applied == 3
    assert records[0].recompiles >= 1  # the first window compiled
    assert [r.recompiles for r in records[1:]] == [0, 0]  # same shapes: nothing more
    card = read_runcard(tmp_path / "runcard.json")
    assert card.compile is True
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["recompiles"] for m in metrics if m["kind"] == "step"][1:] == [0, 0]


def test_a_run_card_without_compile_reads_as_eager_and_a_wrong_value_is_refused() -> None:
    card = RunCard(workload="gradaccum.examples:tiny_gpt", plan=BatchPlan(micro_batch=2, accum_steps=2))
    data = card.to_dict()
    assert data["compile"] is False and RunCard.from_dict(data) == card
    del data["compile"]  # a card written before compile was recorded
    assert RunCard.from_dict(data).compile is False
    with pytest.raises(RunCardError, match="'compile' must be true or false"):
        RunCard.from_dict({**data, "compile": "yes"})
    with pytest.raises(TrainError, match="compile must be True or False"):
        config(Path("unused"), compile="yes")


def test_train_runcard_that_says_compile_compiles_and_prints_the_windows_that_did(
    aot_eager_default: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradaccum.cli.main import main
    from gradaccum.runcard import write_runcard
    from gradaccum.step.config import AccumConfig

    card = RunCard(
        workload="gradaccum.examples:tiny_gpt",
        plan=BatchPlan(micro_batch=4, accum_steps=2),
        accum=AccumConfig(max_grad_norm=0.5),
        precision="float64",
        compile=True,
    )
    write_runcard(card, tmp_path / "card.json")
    run_dir = tmp_path / "run"
    argv = ["train", "--runcard", str(tmp_path / "card.json"), "--steps", "2", "--run-dir", str(run_dir)]
    with one_thread():
        code = main([*argv, "--threads", "1"])
    text = " ".join(capsys.readouterr().out.split())
    assert code == 0, text
    assert "; compiled (torch.compile)" in text
    assert "step 1: torch.compile compiled" in text and "step 2: torch.compile" not in text
    assert json.loads((run_dir / "runcard.json").read_text())["compile"] is True
    # the compile time on its own line, out of the throughput, and the summary says so
    assert re.search(r"compile time: [\d.,]+ s \(torch.compile, \d+ graphs? in 1 window", text), text
    assert "kept out of the tok/s below" in text
    assert "tok/s in the training windows that did not compile" in text
    assert "s wall time without compiling" in text
