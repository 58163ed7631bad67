"""The once-per-window optimizer update: the gradient norm, the finiteness check, then unscale,
clip, step and schedule.

Everything here runs once per optimizer step, after the window's last backward, on gradients that
are already synchronized (DDP), reduced into shards (FSDP) or spread over a mesh. Which norm is the
*global* one depends on where the gradients live, so :class:`OptimizerUpdate` is built once by the
engine with the layout it found and answers the same way every window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from gradaccum.distributed import dist
from gradaccum.mesh.reduction import clip_mesh_grads_, local_squares
from gradaccum.step.accum_dtype import wide_gradients
from gradaccum.step.config import AccumConfig
from gradaccum.step.norms import clip_grads_, nonfinite_flag, total_norm

__all__ = ["OptimizerUpdate"]


class OptimizerUpdate:
    """The optimizer side of one window: built once per engine, called once per applied update."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: AccumConfig,
        *,
        scheduler: Any,
        scaler: Any,
        kind: str,
        synced: Any,
        layout: Any,
        uniform: bool,
        device: torch.device,
    ) -> None:
        self.optimizer = optimizer
        self.config = config
        self.scheduler = scheduler
        self.scaler = scaler
        self.kind = kind
        self.synced = synced  # the DDP/FSDP module; FSDP1 reduces its own norm
        self.layout = layout
        self.uniform = uniform  # every gradient has its parameter's device and dtype
        # a mesh's TP/PP ranks hold parts of the same parameters: each square is counted once
        self.norm_holders = layout.world // layout.pp if layout is not None else 1
        self.one = torch.ones(1, dtype=torch.float32, device=device)  # the fused check's unit scale
        self.device = device
        # finiteness from the fused check alone, decided once: nothing else reads the norm, and the
        # gradients are whole on this rank (a shard's check would be local to the shard)
        self.check_only = (
            config.skip_nonfinite
            and not (config.wants_norm or config.noise_scale)
            and kind in ("local", "ddp")
            and layout is None
        )
        # accum_dtype: narrow gradients summed wide (step/accum_dtype.py), rounded once after clipping
        self.wide = wide_gradients(config.accum_dtype, synced, kind, config.policy, layout, pipeline=False)

    def gradient_check(
        self, grads: list[torch.Tensor], *, noise: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the global norm or None, what says whether the gradient is finite).

        Finiteness comes from the norm when clipping, the report or the noise scale need it anyway,
        else from a fused check that costs a third of it (replicated gradients only: a shard's
        check would be local to the shard). On a mesh the second value is this rank's share of
        the squared norm (:func:`gradaccum.mesh.reduction.local_squares`): it rides in the
        end-of-window all-reduce, and the engine's settle returns the norm.
        """
        if self.check_only:
            flag = nonfinite_flag(grads, uniform=self.uniform, one=self.one)
            if flag is not None:
                return None, flag
        config = self.config
        needs_norm = config.wants_norm or config.skip_nonfinite or noise
        if self.layout is not None:
            return None, local_squares(grads, self.norm_holders, self.device) if needs_norm else None
        if needs_norm:
            norm = self.grad_norm(grads, None)
            return norm, norm
        return None, None

    def grad_norm(self, grads: list[torch.Tensor], group: Any) -> torch.Tensor | None:
        """The global gradient norm: what every rank's clipping and skip decision must see."""
        if self.layout is not None:  # every rank takes part, gradients or not
            squares = local_squares(grads, self.norm_holders, self.device)
            return dist.all_reduce_sum_(squares, group, what="the gradient norm").sqrt()
        if self.kind == "fsdp":
            # FSDP1 shards flat gradients; its own method reduces the norm across ranks. With an
            # infinite max_norm it multiplies by exactly 1 (the clip coefficient is clamped to 1).
            return self.synced.clip_grad_norm_(float("inf"))
        return total_norm(grads, uniform=self.uniform) if grads else None

    def apply(
        self,
        params: Sequence[torch.Tensor],
        grads: list[torch.Tensor],
        norm: torch.Tensor | None,
        norm_host: float,
        group: Any,
    ) -> float:
        """Unscale, clip by the global pre-clip norm, step the optimizer and the scheduler, once.

        Returns the pre-clip norm on the host (recomputed after unscaling under a GradScaler).
        """
        config = self.config
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
            if config.wants_norm:
                norm = self.grad_norm(grads, group)
                norm_host = float(norm.item()) if norm is not None else math.nan
        if config.max_grad_norm is not None and norm is not None:
            if self.layout is not None:  # shards on several meshes: each rank scales its own part
                clip_mesh_grads_(grads, config.max_grad_norm, norm)
            else:
                clip_grads_(params, config.max_grad_norm, norm)
        self.wide.narrow()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return norm_host
