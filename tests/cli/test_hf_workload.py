"""``--workload hf:MODEL_DIR --data FILE``: a tiny local transformers model folder (config alone, and
config plus weights) and local .txt/.jsonl data, through verify, verify --packed, scan, accept,
bench and train; and every missing piece refused with exit 2 and a message, not a traceback.

The folders are built once per module in a temporary directory (tests/helpers/hf.py); nothing is
downloaded. accept measures in this process (its worker-process path is the bench test's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from gradaccum.check.workload import load_workload
from gradaccum.cli import cmd_accept
from gradaccum.cli.main import main
from gradaccum.errors import WorkloadError
from gradaccum.runcard import read_runcard
from gradaccum.workloads import HFSpec
from tests.cli.test_accept_cli import in_process_launching
from tests.helpers import hf

SEQ = ["--seq-len", "32"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    documents = hf.texts()
    bare = root / "no-tokenizer"
    bare.mkdir()
    (bare / "config.json").write_text("{}", encoding="utf-8")
    return {
        "config_only": hf.make_model_folder(root / "config-only", weights=False),
        "weights": hf.make_model_folder(root / "weights", weights=True),
        "no_tokenizer": bare,
        "txt": hf.write_txt(root / "docs.txt", documents),
        "jsonl": hf.write_jsonl(root / "docs.jsonl", documents, field="body"),
        "root": root,
    }


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_verify_config_only_folder_on_txt_passes(files: dict, capsys: pytest.CaptureFixture[str]) -> None:
    workload = f"hf:{files['config_only']}"
    code, out, _ = _run(
        capsys, "verify", "--workload", workload, "--data", str(files["txt"]), *SEQ, "--trace-steps", "2"
    )
    assert code == 0, out
    assert "verify hf:config-only: llama" in out and "config only, seeded init 0" in out
    assert "24 documents padded into 24 rows of 32 tokens" in out
    assert "tokens counted per micro-batch" in out and "verdict: PASS" in out


def test_verify_weights_folder_packed_document_normalization_passes(
    files: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--workload", f"hf:{files['weights']}", "--data", str(files["jsonl"]), "--text-field", "body"]
    code, out, _ = _run(
        capsys,
        "verify",
        *args,
        *SEQ,
        "--pack",
        "--normalization",
        "document",
        "--sizes",
        "1,3,4",
        "--trace-steps",
        "0",
    )
    assert code == 0, out
    assert "(weights)" in out and "packed into" in out
    assert "documents counted per micro-batch" in out and "verdict: PASS" in out


@pytest.mark.parametrize("normalization", ["token", "document"])
def test_verify_packed_agrees(files: dict, capsys: pytest.CaptureFixture[str], normalization: str) -> None:
    args = ["--workload", f"hf:{files['weights']}", "--data", str(files["txt"]), *SEQ]
    code, out, _ = _run(capsys, "verify", *args, "--packed", "--normalization", normalization)
    assert code == 0, out
    assert f"packed vs padded, full batch ({normalization} normalization: same update expected)" in out
    assert "packed and padded agree" in out and "verdict: PASS" in out


def test_verify_packed_shows_sequence_normalization_differs(
    files: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--workload", f"hf:{files['weights']}", "--data", str(files["txt"]), *SEQ]
    code, out, _ = _run(capsys, "verify", *args, "--packed", "--normalization", "sequence")
    assert code == 0, out
    assert "a different update expected" in out and "as sequence normalization must" in out


def test_scan_reads_the_default_seq_len_from_the_model(
    files: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    # no --seq-len: 128 is longer than the model's 64 positions, so the rows are 64 long
    code, out, _ = _run(capsys, "scan", "--workload", f"hf:{files['weights']}", "--data", str(files["txt"]))
    assert code == 0, out
    assert "scan of hf:weights (LlamaForCausalLM" in out


def test_accept_end_to_end_writes_a_card_that_rebuilds_the_workload(
    files: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cmd_accept, "make_launching", in_process_launching)
    data = [
        "--data",
        str(files["jsonl"]),
        "--text-field",
        "body",
        *SEQ,
        "--pack",
        "--normalization",
        "document",
    ]
    fast = ["--steps", "4", "--block-updates", "1", "--warmup", "1", "--trace-steps", "2", "--no-progress"]
    args = [
        "accept",
        "--workload",
        f"hf:{files['weights']}",
        *data,
        "--baseline",
        "4x2",
        "--candidate",
        "2x4",
    ]
    code, out, _ = _run(capsys, *args, "--out-dir", str(tmp_path), *fast)
    (folder,) = tmp_path.iterdir()
    results = json.loads((folder / "results.json").read_text())
    assert code == (3 if results["verdict"]["decision"] == "INCONCLUSIVE" else 0), out
    criteria = results["verdict"]["criteria"]
    assert all(c["passed"] for c in criteria[:5]), criteria  # all but the machine-dependent gain
    assert "documents/s" in criteria[5]["figure"]
    card = read_runcard(folder / "runcard.json")
    spec = HFSpec.parse(card.workload)
    assert spec.model_dir == str(files["weights"]) and spec.data == str(files["jsonl"])
    assert (spec.text_field, spec.seq_len, spec.pack, spec.normalization) == ("body", 32, True, "document")
    workload = load_workload(card.workload)
    assert workload.unit == "documents" and workload.extras["layout"].position_ids is not None


@pytest.mark.slow
def test_bench_measures_in_a_fresh_worker_process(
    files: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "--workload", f"hf:{files['config_only']}", "--data", str(files["txt"]), *SEQ]
    sweep = ["--global-batch", "4", "--configs", "2x2", "--runs", "1", "--steps", "1", "--warmup", "1"]
    code, out, _ = _run(capsys, *args, *sweep, "--no-progress", "--out-dir", str(tmp_path))
    assert code == 0, out
    (folder,) = tmp_path.iterdir()
    results = json.loads((folder / "results.json").read_text())
    (run,) = results["runs"]
    assert run["measurement"]["fresh_process"] and run["status"] == "ok"
    assert results["spec"]["workload"].startswith(f"hf:{files['config_only']}?data=")


def test_train_a_few_steps(files: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["train", "--workload", f"hf:{files['weights']}", "--data", str(files["txt"]), *SEQ, "--pack"]
    run = ["--steps", "2", "--global-batch", "4", "--micro-batch", "2", "--device", "cpu"]
    code, out, err = _run(capsys, *args, *run, "--run-dir", str(tmp_path / "run"))
    assert code == 0, out + err
    assert "completed: 2 boundaries, 2 updates applied" in out
    card = json.loads((tmp_path / "run" / "runcard.json").read_text())
    assert card["workload"].startswith("hf:") and "pack=1" in card["workload"]
    # packed, the 24 documents fill 7 rows: too few to split, and the run says so
    assert "evaluation: none held out, 7 rows are too few to split (evaluation is refused)" in out
    assert card["extra"]["evaluation"] == {
        "held_out_rows": 0,
        "rows": 7,
        "summary": "evaluation: none held out, 7 rows are too few to split (evaluation is refused)",
    }


def test_train_says_and_records_the_held_out_rows(
    files: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["train", "--workload", f"hf:{files['config_only']}", "--data", str(files["txt"]), *SEQ]
    run = ["--steps", "1", "--global-batch", "2", "--micro-batch", "2", "--eval-every", "1"]
    code, out, err = _run(capsys, *args, *run, "--run-dir", str(tmp_path / "run"))
    assert code == 0, out + err
    words = "evaluation: 2 held-out rows of 24, never trained on"  # one padded document per row
    assert words in " ".join(out.split())
    card = json.loads((tmp_path / "run" / "runcard.json").read_text())
    assert card["extra"]["evaluation"] == {"held_out_rows": 2, "rows": 24, "summary": words}


def _bad(files: dict, case: str) -> list[str]:
    txt, weights = str(files["txt"]), f"hf:{files['weights']}"
    bad_jsonl = files["root"] / "bad.jsonl"
    bad_jsonl.write_text('{"body": "a b"}\n{"title": "no text"}\n', encoding="utf-8")
    csv = files["root"] / "docs.csv"
    csv.write_text("a,b\n", encoding="utf-8")
    return {
        "missing data": ["--workload", weights, "--data", str(files["root"] / "nope.txt")],
        "no data": ["--workload", weights],
        "missing folder": ["--workload", f"hf:{files['root'] / 'nowhere'}", "--data", txt],
        "no tokenizer": ["--workload", f"hf:{files['no_tokenizer']}", "--data", txt],
        "missing field": ["--workload", weights, "--data", str(bad_jsonl), "--text-field", "body"],
        "wrong suffix": ["--workload", weights, "--data", str(csv)],
        "too long": ["--workload", weights, "--data", txt, "--seq-len", "100"],
        "data without hf": ["--data", txt],
    }[case]


BAD = {
    "missing data": "nope.txt' does not exist; --data takes a local .txt or .jsonl",
    "no data": "needs a data file: add --data FILE",
    "missing folder": "nowhere' does not exist; --workload hf:MODEL_DIR names a local folder",
    "no tokenizer": "has no tokenizer (none of tokenizer.json",
    "missing field": "bad.jsonl:2 has no field 'body' (its fields: title); name the text field with "
    "--text-field",
    "wrong suffix": "ends in '.csv'; --data reads .txt",
    "too long": "--seq-len 100 is longer than the model's max_position_embeddings=64",
    "data without hf": "--data describes the data of an hf: workload, but the workload is "
    "gradaccum.examples:tiny_gpt",
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_exits_2_with_the_setting_and_the_fix(
    files: dict, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, "verify", *_bad(files, case), "--trace-steps", "0")
    assert code == 2, out + err
    assert BAD[case] in err, err
    assert "Traceback" not in err + out


def test_without_transformers_the_error_names_the_extra(
    files: dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    code, _, err = _run(capsys, "verify", "--workload", f"hf:{files['weights']}", "--data", str(files["txt"]))
    assert code == 2
    assert "needs transformers and tokenizers" in err and "pip install 'gradaccum[transformers]'" in err


def test_the_spec_round_trips_any_path() -> None:
    spec = HFSpec(model_dir="/tmp/a dir?x=1&y", data="/tmp/d&ata %20.jsonl", seq_len=12, pack=True)
    assert HFSpec.parse(spec.to_spec()) == spec
    assert HFSpec.parse("hf:/m") == HFSpec(model_dir="/m")
    with pytest.raises(WorkloadError, match=r"unknown setting\(s\) \['seqlen'\]"):
        HFSpec.parse("hf:/m?seqlen=3")


def test_held_out_rows_are_never_trained_on_and_the_split_is_said(files: dict) -> None:
    spec = HFSpec(model_dir=str(files["config_only"]), data=str(files["txt"]), seq_len=32)
    workload = load_workload(spec.to_spec())
    assert "22 rows to train on, 2 held out for evaluation" in workload.description
    assert (workload.extras["train_rows"], workload.extras["held_out_rows"]) == (22, 2)
    rows = {tuple(r) for r in workload.extras["layout"].batch["input_ids"].tolist()}
    trained = {tuple(r) for s in range(40) for r in workload.make_batch(8, s)["input_ids"].tolist()}
    held = {tuple(r) for s in range(40) for r in workload.make_batch.held_out(8, s)["input_ids"].tolist()}
    assert len(trained) == 22 and len(held) == 2 and not trained & held and trained | held == rows


def test_a_file_too_small_to_split_refuses_evaluation(
    files: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # packed, the 24 documents fill 7 rows: too few to hold any out
    args = ["train", "--workload", f"hf:{files['config_only']}", "--data", str(files["txt"]), *SEQ, "--pack"]
    run = ["--steps", "2", "--global-batch", "4", "--micro-batch", "2", "--eval-every", "1"]
    code, out, err = _run(capsys, *args, *run, "--run-dir", str(tmp_path / "run"))
    assert code == 2, out + err
    assert "holds 7 rows, too few to hold any out for evaluation" in err and "Traceback" not in err


def test_a_micro_batch_larger_than_the_file_is_refused(
    files: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["train", "--workload", f"hf:{files['config_only']}", "--data", str(files["txt"]), *SEQ]
    run = ["--steps", "2", "--global-batch", "64", "--micro-batch", "64"]
    code, out, err = _run(capsys, *args, *run, "--run-dir", str(tmp_path / "run"))
    assert code == 2, out + err
    assert "a batch of 64 examples from docs.txt, which holds 22 rows to train on, repeats rows" in err
    assert "Ask for at most 22 examples per window" in err


def test_verify_on_a_one_document_file_says_the_check_is_weak_and_why(
    files: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    one = hf.write_txt(files["root"] / "one.txt", ["alpha beta gamma delta"])
    args = ["verify", "--workload", f"hf:{files['config_only']}", "--data", str(one), *SEQ]
    code, out, _ = _run(capsys, *args, "--trace-steps", "0")
    assert code == 0, out
    assert "weak check: every micro-batch counts the same number of tokens" in out
    assert "which holds 1 row to train on, repeats rows (about 8.0 times each)" in out
    assert "verdict: PASS (a weak check: see above)" in out


def test_a_field_of_the_wrong_type_is_named_with_its_article(tmp_path: Path) -> None:
    from gradaccum.workloads.data import read_documents

    bad = tmp_path / "ints.jsonl"
    bad.write_text('{"text": 3}\n', encoding="utf-8")
    with pytest.raises(WorkloadError, match="field 'text' holds an int, not text"):
        read_documents(str(bad), text_field="text")
