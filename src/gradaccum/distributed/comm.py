"""Counting communication: DDP's gradient all-reduces (a comm hook), FSDP2's parameter all-gathers
and gradient reduce-scatters (its custom-collective API), and the step's own collectives and host
reads (a patch, for tests and benchmarks).

No ``from __future__ import annotations`` in this module: DDP inspects the hook's ``bucket``
annotation and needs the real ``dist.GradBucket`` class, not a string.
"""

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "CollectiveRecord",
    "CommCounter",
    "Fsdp2CommCounter",
    "RecordingAllGather",
    "RecordingReduceScatter",
    "SyncPoints",
    "count_allreduces",
    "count_fsdp2_comms",
    "count_sync_points",
]


@dataclass
class CommCounter:
    """Gradient buckets all-reduced (calls) and their payload (bytes) since the last reset."""

    calls: int = 0
    bytes: int = 0
    last_call_s: float = 0.0
    """``time.perf_counter()`` when the hook last handed a bucket over: the end of this rank's own
    backward work (the wait for the other ranks comes after it)."""

    def reset(self) -> None:
        self.calls = 0
        self.bytes = 0
        self.last_call_s = 0.0


def _counting_allreduce(state: CommCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    # Same arithmetic as DDP's default: divide by the world size, then sum across ranks.
    state.calls += 1
    state.last_call_s = time.perf_counter()
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


@dataclass
class Fsdp2CommCounter:
    """FSDP2's collectives since the last reset: parameter all-gathers (bytes gathered, the full
    unsharded size) and gradient reduce-scatters (bytes reduced, the full unsharded size), per rank."""

    allgather_calls: int = 0
    allgather_bytes: int = 0
    reduce_scatter_calls: int = 0
    reduce_scatter_bytes: int = 0

    def reset(self) -> None:
        self.allgather_calls = self.allgather_bytes = 0
        self.reduce_scatter_calls = self.reduce_scatter_bytes = 0

    def record(self, collective: str, group: Any, nbytes: int) -> None:
        if collective == "all_gather":
            self.allgather_calls += 1
            self.allgather_bytes += nbytes
        else:
            self.reduce_scatter_calls += 1
            self.reduce_scatter_bytes += nbytes


# what FSDP2's defaults call: the *_single names where this torch has them (the older ones warn)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


CollectiveRecord = Callable[[str, Any, int], None]
"""``record(collective, group, nbytes)``: told of each collective a recording FSDP2 hook issues."""


class _Allocate:
    """FSDP2's default buffer allocation (``torch.empty``), shared by both recording collectives."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class RecordingAllGather(_Allocate):
    """FSDP2's default all-gather (for ``set_custom_all_gather``), plus a record of it: the same
    call into torch.distributed; the bytes are the gathered (unsharded) size."""

    def __init__(self, record: CollectiveRecord) -> None:
        self.record = record

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        self.record("all_gather", group, output_tensor.numel() * output_tensor.element_size())
        return _ALL_GATHER(output_tensor, input_tensor, group=group, async_op=async_op)


class RecordingReduceScatter(_Allocate):
    """FSDP2's default reduce-scatter (for ``set_custom_reduce_scatter``), plus a record of it; the
    bytes are the reduced (unsharded) size."""

    def __init__(self, record: CollectiveRecord) -> None:
        self.record = record

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        self.record("reduce_scatter", group, input_tensor.numel() * input_tensor.element_size())
        return _REDUCE_SCATTER(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def count_fsdp2_comms(units: list[Any]) -> Fsdp2CommCounter | None:
    """Count the collectives of FSDP2 ``units`` (the modules ``fully_shard`` wrapped), through the
    public ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``: the counting
    collectives allocate and communicate as FSDP2's defaults do. ``None`` on a torch without them
    (before 2.8), or when there is nothing to count."""
    if not units or not all(
        hasattr(u, "set_custom_all_gather") and hasattr(u, "set_custom_reduce_scatter") for u in units
    ):
        return None
    counter = Fsdp2CommCounter()
    for unit in units:
        unit.set_custom_all_gather(RecordingAllGather(counter.record))
        unit.set_custom_reduce_scatter(RecordingReduceScatter(counter.record))
    return counter


_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast",
    "broadcast_object_list",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "barrier",
)
_HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__")


@dataclass
class SyncPoints:
    """Collectives issued from Python and device-to-host reads, since the counter started.

    DDP's gradient all-reduces run inside its C++ reducer and are not counted here: they are the
    comm hook's (:class:`CommCounter`). What is counted are the step's own small collectives (the
    counts, the agreement, a gather) and every read of a tensor's value on the host, which waits for
    the device to finish (a synchronization point on an accelerator).
    """

    collectives: int = 0
    host_reads: int = 0
    cpu_reads: int = 0
    """Reads of tensors that live in host memory (:func:`read_cpu`: the counts of a window whose
    ``count_fn`` returns CPU tensors), which wait for no device; not among ``host_reads``."""
    by_name: dict[str, int] = field(default_factory=dict)

    def _add(self, name: str, kind: str) -> None:
        if kind == "host":
            self.host_reads += 1
        elif kind == "cpu":
            self.cpu_reads += 1
        else:
            self.collectives += 1
        self.by_name[name] = self.by_name.get(name, 0) + 1


def read_cpu(tensor: torch.Tensor) -> list[Any]:
    """The values of a CPU tensor, for the step's host-side arithmetic: reading host memory waits
    for no device, so :func:`count_sync_points` counts it apart (``cpu_reads``)."""
    return tensor.tolist()


@contextlib.contextmanager
def count_sync_points() -> Iterator[SyncPoints]:
    """``with count_sync_points() as points:`` counts the collectives and host reads inside.

    Patches ``torch.distributed``'s collectives and ``torch.Tensor``'s value reads for the block
    and restores them on exit; nested calls (``all_gather_object`` calls ``all_gather``) count once.
    For tests and benchmarks only: it slows every counted call a little.
    """
    points = SyncPoints()
    depth = [0]
    saved: list[tuple[object, str, object]] = []

    def wrap(owner: object, name: str, kind: str) -> None:
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                points._add(name, kind)
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        saved.append((owner, name, original))
        setattr(owner, name, counted)

    for name in _COLLECTIVES:
        if hasattr(dist, name):
            wrap(dist, name, "collective")
    for name in _HOST_READS:
        wrap(torch.Tensor, name, "host")
    wrap(sys.modules[__name__], "read_cpu", "cpu")  # callers look it up on this module
    try:
        yield points
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
