"""What a fresh interpreter imports: the light paths (``--help``, ``import gradaccum``) must not load
the heavy modules."""

from __future__ import annotations

import ast
import subprocess
import sys


def loaded_after(snippet: str, modules: list[str]) -> list[str]:
    """Which of ``modules`` are in ``sys.modules`` after a fresh interpreter runs ``snippet``."""
    code = f"import sys\n{snippet}\nprint([m for m in {modules!r} if m in sys.modules])\n"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    found = ast.literal_eval(out.stdout.strip())
    assert isinstance(found, list)
    return [str(m) for m in found]
