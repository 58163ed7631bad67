"""The one module that talks to ``torch.distributed``, with a single-process fallback.

Everything else asks this module "how many data-parallel ranks are there?" and "sum this across
them", so a plain single-process run never touches ``torch.distributed`` at all. A collective that
fails (a peer closed its connection, or the process-group timeout expired) is re-raised as
:class:`CollectiveError`, which says what was being exchanged and what a failure there means.

:func:`init_process_group` joins a launcher's group (torchrun's) with the process group's keys under
a prefix of its restart round, and bounds the joining and the first collective: a rank that does not
come ends in a :class:`CollectiveError` naming it, not a hang (docs/design/distributed-and-mesh.md,
"Restart rounds").
"""

from __future__ import annotations

from datetime import timedelta
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
    "init_process_group",
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


def init_process_group(
    backend: str,
    *,
    host: str,
    port: int,
    rank: int,
    world: int,
    restart_round: int = 0,
    agent_store: bool = True,
    timeout_s: float = 300.0,
    device_id: torch.device | None = None,
) -> None:
    """Join the process group of ``world`` ranks whose store serves at ``host:port``, as rank ``rank``.

    ``agent_store``: the launcher's agent hosts the store (torchrun does; it keeps it, on the same
    port, for every restart round), else rank 0 hosts it. The group's keys live under
    ``round<restart_round>/``: a restarted rank never reads an address a peer published in an
    earlier round (the peer is gone; connecting to it is refused, and joining fails or hangs).
    Joining, and a first collective over every rank (gloo: a monitored barrier, which names the
    ranks that did not come), each wait at most ``timeout_s``; past it a :class:`CollectiveError`
    says who is missing and what to check. The collectives of training keep torch's timeout.
    """
    timeout = timedelta(seconds=timeout_s)
    where = f"rank {rank} of {world}, store {host}:{port}, restart round {restart_round}"
    try:
        hosts = rank == 0 and not agent_store
        # multi_tenant as torch's env:// rendezvous: another store of this process may serve the port
        tcp = dist.TCPStore(
            host, port, world_size=world, is_master=hosts, timeout=timeout, multi_tenant=hosts
        )
        store = dist.PrefixStore(f"round{restart_round}", tcp)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=timeout, device_id=device_id
        )
    except (RuntimeError, ValueError) as exc:  # a store that never answers, a rendezvous timeout
        raise CollectiveError(
            f"{where}: the process group did not form within {timeout_s:g} s ({exc}). Every rank must "
            "start and reach the same store: check that all processes were launched, that "
            "MASTER_ADDR/MASTER_PORT are reachable, and the first error in the other ranks' logs"
        ) from exc
    try:
        if backend == "gloo" and world > 1:
            dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
        elif world > 1:
            dist.barrier()
    except RuntimeError as exc:
        raise CollectiveError(
            f"{where}: the process group formed, but its first collective did not complete within "
            f"{timeout_s:g} s ({exc}). A rank died or hangs while starting: its own log holds the "
            "first error"
        ) from exc
    _restore_collective_timeout(backend)


def _restore_collective_timeout(backend: str) -> None:
    """From here on the collectives wait torch's default time (a long checkpoint write on rank 0,
    say, while the others wait), not the joining's bound."""
    from torch.distributed import constants

    default = constants.default_pg_nccl_timeout if backend == "nccl" else constants.default_pg_timeout
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if default is not None and set_timeout is not None:
        set_timeout(default)
