"""Test hygiene: fixed seeds, restored environment, no process group left behind."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _seeded() -> Iterator[None]:
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    saved = dict(os.environ)
    default_dtype = torch.get_default_dtype()
    yield
    os.environ.clear()
    os.environ.update(saved)
    torch.set_default_dtype(default_dtype)


@pytest.fixture(autouse=True)
def _no_process_group_left() -> Iterator[None]:
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
