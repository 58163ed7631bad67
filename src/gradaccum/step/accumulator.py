"""The exact accumulating optimizer step: ``Accumulator(...).step(window, loss_fn, count_fn)``.

Each micro-batch backpropagates ``loss_fn(model, micro_batch)`` (its loss *summed* over the
``count_fn(micro_batch)`` units it counts) times W/N, N counted over the whole window on every
rank before the first backward; :mod:`gradaccum.step.engine` has the derivation and runs the window.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn

from gradaccum.errors import ConfigError
from gradaccum.step.checks import check_loss, unmean
from gradaccum.step.config import AccumConfig, LossReduction, StepResult
from gradaccum.step.engine import ZERO_COUNT, Contribution, CountFn, Observer, WindowCount, WindowEngine
from gradaccum.step.face import EngineFace
from gradaccum.step.noise import NoiseScale

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

_UNSET: Any = object()
"""A keyword the caller did not pass (so ``config=`` and explicit keywords can be told apart)."""


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
        max_grad_norm: float | None = _UNSET,
        scaler: Any = None,
        *,
        loss_reduction: LossReduction = _UNSET,
        defer_sync: bool = _UNSET,
        track_grad_norm: bool = _UNSET,
        skip_nonfinite: bool = _UNSET,
        max_consecutive_skips: int | None = _UNSET,
        agree_on_failure: bool = _UNSET,
        noise_scale: bool = _UNSET,
        config: AccumConfig | None = None,
        dp_group: Any = None,
        on_step: Sequence[Callable[[StepResult], None]] = (),
        observer: Observer | None = None,
    ) -> None:
        keywords = {
            "max_grad_norm": max_grad_norm,
            "loss_reduction": loss_reduction,
            "defer_sync": defer_sync,
            "track_grad_norm": track_grad_norm,
            "skip_nonfinite": skip_nonfinite,
            "max_consecutive_skips": max_consecutive_skips,
            "agree_on_failure": agree_on_failure,
            "noise_scale": noise_scale,
        }
        config = resolve_config(config, keywords)
        self._engine = WindowEngine(
            model,
            optimizer,
            config,
            scheduler=scheduler,
            scaler=scaler,
            dp_group=dp_group,
            on_step=on_step,
            observer=observer,
        )

    @classmethod
    def from_config(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: AccumConfig,
        *,
        scheduler: Any = None,
        scaler: Any = None,
        dp_group: Any = None,
        on_step: Sequence[Callable[[StepResult], None]] = (),
        observer: Observer | None = None,
    ) -> Accumulator:
        """An Accumulator with the settings a run card recorded (the same as ``config=``)."""
        return cls(
            model,
            optimizer,
            scheduler,
            scaler=scaler,
            config=config,
            dp_group=dp_group,
            on_step=on_step,
            observer=observer,
        )

    @property
    def noise_scale(self) -> NoiseScale:
        """The gradient noise scale B_simple over the windows stepped so far (frozen), with
        ``noise_scale=True``; a :class:`ConfigError` without. See :mod:`gradaccum.step.noise`."""
        return self._engine.noise_scale

    def step(self, window: Iterable[Any], loss_fn: LossFn, count_fn: CountFn) -> StepResult:
        """Accumulate the window's gradients exactly and apply one optimizer update."""
        engine = self._engine
        micro_batches, failure = engine.open(window)
        counted = engine.count(micro_batches, count_fn, failure)
        engine.zero_grad()
        if counted.global_host == 0:  # known before any forward under torch.distributed
            return engine.skip(0, 0, len(micro_batches), None, ZERO_COUNT)
        model, scaler = engine.model, engine.scaler
        mean = engine.config.loss_reduction == "mean"
        # each micro-batch adds sum_t l_t / N; DDP then averages over W ranks, so scale by W / N
        scale64 = counted.scale()
        scales: dict[torch.dtype, torch.Tensor] = {}
        counts = counted.counts

        def contribute(i: int, mb: Any) -> Contribution:
            loss = check_loss(loss_fn(model, mb), i)
            if mean:
                loss = unmean(loss, counts[i], i)
            scale = scales.get(loss.dtype)
            if scale is None:
                scale = scales[loss.dtype] = scale64.to(loss.dtype)
            contribution = loss * scale
            if scaler is not None:
                contribution = scaler.scale(contribution)
            return Contribution(contribution, loss.detach())

        accumulated = engine.accumulate(micro_batches, contribute)
        return engine.conclude(counted, accumulated)


def resolve_config(config: AccumConfig | None, keywords: dict[str, Any]) -> AccumConfig:
    """``config`` as given, or one built from the keywords the caller passed; not both."""
    given = {name: value for name, value in keywords.items() if value is not _UNSET}
    if config is None:
        return AccumConfig(**given)
    if not isinstance(config, AccumConfig):
        raise ConfigError(f"config must be a gradaccum.AccumConfig, got {type(config).__name__}")
    if given:
        raise ConfigError(
            f"pass the settings as config=AccumConfig(...) or as keywords, not both; got config and "
            f"{', '.join(sorted(given))}. Use dataclasses.replace(config, ...) to change a few."
        )
    return config
