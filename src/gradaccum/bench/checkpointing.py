"""Activation checkpointing of a workload's repeated blocks, as a dimension of the sweep.

``full`` wraps each block's forward in ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:
the forward keeps only the block's inputs, and the backward recomputes the block (with the forward's
RNG state, so dropout draws the same masks) before computing its gradient. The blocks are the
workload's own when it declares them (``Workload.extras["checkpoint_blocks"]``, a function of the
model returning the modules), else the members of every ``nn.ModuleList``
(:func:`gradaccum.distributed.wrap.repeated_blocks`: a transformer's layers) that no other block
contains.

Each block's ``forward`` is replaced on the instance, so module paths, parameter names and order,
and FSDP2's units (``fully_shard`` of each block) stay what they are without checkpointing; the
checkpoint runs inside FSDP2's gather, and its recomputation inside FSDP2's backward gather.

What checkpointing costs in memory is measured, not assumed (see :mod:`gradaccum.bench.memory`):
the outer saved-tensor hooks count the inputs each checkpointed block keeps, and a
:class:`RecomputeProbe` measures the block's own saved tensors, which its recomputation holds during
its backward. :func:`check_checkpointing` proves in float64 that checkpointed and plain models compute
the same update.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from gradaccum.batch import split
from gradaccum.bench.memory import SavedBytes
from gradaccum.bench.spec import CHECKPOINTING
from gradaccum.check.workload import Workload
from gradaccum.distributed.wrap import repeated_blocks
from gradaccum.errors import BenchError

__all__ = [
    "CHECKPOINTING",
    "CHECKPOINT_TOLERANCE",
    "CheckpointingCheck",
    "RecomputeProbe",
    "apply_checkpointing",
    "check_checkpointing",
    "checkpoint_blocks",
]


CHECKPOINT_TOLERANCE = 1e-12
"""Largest relative difference of gradients and updated parameters, checkpointed against plain, in
float64. The recomputation runs the same kernels on the same float64 inputs, so the two agree to
the last bit on a CPU; a different kernel choice or summation order would leave ~1e-16 per
operation. A real change of the function (a mask drawn anew, a block fed other inputs) is ~1e-3 or
more, nine orders above."""

DECLARED = "checkpoint_blocks"
"""The ``Workload.extras`` key a workload declares its blocks under: ``model -> list of modules``."""


def checkpoint_blocks(workload: Workload, model: nn.Module) -> list[nn.Module]:
    """The blocks to checkpoint: the workload's declared ones, else every ``nn.ModuleList`` member."""
    declared = workload.extras.get(DECLARED)
    if declared is not None:
        if not callable(declared):
            raise BenchError(
                f"workload {workload.name!r}: extras[{DECLARED!r}] must be a function of the model "
                f"returning the modules to checkpoint, got {type(declared).__name__}"
            )
        blocks = list(declared(model))
        stray = [type(b).__name__ for b in blocks if not isinstance(b, nn.Module)]
        if stray:
            raise BenchError(f"workload {workload.name!r}: extras[{DECLARED!r}] returned non-modules {stray}")
    else:
        blocks = _outermost(repeated_blocks(model))
    if not blocks:
        raise BenchError(
            f"workload {workload.name!r} has no repeated blocks to checkpoint (no nn.ModuleList in "
            f"{type(model).__name__}); declare them as Workload.extras[{DECLARED!r}] = lambda model: "
            "[...], or leave checkpointing out (--checkpointing none)"
        )
    return blocks


def _outermost(blocks: list[nn.Module]) -> list[nn.Module]:
    """``blocks`` without those inside another one (a mixture-of-experts layer's ``ModuleList`` of
    experts within a transformer block): checkpointing the outer block already recomputes them."""
    inner = {id(m) for b in blocks for m in b.modules() if m is not b}
    return [b for b in blocks if id(b) not in inner]


class RecomputeProbe:
    """Measures, while :attr:`active`, the bytes each checkpointed block's recomputation holds.

    The checkpoint's own saved-tensor hooks hide the block's saved tensors from any outer counter,
    and no public hook reaches into the recomputation. So when active, the block also runs once
    without a checkpoint, under a counter of its own, with the RNG forked (the real forward draws
    what it would have drawn) and its output dropped: what that forward saves, parameters and the
    block's inputs excluded (the checkpoint keeps those anyway), is what the recomputation holds
    during the block's backward. Costs one extra block forward per block while active: measure
    on an unmeasured update.
    """

    def __init__(self) -> None:
        self.active = False
        self.largest_bytes = 0
        """The largest block's recomputed saved bytes seen while active."""

    def measure(
        self, block: nn.Module, forward: Callable[..., Any], args: Sequence[Any], kwargs: Any
    ) -> None:
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        counter = SavedBytes(exclude=[*block.parameters(), *inputs])
        devices = sorted({t.device.index or 0 for t in inputs if t.device.type == "cuda"})
        with (
            torch.random.fork_rng(devices=devices),
            torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack),
        ):
            forward(*args, **kwargs)
        self.largest_bytes = max(self.largest_bytes, counter.bytes)


def _checkpointed_forward(
    block: nn.Module, forward: Callable[..., Any], probe: RecomputeProbe | None, *args: Any, **kwargs: Any
) -> Any:
    if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
        return forward(*args, **kwargs)
    if probe is not None and probe.active:
        probe.measure(block, forward, args, kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_checkpointing(blocks: Sequence[nn.Module], probe: RecomputeProbe | None = None) -> None:
    """Checkpoint each of ``blocks`` (in place): its ``forward`` becomes a non-reentrant checkpoint
    of the original. Apply before wrapping the model for data parallelism."""
    for block in blocks:
        original = block.forward
        # an instance attribute: nn.Module.__call__ finds it before the class's forward
        block.forward = functools.partial(_checkpointed_forward, block, original, probe)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointingCheck:
    """Checkpointed against plain, one update in float64: the same gradients and parameters."""

    mode: str
    """The checkpointing mode checked."""
    blocks: int
    """Blocks checkpointed."""
    micro_batches: int
    """Micro-batches the update accumulated."""
    grad_max_rel_err: float
    """Largest relative difference of the gradients (per tensor, max |a - b| / max |a|)."""
    param_max_rel_err: float
    """Largest relative difference of the parameters after the update."""
    tolerance: float
    """What both must stay below (:data:`CHECKPOINT_TOLERANCE`)."""
    buffers_match: bool
    """Whether buffers (BatchNorm running statistics) match too: a recomputed BatchNorm updates
    them a second time."""

    @property
    def passed(self) -> bool:
        return self.grad_max_rel_err <= self.tolerance and self.param_max_rel_err <= self.tolerance

    def describe(self) -> str:
        text = (
            f"{'PASS' if self.passed else 'FAIL'}: {self.blocks} block(s) checkpointed, one update of "
            f"{self.micro_batches} micro-batches in float64: gradients differ by "
            f"{self.grad_max_rel_err:.1e}, parameters by {self.param_max_rel_err:.1e} "
            f"(relative; tolerance {self.tolerance:.0e})"
        )
        if not self.buffers_match:
            text += "; buffers differ (the recomputation updated running statistics again)"
        return text


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = a.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def check_checkpointing(
    workload: Workload, *, mode: str = "full", seed: int = 0, device: str = "cpu"
) -> CheckpointingCheck:
    """One accumulated update of the verification batch (``workload.batch(seed)`` in micro-batches of
    ``workload.micro_batch``), plain and checkpointed, in float64, from the same weights and RNG."""
    from gradaccum.batch import cast
    from gradaccum.step.accumulator import Accumulator

    if mode not in CHECKPOINTING:
        raise BenchError(f"checkpointing must be one of {CHECKPOINTING}, got {mode!r}")
    dev = torch.device(device)
    batch = cast(workload.batch(seed), torch.float64, dev)
    micro_batches = split(batch, micro_batch=workload.micro_batch)
    models = []
    blocks = 0
    for checkpointed in (False, True):
        model = workload.build_model().to(device=dev, dtype=torch.float64)
        if checkpointed and mode != "none":
            chosen = checkpoint_blocks(workload, model)
            apply_checkpointing(chosen)
            blocks = len(chosen)
        acc = Accumulator(model, workload.optimizer_factory(model.parameters()))
        torch.manual_seed(seed)  # the same dropout masks in both
        acc.step(micro_batches, workload.loss_fn, workload.count_fn)
        models.append(model)
    plain, ckpt = models
    pairs = list(zip(plain.parameters(), ckpt.parameters(), strict=True))
    grads = [_rel(a.grad, b.grad) for a, b in pairs if a.grad is not None and b.grad is not None]
    missing = sum((a.grad is None) != (b.grad is None) for a, b in pairs)
    buffers = list(zip(plain.buffers(), ckpt.buffers(), strict=True))
    return CheckpointingCheck(
        mode=mode,
        blocks=blocks,
        micro_batches=len(micro_batches),
        grad_max_rel_err=float("inf") if missing else max(grads, default=0.0),
        param_max_rel_err=max((_rel(a.detach(), b.detach()) for a, b in pairs), default=0.0),
        tolerance=CHECKPOINT_TOLERANCE,
        buffers_match=all(torch.equal(a, b) for a, b in buffers),
    )
