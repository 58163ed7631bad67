"""Memory measured from the tensors themselves, on any device: persistent and activation bytes.

A process's peak RSS on a CPU is mostly the torch runtime (hundreds of MiB for a model of a few),
so it cannot show the seeds' central claim: the activation term falls with the micro-batch, the
persistent term does not. These figures can, on a CPU too:

* **persistent** bytes: parameters, gradients and optimizer state, deduplicated by storage (a
  tensor and its views count once; a DTensor counts its local shard, i.e. per rank). They do not
  depend on the micro-batch, so accumulation cannot shrink them: an optimizer-state OOM needs
  sharding or a lighter optimizer.
* **activation** bytes: what the forward of one micro-batch saves for its backward, counted with
  saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``) and deduplicated by storage;
  parameters saved by the graph are persistent and not counted again. The largest micro-batch of
  the window is reported.

On CUDA the allocator's own figures (``max_memory_allocated`` / ``max_memory_reserved`` per update)
are measured beside them by :mod:`gradaccum.bench.measure`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = ["MemoryFigures", "SavedBytes", "persistent_bytes", "saved_bytes"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryFigures:
    """One configuration's memory, from its tensors (and, on CUDA, from the allocator)."""

    parameter_bytes: int
    """Parameters (this rank's shards under FSDP2)."""
    gradient_bytes: int
    """Gradients held after a backward."""
    optimizer_state_bytes: int
    """Optimizer state (Adam's two moments, step counters, momentum buffers)."""
    activation_bytes: int
    """Bytes saved for backward by one micro-batch's forward (the largest of a window)."""
    max_allocated_bytes: int | None = None
    """CUDA ``max_memory_allocated`` over an update (largest update); ``None`` on a CPU."""
    max_reserved_bytes: int | None = None
    """CUDA ``max_memory_reserved`` over an update; ``None`` on a CPU."""

    @property
    def persistent_bytes(self) -> int:
        """Parameters + gradients + optimizer state: what no micro-batch size changes."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["persistent_bytes"] = self.persistent_bytes
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryFigures:
        return cls(**{k: v for k, v in data.items() if k != "persistent_bytes"})


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _storage_key(tensor: torch.Tensor) -> tuple[int, int, str] | None:
    """(data pointer, bytes, device) of the storage behind ``tensor``; None for empty storage."""
    try:
        storage = _local(tensor).untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without a plain storage
        return None
    nbytes = storage.nbytes()
    if nbytes == 0 or storage.data_ptr() == 0:
        return None
    return storage.data_ptr(), nbytes, str(storage.device)


def _unique_bytes(tensors: Iterable[torch.Tensor], seen: set[tuple[int, int, str]]) -> int:
    total = 0
    for tensor in tensors:
        key = _storage_key(tensor)
        if key is not None and key not in seen:
            seen.add(key)
            total += key[1]
    return total


def persistent_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer state) bytes of ``model`` and ``optimizer``, each storage once."""
    seen: set[tuple[int, int, str]] = set()
    params = list(model.parameters())
    parameter = _unique_bytes(params, seen)
    gradient = _unique_bytes((p.grad for p in params if p.grad is not None), seen)
    state = (
        value
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    )
    return parameter, gradient, _unique_bytes(state, seen)


class SavedBytes:
    """Counts the storages a forward saves for backward (see :func:`saved_bytes`)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {key for key in map(_storage_key, exclude) if key is not None}
        self._seen: set[tuple[int, int, str]] = set()
        self.bytes = 0
        """Bytes saved so far, each storage once."""

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key is not None and key not in self._exclude and key not in self._seen:
            self._seen.add(key)
            self.bytes += key[1]
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


@contextlib.contextmanager
def saved_bytes(model: nn.Module) -> Iterator[SavedBytes]:
    """Within the block, count what forwards save for backward, the model's parameters excluded.

    The hooks hand every tensor back unchanged, so the backward computes exactly what it would
    without them; only the bookkeeping costs time, so measure outside timed updates.
    """
    counter = SavedBytes(exclude=model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        yield counter
