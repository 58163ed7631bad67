"""Exact mode's routing pass: each micro-batch's forward up to its last router, leaving the model's
buffers and the random number generators as it found them.

What the pass needs of a forward is the routers' logits, for ``(c, R)``. The rest (the layers
after the last router, the final norm, the LM head and the loss: with a realistic vocabulary most
of a forward) is not run: once a forward has recorded as many router calls as a whole forward
makes, the capture's ``after`` callback raises :class:`_Routed` inside the router's hook, and the
pass catches it. That number is learned from the pass's first forward of the run, which runs
whole. The same forward shows whether the model draws random numbers before its last router (its
routing then depends on them: dropout, router jitter) and after it (dropout in the layers that
follow). Where it does both, a stopped forward of micro-batch m would leave the generator short of
the draws the training forward of m makes, and the pass of micro-batch m+1 would route under other
random numbers than its training forward; those models run whole forwards in the pass.

Module state: a forward in training mode updates buffers (BatchNorm's running statistics and
``num_batches_tracked``, whatever a module keeps with ``register_buffer``), in place or by
replacing them. The pass clones every buffer of the model before its first forward and, after its
last, puts back the original tensor where one was replaced and copies the saved values into each
(all of them: BatchNorm's kernel writes its running statistics without moving the tensors' version
counters, so no cheaper test tells which changed): the buffers are bitwise those of the same step
without the pass, whatever ``batchnorm_stats`` says. The cost is a copy of the model's buffers per
window, small beside a forward for the models this balances (a rotary table, BatchNorm's moments).
Python attributes a forward changes (a counter, a cache length) are not restored; a routing that
depends on them differs in the training forward, and the step vetoes the update
(``EquivalenceError``) as for any routing the pass cannot replay.

RNG: the pass runs inside ``torch.random.fork_rng`` (the CPU generator, and the device's when it is
CUDA), so the training forwards draw the numbers they would have drawn without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn

from gradaccum.moe.capture import Records, RouterCapture

__all__ = ["RoutingPass"]

Forward = Callable[[Any], Any]
_Kept = tuple[nn.Module, str, torch.Tensor, torch.Tensor]


class _Routed(BaseException):
    """Control flow of the routing pass: the forward has recorded every router call it makes.

    A ``BaseException``, as ``GeneratorExit`` is: a ``loss_fn`` or workload wrapper that turns any
    ``Exception`` into its own error (``check/workload.py`` does) lets it through to the pass."""


def _keep(roots: Iterable[nn.Module]) -> list[_Kept]:
    """Each buffer under ``roots`` with its owner, name and a copy of its values."""
    kept: list[_Kept] = []
    seen: set[int] = set()
    for module in (m for root in roots for m in root.modules()):
        if id(module) in seen:
            continue
        seen.add(id(module))
        for name, buffer in module.named_buffers(recurse=False):
            kept.append((module, name, buffer, buffer.detach().clone()))
    return kept


def _restore(kept: Sequence[_Kept]) -> None:
    """The buffers as :func:`_keep` saw them: the same tensors, holding the same values."""
    with torch.no_grad():
        for module, name, buffer, saved in kept:
            if getattr(module, name, None) is not buffer:
                setattr(module, name, buffer)
            buffer.copy_(saved)


class RoutingPass:
    """The no-grad forwards of exact mode's count phase (see the module docstring)."""

    def __init__(self, capture: RouterCapture, device: torch.device, roots: Sequence[nn.Module]) -> None:
        """``roots``: the modules whose buffers the pass leaves as found (the model, or its routers)."""
        self.capture = capture
        self.device = device
        self._roots = tuple(roots)
        self.calls: int | None = None
        """Router calls per whole forward, learned from the first; 0: the pass runs whole forwards."""

    def run(self, micro_batches: Sequence[Any], forward: Forward) -> list[Records]:
        """Every micro-batch's recorded router logits, the model's buffers and the RNG left as found."""
        out: list[Records] = []
        devices = [self.device] if self.device.type == "cuda" else []
        kept = _keep(self._roots)
        try:
            with torch.random.fork_rng(devices=devices, device_type=self.device.type), torch.no_grad():
                for mb in micro_batches:
                    whole = self.calls is None  # the run's first forward: learn where to stop
                    out.append(self._probe(mb, forward) if whole else self._forward(mb, forward))
        finally:
            _restore(kept)
        return out

    def _forward(self, mb: Any, forward: Forward) -> Records:
        calls = self.calls or 0

        def stop(records: Records) -> None:
            if len(records) >= calls:  # the last router has run: nothing after it is needed
                raise _Routed

        after = stop if calls else None
        with self.capture.recording(graph=False, after=after) as records, contextlib.suppress(_Routed):
            forward(mb)
        return records

    def _probe(self, mb: Any, forward: Forward) -> Records:
        """A whole forward: how many router calls it makes, and where it draws random numbers."""
        start = self._rng()
        at_last = [start]

        def note(records: Records) -> None:
            at_last[0] = self._rng()

        with self.capture.recording(graph=False, after=note) as records:
            forward(mb)
        draws_before = not _same(start, at_last[0])
        draws_after = not _same(at_last[0], self._rng())
        self.calls = 0 if draws_before and draws_after else len(records)
        return records

    def _rng(self) -> list[torch.Tensor]:
        states = [torch.get_rng_state()]
        if self.device.type == "cuda":
            states.append(torch.cuda.get_rng_state(self.device))
        return states


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
