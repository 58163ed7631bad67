"""The one module that talks to ``torch.distributed``, with a single-process fallback.

Everything else asks this module "how many data-parallel ranks are there?" and "sum this across
them", so a plain single-process run never touches ``torch.distributed`` at all. A collective that
fails (a peer closed its connection, or the process-group timeout expired) is re-raised as
:class:`CollectiveError`, which says what was being exchanged and what a failure there means.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradaccum.errors import CollectiveError

__all__ = [
    "CollectiveError",
    "all_gather_objects",
    "all_reduce_sum_",
    "all_reduce_sum_future",
    "collective_failed",
    "is_distributed",
    "looks_like_comm_failure",
    "rank",
    "world_size",
]

# NCCL raises torch.distributed.DistError subclasses when a peer is gone or a collective timed out;
# gloo raises plain RuntimeErrors whose text names its source file (".../gloo/transport/...").
# Narrow on purpose: a user's own "connection reset" must not be mistaken for a lost peer.
_COMM_FAILURE_TEXTS = ("gloo", "nccl")


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


def looks_like_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a communication failure (a lost peer, a timeout) rather than a local bug."""
    if isinstance(exc, CollectiveError) or (
        dist.is_available() and isinstance(exc, getattr(dist, "DistError", ()))
    ):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(t in text for t in _COMM_FAILURE_TEXTS)


def collective_failed(what: str, exc: BaseException, group: Any = None) -> CollectiveError:
    """The error to raise when exchanging ``what`` failed with ``exc``."""
    return CollectiveError(
        f"rank {rank(group)}: exchanging {what} with the other data-parallel ranks failed ({exc}). "
        "Another rank stopped taking part: it failed where the ranks cannot agree to stop together "
        "(inside the synchronizing backward, the optimizer step, a scheduler or hook, or outside "
        "Accumulator.step), or its process died or hangs. That rank's log holds the first error."
    )


def all_reduce_sum_(tensor: torch.Tensor, group: Any = None, *, what: str = "a tensor") -> torch.Tensor:
    """Sum ``tensor`` in place across ``group``; a no-op on one process. Returns ``tensor``.

    ``what`` names the exchanged numbers in the :class:`CollectiveError` raised if a peer is gone.
    """
    if is_distributed(group):
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        except RuntimeError as exc:
            raise collective_failed(what, exc, group) from exc
    return tensor


def all_reduce_sum_future(tensor: torch.Tensor, group: Any = None) -> torch.futures.Future[Any]:
    """Start summing ``tensor`` in place across ``group``; the future a DDP communication hook
    returns (its value: a list holding ``tensor``)."""
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    assert work is not None  # async_op=True always returns a work handle
    return work.get_future()


def all_gather_objects(obj: Any, group: Any = None, *, what: str = "an object") -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` on one process)."""
    if not is_distributed(group):
        return [obj]
    out: list[Any] = [None] * world_size(group)
    try:
        dist.all_gather_object(out, obj, group=group)
    except RuntimeError as exc:
        raise collective_failed(what, exc, group) from exc
    return out
