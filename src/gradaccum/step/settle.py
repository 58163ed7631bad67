"""The end-of-window summary: the figures every rank's verdict reads, reduced and read once.

After the last backward each rank knows its own loss, its vetoes, its gradient's finiteness or
squared norm, and the window's counts. The verdict (apply, skip, refuse) must be the same on every
rank, so it reads figures that are the same on every rank: those still local are summed in one
small all-reduce, and everything travels to the host in one read. One process skips the reduction
and reads one stacked tensor.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from gradaccum.step.batchnorm import WindowBatchNorm
from gradaccum.step.ledger import Ledger
from gradaccum.step.noise import NoiseScaleMeter
from gradaccum.step.window import Accumulated, WindowCount, WindowTotals

__all__ = ["WindowSettler"]


class WindowSettler:
    """Built once per engine with what does not change between windows; :meth:`settle` per window."""

    def __init__(
        self,
        zero: torch.Tensor,
        group: Any,
        *,
        layout: Any,
        noise: NoiseScaleMeter | None,
        scaler: Any,
    ) -> None:
        self.device = zero.device
        self.group = group
        self.layout = layout
        self.noise = noise
        self.scaler = scaler
        self.batchnorm: WindowBatchNorm | None = None  # set by step/batchnorm.py, like the meeting's
        # ranks that hold the same tokens (TP) add the same loss: the sum is divided by them
        self.loss_replicas = layout.tp if layout is not None else 1
        self.zero = zero  # the engine's 0-dim float64 zero: vetoes that are this tensor were never summed

    def settle(
        self,
        counted: WindowCount,
        accumulated: Accumulated,
        objective: torch.Tensor | None,
        gradient: torch.Tensor | None,
        norm: torch.Tensor | None,
        *,
        distributed: bool,
    ) -> tuple[WindowTotals, torch.Tensor | None]:
        """The end-of-window summary, reduced over ranks where it is still local and read once;
        and the gradient norm (on a mesh, assembled here from every rank's squares).

        The count is global already (collective 1), and so is the norm off a mesh (gradients are
        synchronized; sharded norms are reduced by :meth:`OptimizerUpdate.grad_norm`). The loss and the vetoes
        are global when the ranks met before the synchronizing backward; else they are summed
        here, in one small all-reduce, with the noise scale's per-rank sums and a mesh's squares.
        Ranks that hold the same tokens (TP) add the same loss: the sum is divided by them.
        """
        noise = self.noise
        if not distributed and noise is None and self.layout is None:
            alone = self.read_alone(counted, accumulated, objective, gradient)
            if alone is not None:
                return alone, norm
        still_local = distributed and not accumulated.loss_is_global
        squares = self.layout is not None and gradient is not None
        ledger = Ledger(self.device)
        # one process adds the micro-batches' losses on the host, as read_alone does (the same bits)
        added_here = objective is None and accumulated.loss is None and not distributed
        if added_here:
            ledger.add("loss", self.zero, summed=False)
            ledger.add("losses", torch.stack(accumulated.losses), summed=False)
        elif objective is None:
            ledger.add("loss", accumulated.loss_sum(), summed=still_local)
        else:  # the objective is computed identically on every rank: never summed
            ledger.add("loss", objective.detach(), summed=False)
        ledger.add("rejected", accumulated.rejected, summed=still_local)
        ledger.add("gradient", self.zero if gradient is None else gradient, summed=squares)
        if noise is not None:
            # every rank's micro-batches are small batches: P and K are summed over ranks
            small, batches, big, sigma = noise.window_sums(
                counted.counts, norm, self.scaler, rescale=counted.post_factor()
            )
            ledger.add("noise_small", small, summed=distributed)
            ledger.add("noise_batches", batches, summed=distributed)
            ledger.add("noise_global", torch.stack([big, sigma]), summed=False)
        # BatchNorm window moments not pooled in a meeting ride in this all-reduce (step/batchnorm.py)
        batchnorm = (
            self.batchnorm if still_local and self.batchnorm is not None and self.batchnorm.layers else None
        )
        if batchnorm is not None:
            ledger.add("batchnorm", batchnorm.payload(self.device))
        ledger.add("global_count", counted.global_count, summed=False)
        ledger.add("local_count", counted.local_count, summed=False)
        smallest = self.zero if counted.min_count is None else counted.min_count
        ledger.add("smallest_count", smallest, summed=False)
        what = "the window's loss" if noise is None else "the window's loss and noise-scale sums"
        settled = ledger.settle(self.group, what=what, distributed=distributed)
        totals = settled.unpack(WindowTotals)
        if added_here:
            totals = dataclasses.replace(totals, loss=math.fsum(settled.value("losses")))  # type: ignore[arg-type]
        if batchnorm is not None:
            batchnorm.receive(settled.device("batchnorm"))
        if noise is not None:
            big_sq, scale_sigma = settled.value("noise_global")  # type: ignore[misc]
            noisy = [settled.value("noise_small"), settled.value("noise_batches"), big_sq, scale_sigma]
            totals = dataclasses.replace(totals, noise=noisy)  # type: ignore[arg-type]
        if distributed and objective is None and self.loss_replicas > 1:
            totals = dataclasses.replace(totals, loss=totals.loss / self.loss_replicas)
        if squares:
            norm = settled.device("gradient").sqrt()
            totals = dataclasses.replace(totals, gradient=math.sqrt(max(totals.gradient, 0.0)))
        return totals, norm

    def read_alone(
        self,
        counted: WindowCount,
        accumulated: Accumulated,
        objective: torch.Tensor | None,
        gradient: torch.Tensor | None,
    ) -> WindowTotals | None:
        """One process, nothing to reduce: the figures in one stack and one read (the ledger packs
        them one by one, ~40 us more on every update), the micro-batches' losses among them, added
        on the host (``math.fsum``: rounded once); ``None`` when they are not all 0-dim on one
        device, for the ledger to pack."""
        losses = accumulated.losses if objective is None else (objective.detach(),)
        if not losses:
            losses = (accumulated.loss_sum(),)
        figures = [*losses, self.zero if gradient is None else gradient]
        # N known on the host (int or CPU counts, one process): no count to read
        counts_here = counted.global_host is not None and counted.min_count is None
        if not counts_here:
            smallest = self.zero if counted.min_count is None else counted.min_count
            figures += [counted.global_count, counted.local_count, smallest]
        no_vetoes = accumulated.rejected is self.zero  # known on the host: not read
        if not no_vetoes:
            figures.append(accumulated.rejected)
        try:  # one device and all 0-dim, or stack refuses them (cheaper than checking each)
            stacked = torch.stack(figures)
        except RuntimeError:
            return None
        # float64 where counts ride along (exact below 2**53); else any float dtype, which holds
        # each figure exactly (stack promotes to the widest)
        wanted = stacked.dtype.is_floating_point if counts_here else stacked.dtype == torch.float64
        if stacked.ndim != 1 or not wanted:
            return None
        values = stacked.tolist()
        rejected = 0.0 if no_vetoes else values.pop()
        if counts_here:
            *summands, flag = values
            n = float(counted.global_host)  # type: ignore[arg-type]
            return WindowTotals(math.fsum(summands), rejected, flag, n, n, 0.0)
        *summands, flag, global_count, local_count, smallest = values
        return WindowTotals(math.fsum(summands), rejected, flag, global_count, local_count, smallest)
