"""The one module that talks to ``torch.distributed``, with a single-process fallback.

Everything else asks this module "how many data-parallel ranks are there?" and "sum this across
them", so a plain single-process run never touches ``torch.distributed`` at all.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_objects",
    "all_reduce_sum_",
    "is_distributed",
    "rank",
    "world_size",
]


def is_distributed(group: Any = None) -> bool:
    """True when a process group is initialized and ``group`` spans more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def world_size(group: Any = None) -> int:
    """Ranks in ``group`` (1 without an initialized process group)."""
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size(group))
    return 1


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (0 without an initialized process group)."""
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank(group))
    return 0


def all_reduce_sum_(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum ``tensor`` in place across ``group``; a no-op on one process. Returns ``tensor``."""
    if is_distributed(group):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` on one process)."""
    if not is_distributed(group):
        return [obj]
    out: list[Any] = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
