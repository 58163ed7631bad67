"""Counting DDP's gradient all-reduces: a comm hook that counts calls and bytes, then averages.

No ``from __future__ import annotations`` in this module: DDP inspects the hook's ``bucket``
annotation and needs the real ``dist.GradBucket`` class, not a string.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["CommCounter", "count_allreduces"]


@dataclass
class CommCounter:
    """Gradient buckets all-reduced (calls) and their payload (bytes) since the last reset."""

    calls: int = 0
    bytes: int = 0

    def reset(self) -> None:
        self.calls = 0
        self.bytes = 0


def _counting_allreduce(state: CommCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    # Same arithmetic as DDP's default: divide by the world size, then sum across ranks.
    state.calls += 1
    buf = bucket.buffer()
    state.bytes += buf.numel() * buf.element_size()
    buf.div_(dist.get_world_size())
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def count_allreduces(ddp: DistributedDataParallel) -> CommCounter:
    """Register the counting hook on ``ddp`` (once, before its first forward) and return its counter."""
    counter = CommCounter()
    ddp.register_comm_hook(counter, _counting_allreduce)
    return counter
