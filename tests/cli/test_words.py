"""What the commands say: every option has help that shows its default, no internal jargon, no
Python reprs, and scan and ``verify --cached`` agree about in-batch negatives."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from gradaccum.cli.main import build_parser, main

README = Path(__file__).resolve().parents[2] / "README.md"


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


COMMANDS = _commands()


def _options(command: str) -> list[tuple[argparse.Action, str]]:
    parser = COMMANDS[command]
    formatter = parser._get_formatter()
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        out.append((action, formatter._expand_help(action) if action.help else ""))
    return out


def test_every_command_is_checked() -> None:
    assert set(COMMANDS) == {"accept", "audit", "bench", "plan", "scan", "train", "verify"}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_help_and_shows_its_default(command: str) -> None:
    missing_help, missing_default = [], []
    for action, text in _options(command):
        name = action.option_strings[-1] if action.option_strings else action.dest
        if not text.strip():
            missing_help.append(name)
        elif action.nargs != 0 and "default" not in text:
            missing_default.append(name)
    assert not missing_help, f"{command}: no help for {missing_help}"
    assert not missing_default, f"{command}: the help does not show the default of {missing_default}"


def test_verify_shows_every_default() -> None:
    for action, text in _options("verify"):
        if action.option_strings and action.nargs != 0:
            assert "default" in text, action.option_strings


@pytest.mark.parametrize("command", ["", *sorted(COMMANDS)])
def test_help_has_no_internal_jargon(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"] if command else ["--help"])
    text = capsys.readouterr().out
    # "the seeds" are this project's source documents, a word users never saw ("--seeds S" is a flag)
    assert "the seeds" not in text.lower() and "seeds'" not in text, text
    assert "None)" not in text and "(default: None" not in text, text


def test_the_readme_has_no_internal_jargon() -> None:
    assert "seeds' table" not in README.read_text()


def test_plan_without_arguments_explains_its_worked_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "a worked example of 25,600 sequences on 8 replicas (A = 8x8x4, B = 4x8x8, changed-batch = 4x8x1)"
        in text
    )


def test_scan_points_in_batch_negatives_at_the_gradient_cache(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scan", "--workload", "gradaccum.examples:contrastive"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "fix: step with gradaccum.CachedAccumulator(model, optimizer).step(window, encode_fn, loss_fn)"
        in text
    )
    assert "check it with `gradaccum verify --cached`" in text
    assert "gradaccum verify --workload gradaccum.examples:contrastive --cached" in text
    assert "1 finding breaks equivalence" in text and "finding(s)" not in text


def test_verify_cached_does_not_call_the_hazard_it_handles_an_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["verify", "--workload", "gradaccum.examples:contrastive", "--cached"]) == 0
    text = capsys.readouterr().out
    assert "verdict: PASS" in text
    assert "[error] declared-hazard" not in text


def test_train_prints_no_python_reprs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--steps", "2", "--run-dir", str(tmp_path / "run")]) == 0
    text = capsys.readouterr().out
    for python in ("None", "True", "False", "PosixPath(", "process(es)", "[", "{'"):
        assert python not in text, (python, text)
    assert not re.search(r"\b1 (boundaries|updates|steps)\b", text), text
