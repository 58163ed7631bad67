"""Count one update's collectives by mesh dimension, and the gradient bytes a rank holds.

**Collectives.** Two sources, both labelled by the mesh dimension whose group they run over
(``world`` for a group of every rank, the step's own count and end-of-window all-reduces):

- FSDP2's parameter all-gathers and gradient reduce-scatters, through its public custom-collective
  hooks (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``), which receive the
  group; they allocate and communicate as FSDP2's defaults do;
- ``torch.distributed`` calls issued from Python (HSDP's all-reduce over the replicas, the step's
  own), patched while counting. DDP's reducer (C++) and DTensor's functional collectives (tensor
  parallel activations, which do not depend on accumulation) are not seen.

Bytes are each call's payload on this rank: a reduce-scatter's input (the unsharded gradient), an
all-gather's output (the unsharded parameter), an all-reduce's tensor.

**Gradient memory held.** :func:`gradient_bytes_held` sums the bytes of every gradient tensor alive
on this rank: each parameter's ``.grad`` (the local shard of a DTensor), and FSDP2's unsharded
gradients kept while reduction is deferred (``FSDPParam._unsharded_param.grad`` and
``unsharded_accumulated_grad``) and the reduce-scattered, not yet all-reduced shards of HSDP
(``FSDPParamGroup._partial_reduce_output``). FSDP2 has no public getter for those in torch 2.13:
they are read with getattr, and a torch without them counts ``.grad`` alone. Views of one buffer
are counted once each by their own size; the same tensor twice, once.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from gradaccum.distributed.comm import RecordingAllGather, RecordingReduceScatter

__all__ = ["MeshCommCounter", "MeshComms", "fsdp_param_groups", "fsdp_units", "gradient_bytes_held"]

# collectives issued from Python, and which argument is the payload counted
_PATCHED = {
    "all_reduce": "tensor",
    "all_gather_into_tensor": "output_tensor",
    "reduce_scatter_tensor": "input",
    "broadcast": "tensor",
    "all_gather": "tensor",
}
_NAMES = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


@dataclass
class MeshComms:
    """Calls and bytes per (collective, mesh dimension) since counting started."""

    calls: dict[tuple[str, str], int] = field(default_factory=dict)
    bytes: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, collective: str, dimension: str, nbytes: int) -> None:
        key = (collective, dimension)
        self.calls[key] = self.calls.get(key, 0) + 1
        self.bytes[key] = self.bytes.get(key, 0) + nbytes


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel() * tensor.element_size()) if isinstance(tensor, torch.Tensor) else 0


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` wrapped, outermost last (``model.modules()`` order reversed)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in reversed(list(model.modules())) if isinstance(m, FSDPModule)]


def fsdp_param_groups(model: nn.Module) -> list[Any]:
    """FSDP2's parameter groups (one per unit that owns parameters), read with getattr: torch 2.13
    has no public accessor. Empty on a torch that lays them out differently."""
    groups: dict[int, Any] = {}
    for unit in fsdp_units(model):
        get_state = getattr(unit, "_get_fsdp_state", None)
        state = get_state() if callable(get_state) else None
        for group in getattr(state, "_fsdp_param_groups", None) or ():
            groups[id(group)] = group
    return list(groups.values())


class MeshCommCounter:
    """Counts collectives by the mesh dimension their group spans (see the module doc).

    ``watch(model)`` installs the counting FSDP2 collectives once (they count only inside
    ``counting()``); ``with counter.counting() as comms:`` also patches ``torch.distributed``.
    """

    def __init__(self, mesh: Any) -> None:
        self.world = dist.get_world_size()
        self.dims: dict[frozenset[int], str] = {}
        for name in mesh.mesh_dim_names:
            ranks = frozenset(dist.get_process_group_ranks(mesh[name].get_group()))
            self.dims.setdefault(ranks, name)
        self._comms: MeshComms | None = None
        self._depth = 0

    def label(self, group: Any) -> str:
        """The mesh dimension ``group`` spans: ``world`` for every rank, ``other`` for none."""
        if group is None:
            return "world"
        ranks = frozenset(dist.get_process_group_ranks(group))
        if len(ranks) == self.world:
            return "world"
        return self.dims.get(ranks, "other")

    def record(self, collective: str, group: Any, nbytes: int) -> None:
        if self._comms is not None and self._depth == 0:
            self._comms.add(collective, self.label(group), nbytes)

    def watch(self, model: nn.Module) -> int:
        """Install the counting collectives on every FSDP2 unit of ``model``; how many units."""
        units = fsdp_units(model)
        for unit in units:
            unit.set_custom_all_gather(RecordingAllGather(self._record_fsdp))  # type: ignore[operator]
            unit.set_custom_reduce_scatter(RecordingReduceScatter(self._record_fsdp))  # type: ignore[operator]
        return len(units)

    def _record_fsdp(self, collective: str, group: Any, nbytes: int) -> None:
        # FSDP2's collectives call torch.distributed's captured originals: never counted twice
        self.record(collective, group, nbytes)

    @contextlib.contextmanager
    def counting(self) -> Iterator[MeshComms]:
        comms = MeshComms()
        saved: list[tuple[str, Any]] = []
        for name, payload in _PATCHED.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            saved.append((name, original))
            setattr(dist, name, self._wrap(name, original, payload))
        self._comms = comms
        try:
            yield comms
        finally:
            self._comms = None
            for name, original in reversed(saved):
                setattr(dist, name, original)

    def _wrap(self, name: str, original: Any, payload: str) -> Any:
        signature = inspect.signature(original)

        def counted(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:
                bound = {}
            self.record(_NAMES.get(name, name), bound.get("group"), _nbytes(bound.get(payload)))
            self._depth += 1  # a collective built on another (all_gather_object) counts once
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def gradient_bytes_held(model: nn.Module) -> int:
    """Bytes of the gradient tensors alive on this rank (see the module doc for which)."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def add(tensor: Any) -> None:
        nonlocal total
        if not isinstance(tensor, torch.Tensor):
            return
        local = _local(tensor)
        if local.numel() == 0:
            return
        key = (local.data_ptr(), local.numel())
        if key not in seen:
            seen.add(key)
            total += _nbytes(local)

    for p in model.parameters():
        add(p.grad)
    for group in fsdp_param_groups(model):
        add(getattr(group, "_partial_reduce_output", None))
        for fsdp_param in getattr(group, "fsdp_params", ()):
            add(getattr(fsdp_param, "unsharded_accumulated_grad", None))
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            add(getattr(unsharded, "grad", None))
    return total
