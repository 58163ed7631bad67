"""Gradient norms, clipping and finiteness, for plain and sharded (DTensor) gradients.

The step computes these once per window, so their fixed cost matters on small models: when every
parameter is a plain tensor of one device and dtype (decided once, when the step is built, since a
gradient always has its parameter's device and dtype), the per-gradient checks and the grouping by
device and dtype that ``torch.nn.utils.get_total_norm`` does in Python are skipped.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from itertools import repeat

import torch

__all__ = [
    "clip_grads_",
    "grad_norm",
    "local_grads_finite",
    "local_part",
    "nonfinite_flag",
    "present_grads",
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


_grad_of = operator.attrgetter("grad")


def present_grads(params: Sequence[torch.Tensor]) -> tuple[Sequence[torch.Tensor], list[torch.Tensor]]:
    """The parameters that hold a gradient, and those gradients. Read by ``map`` in C: after a
    window's backwards the step's code runs cold, and a comprehension's line per parameter cost
    ~1 us each there (30 on the bundled GPT)."""
    grads = list(map(_grad_of, params))
    if not any(map(operator.is_, grads, repeat(None))):
        return params, grads
    return [p for p in params if p.grad is not None], [g for g in grads if g is not None]


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


def nonfinite_flag(
    grads: Sequence[torch.Tensor], *, uniform: bool, one: torch.Tensor | None = None
) -> torch.Tensor | None:
    """A 0-dim float tensor on the gradients' device: non-zero iff some gradient holds a NaN or an
    infinity; ``None`` when the fused check does not apply (not ``uniform``, or no gradients), and
    the caller then takes finiteness from the norm.

    It is the check GradScaler runs in ``unscale_`` (one fused pass, no output per tensor), with a
    scale of exactly 1, so no gradient changes (x * 1.0 == x in IEEE arithmetic). On the CPU it
    costs about a third of the norm; it is what keeps the skip on non-finite values on by default
    at almost no cost when nothing asks for the norm. ``one``: a float32 ``[1.0]`` on that device
    the caller keeps (one op fewer per call; it is only read).
    """
    if not (uniform and grads and _nonfinite_check is not None):
        return None
    device = grads[0].device
    if one is None or one.device != device:
        one = torch.ones(1, dtype=torch.float32, device=device)
    found = torch.zeros((), dtype=torch.float32, device=device)  # 0-dim, as GradScaler's own
    _nonfinite_check(grads if isinstance(grads, list) else list(grads), found, one)
    return found


def scale_grads_(
    grads: Sequence[torch.Tensor], factor: torch.Tensor | float, *, uniform: bool = False
) -> None:
    """Multiply every gradient in place by the 0-dim ``factor`` (on the device: no host read; or a
    host float, when post-scaling knew it there), one foreach multiply per device and dtype; the
    factor is cast to each gradient's dtype once, so a float64 gradient is multiplied by the
    full-precision factor. DTensor gradients (FSDP2's shards after the reduce-scatter) are
    multiplied shard by shard. ``uniform`` (see :func:`uniform_plain`): skip the grouping."""
    if not grads:
        return
    groups = {(grads[0].device, grads[0].dtype): grads} if uniform else _by_device_and_dtype(grads)
    for (device, dtype), group in groups.items():
        cast: torch.Tensor | float
        if not isinstance(factor, float):
            cast = factor.to(device=device, dtype=dtype)
        elif dtype in (torch.float32, torch.float64):
            # the value the float64 tensor cast to this dtype would hold; a 0-dim tensor, since a
            # foreach multiply by a Python scalar runs ~3x slower on the CPU (31k float32 values:
            # 89 us against 26 us)
            cast = torch.full((), factor, dtype=dtype, device=device)
        else:  # a half dtype would compute with the float32 scalar: cast it as the tensor path does
            cast = torch.tensor(factor, dtype=torch.float64, device=device).to(dtype)
        if _foreach_mul_ is not None and (uniform or all(type(g) is torch.Tensor for g in group)):
            _foreach_mul_(list(group), cast)
        else:
            for g in group:
                g.mul_(cast)


_Groups = dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]


def _by_device_and_dtype(tensors: Sequence[torch.Tensor]) -> _Groups:
    groups: _Groups = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


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
