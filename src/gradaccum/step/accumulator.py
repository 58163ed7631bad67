"""The exact accumulating optimizer step: ``Accumulator(...).step(window, loss_fn, count_fn)``.

Each micro-batch backpropagates ``loss_fn(model, micro_batch)`` (its loss *summed* over the
``count_fn(micro_batch)`` units it counts) times W/N, N counted over the whole window on every
rank before the first backward; :mod:`gradaccum.step.engine` has the derivation and runs the window.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from gradaccum.distributed.sync import ddp_forward_checked
from gradaccum.errors import ConfigError
from gradaccum.moe.balancer import WindowBalance
from gradaccum.moe.runner import balanced_forward, balancer_for, routing_forward
from gradaccum.moe.spec import LoadBalance
from gradaccum.step.checks import check_loss, unmean
from gradaccum.step.config import AccumConfig, StepResult
from gradaccum.step.engine import WindowEngine
from gradaccum.step.face import EngineFace
from gradaccum.step.lifetime import closed_error
from gradaccum.step.noise import NoiseScale
from gradaccum.step.plain import plain_window
from gradaccum.step.post_scaling import PostScalingEngine
from gradaccum.step.reduction import ReductionCheck
from gradaccum.step.stream import declared_length
from gradaccum.step.window import (
    ZERO_COUNT,
    Backward,
    CastScale,
    Contribution,
    CountFn,
    Observer,
    WindowCount,
)

__all__ = [
    "ZERO_COUNT",
    "AccumConfig",
    "Accumulator",
    "CountFn",
    "LossFn",
    "NoiseScale",
    "StepResult",
    "WindowCount",
]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""``loss_fn(model, micro_batch)``: the loss summed over the micro-batch's counted units."""


class Accumulator(EngineFace):
    """Runs one exact optimizer step over a window of micro-batches.

    >>> acc = Accumulator(model, optimizer, scheduler=None, max_grad_norm=1.0)
    >>> result = acc.step(window, loss_fn, count_fn)

    The settings are one :class:`AccumConfig`: pass ``config=AccumConfig(...)``, or its fields as
    keywords (``max_grad_norm`` also positionally), not both. Under ``torch.distributed`` the model
    must be wrapped in DDP, FSDP or FSDP2 (``fully_shard``), whose averaging over ranks the step
    compensates for. The counts are summed across the data-parallel group in one small all-reduce
    before the first backward and read on the host once, so that every rank refuses an empty
    window or skips a zero-count window together instead of hanging; on one process nothing
    leaves the device until the end-of-step check.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        scaler: Any = None,
        *,
        config: AccumConfig | None = None,
        dp_group: Any = None,
        mesh: Any = None,
        mesh_dims: Mapping[str, str] | None = None,
        on_step: Sequence[Callable[[StepResult], None]] = (),
        observer: Observer | None = None,
        backward: Backward | None = None,
        balance: LoadBalance | None = None,
        **settings: Any,
    ) -> None:
        """``settings``: :class:`AccumConfig`'s fields as keywords (``loss_reduction``,
        ``defer_sync``, ``track_grad_norm``, ...), when no ``config`` is given. ``mesh``: the
        ``DeviceMesh`` the model was parallelized with, its dimensions named by role
        (``dp_replicate``, ``dp_shard``, ``cp``, ``tp``; ``mesh_dims`` maps other names), instead of
        ``dp_group``: N is summed over the data dimensions only (see :mod:`gradaccum.mesh`). ``backward``: how
        a micro-batch's scaled loss is backpropagated (``Tensor.backward`` by default; Lightning's
        ``manual_backward`` in :func:`gradaccum.integrations.lightning.window_step`). ``balance``:
        an MoE load balance (:class:`gradaccum.moe.LoadBalance`); ``loss_fn`` then returns the summed
        cross-entropy only, and the step adds each micro-batch's part of the window's balancing term."""
        if max_grad_norm is not None:  # the one setting also taken positionally; None = not given
            settings["max_grad_norm"] = max_grad_norm
        config = AccumConfig.resolve(config, settings)
        engine = PostScalingEngine if config.scaling == "post" else WindowEngine
        balancer = balancer_for(balance, model, config)
        self._host_scales: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = {}
        self._engine: WindowEngine = engine(
            model,
            optimizer,
            config,
            scheduler=scheduler,
            scaler=scaler,
            dp_group=dp_group,
            mesh=mesh,
            mesh_dims=mesh_dims,
            on_step=on_step,
            observer=observer,
            backward=backward,
            balance=balancer,
        )
        if balancer is not None:  # its counts carry, and its bias moves, once per applied update
            hooks = self._engine.on_step  # before the caller's hooks, which may evaluate the model
            hooks.insert(len(hooks) - len(on_step), balancer.applied)
        # the first window's losses are read for a mean passed as a sum (step/reduction.py)
        self._reduction = ReductionCheck(config.loss_reduction, config.check_loss_reduction)
        # decided once: a plain step skips what only distributed or optional features use
        self._plain = plain_window(self._engine)
        # DDP must run its forward in a synchronizing micro-batch; a backward of the caller's own
        # (Lightning's manual_backward, whose training_step already runs inside DDP's forward)
        # prepares the reducer itself
        self._sync_kind = self._engine.kind if backward is None else "local"

    @classmethod
    def from_config(
        cls, model: nn.Module, optimizer: torch.optim.Optimizer, config: AccumConfig, **objects: Any
    ) -> Accumulator:
        """An Accumulator with the settings a run card recorded: ``cls(model, optimizer,
        config=config, **objects)`` (objects: ``scheduler``, ``scaler``, ``dp_group``, ...)."""
        return cls(model, optimizer, config=config, **objects)

    @property
    def balance(self) -> WindowBalance | None:
        """The running load balance (its last window's counts and term), or ``None``."""
        return self._engine.balance

    @property
    def noise_scale(self) -> NoiseScale:
        """The gradient noise scale B_simple over the windows stepped so far (frozen), with
        ``noise_scale=True``; a :class:`ConfigError` without. See :mod:`gradaccum.step.noise`."""
        return self._engine.noise_scale

    def step(
        self, window: Iterable[Any], loss_fn: LossFn, count_fn: CountFn, *, length: int | None = None
    ) -> StepResult:
        """Accumulate the window's gradients exactly and apply one optimizer update.

        With ``scaling="post"`` the window may be any iterable, consumed once, in order
        (:mod:`gradaccum.step.stream`); ``length``: its number of micro-batches, when known (the
        step then reads none ahead, and takes exactly that many from a longer iterator)."""
        engine = self._engine
        if engine.closed:  # before any path touches the gradients
            raise closed_error("Accumulator")
        if engine.config.scaling == "post":
            return self._step_post(window, loss_fn, count_fn, declared_length(window, length))
        if length is not None:
            raise ConfigError(
                f"length={length!r} declares a streamed window's size and applies with scaling='post'; "
                "with scaling='pre' the step reads the whole window first. Drop length=."
            )
        if self._plain is not None and self._plain.applies():
            return self._plain.step(window, loss_fn, count_fn, self._reduction)
        micro_batches, failure = engine.open(window)
        model, scaler, balance = engine.model, engine.scaler, engine.balance
        if balance is not None:
            balance.use(routing_forward(model, loss_fn))
        counted = engine.count(micro_batches, count_fn, failure)
        engine.zero_grad()
        if counted.global_host == 0:  # known before any forward under torch.distributed
            return engine.skip(0, 0, len(micro_batches), None, ZERO_COUNT)
        mean = engine.config.loss_reduction == "mean"
        # each micro-batch adds sum_t l_t / N; DDP then averages over W ranks, so scale by W / N
        scale = CastScale(counted.scale())
        counts = counted.counts
        reduction = self._reduction
        judging = reduction.pending  # the first window only: a refusal raises inside contribute

        def contribute(i: int, mb: Any) -> Contribution:
            if balance is None:
                loss, term, rejected = check_loss(loss_fn(model, mb), i), None, None
            else:
                loss, term, rejected = balanced_forward(balance, i, mb, model, loss_fn)
            if judging:
                reduction.judge(loss, counts[i], i)
            if mean:
                loss = unmean(loss, counts[i], i)
            contribution = loss * scale.to(loss.dtype)
            if term is not None:  # its part of the window's term; DDP averages over W ranks, so times W
                contribution = contribution + (term * counted.factor).to(loss.dtype)
            if scaler is not None:
                contribution = scaler.scale(contribution)
            return Contribution(contribution, loss.detach(), rejected)

        checked = ddp_forward_checked(model, self._sync_kind, contribute)
        accumulated = engine.accumulate(micro_batches, checked)
        reduction.pending = False  # every micro-batch's loss was read without a refusal
        if balance is None:
            return engine.conclude(counted, accumulated)
        balance.finish()
        return engine.conclude(counted, accumulated, rejection=balance.rejection)

    def _step_post(
        self, window: Iterable[Any], loss_fn: LossFn, count_fn: CountFn, length: int | None
    ) -> StepResult:
        """Post-scaling: each micro-batch backpropagates c * its summed loss as it arrives; the
        engine multiplies the gradients by W/(N c) once the window is done."""
        engine = self._engine
        engine.zero_grad()
        model, scaler = engine.model, engine.scaler
        mean = engine.config.loss_reduction == "mean"
        scales: dict[torch.dtype, torch.Tensor] = {}
        reduction = self._reduction
        judging = reduction.pending  # the first window only: a refusal raises inside contribute

        def contribute(i: int, mb: Any, count: int | torch.Tensor, c: torch.Tensor | float) -> Contribution:
            loss = check_loss(loss_fn(model, mb), i)
            if judging:
                reduction.judge(loss, count, i)
            if mean:
                loss = unmean(loss, count, i)
            scale = scales.get(loss.dtype)
            if scale is None:  # c is a power of two: exact in every float dtype
                scale = scales[loss.dtype] = self._post_scale(c, loss)
            contribution = loss * scale
            if scaler is not None:
                contribution = scaler.scale(contribution)
            return Contribution(contribution, loss.detach())

        assert isinstance(engine, PostScalingEngine)
        checked = ddp_forward_checked(model, self._sync_kind, contribute)
        counted, accumulated = engine.stream(window, checked, count_fn, length=length)
        reduction.pending = False
        return engine.conclude(counted, accumulated)

    def _post_scale(self, c: torch.Tensor | float, loss: torch.Tensor) -> torch.Tensor:
        """c in the loss's dtype, on its device. A tensor even when c is a host float (tensor *
        tensor dispatches ~1.4 us faster than tensor * float, once per micro-batch); a host c
        rarely changes from window to window, so its tensor is kept for the next ones."""
        if not isinstance(c, float):
            return c.to(loss.dtype)
        key = (c, loss.dtype, loss.device)
        scale = self._host_scales.get(key)
        if scale is None:
            if len(self._host_scales) > 8:  # the count drifted: drop the powers of two of the past
                self._host_scales.clear()
            scale = self._host_scales[key] = torch.tensor(c, dtype=loss.dtype, device=loss.device)
        return scale
