"""Router outputs captured by forward hooks, only while the step records a forward.

A hook on every router appends ``(layer, logits)`` while :meth:`RouterCapture.recording` is open:
around a micro-batch's forward (and the no-grad routing pass). Activation checkpointing recomputes
the routers during the *backward*, outside any recording, so a recompute neither counts nor adds
the term twice; the logits captured in the forward keep their place in the autograd graph (with
non-reentrant checkpointing, transformers' default, only their saved inputs are recomputed).
Reentrant checkpointing runs the forward without a graph: its logits carry no gradient, and
:meth:`RouterCapture.recording` refuses them instead of dropping the term's gradient silently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

from gradaccum.errors import ConfigError

__all__ = ["RouterCapture"]

Records = list[tuple[int, torch.Tensor]]


class RouterCapture:
    """Forward hooks on the routers, registered once; they record only inside :meth:`recording`."""

    def __init__(self, routers: Sequence[nn.Module], logits_index: int) -> None:
        self._routers = list(routers)
        self._index = logits_index
        self._records: Records | None = None
        self._after: Callable[[Records], None] | None = None
        self._handles = [r.register_forward_hook(self._hook(layer)) for layer, r in enumerate(self._routers)]

    def _hook(self, layer: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            records = self._records
            if records is None:
                return  # a recompute in the backward, an evaluation: not the step's forward
            logits = output[self._index] if isinstance(output, (tuple, list)) else output
            if not isinstance(logits, torch.Tensor):
                raise ConfigError(
                    f"router {layer} ({type(module).__name__}) returned {type(logits).__name__} where its "
                    f"logits should be (LoadBalance.logits_index={self._index})"
                )
            records.append((layer, logits))
            if self._after is not None:
                self._after(records)

        return hook

    @contextmanager
    def recording(self, *, graph: bool, after: Callable[[Records], None] | None = None) -> Iterator[Records]:
        """Record the routers' logits of the forwards run inside; ``graph``: the forward builds the
        backward's graph, so every trainable router's logits must carry a gradient. ``after``:
        called with the records after each one is added, inside the router's hook (the routing
        pass stops its forward there, :mod:`gradaccum.moe.routing`)."""
        records: Records = []
        self._records, self._after = records, after
        try:
            yield records
        finally:
            self._records, self._after = None, None
        if graph and torch.is_grad_enabled():
            for layer, logits in records:
                trains = any(p.requires_grad for p in self._routers[layer].parameters())
                if trains and logits.grad_fn is None:
                    raise ConfigError(
                        f"router {layer}'s logits carry no gradient although its weights train: reentrant "
                        "activation checkpointing runs the forward without a graph. Use non-reentrant "
                        "checkpointing (gradient_checkpointing_kwargs={'use_reentrant': False}, the default)."
                    )

    def remove(self) -> None:
        """Take the hooks off the routers."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
