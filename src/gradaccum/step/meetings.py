"""The agreement points before a synchronizing backward, and DDP's bookkeeping across windows.

Under DDP a rank that fails mid-window must not leave the others waiting in the gradient
all-reduce of their synchronizing backward. So, with ``agree_on_failure`` on, every rank meets
before that backward (one small all-reduce that also carries the window's loss): all go on, or all
clear their gradients and raise. :mod:`gradaccum.step.agreement` says what the meeting carries and
what it cannot cover; this module holds the one piece of state it leaves behind: after an agreed
failure DDP still expects the backward of a synchronizing forward that completed, so the next
window's first micro-batch synchronizes on every rank (``resync``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch

from gradaccum.step.agreement import (
    LocalFailure,
    agree_before_backward,
    raise_alone,
    raise_from_sync_backward,
)
from gradaccum.step.batchnorm import WindowBatchNorm
from gradaccum.step.window import Backward, Contribution

__all__ = ["Meetings"]


class Meetings:
    """Where the ranks meet in a window, built once per engine."""

    def __init__(
        self,
        kind: str,
        *,
        agree_on_failure: bool,
        group: Any,
        reduced_params: Sequence[tuple[str, torch.Tensor]],
        backward: Backward,
        zero_grad: Callable[[], None],
        zero: torch.Tensor,
    ) -> None:
        self.kind = kind
        self.agree_on_failure = agree_on_failure
        self.group = group
        self.reduced_params = reduced_params  # what DDP waits for in a synchronizing backward
        self.backward = backward
        self.zero_grad = zero_grad
        self.zero = zero
        # batchnorm_stats="window": its moments ride in the meeting (set by step/batchnorm.py)
        self.batchnorm: WindowBatchNorm | None = None
        # the wrapper's bookkeeping across windows, not a failure carried between phases
        self.resync = False

    def meets(self, distributed: bool) -> bool:
        """Whether the ranks meet before synchronizing backwards (DDP with agreement on)."""
        return distributed and self.kind == "ddp" and self.agree_on_failure

    def outside(self, failure: LocalFailure | None, distributed: bool) -> None:
        """An agreement point outside the micro-batch loop (gradient caching's phases): a failure
        raises on every rank (one flags all-reduce under DDP), or at once where no rank waits."""
        if self.meets(distributed):
            self.agree(failure, 0, None, self.tally([], []))
        elif failure is not None:
            self.fail_alone(failure, distributed)

    def fail_alone(self, failure: LocalFailure, distributed: bool) -> NoReturn:
        """A failure no other rank learns of here: one process, FSDP, or agreement turned off."""
        self.zero_grad()
        self.resync = self.kind == "ddp"
        raise_alone(failure, recoverable=not distributed)

    def tally(self, losses: list[torch.Tensor], rejections: list[torch.Tensor]) -> torch.Tensor:
        """The window's loss and vetoes so far, as the meeting carries them; then, in a BatchNorm
        window, the moments so far (:meth:`split` takes them back out)."""
        loss = torch.stack(losses).sum(dtype=torch.float64) if losses else self.zero
        rejected = torch.stack(rejections).sum(dtype=torch.float64) if rejections else self.zero
        tally = torch.stack([loss, rejected])
        if self.batchnorm is not None and self.batchnorm.open:
            tally = torch.cat([tally, self.batchnorm.payload(tally.device)])
        return tally

    def split(self, reduced: list[float]) -> list[float]:
        """The reduced tally's loss and vetoes; the BatchNorm moments after them go to their part."""
        if self.batchnorm is not None and self.batchnorm.open and len(reduced) > 2:
            self.batchnorm.receive(reduced[2:])
        return reduced[:2]

    def agree(
        self, failure: LocalFailure | None, index: int, piece: Contribution | None, tally: torch.Tensor
    ) -> list[float] | None:
        """Before a synchronizing backward: all ranks go on, or all clear their gradients and raise."""
        try:
            reduced = agree_before_backward(
                failure,
                None if piece is None else piece.backprop,
                index,
                self.kind,
                check_parameters=self.reduced_params,
                group=self.group,
                tally=tally,
                resynchronizing=index == 0 and self.resync,
            )
        except BaseException:
            self.abandoned()
            raise
        return None if reduced is None else self.split(reduced)

    def abandoned(self) -> None:
        """A window given up at a meeting: gradients cleared, and DDP resynchronizes next window."""
        self.zero_grad()
        self.resync = self.kind == "ddp"

    def sync_backward(self, contribution: torch.Tensor, index: int) -> None:
        """The synchronizing backward; a failure in it is reported as one that reached DDP."""
        try:
            self.backward(contribution)
        except Exception as exc:
            self.zero_grad()
            raise_from_sync_backward(exc, index, self.group)
        self.resync = False
