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
  parameters saved by the graph are persistent and not counted again (under FSDP2 neither are the
  unsharded parameters a unit gathers for its forward). The largest micro-batch of the window is
  reported.

  With activation checkpointing (non-reentrant ``torch.utils.checkpoint``) the checkpoint pushes
  saved-tensor hooks of its own inside each block, so the outer hooks no longer see what the block
  computes; they do see the block's inputs, which the checkpoint keeps for the recomputation (it
  saves them before entering its hooks). That alone would understate the peak: in the backward,
  each block is recomputed and holds its own saved tensors until its gradient is done. The figure
  adds the largest block's saved tensors (``recompute_bytes``, measured by
  :mod:`gradaccum.bench.checkpointing`), so it is what the forward kept plus the worst
  recomputation, a bound on the activations alive at once.
* **held gradient** bytes: the gradients a rank holds at a micro-batch boundary, largest over the
  window. Under FSDP2 with sync deferred these include the unsharded gradients FSDP2 accumulates
  on every rank until the final micro-batch reduce-scatters them: the memory deferral trades back
  for communication.

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

from gradaccum.distributed.wrap import fsdp2_units
from gradaccum.precision import accum_dtype_name, accum_dtype_of

__all__ = [
    "GradientCensus",
    "MemoryFigures",
    "SavedBytes",
    "accum_buffer_bytes",
    "persistent_bytes",
    "saved_bytes",
]

StorageKey = tuple[int, int, str]


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
    """Activations of one micro-batch (the largest of a window): the bytes its forward saves for
    backward, plus, with checkpointing, ``recompute_bytes``."""
    max_allocated_bytes: int | None = None
    """CUDA ``max_memory_allocated`` over an update (largest update); ``None`` on a CPU."""
    max_reserved_bytes: int | None = None
    """CUDA ``max_memory_reserved`` over an update; ``None`` on a CPU."""
    recompute_bytes: int = 0
    """Of ``activation_bytes``: the largest checkpointed block's own saved tensors, which its
    recomputation holds during that block's backward; 0 without checkpointing."""
    held_gradient_bytes: int | None = None
    """The most gradient bytes one rank held at a micro-batch boundary of a window (under FSDP2
    with deferred sync, the unsharded gradients too); ``None`` where not measured."""
    accum_buffer_bytes: int = 0
    """The float32 sums ``AccumConfig.accum_dtype`` keeps for narrower parameters while a window
    accumulates (:func:`accum_buffer_bytes`); 0 without it. Persistent: every window holds them,
    and the rounding before the step holds them beside the narrow gradient."""

    @property
    def persistent_bytes(self) -> int:
        """Parameters + gradients + optimizer state (+ ``accum_dtype``'s sums): what no micro-batch
        size changes."""
        return (
            self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes + self.accum_buffer_bytes
        )

    @property
    def saved_bytes(self) -> int:
        """What the forward itself kept for backward (the checkpointed blocks' inputs included)."""
        return self.activation_bytes - self.recompute_bytes

    @property
    def tensor_peak_bytes(self) -> int:
        """The peak from the tensors: parameters, optimizer state, the larger of the gradients after
        an update and those held within a window, and one micro-batch's activations. Kernels'
        workspace and the allocator's slack come on top (CUDA's own figures show them)."""
        gradients = max(self.gradient_bytes, self.held_gradient_bytes or 0) + self.accum_buffer_bytes
        return self.parameter_bytes + self.optimizer_state_bytes + gradients + self.activation_bytes

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["persistent_bytes"] = self.persistent_bytes
        data["saved_bytes"] = self.saved_bytes
        data["tensor_peak_bytes"] = self.tensor_peak_bytes
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryFigures:
        derived = ("persistent_bytes", "saved_bytes", "tensor_peak_bytes")
        return cls(**{k: v for k, v in data.items() if k not in derived})


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _dense_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The dense tensors that hold ``tensor``'s data: itself, or a sparse tensor's indices and
    values (``nn.Embedding(sparse=True)``'s gradient has no storage of its own)."""
    layout = tensor.layout
    if layout is torch.sparse_coo:
        return tensor._indices(), tensor._values()
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return tensor.crow_indices(), tensor.col_indices(), tensor.values()
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return tensor.ccol_indices(), tensor.row_indices(), tensor.values()
    return (tensor,)


def _storage_keys(tensor: torch.Tensor) -> list[StorageKey]:
    """(data pointer, bytes, device) of each storage behind ``tensor``, empty storages left out.
    An opaque tensor (MKL-DNN's layout) does not expose its bytes to torch: it is not counted."""
    keys = []
    for part in _dense_parts(_local(tensor)):
        try:
            storage = part.untyped_storage()
        except NotImplementedError:  # "Cannot access storage of OpaqueTensorImpl"
            continue
        if storage.nbytes() and storage.data_ptr():
            keys.append((storage.data_ptr(), storage.nbytes(), str(storage.device)))
    return keys


def _unique_bytes(tensors: Iterable[torch.Tensor], seen: set[StorageKey]) -> int:
    total = 0
    for tensor in tensors:
        for key in _storage_keys(tensor):
            if key not in seen:
                seen.add(key)
                total += key[1]
    return total


def accum_buffer_bytes(model: nn.Module, accum_dtype: str | torch.dtype | None) -> int:
    """Bytes of the sums ``accum_dtype`` holds: its itemsize per trainable parameter narrower than it
    (a bf16 model in float32: 4 bytes per parameter); 0 for ``None``."""
    name = accum_dtype_name(accum_dtype)
    if name is None:
        return 0
    dtype = accum_dtype_of(name)
    return sum(
        p.numel() * dtype.itemsize
        for p in model.parameters()
        if p.requires_grad and p.is_floating_point() and p.dtype.itemsize < dtype.itemsize
    )


def persistent_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer state) bytes of ``model`` and ``optimizer``, each storage once."""
    seen: set[StorageKey] = set()
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
        self._exclude: set[StorageKey] = {key for tensor in exclude for key in _storage_keys(tensor)}
        self._seen: set[StorageKey] = set()
        self.bytes = 0
        """Bytes saved so far, each storage once."""

    def exclude(self, tensors: Iterable[torch.Tensor]) -> list[StorageKey]:
        """Stop counting the storages of ``tensors`` (e.g. parameters gathered for a forward);
        returns the keys added, for :meth:`include`."""
        added = [key for tensor in tensors for key in _storage_keys(tensor) if key not in self._exclude]
        self._exclude.update(added)
        return added

    def include(self, keys: Iterable[StorageKey]) -> None:
        """Count these storages again (their memory was freed, and may be reused for activations)."""
        self._exclude.difference_update(keys)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        for key in _storage_keys(tensor):
            if key not in self._exclude and key not in self._seen:
                self._seen.add(key)
                self.bytes += key[1]
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


@contextlib.contextmanager
def _while_units_run(model: nn.Module, on_enter: Any, on_exit: Any | None = None) -> Iterator[None]:
    """``on_enter(unit)`` after each FSDP2 unit of ``model`` has gathered its parameters for a
    forward, ``on_exit(unit)`` after it has resharded them; nothing for a model without FSDP2.

    FSDP2 prepends its pre-forward hook (gather) and appends its post-forward hook (reshard), so
    hooks registered here run after both.
    """
    handles = []
    for unit in fsdp2_units(model):
        handles.append(unit.register_forward_pre_hook(lambda module, args: on_enter(module)))
        if on_exit is not None:
            handles.append(unit.register_forward_hook(lambda module, args, out: on_exit(module)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def saved_bytes(model: nn.Module) -> Iterator[SavedBytes]:
    """Within the block, count what forwards save for backward, the model's parameters excluded.

    Under FSDP2 each unit's parameters are gathered into fresh storage for its forward; those
    storages are excluded while the unit runs (they are the unit's parameters, not activations).
    The hooks hand every tensor back unchanged, so the backward computes exactly what it would
    without them; only the bookkeeping costs time, so measure outside timed updates.
    """
    counter = SavedBytes(exclude=model.parameters())
    gathered: dict[int, list[StorageKey]] = {}

    def enter(unit: nn.Module) -> None:
        gathered[id(unit)] = counter.exclude(unit.parameters())

    def leave(unit: nn.Module) -> None:
        counter.include(gathered.pop(id(unit), []))

    with (
        _while_units_run(model, enter, leave),
        torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack),
    ):
        yield counter


class GradientCensus:
    """The gradient bytes a rank holds right now, unsharded FSDP2 gradients included.

    ``p.grad`` of a model's parameters is what a plain or DDP model holds (and, under FSDP2, the
    sharded gradients after a reduce-scatter). While FSDP2 defers sync, the gradients accumulate on
    the *unsharded* parameters each unit gathers for its forward, which the model's
    ``parameters()`` no longer return once the unit has resharded. Inside :meth:`watching`, every
    unit's gathered parameters are remembered as it runs, so :meth:`held_bytes` sees their
    gradients too (each storage once).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._unsharded: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def watching(self) -> Iterator[GradientCensus]:
        def remember(unit: nn.Module) -> None:
            for p in unit.parameters():
                if not callable(getattr(p, "to_local", None)):  # gathered, not a sharded DTensor
                    self._unsharded[id(p)] = p

        with _while_units_run(self.model, remember):
            yield self

    def held_bytes(self) -> int:
        """Bytes of every gradient held now, each storage once (local shards under FSDP2)."""
        params = [*self.model.parameters(), *self._unsharded.values()]
        return _unique_bytes((p.grad for p in params if p.grad is not None), set())
