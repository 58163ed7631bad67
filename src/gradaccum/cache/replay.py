"""The parts of gradient caching that handle representations: RNG capture and replay, checks,
the exact gather across ranks, and the scalar that sends cached gradients into a replay.

:mod:`gradaccum.cache.accumulator` composes them into :class:`~gradaccum.cache.accumulator.CachedAccumulator`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from gradaccum.distributed import dist
from gradaccum.errors import CacheError, LossError

__all__ = [
    "CacheError",
    "ShapeMeta",
    "as_reps",
    "check_ranks_reps",
    "check_rep_loss",
    "gather_reps",
    "replay_contribution",
    "replay_error",
]

ShapeMeta = list[tuple[tuple[int, ...], str]]
"""One rank's representations: (shape, dtype name) per tower."""


def as_reps(out: object, index: int) -> tuple[tuple[torch.Tensor, ...], bool]:
    """``encode_fn``'s result as a tuple of towers, and whether it was a single tensor."""
    single = isinstance(out, torch.Tensor)
    reps = (out,) if single else out
    if not isinstance(reps, (tuple, list)) or not reps:
        raise CacheError(
            f"encode_fn returned {type(out).__name__} for micro-batch {index}; it must return a tensor "
            "of representations, or a tuple with one tensor per tower"
        )
    for t, rep in enumerate(reps):
        if not isinstance(rep, torch.Tensor) or rep.ndim == 0 or not rep.dtype.is_floating_point:
            what = f"shape {tuple(rep.shape)}, dtype {rep.dtype}" if isinstance(rep, torch.Tensor) else rep
            raise CacheError(
                f"encode_fn returned {what} as tower {t} of micro-batch {index}; representations must "
                "be floating-point tensors with examples along dim 0"
            )
    return tuple(reps), single


def check_rep_loss(loss: object) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.dtype.is_floating_point:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss)
        raise LossError(
            f"loss_fn(reps) returned {what}; it must return the window's objective as a floating-point "
            "scalar (e.g. the mean InfoNCE loss over all pairs)"
        )
    if not loss.requires_grad:
        raise LossError(
            "loss_fn(reps) returned a scalar that does not depend on the representations (no grad); "
            "was it computed under torch.no_grad() or from detached tensors?"
        )
    return loss


def gather_reps(
    local: list[torch.Tensor], metas: list[ShapeMeta], group: Any
) -> tuple[list[torch.Tensor], list[int]]:
    """Every rank's representations per tower, in rank order, and the row where this rank's start.

    Ranks may hold different numbers of rows (``metas`` carries every rank's shapes): each rank
    writes its rows at its offset into a zero buffer and the buffers are summed. Adding zeros is
    exact, so this is an exact gather, in one collective per dtype.
    """
    if not dist.is_distributed(group):
        return local, [0] * len(local)
    me = dist.rank(group)
    rows = [[meta[t][0][0] for meta in metas] for t in range(len(local))]
    starts = [sum(r[:me]) for r in rows]
    gathered: dict[int, torch.Tensor] = {}
    for dtype in dict.fromkeys(rep.dtype for rep in local):
        towers = [t for t, rep in enumerate(local) if rep.dtype == dtype]
        inner = [math.prod(local[t].shape[1:]) for t in towers]
        sizes = [sum(rows[t]) * n for t, n in zip(towers, inner, strict=True)]
        flat = local[towers[0]].new_zeros(sum(sizes))
        base = 0
        for t, n, size in zip(towers, inner, sizes, strict=True):
            flat[base + starts[t] * n : base + (starts[t] + rows[t][me]) * n] = local[t].reshape(-1)
            base += size
        dist.all_reduce_sum_(flat, group, what="the window's representations")
        for t, part in zip(towers, flat.split(sizes), strict=True):
            gathered[t] = part.view(sum(rows[t]), *local[t].shape[1:])
    return [gathered[t] for t in range(len(local))], starts


def check_ranks_reps(metas: list[ShapeMeta]) -> None:
    """Towers, trailing shapes and dtypes must agree across ranks; every rank raises alike."""

    def signature(meta: list[tuple[tuple[int, ...], str]]) -> list[tuple[tuple[int, ...], str]]:
        return [(shape[1:], dtype) for shape, dtype in meta]

    if any(signature(m) != signature(metas[0]) for m in metas):
        lines = "\n".join(
            f"  rank {r}: "
            + ", ".join(f"tower {t} {s[0]} rows x {list(s[1:])} {d}" for t, (s, d) in enumerate(m))
            for r, m in enumerate(metas)
        )
        raise CacheError(
            "ranks' representations cannot be concatenated: every rank's encode_fn must return the "
            f"same towers with the same trailing shape and dtype (rows may differ):\n{lines}"
        )


def replay_contribution(
    reps: tuple[torch.Tensor, ...], before: tuple[torch.Tensor, ...], grads: list[torch.Tensor], index: int
) -> torch.Tensor:
    """sum_t <R_t, G_t>: a scalar whose backward sends exactly G_t into each replayed R_t.

    (d/dR of sum(R * G) is 1 * G, exact.) A scalar lets the replay reuse the Accumulator's
    agreement point and synchronizing backward, which take the tensor about to be backpropagated.
    """
    if len(reps) != len(before) or any(a.shape != b.shape for a, b in zip(reps, before, strict=True)):
        raise CacheError(
            f"the second pass of micro-batch {index} returned shapes {[tuple(r.shape) for r in reps]}, the "
            f"first {[tuple(r.shape) for r in before]}: encode_fn must be deterministic given the "
            "micro-batch and torch's RNG state"
        )
    terms = [(r * g).sum() for r, g in zip(reps, grads, strict=True) if r.requires_grad]
    if not terms:
        raise CacheError(
            f"no representation of micro-batch {index} requires grad in the second pass: the encoder "
            "has no trainable parameters, or encode_fn detached its outputs"
        )
    return torch.stack(terms).sum() if len(terms) > 1 else terms[0]


def replay_error(now: Sequence[torch.Tensor], before: Sequence[torch.Tensor]) -> torch.Tensor:
    """Largest per-tower relative L2 difference between the second and the first pass."""
    errors = [
        torch.linalg.vector_norm(a.detach() - b, dtype=torch.float64)
        / torch.linalg.vector_norm(b, dtype=torch.float64).clamp(min=torch.finfo(torch.float64).tiny)
        for a, b in zip(now, before, strict=True)
    ]
    return torch.stack(errors).max()
