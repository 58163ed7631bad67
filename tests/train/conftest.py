"""Training tests run tiny models: one intra-op thread avoids contention on a shared 2-core machine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.train.common import one_thread


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield
