"""The controlled conditions of the equivalence check: what it switches off so that the two
partitionings differ in nothing but how the batch is cut.

Randomness is switched off by setting drop probabilities to 0, not by calling ``eval()``: a module
may read a child's probability itself in training mode (GPT-2's attention passes
``self.attn_dropout.p if self.training else 0.0`` to its attention kernel), and ``eval()`` on the
child would leave that draw in place. Normalization keeps its training mode: per-micro-batch
statistics are exactly what the check must show.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.nn as nn

from gradaccum.hazards.scanner import RandomSource, random_sources

__all__ = ["randomness_off"]


@contextlib.contextmanager
def randomness_off(*models: nn.Module) -> Iterator[tuple[RandomSource, ...]]:
    """Within the block, every switchable random source of ``models`` draws nothing; on exit each
    attribute has its value back. Yields the sources of the first model (what a report lists)."""
    saved: list[tuple[nn.Module, str, Any]] = []
    first: tuple[RandomSource, ...] = ()
    try:
        for i, model in enumerate(models):
            sources = tuple(random_sources(model))
            if i == 0:
                first = sources
            for source in sources:
                if source.attribute is None:
                    continue  # fractional pooling: the reproducibility probe reports it
                module = model.get_submodule(source.path)
                saved.append((module, source.attribute, getattr(module, source.attribute)))
                setattr(module, source.attribute, False if source.attribute == "training" else 0.0)
        yield first
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)
