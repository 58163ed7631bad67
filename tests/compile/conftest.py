"""Shared fixtures of the compile tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def aot_eager_default() -> Iterator[None]:
    """torch.compile's default backend set to ``aot_eager`` for one test: the commands compile
    through the default, and aot_eager builds no C++ on this machine (inductor takes ~45 s)."""
    torch.compiler.reset()
    torch.compiler.set_default_backend("aot_eager")
    yield
    torch.compiler.set_default_backend(None)
    torch.compiler.reset()
