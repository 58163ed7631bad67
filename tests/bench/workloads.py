"""Workloads for the bench tests: a masked-regression MLP and one that "runs out of memory".

Importable by worker processes as ``tests.bench.workloads:NAME`` when the repository root is the
working directory (``python -m`` puts it on ``sys.path``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from gradaccum.batch import batch_size
from gradaccum.check.workload import Workload
from tests.helpers import models

OOM_FROM = 4
"""``oom_mlp`` raises CUDA's out-of-memory error for micro-batches of this many examples or more."""


def _mlp() -> nn.Module:
    return models.mlp(0, torch.float32)


def tiny_mlp() -> Workload:
    """The tests' MLP on examples with a 0/1 weight: counts differ between micro-batches."""
    return Workload(
        name="tiny_mlp",
        build_model=_mlp,
        make_batch=lambda n, seed: models.mlp_batch(n, seed),
        loss_fn=models.mlp_loss,
        count_fn=models.count_rows,
        unit="examples",
    )


def _oom_loss(model: nn.Module, micro_batch: Any) -> torch.Tensor:
    if batch_size(micro_batch) >= OOM_FROM:
        # what the CUDA caching allocator raises; constructible on a CPU build
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
    return models.mlp_loss(model, micro_batch)


def oom_mlp() -> Workload:
    """``tiny_mlp`` whose forward fails like a CUDA OOM at micro-batches >= ``OOM_FROM``."""
    return dataclasses.replace(tiny_mlp(), name="oom_mlp", loss_fn=_oom_loss)


def _nan_every_other(n: int, seed: int) -> dict[str, torch.Tensor]:
    batch = models.mlp_batch(n, seed)
    if seed % 2 == 0:
        batch["x"][0, 0] = float("nan")  # a non-finite loss: the update must be skipped
    return batch


def nan_mlp() -> Workload:
    """``tiny_mlp`` whose batches drawn with an even seed hold a NaN: those updates are skipped."""
    return dataclasses.replace(tiny_mlp(), name="nan_mlp", make_batch=_nan_every_other)


def _fails_on_rank_1() -> nn.Module:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() == 1:
        raise RuntimeError("rank 1 cannot build its model (simulated)")
    return _mlp()


def rank1_fails() -> Workload:
    """``tiny_mlp`` whose model cannot be built on rank 1: rank 0 would wait for it forever."""
    return dataclasses.replace(tiny_mlp(), name="rank1_fails", build_model=_fails_on_rank_1)


def _mean_loss(model: nn.Module, micro_batch: Any) -> torch.Tensor:
    # the classic mistake: a mean over the micro-batch where the step expects a sum
    return models.mlp_loss(model, micro_batch) / models.count_rows(micro_batch).clamp(min=1)


def mean_mlp() -> Workload:
    """``tiny_mlp`` with a per-micro-batch mean loss: accumulation is not exact, verify must fail."""
    return dataclasses.replace(tiny_mlp(), name="mean_mlp", loss_fn=_mean_loss)


def dropout_gpt() -> Workload:
    """The bundled tiny GPT with dropout 0.1 in every block: checkpointing must redraw the same masks."""
    from gradaccum.examples import build_tiny_gpt, tiny_gpt

    return dataclasses.replace(
        tiny_gpt(), name="dropout_gpt", build_model=lambda: build_tiny_gpt(dropout=0.1)
    )


def bn_declared() -> Workload:
    """The bundled BatchNorm CNN (no ``nn.ModuleList``) declaring its residual stage as the block."""
    from gradaccum.examples import bn_cnn

    workload = bn_cnn()
    return dataclasses.replace(workload, extras={"checkpoint_blocks": lambda model: [model.layer1]})


class _Drifting(nn.Module):
    """A block whose output changes from one call to the next: a recomputation sees other values."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.block(x) * (1.0 + 0.01 * self.calls)


def _drifting_gpt() -> nn.Module:
    from gradaccum.examples import build_tiny_gpt

    model = build_tiny_gpt()
    model.blocks = nn.ModuleList(_Drifting(b) for b in model.blocks)
    return model


def drifting_gpt() -> Workload:
    """The tiny GPT with blocks that are not functions of their input: checkpointing changes them,
    so the float64 check must fail (its negative control)."""
    from gradaccum.examples import tiny_gpt

    return dataclasses.replace(tiny_gpt(), name="drifting_gpt", build_model=_drifting_gpt)
