"""Torch's random generators: capture their state, restore it, run a block from it.

One record for every user: the OOM retry restores the generators where a failed attempt began
(so dropout draws what an uninterrupted run would), gradient caching replays each micro-batch from
its first pass's state, and checkpoints save them with the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = ["RngState", "capture_rng", "replaying", "restore_rng"]


@dataclass(frozen=True, slots=True)
class RngState:
    """The CPU generator's state and that of each listed CUDA device."""

    cpu: torch.Tensor
    cuda: tuple[tuple[int, torch.Tensor], ...] = ()
    """(device index, state) for each CUDA device captured."""

    @property
    def cuda_devices(self) -> list[int]:
        return [d for d, _ in self.cuda]


def capture_rng(cuda_devices: Sequence[int] | None = None) -> RngState:
    """The generators' state now. ``cuda_devices``: which CUDA devices (``None``: every device,
    once CUDA is initialized; none before, so capturing never initializes CUDA)."""
    if cuda_devices is None:
        cuda_devices = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else ()
    return RngState(torch.get_rng_state(), tuple((d, torch.cuda.get_rng_state(d)) for d in cuda_devices))


def restore_rng(state: RngState) -> None:
    """Put the generators back to ``state``."""
    torch.set_rng_state(state.cpu)
    for device, cuda_state in state.cuda:
        torch.cuda.set_rng_state(cuda_state, device)


@contextlib.contextmanager
def replaying(state: RngState) -> Iterator[None]:
    """Run the block from ``state``, then put the generators back where they were.

    A window replayed this way advances the global generators only by its first passes, exactly as
    one un-cached pass over the same micro-batches would.
    """
    with torch.random.fork_rng(devices=state.cuda_devices):
        restore_rng(state)
        yield
