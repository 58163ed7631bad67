"""What every accumulator shows of the engine it composes: its objects, settings and counters, and
``close()`` (``with Accumulator(...) as acc:``).

A read-only face over :class:`~gradaccum.step.engine.WindowEngine`: the accumulators inherit these
public properties (and ``state_dict``), never the engine's phases, which they call on ``_engine``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn as nn

from gradaccum.step.config import AccumConfig, StepResult
from gradaccum.step.engine import WindowEngine

__all__ = ["EngineFace"]

_Face = TypeVar("_Face", bound="EngineFace")


class EngineFace:
    """The public, read-only attributes of an accumulator (settings live in the frozen config)."""

    _engine: WindowEngine

    def close(self) -> None:
        """Give the model back as found: every hook the step registered is removed, every
        ``grad_dtype`` restored, a window left open (an interrupted step) ended with its ``.grad``
        in the parameters' dtype; a later ``step`` raises. Idempotent; also the end of a
        ``with`` block. See :mod:`gradaccum.step.lifetime`."""
        self._engine.close()

    def __enter__(self: _Face) -> _Face:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """The counters (applied, skipped, consecutive skips) and, with ``noise_scale=True``, the
        noise scale's moving averages: what a resumed run must continue."""
        return self._engine.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue counting from :meth:`state_dict`'s values (a checkpoint's)."""
        self._engine.load_state_dict(state)

    @property
    def config(self) -> AccumConfig:
        return self._engine.config

    @property
    def model(self) -> nn.Module:
        return self._engine.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._engine.optimizer

    @property
    def scheduler(self) -> Any:
        return self._engine.scheduler

    @property
    def scaler(self) -> Any:
        return self._engine.scaler

    @property
    def dp_group(self) -> Any:
        return self._engine.dp_group

    @property
    def device(self) -> torch.device:
        """Where the model's parameters, and the step's counts and flags, live."""
        return self._engine.device

    @property
    def kind(self) -> str:
        """How the model's gradients are synchronized: ``local``, ``ddp``, ``fsdp`` or ``fsdp2``."""
        return self._engine.kind

    @property
    def on_step(self) -> list[Callable[[StepResult], None]]:
        """Hooks called with each applied step's result (append to add one). Where post-scaling
        decides the update on the device, with every window's result: read ``result.applied``."""
        return self._engine.on_step

    @property
    def steps_applied(self) -> int:
        self._engine.settle_counters()  # updates decided on the device are read here
        return self._engine.steps_applied

    @property
    def steps_skipped(self) -> int:
        self._engine.settle_counters()  # updates decided on the device are read here
        return self._engine.steps_skipped

    @property
    def consecutive_skips(self) -> int:
        self._engine.settle_counters()  # updates decided on the device are read here
        return self._engine.consecutive_skips
