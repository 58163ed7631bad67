"""The values that cross ranks, by name: one pack, one all-reduce, one host read, one unpack.

The step meets the other ranks in a few small all-reduces, each carrying several numbers at once
(the count, flags, the loss, the norm, fingerprints). Addressing them by position
(``summary[6:8]``) makes every new value an edit of offsets in three places; a :class:`Ledger`
names them instead::

    ledger = Ledger(device)
    ledger.add("global_count", local_count)       # summed over the group
    ledger.add("local_count", local_count, summed=False)
    settled = ledger.settle(group, what="the window's counts")
    totals = settled.unpack(CountTotals)          # a frozen dataclass whose fields are the names
    n = settled.device("global_count")            # still on the device, for the scale

Summed slots are packed first, so the all-reduce covers one contiguous prefix; the rest rides in
the same host read. A slot holds a scalar or a 1-d run of values (a fingerprint); a run unpacks as
a list. Everything travels as float64, exact for integers below 2**53.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import torch

from gradaccum.distributed import dist

__all__ = ["Ledger", "Settled"]

T = TypeVar("T")
Value = torch.Tensor | float | int | bool | Sequence[float]


@dataclass(frozen=True, slots=True)
class _Slot:
    name: str
    start: int
    size: int
    vector: bool


class Ledger:
    """Named values to reduce across ranks (or only to read, on one process) in one go."""

    __slots__ = ("_device", "_local", "_summed")

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._summed: list[tuple[str, torch.Tensor | list[float], bool]] = []
        self._local: list[tuple[str, torch.Tensor | list[float], bool]] = []

    def add(self, name: str, value: Value, *, summed: bool = True) -> None:
        """Record ``value`` under ``name``; ``summed=False``: read as it is on this rank.

        Host numbers are kept on the host until :meth:`settle` copies them in one tensor, so a
        ledger of flags costs one copy, not one per flag."""
        entry: torch.Tensor | list[float]
        if isinstance(value, torch.Tensor):
            vector = value.ndim > 0
            entry = value.detach().reshape(-1)
        elif isinstance(value, (float, int, bool)):
            vector, entry = False, [float(value)]
        else:
            vector, entry = True, [float(v) for v in value]
        (self._summed if summed else self._local).append((name, entry, vector))

    def settle(self, group: Any = None, *, what: str, distributed: bool = True) -> Settled:
        """Sum the summed slots over ``group`` (when ``distributed``), then read everything once."""
        pieces: list[torch.Tensor] = []
        pending: list[float] = []
        slots: dict[str, _Slot] = {}
        start = summed = 0
        for index, (name, entry, vector) in enumerate(self._summed + self._local):
            if isinstance(entry, list):
                pending.extend(entry)
            else:
                if pending:
                    pieces.append(torch.tensor(pending, dtype=torch.float64, device=self._device))
                    pending = []
                pieces.append(entry.to(device=self._device, dtype=torch.float64))
            size = len(entry) if isinstance(entry, list) else entry.numel()
            slots[name] = _Slot(name, start, size, vector)
            start += size
            if index < len(self._summed):
                summed = start
        if pending:
            pieces.append(torch.tensor(pending, dtype=torch.float64, device=self._device))
        packed = torch.cat(pieces) if len(pieces) > 1 else pieces[0] if pieces else torch.zeros(0)
        if distributed and summed:
            if summed == start:
                packed = dist.all_reduce_sum_(packed if len(pieces) > 1 else packed.clone(), group, what=what)
            else:
                packed[:summed] = dist.all_reduce_sum_(packed[:summed].clone(), group, what=what)
        return Settled(packed, slots)


class Settled:
    """A ledger after its reduction: host values by name (read once), device slices on demand."""

    __slots__ = ("_host", "_packed", "_slots")

    def __init__(self, packed: torch.Tensor, slots: dict[str, _Slot]) -> None:
        self._packed = packed
        self._slots = slots
        self._host: list[float] | None = None

    def value(self, name: str) -> float | list[float]:
        """The slot's value on the host (the first call reads the whole ledger once)."""
        if self._host is None:
            self._host = self._packed.tolist()
        slot = self._slots[name]
        values = self._host[slot.start : slot.start + slot.size]
        return values if slot.vector else values[0]

    def unpack(self, cls: type[T]) -> T:
        """``cls(**{field: value})`` for a dataclass whose field names are slot names; a field
        without a slot keeps its default (a value that only some windows carry)."""
        values = {f.name: self.value(f.name) for f in fields(cls) if f.name in self._slots}  # type: ignore[arg-type]
        return cls(**values)

    def device(self, name: str) -> torch.Tensor:
        """The slot as a tensor on the device (no host read): a scalar slot as a 0-dim tensor."""
        slot = self._slots[name]
        part = self._packed[slot.start : slot.start + slot.size]
        return part if slot.vector else part[0]
