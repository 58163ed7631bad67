"""The measuring pieces every audit shares: a float64 copy of the user's model with randomness off,
its gradient in parameter order, the relative L2 error, and the random state left as found."""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

from gradaccum.check.controls import randomness_off
from gradaccum.errors import ConfigError
from gradaccum.workloads.experts import EAGER_FIX, eager_experts_on

__all__ = [
    "RecordingOptimizer",
    "accelerate_state_kept",
    "float64_copy",
    "gradients",
    "preserved_rng",
    "rel_l2",
    "state_fingerprint",
]


class RecordingOptimizer(torch.optim.Optimizer):
    """An optimizer that records the gradients it is given and moves nothing."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        super().__init__(list(params), {"lr": 0.0})
        self.received: list[list[torch.Tensor]] = []

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:  # Lightning runs the last micro-batch's forward/backward here
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group["params"]]
        self.received.append(
            [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
        )
        return loss


def float64_copy(model: nn.Module, stack: contextlib.ExitStack) -> nn.Module:
    """A float64 deep copy of ``model`` (the user's is not touched), its gradients cleared, every
    switchable random source off for as long as ``stack`` is open, and a transformers MoE's
    experts on the eager kernel (:func:`~gradaccum.workloads.experts.eager_experts_on`: the fused
    kernels take no float64) on the copy only."""
    twin = copy.deepcopy(model).to(torch.float64)
    eager_experts_on(twin, what="the audit's float64 copy", fix=EAGER_FIX, error=ConfigError)
    twin.zero_grad(set_to_none=True)
    stack.enter_context(randomness_off(twin))
    return twin


def gradients(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter's gradient in parameter order, float64, zeros where none arrived (what an
    optimizer would see)."""
    return [
        torch.zeros_like(p, dtype=torch.float64)
        if p.grad is None
        else p.grad.detach().to(torch.float64).clone()
        for p in model.parameters()
    ]


def rel_l2(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    """|got - want| / |want| over all parameters together (inf when ``want`` is zero and ``got`` is not)."""
    num = sum(float((g - w).pow(2).sum()) for g, w in zip(got, want, strict=True))
    den = sum(float(w.pow(2).sum()) for w in want)
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return (num / den) ** 0.5


def norm(tensors: Sequence[torch.Tensor]) -> float:
    return sum(float(t.pow(2).sum()) for t in tensors) ** 0.5


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """torch's (CPU and initialized CUDA devices), Python's and NumPy's random states, restored on exit:
    an audit draws what the trainer's sampler and model would draw, and gives the draws back."""
    cuda = torch.cuda.is_initialized()
    states = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None, random.getstate())
    import numpy as np  # a dependency of transformers, and of every framework an audit runs

    numpy_state = np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        if states[1] is not None:
            torch.cuda.set_rng_state_all(states[1])
        random.setstate(states[2])
        np.random.set_state(numpy_state)


@contextlib.contextmanager
def accelerate_state_kept() -> Iterator[None]:
    """Accelerate's process-wide state (each singleton's ``_shared_state``) cleared for a recipe that
    builds its own ``Accelerator`` (Accelerate's row, Trainer's), and the process's own (the
    caller's, or an earlier run's) given back as it was."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    singletons = (PartialState, AcceleratorState, GradientState)
    saved = [dict(cls._shared_state) for cls in singletons]
    for cls in singletons:
        cls._shared_state.clear()
    try:
        yield
    finally:
        for cls, state in zip(singletons, saved, strict=True):
            cls._shared_state.clear()
            cls._shared_state.update(state)


def state_fingerprint(model: nn.Module) -> list[tuple[str, torch.Tensor | None]]:
    """Copies of every parameter, buffer and gradient, for a bitwise comparison before and after."""
    out: list[tuple[str, torch.Tensor | None]] = []
    for name, p in model.named_parameters():
        out.append((name, p.detach().clone()))
        out.append((f"{name}.grad", None if p.grad is None else p.grad.detach().clone()))
    out += [(name, b.detach().clone()) for name, b in model.named_buffers()]
    return out
