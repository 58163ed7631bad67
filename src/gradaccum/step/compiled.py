"""Counting what ``torch.compile`` compiles during a window: ``StepResult.recompiles``.

Accumulation is where compiled training goes quietly wrong in two ways, and the step guards both:

* **The scale never enters a graph.** The engine multiplies each micro-batch's summed loss by W/N
  as a 0-dim tensor *outside* the model's forward (``loss * scale`` in the step, after ``loss_fn``
  returned), so a compiled model sees the same inputs whatever N is: no graph holds N as a Python
  constant, and a window with another N neither recompiles nor reuses a stale denominator.
* **Varying micro-batch shapes recompile.** Dynamo compiles a graph for the shapes it first sees,
  recompiles once with the changed dimensions dynamic, and specializes sizes 0 and 1 (a one-row
  micro-batch, a length-1 sequence) and, on torch 2.13, a zero storage offset (the first of the
  views :func:`gradaccum.split` cuts from one batch) in graphs of their own. After a warm-up that
  has seen each of those kinds once (at most four graphs for the first frame: static, size-1,
  dynamic, dynamic at offset 0), windows of any row count >= 2 and any length reuse the dynamic
  graph: the documented bound is **at most one recompile in 100 windows after warm-up** (the one
  a new kind of micro-batch costs, e.g. a first one-row remainder). With ``dynamic=False`` (or
  CUDA graphs, ``mode="reduce-overhead"``) every distinct shape is a graph and dynamo falls back to
  eager after ``torch._dynamo.config.recompile_limit`` (8) of them: pad the micro-batches with
  ``gradaccum.windows(..., pad_to_multiple=N)`` so that at most max_len / N lengths exist.

``recompiles`` counts the graphs dynamo compiled in this process while the window ran (the model's,
and any compiled loss), so a step that recompiled says so. torch 2.13 has no public counter of
compiled graphs: this reads dynamo's own statistics (``torch._dynamo.utils.counters["stats"]
["unique_graphs"]``, incremented once per graph it compiles) through ``getattr`` with 0 as the
fallback, and only when dynamo is already imported, so an eager run pays one dictionary lookup and
imports nothing.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["CompileCounter", "graphs_compiled"]


_counters: list[Any] = []  # dynamo's statistics, once found (a module global it clears, never replaces)


def graphs_compiled() -> int:
    """Graphs ``torch.compile`` compiled in this process so far; 0 when dynamo was never imported
    (nothing can have compiled) or its statistics are not where torch 2.4-2.13 keep them."""
    if _counters:
        counters = _counters[0]
    else:
        counters = getattr(sys.modules.get("torch._dynamo.utils"), "counters", None)
        if counters is None:
            return 0
        _counters.append(counters)
    try:
        return int(counters["stats"]["unique_graphs"])
    except (KeyError, TypeError, ValueError):
        return 0


class CompileCounter:
    """Graphs compiled since :meth:`start`: the engine starts it when a window opens."""

    __slots__ = ("_start",)

    def __init__(self) -> None:
        self._start = graphs_compiled()

    def start(self) -> None:
        self._start = graphs_compiled()

    def since(self) -> int:
        """Graphs compiled since :meth:`start` (never negative: ``torch._dynamo.reset()`` clears the
        statistics, after which the count starts again from 0)."""
        now = graphs_compiled()
        return now - self._start if now >= self._start else now
