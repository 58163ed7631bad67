"""What the model's gradient reductions divide by, and the norm of gradients spread over a mesh.

**The averaging factor.** Each rank backpropagates its summed loss times s. A reduction that
*averages* over a group G turns sum_r s grad_r into s sum_r grad_r / |G|; the full-batch gradient
is sum_r grad_r / N. So s = F / N, where F is the product of the divisors of every reduction the
gradient passes through: DDP's average over its process group, FSDP2's reduce-scatter over the
shards times HSDP's all-reduce over the replicas (FSDP2 divides once by their product), or the
factor set with ``FSDPModule.set_gradient_divide_factor`` (torchtitan sets 1.0: a sum). Tensor
parallelism does not reduce gradients over TP ranks (each holds its shard, computed from the same
tokens), so TP never enters F; context parallelism does, through the FSDP or DDP group that spans
the CP ranks.

**The norm.** Clipping needs the norm of the whole gradient: every shard (FSDP, TP), every pipeline
stage. torch 2.13's ``get_total_norm`` refuses DTensors on two meshes (TP on some layers gives 2-D
gradients, the rest 1-D), so the norm is assembled here: over the ranks that hold parts of the
model, each rank adds, for each gradient, its local squared norm divided by the number of ranks
holding each of its elements, |group| / prod(sizes of the dims it is sharded over); one all-reduce
(the step's end-of-window one) sums them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn

from gradaccum.distributed import dist
from gradaccum.distributed.sync import SyncKind, sync_module
from gradaccum.errors import ConfigError

__all__ = ["DivideFactor", "averaging_factor", "clip_mesh_grads_", "local_squares"]


def _mesh_divisor(group: object) -> float | None:
    """What one FSDP2 parameter group's reduction divides by when no factor is set on it:
    shards x replicas of its mesh (None: not readable)."""
    info = getattr(group, "mesh_info", None)
    shards = getattr(info, "shard_mesh_size", None)
    if shards is None:
        return None
    return float(shards * getattr(info, "replicate_mesh_size", 1))


class DivideFactor:
    """F, read again wherever a window scales: what the model's gradient reductions divide by.

    DDP's group and a plain module's 1 are fixed when the accumulator is built. FSDP2's is not:
    ``FSDPModule.set_gradient_divide_factor`` may be called at any time, and it writes
    ``gradient_divide_factor`` on the parameter groups, which the reduce-scatter reads in each
    synchronizing backward. So the groups (fixed by ``fully_shard``) are found once, here, and
    each :meth:`read` takes their factors again: a few attribute reads per window, no walk over
    the modules. FSDP2 has no public getter (torch 2.13), hence the attribute.

    The setter is not recursive: it writes the groups of the one module it is called on, *not*
    those of the modules sharded inside it, so ``model.set_gradient_divide_factor(1.0)`` on the
    root leaves the blocks averaging. One scale F/N serves every parameter, so groups that divide
    by different factors are refused, naming the modules (torchtitan sets the factor on every
    ``FSDPModule``).
    """

    __slots__ = ("_fixed", "_groups")

    def __init__(self, model: nn.Module, kind: SyncKind, data_size: int) -> None:
        """``data_size``: ranks holding different tokens, the fallback where the wrapper does not say."""
        self._fixed: float | None = None
        self._groups: list[tuple[str, object, float]] = []
        if kind == "local":
            self._fixed = 1.0
            return
        owner = sync_module(model)
        if kind == "ddp":
            self._fixed = float(dist.world_size(getattr(owner, "process_group", None)))
            return
        if kind == "fsdp2":
            for name, sub in owner.named_modules():
                get_state = getattr(sub, "_get_fsdp_state", None)
                groups = getattr(get_state(), "_fsdp_param_groups", None) if callable(get_state) else None
                for group in groups or ():
                    divisor = _mesh_divisor(group)
                    self._groups.append(
                        (name or "<root>", group, float(data_size) if divisor is None else divisor)
                    )
        if not self._groups:
            self._fixed = float(data_size)
        self.read()  # modules that divide by different factors are refused at construction already

    @property
    def factor(self) -> float:
        """F as the model's reductions will divide in the next synchronizing backward (read now)."""
        return self.read()

    def read(self) -> float:
        """F as the model's reductions will divide in the next synchronizing backward."""
        if self._fixed is not None:
            return self._fixed
        found: dict[float, list[str]] = {}
        for name, group, default in self._groups:
            factor = getattr(group, "gradient_divide_factor", None)
            found.setdefault(default if factor is None else float(factor), []).append(name)
        if len(found) > 1:
            shown = "; ".join(f"{', '.join(names)}: divides by {f}" for f, names in found.items())
            raise ConfigError(
                f"the FSDP2 modules' gradient reductions divide by different factors ({shown}), so no "
                "one scale F/N makes every parameter's gradient the full batch's. "
                "set_gradient_divide_factor is not recursive in torch 2.13: call it on every FSDPModule "
                "(for m in model.modules(): if isinstance(m, FSDPModule): m.set_gradient_divide_factor(f)), "
                "or on none."
            )
        return next(iter(found))


def averaging_factor(model: nn.Module, kind: SyncKind, data_size: int) -> float:
    """F: what the model's gradient reductions divide the summed gradient by (see the module doc),
    read now; :class:`DivideFactor` reads it again for each window.

    ``data_size``: ranks holding different tokens, the fallback where the wrapper does not say.
    """
    return DivideFactor(model, kind, data_size).read()


def _holders(grad: torch.Tensor, group_size: int) -> int:
    """Ranks of the group that hold each element of ``grad`` (a full copy on each, unless sharded)."""
    placements = getattr(grad, "placements", None)
    if placements is None:
        return group_size
    mesh = grad.device_mesh  # type: ignore[attr-defined]
    # a dimension splits the gradient unless it replicates it (FSDP's _StridedShard under TP is
    # not a Shard subclass in torch 2.13, so "not replicated" is the test, not "is_shard")
    split = math.prod(mesh.size(i) for i, p in enumerate(placements) if not p.is_replicate())
    return max(group_size // split, 1)


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient (the local shard of a DTensor; shares its storage)."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


def local_squares(grads: Sequence[torch.Tensor], group_size: int, device: torch.device) -> torch.Tensor:
    """This rank's share of the squared norm of a gradient spread over ``group_size`` ranks:
    summed over those ranks (one all-reduce, which the caller may share), it is |grad|^2."""
    squares = [
        torch.linalg.vector_norm(_local(g), dtype=torch.float64).square() / _holders(g, group_size)
        for g in grads
    ]
    return torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64, device=device)


def clip_mesh_grads_(grads: Sequence[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Multiply every local shard by min(1, max_norm / (norm + 1e-6)), as ``clip_grad_norm_`` does."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for grad in grads:
            local = _local(grad)
            local.mul_(coef.to(local.device, local.dtype))
