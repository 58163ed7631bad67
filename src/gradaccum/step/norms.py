"""Gradient norms, clipping and finiteness, for plain and sharded (DTensor) gradients.

The step computes these once per window, so their fixed cost matters on small models: when every
parameter is a plain tensor of one device and dtype (decided once, when the step is built, since a
gradient always has its parameter's device and dtype), the per-gradient checks and the grouping by
device and dtype that ``torch.nn.utils.get_total_norm`` does in Python are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "clip_grads_",
    "grad_norm",
    "local_grads_finite",
    "local_part",
    "nonfinite_flag",
    "scale_grads_",
    "total_norm",
    "uniform_plain",
]

# The foreach norm (documented under "Foreach operations"; what get_total_norm and torch.optim use)
_foreach_norm = getattr(torch, "_foreach_norm", None)
# GradScaler's fused non-finite check (``torch.amp.GradScaler.unscale_`` calls it); kept behind a
# getattr so that a torch without it falls back to the norm
_nonfinite_check = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
# the foreach multiply (what clip_grads_with_norm_ and torch.optim use), behind a getattr likewise
_foreach_mul_ = getattr(torch, "_foreach_mul_", None)


def uniform_plain(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` are plain tensors (not DTensors) of one device and one dtype."""
    if not tensors:
        return False
    first = tensors[0]
    return all(
        type(t) in (torch.Tensor, torch.nn.Parameter) and t.device == first.device and t.dtype == first.dtype
        for t in tensors
    )


def total_norm(grads: Sequence[torch.Tensor], *, uniform: bool) -> torch.Tensor:
    """Total L2 norm of ``grads`` (non-empty), on their device; the full norm for DTensors.

    ``uniform`` (see :func:`uniform_plain`): one foreach norm and a norm of the per-tensor norms.
    """
    if uniform and _foreach_norm is not None:
        return torch.linalg.vector_norm(torch.stack(_foreach_norm(list(grads))))
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:
        norm = get_total_norm(list(grads), 2.0)
    else:  # torch < 2.6
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    full_tensor = getattr(norm, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else norm


def grad_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """Total L2 norm of the gradients of ``parameters`` (None when none has a gradient)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    return total_norm(grads, uniform=uniform_plain(grads)) if grads else None


def nonfinite_flag(grads: Sequence[torch.Tensor], *, uniform: bool) -> torch.Tensor | None:
    """A 0-dim float tensor on the gradients' device: non-zero iff some gradient holds a NaN or an
    infinity; ``None`` when the fused check does not apply (not ``uniform``, or no gradients), and
    the caller then takes finiteness from the norm.

    It is the check GradScaler runs in ``unscale_`` (one fused pass, no output per tensor), with a
    scale of exactly 1, so no gradient changes (x * 1.0 == x in IEEE arithmetic). On the CPU it
    costs about a third of the norm; it is what keeps the skip on non-finite values on by default
    at almost no cost when nothing asks for the norm.
    """
    if not (uniform and grads and _nonfinite_check is not None):
        return None
    device = grads[0].device
    found = torch.zeros(1, dtype=torch.float32, device=device)
    _nonfinite_check(list(grads), found, torch.ones(1, dtype=torch.float32, device=device))
    return found.reshape(())


def scale_grads_(grads: Sequence[torch.Tensor], factor: torch.Tensor | float) -> None:
    """Multiply every gradient in place by the 0-dim ``factor`` (on the device: no host read; or a
    host float, when post-scaling knew it there), one
    foreach multiply per device and dtype; the factor is cast to each gradient's dtype once, so a
    float64 gradient is multiplied by the full-precision factor. DTensor gradients (FSDP2's shards
    after the reduce-scatter) are multiplied shard by shard."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), group in groups.items():
        cast: torch.Tensor | float
        if not isinstance(factor, float):
            cast = factor.to(device=device, dtype=dtype)
        elif dtype in (torch.float32, torch.float64):
            cast = factor  # multiplies as the tensor cast to this dtype would, with no device op
        else:  # a half dtype would compute with the float32 scalar: cast it as the tensor path does
            cast = torch.tensor(factor, dtype=torch.float64, device=device).to(dtype)
        plain = all(type(g) is torch.Tensor for g in group)
        if _foreach_mul_ is not None and plain:
            _foreach_mul_(group, cast)
        else:
            for g in group:
                g.mul_(cast)


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
