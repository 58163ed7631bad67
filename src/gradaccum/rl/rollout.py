"""Rollouts that span several optimizer updates: one generation batch, M updates of k micro-batches.

Two normalizations, both exact, chosen by name:

* ``"update"`` (the default, what the papers define): each update is the mean over its own window,
  the accumulator's count of the loss's units (tokens or sequences) in that update on all ranks.
* ``"generation"``: each update divides its summed loss by the generation batch's count per update,
  N_gen / M, the same for all M updates (what TRL's ``dapo`` and ``cispo`` mean to compute). This
  fits the engine's rule without touching it: the count becomes each micro-batch's rows, whose
  window total is the generation batch's rows R_gen / M, and the loss is scaled by R_gen / N_gen,
  so an update backpropagates (summed loss) x (R_gen / N_gen) / (R_gen / M) = (summed loss) x M / N_gen.
  N_gen and R_gen are summed over the data-parallel ranks once, when the updates are built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

import torch
import torch.nn as nn

from gradaccum.batch import Batch, batch_size, split
from gradaccum.distributed import dist
from gradaccum.errors import ConfigError, PlanError
from gradaccum.values import is_int, require_choice

__all__ = ["ROLLOUT_NORMALIZATIONS", "RolloutNormalization", "RolloutUpdate", "rollout_updates"]

RolloutNormalization = Literal["update", "generation"]
ROLLOUT_NORMALIZATIONS: tuple[str, ...] = get_args(RolloutNormalization)


class _Loss(Protocol):
    def loss_fn(self, model: nn.Module, micro_batch: Any) -> torch.Tensor: ...
    def count_fn(self, micro_batch: Any) -> Any: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutUpdate:
    """One optimizer update of a rollout: ``acc.step(u.micro_batches, u.loss_fn, u.count_fn)``."""

    micro_batches: tuple[Batch, ...]
    """This rank's micro-batches of the update, in order."""
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    """The summed loss (scaled by R_gen / N_gen under ``"generation"``)."""
    count_fn: Callable[[Any], Any]
    """The loss's units (``"update"``), or the micro-batch's rows (``"generation"``)."""


@dataclass(frozen=True, slots=True)
class _GenerationScaled:
    """A loss normalized by the generation batch's count per update (see the module docstring)."""

    loss: _Loss
    scale: float
    """R_gen / N_gen, over every rank."""

    def loss_fn(self, model: nn.Module, micro_batch: Any) -> torch.Tensor:
        return self.loss.loss_fn(model, micro_batch) * self.scale

    def count_fn(self, micro_batch: Any) -> int:
        return batch_size(micro_batch)

    def positions(self, micro_batch: Any) -> Any:
        """The wrapped loss's target positions, for the denominator audit."""
        positions = getattr(self.loss, "positions", None)
        return positions(micro_batch) if callable(positions) else self.loss.count_fn(micro_batch)


def rollout_updates(
    rollout: Batch,
    loss: _Loss,
    *,
    updates: int,
    micro_batch: int | None = None,
    normalize: RolloutNormalization = "update",
) -> list[RolloutUpdate]:
    """Split this rank's share of a generation batch into ``updates`` optimizer updates.

    ``rollout`` is a mapping of tensors sharing dim 0 (a policy or preference micro-batch of all
    the rows); its rows are cut into ``updates`` equal, consecutive updates, each into micro-batches
    of ``micro_batch`` rows (default: one micro-batch per update). ``loss`` is a
    :class:`~gradaccum.rl.PolicyLoss` or :class:`~gradaccum.rl.PreferenceLoss` (anything with
    ``loss_fn`` and ``count_fn``). Under DDP every rank calls this with the same ``updates`` and
    ``normalize``; ``"generation"`` sums the counts over the ranks (one all-reduce).
    """
    require_choice("rollout_updates normalize", normalize, ROLLOUT_NORMALIZATIONS)
    if not is_int(updates) or updates < 1:
        raise ConfigError(f"rollout_updates updates must be a positive int, got {updates!r}")
    rows = batch_size(rollout)
    if rows % updates:
        raise PlanError(
            f"rollout_updates: {rows} rows of this rank's rollout do not split into {updates} equal "
            f"updates; generate a multiple of {updates} rows per rank"
        )
    per_update = rows // updates
    if micro_batch is not None and (not is_int(micro_batch) or micro_batch < 1 or per_update % micro_batch):
        raise PlanError(
            f"rollout_updates: micro_batch={micro_batch!r} does not divide the {per_update} rows of an "
            f"update ({rows} rows / {updates} updates)"
        )
    parts = split(rollout, micro_batch=per_update)
    loss_fn, count_fn = loss.loss_fn, loss.count_fn
    if normalize == "generation":
        scaled = _GenerationScaled(loss, _rows_per_unit(rollout, loss, rows))
        loss_fn, count_fn = scaled.loss_fn, scaled.count_fn
    size = per_update if micro_batch is None else micro_batch
    return [
        RolloutUpdate(micro_batches=tuple(split(part, micro_batch=size)), loss_fn=loss_fn, count_fn=count_fn)
        for part in parts
    ]


def _rows_per_unit(rollout: Batch, loss: _Loss, rows: int) -> float:
    """R_gen / N_gen over every rank (N_gen clamped to 1: a batch without units adds nothing)."""
    count = torch.as_tensor(loss.count_fn(rollout))
    totals = torch.stack([count.to(torch.float64).reshape(()), count.new_tensor(rows, dtype=torch.float64)])
    totals = dist.all_reduce_sum_(totals, what="the generation batch's counts")
    units, all_rows = totals.tolist()
    return all_rows / max(units, 1.0)
