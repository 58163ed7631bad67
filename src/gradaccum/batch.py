"""Batches as tensors, tuples or mappings of tensors that share dim 0: size, slice, split, move.

The equivalence check, the benchmarks and the trainer all cut one batch of examples into
micro-batches; this module is the one place that knows how. It is also the one reading of a
micro-batch's named fields (:func:`fields`): any mapping (a dict, transformers' ``BatchEncoding``,
a ``UserDict``), a namedtuple or a dataclass, so that no reader asks "is this a dict?" and misses
the mask of a batch a tokenizer or collator returned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import torch

from gradaccum.errors import PlanError
from gradaccum.values import is_int, require_int

__all__ = [
    "PAD_VALUES",
    "Batch",
    "batch_size",
    "cast",
    "concat",
    "fields",
    "pad_length",
    "select",
    "split",
    "split_sizes",
    "take",
    "to_device",
    "trim_length",
]

Batch: TypeAlias = Any
"""A tensor, or a tuple/list/mapping (possibly nested) of tensors that share dim 0."""


_UNNAMED = frozenset((tuple, list, torch.Tensor))
"""Exact types whose instances have no named fields (a namedtuple or a tensor subclass is none of them)."""


def fields(micro_batch: Batch) -> Mapping[Any, Any] | None:
    """A micro-batch's named fields, or ``None`` where it has no names (a tensor, a plain tuple or
    list, anything else).

    Any :class:`~collections.abc.Mapping` is returned as it is (a dict, transformers'
    ``BatchEncoding``, a ``UserDict``: their ``attention_mask`` is read the same way); a
    namedtuple's and a dataclass instance's fields come back as a dict by name. Every library reader
    of a micro-batch's ``attention_mask``, ``labels`` or other field goes through this function.
    """
    kind = type(micro_batch)
    if kind is dict:  # the usual micro-batches first: Mapping's isinstance runs an ABC check in Python
        return micro_batch
    if kind in _UNNAMED:
        return None
    if isinstance(micro_batch, Mapping):
        return micro_batch
    if isinstance(micro_batch, tuple) and hasattr(micro_batch, "_fields"):
        return dict(zip(micro_batch._fields, micro_batch, strict=True))
    if dataclasses.is_dataclass(micro_batch) and not isinstance(micro_batch, type):
        return {f.name: getattr(micro_batch, f.name) for f in dataclasses.fields(micro_batch)}
    return None


def _is_record(batch: Any) -> bool:
    """A dataclass instance: walked field by field, rebuilt with its own type."""
    return dataclasses.is_dataclass(batch) and not isinstance(batch, type)


def _leaves(batch: Batch) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [leaf for value in batch.values() for leaf in _leaves(value)]
    if _is_record(batch):
        return [leaf for f in dataclasses.fields(batch) for leaf in _leaves(getattr(batch, f.name))]
    if isinstance(batch, (tuple, list)):
        return [leaf for value in batch for leaf in _leaves(value)]
    return []


def _rebuild(like: Any, values: Any) -> Any:
    """A container of ``like``'s type holding ``values`` (a dict for mappings, a list otherwise)."""
    if isinstance(like, Mapping):
        try:
            return type(like)(values)  # type: ignore[call-arg]
        except TypeError:
            return dict(values)
    if hasattr(like, "_fields"):  # a namedtuple takes its fields positionally
        return type(like)(*values)
    return type(like)(values)


def _map(batch: Batch, fn: Any) -> Batch:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return _rebuild(batch, {key: _map(value, fn) for key, value in batch.items()})
    if _is_record(batch):
        return _record(batch, {f.name: _map(getattr(batch, f.name), fn) for f in dataclasses.fields(batch)})
    if isinstance(batch, (tuple, list)):
        return _rebuild(batch, [_map(value, fn) for value in batch])
    return batch


def _record(like: Any, values: dict[str, Any]) -> Any:
    """A copy of the dataclass instance ``like`` holding ``values`` (its fields by name)."""
    return dataclasses.replace(like, **values)


def batch_size(batch: Batch) -> int:
    """Examples in ``batch``: the shared size of dim 0 of every tensor in it."""
    leaves = _leaves(batch)
    if not leaves:
        raise PlanError(
            f"a batch must be a tensor or a tuple/list/mapping of tensors, got {type(batch).__name__}"
        )
    sizes = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
    if None in sizes or len(sizes) != 1:
        shapes = [tuple(leaf.shape) for leaf in leaves]
        raise PlanError(f"the tensors of a batch must share dim 0; got shapes {shapes}")
    return int(sizes.pop())  # type: ignore[arg-type]


def take(batch: Batch, start: int, stop: int) -> Batch:
    """Examples ``start:stop`` of ``batch`` (views, no copies)."""
    return _map(batch, lambda t: t[start:stop])


def select(batch: Batch, rows: torch.Tensor) -> Batch:
    """The examples of ``batch`` at the indices ``rows`` (a 1-D integer tensor), in that order
    (new tensors: indexing copies)."""
    return _map(batch, lambda t: t.index_select(0, rows.to(t.device)))


def to_device(batch: Batch, device: torch.device | str) -> Batch:
    """``batch`` with every tensor moved to ``device``."""
    return _map(batch, lambda t: t.to(device))


def cast(batch: Batch, dtype: torch.dtype, device: torch.device | str | None = None) -> Batch:
    """``batch`` with its floating tensors in ``dtype`` (integer ids and labels keep theirs), every
    tensor moved to ``device`` when one is given."""

    def convert(t: torch.Tensor) -> torch.Tensor:
        target = dtype if t.is_floating_point() else t.dtype
        return t.to(target) if device is None else t.to(device=device, dtype=target)

    return _map(batch, convert)


def split_sizes(total: int, micro_batch: int | None = None, sizes: Sequence[int] | None = None) -> list[int]:
    """Micro-batch sizes that cover ``total`` examples exactly.

    Either ``micro_batch`` (which must divide ``total``) or an explicit ``sizes`` partition.
    """
    if (micro_batch is None) == (sizes is None):
        raise PlanError("give exactly one of micro_batch or sizes")
    if sizes is not None:
        parts = list(sizes)
        bad = [s for s in parts if not is_int(s) or s < 1]
        if bad or not parts:
            raise PlanError(f"partition sizes must be positive integers, got {parts}")
        if sum(parts) != total:
            raise PlanError(f"partition sizes {parts} sum to {sum(parts)}, but the batch holds {total}")
        return parts
    assert micro_batch is not None
    require_int("micro_batch", micro_batch)
    if total % micro_batch:
        raise PlanError(
            f"micro_batch={micro_batch} does not divide the batch of {total} examples; "
            f"use a divisor of {total} or pass an explicit partition (sizes summing to {total})"
        )
    return [micro_batch] * (total // micro_batch)


def split(batch: Batch, micro_batch: int | None = None, sizes: Sequence[int] | None = None) -> list[Batch]:
    """Cut ``batch`` into consecutive micro-batches, in order."""
    parts = split_sizes(batch_size(batch), micro_batch, sizes)
    out, start = [], 0
    for size in parts:
        out.append(take(batch, start, start + size))
        start += size
    return out


def concat(batches: Sequence[Batch]) -> Batch:
    """The inverse of :func:`split`: micro-batches of the same structure joined along dim 0."""
    if not batches:
        raise PlanError("concat needs at least one batch")
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(batches))
    if isinstance(first, Mapping):
        return _rebuild(first, {key: concat([b[key] for b in batches]) for key in first})
    if _is_record(first):
        names = [f.name for f in dataclasses.fields(first)]
        return _record(first, {n: concat([getattr(b, n) for b in batches]) for n in names})
    if isinstance(first, (tuple, list)):
        return _rebuild(first, [concat([b[i] for b in batches]) for i in range(len(first))])
    raise PlanError(f"cannot concatenate batches of type {type(first).__name__}")


PAD_VALUES: dict[str | int, float] = {
    "input_ids": 0,
    "labels": -100,  # gradaccum.loss.IGNORE_INDEX: a padded position counts no unit
    "attention_mask": 0,
    "position_ids": 0,
    "token_type_ids": 0,
}
"""What :func:`pad_length` pads the usual token-batch keys with; any other padded tensor needs a
value given, because a wrong one (a label 0 instead of the ignore index) would silently count."""


def pad_length(batch: Batch, multiple: int, values: Mapping[str | int, float] | None = None) -> Batch:
    """``batch`` with dim 1 (the sequence) of every tensor of 2 or more dims right-padded to a
    multiple of ``multiple``; tensors of one dim (per-row values) are kept.

    The value of each padded tensor is ``values[key]`` (its key in a mapping or its field's name in
    a dataclass or a namedtuple, or its index in a tuple), else :data:`PAD_VALUES`; a padded tensor
    without one is refused. Right padding with labels at the ignore index leaves a causal model's
    loss, counts and gradients unchanged (no earlier position attends to a later one); a
    bidirectional model also needs its attention mask padded with 0, as the defaults do.
    Padded tensors are new, contiguous tensors.
    """
    require_int("pad_to_multiple", multiple, error=PlanError)
    table = {**PAD_VALUES, **(values or {})}
    lengths = {leaf.shape[1] for leaf in _leaves(batch) if leaf.ndim >= 2}
    if len(lengths) > 1:
        raise PlanError(
            f"pad_to_multiple pads dim 1 of every tensor with 2 or more dims, but this micro-batch's "
            f"have different sizes there ({sorted(lengths)}); pad it in the collate function instead"
        )
    if not lengths:
        return batch
    length = lengths.pop()
    target = -(-length // multiple) * multiple
    if target == length:
        return batch

    def pad(key: str | int | None, t: torch.Tensor) -> torch.Tensor:
        if t.ndim < 2:
            return t
        if key is None:
            raise PlanError(
                "pad_to_multiple: a micro-batch that is one bare tensor has no key to give a padding "
                "value for; pass micro-batches as mappings or tuples (e.g. {'input_ids': ..., 'labels': ...})"
            )
        if key not in table:
            raise PlanError(
                f"pad_to_multiple: no padding value for the micro-batch's tensor {key!r} (known: "
                f"{sorted(map(str, table))}); pass pad_values={{{key!r}: VALUE}}, e.g. the loss's "
                "ignore index for labels"
            )
        shape = (t.shape[0], target - length, *t.shape[2:])
        return torch.cat([t, t.new_full(shape, table[key])], dim=1)

    if isinstance(batch, torch.Tensor):
        return pad(None, batch)
    if isinstance(batch, Mapping):
        return _rebuild(batch, {key: _map(value, lambda t, k=key: pad(k, t)) for key, value in batch.items()})
    if _is_record(batch):
        named = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
        return _record(batch, {key: _map(value, lambda t, k=key: pad(k, t)) for key, value in named.items()})
    if isinstance(batch, (tuple, list)):
        # a namedtuple's tensor is padded by its field's name where the table knows it, else by index
        names = getattr(batch, "_fields", None) or [None] * len(batch)
        keys = [n if n in table else i for i, n in enumerate(names)]
        return _rebuild(
            batch, [_map(value, lambda t, k=k: pad(k, t)) for k, value in zip(keys, batch, strict=True)]
        )
    return batch


def trim_length(batch: Batch, length: int) -> Batch:
    """``batch`` with dim 1 (the sequence) of every tensor of 2 or more dims cut to its first
    ``length`` positions (views); tensors of one dim (per-row values) are kept.

    The inverse of :func:`pad_length` on right-padded rows: positions past every row's last valid
    token are padding, so cutting them changes no count, loss or gradient of a causal or masked
    model. The tensors must share their size at dim 1, as in :func:`pad_length`.
    """
    require_int("length", length, error=PlanError)
    lengths = {leaf.shape[1] for leaf in _leaves(batch) if leaf.ndim >= 2}
    if len(lengths) > 1:
        raise PlanError(
            f"trimming cuts dim 1 of every tensor with 2 or more dims, but this batch's have different "
            f"sizes there ({sorted(lengths)}); give every per-token tensor the shape (rows, seq, ...)"
        )
    return _map(batch, lambda t: t[:, :length] if t.ndim >= 2 else t)
