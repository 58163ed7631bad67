"""First contact with ``gradaccum train``'s flags: the commands a new user types, their output read
line by line.

- ``--accum-steps K`` (the name of ``gradient_accumulation_steps``): K micro-batches per step, the
  batch equation checked against the other flags (a contradiction: exit 2, one line naming them);
- a shortened flag (``--max-token``) is refused, never read as ``--max-tokens``;
- a bfloat16 ``hf:`` folder trains bfloat16 parameters (banner, run card, checkpoint), and
  ``--accum-dtype float32`` widens their gradients' sums; on float32 parameters it has nothing to
  widen and is refused naming the flag and the dtype;
- a JSONL file's blank lines are counted and named, not dropped unsaid;
- the evaluation line says whether the held-out rows are evaluated, and the summary which clock
  each tok/s figure is over.

Tiny models (the bundled GPT, a 2-layer Llama of width 16), two or three steps each.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from gradaccum.cli.main import main
from gradaccum.train.records import read_metrics
from tests.helpers import hf
from tests.train.common import one_thread

SEQ = ["--seq-len", "16", "--global-batch", "8", "--micro-batch", "2"]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("journey-train")
    documents = hf.texts(40)
    lines = [json.dumps({"text": d}) for d in documents]
    lines.insert(5, "")  # line 6: blank
    lines.insert(9, "   ")  # line 10: only spaces
    data = root / "docs.jsonl"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {
        "bf16": hf.make_model_folder(root / "bf16", weights=True, dtype=torch.bfloat16),
        "f32": hf.make_model_folder(root / "f32", weights=True),
        "data": data,
    }


def _train(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], list[str]]:
    code = main(["train", *argv])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


def _line(lines: list[str], start: str) -> str:
    found = [line for line in lines if line.startswith(start)]
    assert len(found) == 1, (start, lines)
    return found[0]


def test_accum_steps_trains_that_many_micro_batches_per_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    code, out, _ = _train(capsys, "--accum-steps", "2", "--steps", "2", "--run-dir", str(run))
    assert code == 0, out
    # the micro-batch keeps its default (8); the global batch follows: 8 x 1 x 2
    assert (
        out[0] == "batch equation: global_batch = micro_batch 8 x dp 1 x accum_steps 2 = 16 (--accum-steps 2)"
    )
    card = json.loads((run / "runcard.json").read_text())
    assert (card["micro_batch"], card["accum_steps"], card["global_batch"]) == (8, 2, 16)
    steps = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "step"]
    assert [r["accum_steps"] for r in steps] == [2, 2]


def test_accum_steps_checked_against_the_global_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--global-batch", "32", "--accum-steps", "4", "--steps", "1", "--run-dir", str(tmp_path / "a")]
    code, out, _ = _train(capsys, *argv)  # 32 / (1 x 4): micro-batches of 8
    assert code == 0
    assert out[0] == (
        "batch equation: global_batch = micro_batch 8 x dp 1 x accum_steps 4 = 32 "
        "(--accum-steps 4, checked against --global-batch 32)"
    )
    argv = [
        "--global-batch",
        "32",
        "--micro-batch",
        "8",
        "--accum-steps",
        "3",
        "--run-dir",
        str(tmp_path / "b"),
    ]
    code, out, err = _train(capsys, *argv)
    assert code == 2 and out == []
    assert err == [
        "gradaccum train: error: --global-batch 32 contradicts --micro-batch 8 x 1 process x --accum-steps 3 "
        "= 24 (global batch = micro-batch x processes x accum steps); use --accum-steps 4 for --global-batch "
        "32 or --global-batch 24 or two of the three flags"
    ]
    code, out, err = _train(
        capsys, "--global-batch", "30", "--accum-steps", "4", "--run-dir", str(tmp_path / "c")
    )
    assert code == 2
    assert err == [
        "gradaccum train: error: --global-batch 30 with --accum-steps 4 on 1 process: global batch = "
        "micro-batch x processes x accum steps, and 30 is not a multiple of 1 x 4 = 4; use --accum-steps 3 "
        "or 5, or --global-batch 28 or 32"
    ]


def test_a_shortened_flag_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--max-token", "100", "--steps", "1", "--run-dir", str(tmp_path / "r")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("usage: gradaccum train ")
    assert err[-1] == (
        "gradaccum train: error: unrecognized arguments: --max-token 100 (flags are not abbreviated; "
        "--max-token: did you mean --max-tokens?)"
    )
    assert not (tmp_path / "r").exists()


def test_a_bfloat16_folder_trains_bfloat16_parameters_summed_in_float32(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    argv = [
        "--workload",
        f"hf:{files['bf16']}",
        "--data",
        str(files["data"]),
        *SEQ,
        "--accum-dtype",
        "float32",
    ]
    code, out, _ = _train(capsys, *argv, "--steps", "2", "--run-dir", str(run))
    assert code == 0, out
    assert (
        out[0] == "batch equation: global_batch = micro_batch 2 x dp 1 x accum_steps 4 = 8 "
        "(checked against --global-batch 8)"
    )
    assert (
        out[1] == "data: docs.jsonl, 40 documents from 42 lines; skipped 2 lines with no text (lines 6, 10)"
    )
    assert out[2].startswith(
        "1 process on cpu, precision float32 (compute), parameters bfloat16 (--param-dtype saved: as the "
        "folder saved them), computing in bfloat16 (no autocast at precision float32), gradients summed in "
        "float32 (--accum-dtype); workload hf:"
    )
    assert _line(out, "evaluation:") == (
        "evaluation: 4 held-out rows of 40, never trained on; not evaluated: no --eval-every (add "
        "--eval-every N to evaluate them)"
    )
    assert _line(out, "throughput:") == (
        "throughput: tok/s counts valid tokens over the windows' own time (drawing the data and the step), "
        "without checkpoints, evaluation, records or start-up; the summary gives both clocks"
    )
    summary = _line(out, "completed:")
    assert re.fullmatch(
        r"completed: 2 boundaries, 2 updates applied, 0 skipped; [\d,]+ tokens consumed; [\d,]+ tok/s in "
        r"training windows \(over their own [\d.]+ s: the step lines' figure\), [\d,]+ tok/s over the "
        r"[\d.]+ s wall time \(with checkpoints, evaluation and records\) of the [\d.]+ s command "
        r"\(start-up, model and data loading included\)",
        summary,
    ), summary
    card = json.loads((run / "runcard.json").read_text())
    assert (card["param_dtype"], card["precision"], card["accum"]["accum_dtype"]) == (
        "bfloat16",
        "float32",
        "float32",
    )
    assert card["extra"]["data"]["skipped_lines"] == [6, 10]
    state = torch.load(run / "checkpoints" / "step-00000002" / "state.pt", weights_only=False)
    assert {t.dtype for t in state["model"].values() if t.is_floating_point()} == {torch.bfloat16}
    assert state["meta"]["param_dtype"] == "bfloat16"

    # the run card replays the parameters' dtype, and refuses a flag that would change it
    code, out, _ = _train(
        capsys, "--runcard", str(run / "runcard.json"), "--steps", "1", "--run-dir", str(tmp_path / "again")
    )
    assert code == 0, out
    assert "; parameters bfloat16" in out[1]
    assert json.loads((tmp_path / "again" / "runcard.json").read_text())["param_dtype"] == "bfloat16"
    code, _, err = _train(
        capsys,
        "--runcard",
        str(run / "runcard.json"),
        "--param-dtype",
        "float32",
        "--run-dir",
        str(tmp_path / "x"),
    )
    assert code == 2
    assert "--param-dtype float32 (the card has bfloat16)" in err[0]


def test_accum_dtype_on_float32_parameters_is_refused_naming_the_dtype(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = [
        "gradaccum train: error: --accum-dtype float32 widens the gradients of parameters narrower than "
        "float32, but the parameters are float32 (--param-dtype {}): it would do nothing. Train bfloat16 "
        "parameters (--param-dtype bfloat16, or a bfloat16 folder saved as it is), or leave out --accum-dtype"
    ]
    base = ["--data", str(files["data"]), *SEQ, "--accum-dtype", "float32", "--steps", "1"]
    code, out, err = _train(
        capsys, "--workload", f"hf:{files['f32']}", *base, "--run-dir", str(tmp_path / "a")
    )
    assert (code, out, err) == (2, [], [expected[0].format("saved")])  # refused before the banner
    argv = ["--workload", f"hf:{files['bf16']}", *base, "--param-dtype", "float32"]
    code, _, err = _train(capsys, *argv, "--run-dir", str(tmp_path / "b"))
    assert (code, err) == (2, [expected[0].format("float32")])


def test_param_dtype_stores_a_float32_folder_in_bfloat16(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    argv = [
        "--workload",
        f"hf:{files['f32']}",
        "--data",
        str(files["data"]),
        *SEQ,
        "--param-dtype",
        "bfloat16",
    ]
    code, out, _ = _train(capsys, *argv, "--eval-every", "1", "--steps", "1", "--run-dir", str(run))
    assert code == 0, out
    assert out[2].startswith(
        "1 process on cpu, precision float32 (compute), parameters bfloat16 (--param-dtype bfloat16), "
        "computing in bfloat16 (no autocast at precision float32); workload hf:"
    )
    assert _line(out, "evaluation:") == (
        "evaluation: 4 held-out rows of 40, never trained on; evaluated every 1 boundary and at the end, on "
        "64 examples drawn from them each time"
    )
    assert len([line for line in out if line.startswith("eval at step 1: loss ")]) == 1
    assert json.loads((run / "runcard.json").read_text())["param_dtype"] == "bfloat16"
