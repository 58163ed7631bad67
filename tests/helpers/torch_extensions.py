"""Where DeepSpeed's JIT-built CPU communication op is kept between runs (ignored by git): built by
the first run of a checkout (~30-50 s on a 2-core machine), loaded by every later one in under a
second, whatever HOME is (docs/integrations.md). A TORCH_EXTENSIONS_DIR already set is kept."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

EXTENSIONS = Path(__file__).resolve().parents[2] / "build" / "torch_extensions"


def kept_extensions() -> Iterator[None]:
    """The body of a module-scoped fixture: every process the module's tests start inherits it."""
    with pytest.MonkeyPatch.context() as patch:
        if "TORCH_EXTENSIONS_DIR" not in os.environ:
            patch.setenv("TORCH_EXTENSIONS_DIR", str(EXTENSIONS))
        yield
