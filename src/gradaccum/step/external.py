"""An optimizer step owned by a training engine: what the window engine needs from it.

Some engines (DeepSpeed's) reduce, partition, check, clip and apply the gradients themselves, and
keep them where ``p.grad`` does not show them (ZeRO's partitions). The window engine still counts
the window, agrees on N and backpropagates each micro-batch's summed loss x F/N; at the end of the
window it hands the update to the :class:`ExternalStep` instead of clipping and stepping
``optimizer`` itself (:mod:`gradaccum.integrations.deepspeed` implements it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["ExternalOutcome", "ExternalStep"]


@dataclass(frozen=True, slots=True)
class ExternalOutcome:
    """What one external optimizer step did, the same on every rank."""

    applied: bool
    """Whether the parameters were updated (``False``: the engine found the gradients non-finite
    and discarded them on every rank)."""
    grad_norm: float | None
    """The global pre-clip gradient norm the engine computed, or ``None`` where it computed none."""


class ExternalStep(Protocol):
    """The end of a window, done by the engine that holds the gradients."""

    @property
    def factor(self) -> float:
        """F: what the engine's gradient reduction divides the ranks' summed gradient by."""
        ...

    @property
    def holds_gradients(self) -> bool:
        """Whether ``p.grad`` of the model's parameters holds the whole synchronized gradient after
        the last backward: then the window engine checks it (finite? norm?) as for DDP; otherwise
        the external step checks its own gradients and says in :class:`ExternalOutcome`."""
        ...

    def apply(self) -> ExternalOutcome:
        """Clip, step the optimizer and the learning-rate schedule once (or discard, see above)."""
        ...
