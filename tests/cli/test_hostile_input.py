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
        count_fn=count_tokens("labels"),
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
    "accept": ["--runs", "3", "--steps", "1", "--warmup", "0", "--trace-steps", "1", "--timeout", "60"],
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
