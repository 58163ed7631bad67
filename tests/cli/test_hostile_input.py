"""Item 12, command-line side: hostile input exits 2 with a message that names the problem, and
writes nothing half-way.

Every subcommand that takes ``--workload`` is driven with malformed paths and with workloads that
raise or return bad values. The workload factories below are importable as
``tests.cli.test_hostile_input:NAME``, the way a user's own module would be.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gradaccum import Workload
from gradaccum.cli.main import main
from tests.helpers import models

HERE = "tests.cli.test_hostile_input"

# -- workloads that go wrong ---------------------------------------------------------------------


def _workload(**overrides: Any) -> Workload:
    fields: dict[str, Any] = {
        "name": "hostile-mlp",
        "build_model": models.mlp,
        "make_batch": lambda n, seed: models.mlp_batch(n, seed=seed + 1),
        "loss_fn": models.mlp_loss,
        "count_fn": models.count_rows,
        "batch_size": 8,
        "micro_batch": 2,
        "unit": "examples",
    }
    fields.update(overrides)
    return Workload(**fields)


def factory_raises() -> Workload:
    raise RuntimeError("the workload factory exploded")


def not_a_workload() -> int:
    return 42


def bad_field() -> Workload:
    return _workload(micro_batch=0)


def model_raises() -> Workload:
    def build() -> torch.nn.Module:
        raise RuntimeError("cannot build the model")

    return _workload(build_model=build)


def float_counts() -> Workload:
    return _workload(count_fn=lambda mb: 2.5)


def negative_counts() -> Workload:
    return _workload(count_fn=lambda mb: -1)


def vector_loss() -> Workload:
    return _workload(loss_fn=lambda m, mb: ((m(mb["x"]) - mb["y"]) ** 2).sum(dim=1))


def float_labels() -> Workload:
    from gradaccum.loss import count_tokens

    return _workload(
        make_batch=lambda n, seed: {**models.mlp_batch(n, seed=seed + 1), "labels": torch.zeros(n, 3)},
        count_fn=count_tokens("labels", shift=False),
    )


# -- the commands --------------------------------------------------------------------------------


def _commands() -> list[str]:
    from gradaccum.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sorted(name for name, p in sub.choices.items() if any(a.dest == "workload" for a in p._actions))


WORKLOAD_COMMANDS = _commands()
# Output locations of the commands that write: nothing may appear there after a refusal.
OUTPUT_FLAGS = {"train": "--run-dir", "accept": "--out-dir", "bench": "--out-dir"}
# The smallest run of the measuring commands, so that a command that fails late still fails fast;
# --timeout bounds each worker process well inside pytest's per-test timeout.
QUICK = {
    "accept": [
        "--runs",
        "3",
        "--steps",
        "4",
        "--block-updates",
        "1",
        "--warmup",
        "0",
        "--trace-steps",
        "1",
        "--timeout",
        "60",
    ],
    "bench": ["--global-batch", "8", "--configs", "8x1", "--runs", "1", "--steps", "1", "--timeout", "60"],
    "train": ["--steps", "2", "--global-batch", "8", "--micro-batch", "2"],
}

MALFORMED = [
    ("gradaccum.examples", "MODULE:FUNCTION"),
    ("a:b:c", "MODULE:FUNCTION"),
    (":tiny_gpt", "MODULE:FUNCTION"),
    ("no_such_module_gradaccum:build", "cannot import workload module 'no_such_module_gradaccum'"),
    ("gradaccum.examples:no_such_function", "has no callable 'no_such_function'"),
    (f"{HERE}:factory_raises", "raised RuntimeError: the workload factory exploded"),
    (f"{HERE}:not_a_workload", "returned int; it must return gradaccum.Workload"),
    (f"{HERE}:bad_field", "micro_batch must be a positive integer, got 0"),
]


def _malformed_cases() -> list[Any]:
    return [
        pytest.param(command, spec, says, id=f"{command}-{spec}")
        for command in WORKLOAD_COMMANDS
        for spec, says in MALFORMED
    ]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    except Exception as exc:  # an unhandled exception is a failure of this test, with its text
        code = -1
        captured = capsys.readouterr()
        return code, f"{type(exc).__name__}: {exc}\n{captured.err}{captured.out}"
    captured = capsys.readouterr()
    return code, captured.err + captured.out


def _with_output(command: str, argv: list[str], tmp_path: Path) -> tuple[list[str], Path | None]:
    argv = [*argv, *QUICK.get(command, [])]
    flag = OUTPUT_FLAGS.get(command)
    if flag is None:
        return argv, None
    out = tmp_path / "out"
    return [*argv, flag, str(out)], out


def test_every_workload_command_is_covered() -> None:
    assert {"verify", "scan", "train"} <= set(WORKLOAD_COMMANDS)


@pytest.mark.parametrize(("command", "spec", "says"), _malformed_cases())
def test_malformed_workloads_exit_2_naming_the_problem_and_write_nothing(
    command: str, spec: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, out = _with_output(command, [command, "--workload", spec], tmp_path)
    code, text = _run(argv, capsys)
    assert code == 2, text
    assert says in " ".join(text.split()), text  # rich may wrap long lines
    if out is not None:
        assert not out.exists() or not any(out.iterdir()), sorted(out.rglob("*"))


@pytest.mark.parametrize("command", WORKLOAD_COMMANDS)
def test_a_workload_spec_with_colons_is_printed_as_written(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, _ = _with_output(command, [command, "--workload", "a:b:c"], tmp_path)
    code, text = _run(argv, capsys)
    assert code == 2, text
    assert "'a:b:c'" in text, text  # rich's emoji codes would print ":b:" as a symbol


def test_the_shared_console_prints_user_text_without_emoji_codes() -> None:
    from gradaccum.cli.common import console

    with console.capture() as captured:
        console.print("workload a:b:c, :smile:")
    assert "workload a:b:c, :smile:" in captured.get()


# Workloads that load but fail when run: the message must name the problem (these fragments).
RUNTIME = {
    "model_raises": ("cannot build the model",),
    "float_counts": ("count_fn", "2.5"),
    "negative_counts": ("count_fn", "-1"),
    "vector_loss": ("loss_fn", "scalar"),
    "float_labels": ("labels", "integer"),
}


def _says_all(text: str, fragments: tuple[str, ...]) -> bool:
    flat = " ".join(text.split())
    return all(f in flat for f in fragments)


@pytest.mark.parametrize("name", sorted(RUNTIME))
def test_verify_with_a_workload_that_fails_at_run_time_exits_2_naming_the_problem(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text = _run(["verify", "--workload", f"{HERE}:{name}", "--trace-steps", "0"], capsys)
    assert code == 2, text
    assert _says_all(text, RUNTIME[name]), text


@pytest.mark.parametrize("name", sorted(RUNTIME))
def test_train_with_a_workload_that_fails_at_run_time_exits_2_and_writes_nothing(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", "--workload", f"{HERE}:{name}", *QUICK["train"], "--run-dir", str(run_dir)]
    code, text = _run(argv, capsys)
    assert code == 2, text
    assert _says_all(text, RUNTIME[name]), text
    assert not run_dir.exists() or not any(run_dir.iterdir()), sorted(run_dir.rglob("*"))


# -- plan: sizes that are zero, negative or not numbers ------------------------------------------

PLAN_INPUT = [
    (["plan", "0x4x2"], "plan 0x4x2: MICRO must be at least 1, got 0"),
    (["plan", "4x2x0"], "plan 4x2x0: ACCUM must be at least 1, got 0"),
    (["plan", "-4x2x2"], "unrecognized arguments: -4x2x2"),  # argparse reads it as an option
    (["plan", "4x2x"], "MICROxDPxACCUM"),
    (["plan", "2.5x2"], "MICROxDPxACCUM"),
    (["plan", "--seq-len", "0"], "argument --seq-len: expected an integer >= 1, got 0"),
    (["plan", "--seq-len", "-3"], "argument --seq-len: expected an integer >= 1, got -3"),
    (["plan", "--dataset-size", "-1"], "argument --dataset-size: expected an integer >= 0, got -1"),
    (["plan", "--seq-len", "many"], "argument --seq-len: expected an integer, got 'many'"),
    (["plan", "A=4x2x2", "A=8x1x2"], "plan names must be unique; A is given more than once"),
]


@pytest.mark.parametrize(("argv", "says"), PLAN_INPUT, ids=[" ".join(a[1:]) for a in PLAN_INPUT])
def test_plan_hostile_sizes_exit_2_naming_the_problem(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text = _run(argv, capsys)
    assert code == 2, text
    assert says in " ".join(text.split()), text


def test_train_with_a_runcard_truncated_exits_2_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    card = tmp_path / "card.json"
    card.write_text('{"format_version": 1, "workload": "gradaccum.exa')
    run_dir = tmp_path / "run"
    code, text = _run(["train", "--runcard", str(card), "--run-dir", str(run_dir)], capsys)
    assert code == 2, text
    assert "not valid JSON (truncated?)" in " ".join(text.split()), text
    assert not run_dir.exists() or not any(run_dir.iterdir())


# -- every command: flags and values that are refused before any work -----------------------------

FILE = "a-file"  # created in the test's working directory before the command runs
QUICK_ACCEPT = QUICK["accept"]

_HOSTILE_LINES = [
    # train
    ("train --steps 0", "argument --steps: expected an integer >= 1, got 0"),
    ("train --steps many", "argument --steps: expected an integer, got 'many'"),
    ("train --tokens -5", "argument --tokens: expected an integer >= 1, got -5"),
    ("train --micro-batch 0", "argument --micro-batch: expected an integer >= 1, got 0"),
    ("train --global-batch 30 --micro-batch 8", "the nearest reachable global batches are 24 or 32"),
    ("train --lr -1", "argument --lr: expected a finite number > 0, got -1"),
    ("train --lr nan", "argument --lr: expected a finite number > 0, got nan"),
    ("train --weight-decay -0.1", "argument --weight-decay: expected a finite number >= 0, got -0.1"),
    ("train --min-lr-ratio 2", "argument --min-lr-ratio: expected a fraction from 0 to 1, got 2"),
    ("train --warmup 50 --horizon 10", "--warmup 50 is longer than --horizon 10 (steps)"),
    ("train --optimizer lamb", "argument --optimizer: invalid choice: 'lamb'"),
    ("train --keep-checkpoints 0", "argument --keep-checkpoints: expected an integer >= 1, got 0"),
    ("train --checkpoint-every -1", "argument --checkpoint-every: expected an integer >= 0, got -1"),
    ("train --checkpoint-minutes -1", "argument --checkpoint-minutes: expected a finite number >= 0"),
    ("train --eval-examples 0", "argument --eval-examples: expected an integer >= 1, got 0"),
    ("train --threads 0", "argument --threads: expected an integer >= 1, got 0"),
    ("train --seed -1", "argument --seed: expected an integer >= 0, got -1"),
    ("train --device banana", "--device banana is not a device; use auto, cpu, cuda or cuda:N"),
    ("train --resume nowhere", "no checkpoint at nowhere"),
    ("train --resume auto", "--resume auto found no run folder with an intact checkpoint under runs/"),
    ("train --runcard missing.json", "cannot read run card missing.json"),
    (f"train --run-dir {FILE}", f"argument --run-dir: {FILE} is a file, not a folder"),
    (f"train --run-dir {FILE}/run", f"argument --run-dir: {FILE} is a file, not a folder"),
    # scan
    ("scan --accum-steps 0", "argument --accum-steps: expected an integer >= 1, got 0"),
    ("scan --micro-batch 3", "--micro-batch 3 does not divide the batch of 8 examples"),
    # verify
    ("verify --micro-batch 3", "--micro-batch 3 does not divide the batch of 8 examples"),
    ("verify --sizes 1,2", "--sizes 1,2 sums to 3"),
    ("verify --sizes a,b", "--sizes takes comma-separated positive integers"),
    ("verify --trace-steps 999", "--trace-steps 999 is longer than"),
    ("verify --device banana", "--device 'banana' is not a device"),
    ("verify --dtype int8", "argument --check-precision/--dtype: invalid choice: 'int8'"),
    ("verify --cached", "cannot run through a gradient cache: its extras lack encode_fn and rep_loss_fn"),
    # bench
    ("bench --global-batch 0", "argument --global-batch: expected an integer >= 1, got 0"),
    ("bench --configs 3x2 --global-batch 8", "must reach global batch 8 on dp=1"),
    ("bench --configs ,", "--configs ',' names no configuration"),
    ("bench --memory-budget lots", "a memory size is a number with an optional unit"),
    ("bench --runs 0", "argument --runs: expected an integer >= 1, got 0"),
    ("bench --dp 0", "argument --dp: expected an integer >= 1, got 0"),
    ("bench --device banana", "--device must be auto, cpu, cuda or cuda:N, got 'banana'"),
    ("bench --timeout 0", "argument --timeout: expected a finite number > 0, got 0"),
    ("bench --bucket-cap-mb -1", "argument --bucket-cap-mb: expected a finite number > 0, got -1"),
    (f"bench --out-dir {FILE}", f"argument --out-dir: {FILE} is a file, not a folder"),
    # accept
    ("accept --baseline 8x4 --candidate 4x4", "baseline 8x4 has global batch 32"),
    ("accept --baseline 0x4", "plan 0x4: MICRO must be at least 1, got 0"),
    ("accept --candidate 4by8", "a plan is written MICROxACCUM (e.g. 4x8) or MICROxDPxACCUM"),
    ("accept --precision int8", "argument --precision: invalid choice: 'int8'"),
    ("accept --threads 0", "argument --threads: expected an integer >= 1, got 0"),
    ("accept --warmup -1", "argument --warmup: expected an integer >= 0, got -1"),
    (f"accept --out-dir {FILE}", f"argument --out-dir: {FILE} is a file, not a folder"),
    ("accept --runs 2", "argument --runs: expected an integer >= 3, got 2"),
    ("accept --margin -1", "argument --margin: expected a finite number >= 0, got -1"),
    ("accept --trace-steps 0", "argument --trace-steps: expected an integer >= 1, got 0"),
    # plan (sizes are in PLAN_INPUT above)
    ("plan --final-window sometimes", "argument --final-window: invalid choice: 'sometimes'"),
]
HOSTILE = [(line.split(), says) for line, says in _HOSTILE_LINES]
"""Command lines (split at spaces) that every command must refuse, and what its message says."""


def _quick(argv: list[str]) -> list[str]:
    """The quick settings of ``argv``'s command, less the flags ``argv`` sets itself."""
    pairs = QUICK[argv[0]]
    return [
        x
        for flag, value in zip(pairs[::2], pairs[1::2], strict=True)
        if flag not in argv
        for x in (flag, value)
    ]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The command's working directory, fresh: what it writes by a relative path lands here."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _hostile_id(value: object) -> str | None:
    return " ".join(value) if isinstance(value, list) else "-"


@pytest.mark.parametrize(("argv", "says"), HOSTILE, ids=_hostile_id)
def test_every_command_refuses_bad_input_with_exit_2_a_message_and_nothing_left_behind(
    argv: list[str], says: str, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (workdir / FILE).write_text("not a folder\n")
    quick = _quick(argv) if argv[0] in ("accept", "bench") else []
    code, text = _run([*argv, *quick], capsys)
    assert code == 2, text
    assert says in " ".join(text.split()), text
    assert "Traceback" not in text and "Error:" not in text.replace("error:", ""), text
    assert sorted(p.name for p in workdir.iterdir()) == [FILE], "nothing written"


# -- out of memory anywhere in a command: exit 1, the configuration and what to try -----------------


def oom_loss() -> Workload:
    def loss(model: torch.nn.Module, mb: Any) -> torch.Tensor:
        torch.empty(2**62, dtype=torch.uint8)  # the host refuses: a real allocation failure
        return models.mlp_loss(model, mb)

    return _workload(loss_fn=loss)


def oom_model() -> Workload:
    def build() -> torch.nn.Module:
        torch.empty(2**62, dtype=torch.uint8)
        return models.mlp()

    return _workload(build_model=build)


def cuda_oom_loss() -> Workload:
    def loss(model: torch.nn.Module, mb: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.20 GiB")

    return _workload(loss_fn=loss)


OOM = [
    (["train", "--workload", f"{HERE}:oom_loss", *QUICK["train"]], "a smaller --micro-batch"),
    (["train", "--workload", f"{HERE}:cuda_oom_loss", *QUICK["train"]], "a smaller --micro-batch"),
    (
        ["verify", "--workload", f"{HERE}:oom_loss", "--micro-batch", "2"],
        "a smaller --micro-batch or --sizes",
    ),
    (["verify", "--workload", f"{HERE}:cuda_oom_loss"], "a smaller --micro-batch or --sizes"),
    (["scan", "--workload", f"{HERE}:oom_model"], "a smaller model in the workload"),
    (
        [
            "accept",
            "--workload",
            f"{HERE}:oom_loss",
            "--baseline",
            "8x1",
            "--candidate",
            "4x2",
            *QUICK_ACCEPT,
        ],
        "a baseline and candidate with a smaller MICRO",
    ),
]


@pytest.mark.parametrize(("argv", "advice"), OOM, ids=_hostile_id)
def test_out_of_memory_exits_1_naming_the_configuration_and_what_to_try(
    argv: list[str], advice: str, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text = _run([*argv, *(["--run-dir", "run"] if argv[0] == "train" else [])], capsys)
    flat = " ".join(text.split())
    assert code == 1, text
    assert f"gradaccum {argv[0]}: failed: out of memory (" in flat, flat
    assert f"with --workload {argv[2]}" in flat
    assert f"Try {advice}" in flat and "activation checkpointing in the workload's model" in flat
    assert "Traceback" not in text
    assert not (workdir / "run").exists() or not any((workdir / "run").iterdir())


def test_a_workload_beside_the_caller_is_found_and_a_missing_one_says_where_it_looked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mywork_beside.py").write_text(
        "from tests.cli.test_hostile_input import _workload\n\ndef build():\n    return _workload()\n"
    )
    code, text = _run(["scan", "--workload", "mywork_beside:build"], capsys)
    assert code == 0, text
    code, text = _run(["scan", "--workload", "mywork_elsewhere:build"], capsys)
    assert code == 2, text
    flat = " ".join(text.split())
    assert "cannot import workload module 'mywork_elsewhere': No module named 'mywork_elsewhere'" in flat
    assert (
        f"(looked in the current directory {tmp_path} and on the import path: run from the folder that "
        "holds mywork_elsewhere.py, or add that folder to PYTHONPATH)"
    ) in flat
