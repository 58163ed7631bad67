"""The command line's structure: no subcommand module imports another, and building the parser
(what ``gradaccum --help`` does) imports neither torch nor the measurement, training or plotting
code."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import gradaccum.cli
from tests.helpers.imports import loaded_after

CLI = Path(gradaccum.cli.__file__).parent


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_subcommand_module_imports_another() -> None:
    commands = sorted(CLI.glob("cmd_*.py"))
    assert len(commands) >= 6
    for path in commands:
        others = {i for i in _imports(path) if ".cli.cmd_" in i or i.startswith("gradaccum.cli.main")}
        assert not others, f"{path.name} imports {sorted(others)}; shared code belongs in cli/common.py"


def test_help_imports_no_measurement_training_or_plotting_code() -> None:
    # gradaccum.train is a lazy package: the parser reads the torch-free gradaccum.train.spec (the
    # defaults of TrainSpec), never the loop, the checkpoints or the resolver
    heavy = [
        "matplotlib",
        "gradaccum.bench",
        "gradaccum.train.loop",
        "gradaccum.train.checkpoint",
        "gradaccum.train.resolve",
        "torch.distributed.checkpoint",
    ]
    snippet = "from gradaccum.cli.main import build_parser\nbuild_parser().format_help()"
    assert loaded_after(snippet, heavy) == []


def _subcommands() -> list[str]:
    from gradaccum.cli.main import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(action.choices)


def test_every_help_imports_no_torch() -> None:
    """``gradaccum --help`` and ``gradaccum CMD --help`` for every subcommand, each in a fresh
    interpreter: torch is never imported (a help costs the interpreter's start, not torch's)."""
    commands = _subcommands()
    assert len(commands) >= 6
    for argv in ([], *([c] for c in commands)):
        code = (
            "import sys\n"
            "from gradaccum.cli.main import build_parser\n"
            "try:\n"
            f"    build_parser().parse_args({[*argv, '--help']!r})\n"
            "except SystemExit as exc:\n"
            "    assert exc.code == 0, exc.code\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
        )
        assert "usage: gradaccum" in out.stdout, out.stdout
        assert out.stdout.strip().splitlines()[-1] == "[]", f"gradaccum {' '.join(argv)} --help: {out.stdout}"


def test_the_torch_free_dtype_choices_are_the_declared_tolerances() -> None:
    """``verify --dtype``/``--trace-dtype`` list names from gradaccum.names (no torch at --help):
    exactly the dtypes the tolerance tables declare."""
    from gradaccum.check.tolerances import GRAD_TOLERANCES, PARAM_TOLERANCES, TRACE_TOLERANCES
    from gradaccum.names import TRACE_DTYPES, VERIFY_DTYPES
    from gradaccum.precision import dtype_name

    assert tuple(dtype_name(d) for d in GRAD_TOLERANCES) == VERIFY_DTYPES
    assert tuple(dtype_name(d) for d in PARAM_TOLERANCES) == VERIFY_DTYPES
    assert tuple(dtype_name(d) for d in TRACE_TOLERANCES) == TRACE_DTYPES
