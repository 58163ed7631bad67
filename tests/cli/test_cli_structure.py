"""The command line's structure: no subcommand module imports another, and building the parser
(what ``gradaccum --help`` does) imports none of the measurement, training or plotting code."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import gradaccum.cli

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
    heavy = ["matplotlib", "gradaccum.bench", "gradaccum.train", "torch.distributed.checkpoint"]
    code = (
        "import sys\n"
        "from gradaccum.cli.main import build_parser\n"
        "build_parser().format_help()\n"
        f"print([m for m in {heavy!r} if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
