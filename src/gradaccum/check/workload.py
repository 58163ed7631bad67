"""Loading a workload: ``--workload MODULE:FUNCTION`` imports the module and calls the function,
``--workload hf:MODEL_DIR`` builds one from files (:mod:`gradaccum.workloads`).

The function is called with no arguments and returns a :class:`Workload`
(:mod:`gradaccum.workloads.base`, re-exported here). The bundled ones live in
:mod:`gradaccum.examples`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from gradaccum.errors import GradAccumError, WorkloadError
from gradaccum.names import DEFAULT_WORKLOAD, HF_PREFIX
from gradaccum.workloads import load_hf_workload
from gradaccum.workloads.base import OptimizerFactory, Workload, sgd

__all__ = ["DEFAULT_WORKLOAD", "HF_PREFIX", "OptimizerFactory", "Workload", "load_workload", "sgd"]


def load_workload(spec: str) -> Workload:
    """Import ``MODULE:FUNCTION``, call it, and check that it returned a :class:`Workload`; or build
    the workload an ``hf:MODEL_DIR?data=FILE&...`` spec names (:mod:`gradaccum.workloads`)."""
    if isinstance(spec, str) and spec.startswith(HF_PREFIX):
        return _wrapped(spec, load_hf_workload(spec))
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise WorkloadError(
            f"workload must be written MODULE:FUNCTION (e.g. gradaccum.examples:tiny_gpt) or "
            f"hf:MODEL_DIR (with --data FILE), got {spec!r}"
        )
    module_name, func_name = spec.split(":")
    module = _import_workload_module(module_name)
    func = getattr(module, func_name, None)
    if func is None or not callable(func):
        raise WorkloadError(f"module {module_name!r} has no callable {func_name!r}")
    try:
        workload = func()
    except Exception as exc:
        raise WorkloadError(f"workload {spec} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(workload, Workload):
        raise WorkloadError(
            f"workload {spec} returned {type(workload).__name__}; it must return gradaccum.Workload"
        )
    return _wrapped(spec, workload)


def _wrapped(spec: str, workload: Workload) -> Workload:
    wrapped: dict[str, Any] = {name: _reported(spec, name, getattr(workload, name)) for name in _USER_CODE}
    return dataclasses.replace(workload, **wrapped)


def _import_workload_module(name: str) -> Any:
    """Import ``name`` the way ``python -m`` would: the current directory is on the import path, so
    ``--workload mywork:build`` finds ``mywork.py`` beside the caller."""
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name == name.split(".")[0]:
            hint = (
                f" (looked in the current directory {here} and on the import path: run from the folder "
                f"that holds {name.split('.')[0]}.py, or add that folder to PYTHONPATH)"
            )
        raise WorkloadError(f"cannot import workload module {name!r}: {exc}{hint}") from exc


_USER_CODE = ("build_model", "make_batch", "loss_fn", "count_fn", "optimizer_factory")


def _reported(spec: str, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its failures reported as :class:`WorkloadError` naming the workload and the call.

    gradaccum's own errors pass through unchanged, and so do out-of-memory errors, which the
    adaptive micro-batch retry must still recognise.
    """

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (GradAccumError, torch.OutOfMemoryError):
            raise
        except Exception as exc:
            raise WorkloadError(f"workload {spec}: {name} raised {type(exc).__name__}: {exc}") from exc

    return call
