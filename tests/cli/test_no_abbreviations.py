"""No parser of the command line takes a shortened flag: ``--max-token`` is refused (exit 2, naming
the flag it may have meant), never read as ``--max-tokens``. The test walks every subcommand's
parser and every long flag, so a command added later is checked too."""

from __future__ import annotations

import argparse

import pytest

from gradaccum.cli.main import build_parser, main


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(found) == 1
    return dict(found[0].choices)


def _cases() -> list[tuple[str, str]]:
    cases = []
    for name, sub in _subparsers(build_parser()).items():
        flags = {f for action in sub._actions for f in action.option_strings if f.startswith("--")}
        cases += [(name, flag[:-1]) for flag in sorted(flags) if len(flag) > 4 and flag[:-1] not in flags]
    return cases


def test_every_parser_refuses_abbreviations() -> None:
    parser = build_parser()
    assert parser.allow_abbrev is False
    for name, sub in _subparsers(parser).items():
        assert sub.allow_abbrev is False, name


@pytest.mark.parametrize(("command", "prefix"), _cases(), ids=lambda x: x)
def test_a_prefix_of_a_flag_is_left_unrecognized(command: str, prefix: str) -> None:
    sub = _subparsers(build_parser())[command]
    positional = ["8x4"] if command == "plan" else []  # plan's one required argument
    _, unknown = sub.parse_known_args([f"{prefix}=1", *positional])
    assert unknown == [f"{prefix}=1"]


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["train", "--max-token", "100"], "--max-token: did you mean --max-tokens?"),
        (["verify", "--micro", "2"], "--micro: did you mean --micro-batch?"),
        (["bench", "--global", "8"], "--global: did you mean --global-batch?"),
    ],
)
def test_the_command_exits_2_naming_the_flag_meant(
    argv: list[str], hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"gradaccum {argv[0]}: error: unrecognized arguments: {' '.join(argv[1:])}")
    assert last.endswith(f"(flags are not abbreviated; {hint})")
