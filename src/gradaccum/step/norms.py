"""Gradient norms, clipping and finiteness, for plain and sharded (DTensor) gradients."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = ["clip_grads_", "grad_norm", "local_grads_finite", "local_part"]


def grad_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """Total L2 norm of the gradients of ``parameters`` (None when none has a gradient).

    Stays on the device; for sharded (DTensor) gradients the norm is the full, global one.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:
        norm = get_total_norm(grads, 2.0)
    else:  # torch < 2.6
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    full_tensor = getattr(norm, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else norm


def clip_grads_(parameters: Sequence[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    clip_with_norm = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
    if clip_with_norm is not None:
        clip_with_norm(parameters, max_norm, total_norm)
        return
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)  # torch < 2.6
    for p in parameters:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))


def local_grads_finite(params: Sequence[torch.Tensor]) -> bool:
    """Whether this rank's own gradients (its shards, for DTensors) are all finite."""
    for p in params:
        local = local_part(p.grad)
        if local is not None and not bool(torch.isfinite(local).all()):
            return False
    return True


def local_part(grad: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a gradient: the local shard of a DTensor, else the tensor itself."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad
