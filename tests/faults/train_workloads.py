"""Workloads for the command-line fault tests, importable as ``tests.faults.train_workloads:NAME``
by a ``gradaccum train`` subprocess started in the repository root (the current directory is on
the import path for ``--workload``).

They are the tiny GPT, with the same model, data and loss, so a run of one resumes a run of another
exactly; environment variables (read here, in test code only) slow them down or make them report:

* ``GRADACCUM_TEST_SLEEP``: seconds each micro-batch's loss sleeps (long windows to signal into);
* ``GRADACCUM_TEST_MARK``: a folder where the factory writes ``building-<rank>`` (with its pid)
  before it sleeps ``GRADACCUM_TEST_BUILD_SLEEP`` seconds: a signal sent then lands in start-up;
* ``GRADACCUM_TEST_BUFFER_MB``: a buffer of that many MiB in the model, so that writing a
  checkpoint takes long enough to be interrupted.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import torch

from gradaccum import Workload
from gradaccum.examples import tiny_gpt


def _env(name: str, default: float = 0.0) -> float:
    return float(os.environ.get(name, default))


def slow_gpt() -> Workload:
    """The tiny GPT, slowed down and made observable as the environment asks (module docstring)."""
    mark = os.environ.get("GRADACCUM_TEST_MARK")
    rank = os.environ.get("RANK", "0")
    if mark:
        Path(mark, f"building-{rank}").write_text(str(os.getpid()))
        time.sleep(_env("GRADACCUM_TEST_BUILD_SLEEP"))
    workload = tiny_gpt()
    sleep = _env("GRADACCUM_TEST_SLEEP")
    inner_loss, inner_build = workload.loss_fn, workload.build_model
    buffer_mb = int(_env("GRADACCUM_TEST_BUFFER_MB"))

    def loss_fn(model: torch.nn.Module, micro_batch: Any) -> torch.Tensor:
        if sleep:
            time.sleep(sleep)
        return inner_loss(model, micro_batch)

    def build_model() -> torch.nn.Module:
        model = inner_build()
        if buffer_mb:
            model.register_buffer("ballast", torch.zeros(buffer_mb * 2**20 // 4, dtype=torch.float32))
        return model

    return dataclasses.replace(workload, loss_fn=loss_fn, build_model=build_model)


def out_of_memory_gpt() -> Workload:
    """The tiny GPT whose loss asks the host for an impossible allocation: a real out-of-memory error."""
    workload = tiny_gpt()
    inner = workload.loss_fn

    def loss_fn(model: torch.nn.Module, micro_batch: Any) -> torch.Tensor:
        torch.empty(2**62, dtype=torch.uint8)
        return inner(model, micro_batch)

    return dataclasses.replace(workload, loss_fn=loss_fn)
