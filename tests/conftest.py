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


# variables set outside a test's control (as Lightning Fabric's conftest allows them): pytest's own
# record of the running test, torch on its first CUDA call, torch.compile's caches, and inductor's
# loader of compiled C++ kernels (it sets a pointer for them in os.environ at every load)
_LEAKS_ALLOWED = frozenset(
    {
        "PYTEST_CURRENT_TEST",
        "CUDA_MODULE_LOADING",
        "TORCHINDUCTOR_CACHE_DIR",
        "TRITON_CACHE_DIR",
        "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
    }
)


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    """Restore the environment and the default dtype after each test, and fail the test that
    changed an environment variable (use ``monkeypatch.setenv``/``delenv``, which undo themselves
    before this check), naming what it added, changed and removed."""
    saved = dict(os.environ)
    default_dtype = torch.get_default_dtype()
    yield
    now = dict(os.environ)
    os.environ.clear()
    os.environ.update(saved)
    torch.set_default_dtype(default_dtype)
    added = sorted(now.keys() - saved.keys() - _LEAKS_ALLOWED)
    changed = sorted(k for k in now.keys() & saved.keys() if now[k] != saved[k] and k not in _LEAKS_ALLOWED)
    removed = sorted(saved.keys() - now.keys() - _LEAKS_ALLOWED)
    leaks = [
        f"{what} {names}"
        for what, names in (("added", added), ("changed", changed), ("removed", removed))
        if names
    ]
    if leaks:
        pytest.fail(
            f"the test leaked environment variables ({'; '.join(leaks)}); they were restored. Use "
            "monkeypatch.setenv/delenv, or set them in a child process's env",
            pytrace=False,
        )


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
