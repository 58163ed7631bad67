"""Building blocks for the two-process DDP tests (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum.batch import take
from gradaccum.distributed.comm import CommCounter, count_allreduces


def wrap(model: torch.nn.Module, bucket_cap_mb: float = 25.0) -> tuple[DDP, CommCounter]:
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    return ddp, count_allreduces(ddp)


def rank_slice(batch: Any, bounds: list[int], rank: int) -> Any:
    """Examples bounds[rank]:bounds[rank+1] of a global batch: uneven shards on purpose."""
    return take(batch, bounds[rank], bounds[rank + 1])
