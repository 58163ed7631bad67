"""BatchNorm running statistics over the window: ``AccumConfig(batchnorm_stats="window")``.

PyTorch's BatchNorm updates ``running_mean``/``running_var`` in every training forward, so a window
of k micro-batches moves them k times per optimizer step (an effective momentum of
``1 - (1 - m)^k``), each time from one micro-batch's moments. With ``batchnorm_stats="window"``
they move once per applied optimizer step, from the pooled moments of what each BatchNorm saw: the
inputs of its training forwards over the window (on every data-parallel rank). For a BatchNorm
whose input does not pass through another one, that is what one forward over the whole window's
rows would leave; a BatchNorm behind another sees inputs that were normalized per micro-batch, so
its estimate is the pooled one, not that of a whole-window forward:

- a forward pre-hook on every BatchNorm that tracks running statistics reads the per-channel
  moments of its input in each training forward of the window: the count n, the mean and
  M2 = sum (x - mean)^2, in float64, pooled with Chan's parallel merge
  (n = n_a + n_b, d = mean_b - mean_a, mean = mean_a + d n_b / n, M2 = M2_a + M2_b + d^2 n_a n_b / n);
- the module's own update in those forwards must not leak: the hook snapshots the three buffers
  at the module's first forward of the window and the verdict restores them (a copy of 2C + 1
  values per layer per window). Setting momentum to 0 instead is not exact: ``0 * NaN`` is NaN,
  ``num_batches_tracked`` still advances per forward (and drives momentum=None), and changing an
  attribute makes torch.compile recompile;
- at an applied verdict the buffers are restored and updated once, with PyTorch's arithmetic:
  ``num_batches_tracked += 1``, f = momentum (or 1 / num_batches_tracked when momentum is None),
  ``running_mean = f mean + (1 - f) running_mean``, ``running_var = f M2 / (n - 1) + (1 - f)
  running_var`` (the unbiased variance, as PyTorch keeps);
- a skipped window (non-finite, or zero counted units) and an abandoned one (a failure
  mid-window) restore the snapshot: the buffers stay as they were before the window, as the
  parameters do.

The hooks are registered when the accumulator is built and removed by ``close()`` (or when the
part is collected): torch.compile does not see module hooks added after it traced the module
(:mod:`gradaccum.step.lifetime`); outside an open window they return at once.

Recompute under activation checkpointing runs the forward again inside the backward; the hook
skips forwards made while the autograd engine runs (the test FSDP2 and ``ModuleTracker`` use), so
it does not count. Each forward still *normalizes* with its own micro-batch's statistics: only the
running estimates (what evaluation uses) become the window's.

Across data-parallel ranks the moments are pooled for every BatchNorm, not only SyncBatchNorm:
plain BatchNorm under DDP keeps rank 0's statistics (``broadcast_buffers=True``) or lets the ranks
drift apart (``False``); the window's estimate over every rank's rows is the better one and is the
same on every rank. They travel as sums around a common shift K (each layer's running mean at the
window's start, the same on every rank since DDP broadcasts buffers when it is built):
``[n, n (mean - K), M2 + n (mean - K)^2]`` sum to ``[N, N (mu - K), M2_total + N (mu - K)^2]``,
which is Chan's merge written as a sum, so the pooled moments ride in an all-reduce the step makes
anyway (the meeting before the synchronizing backward, or the end-of-window summary). The shift
bounds the cancellation: the variance's relative error is about 1e-16 (1 + (mu - K)^2 / var).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from gradaccum.errors import ConfigError

__all__ = ["WindowBatchNorm", "window_batchnorm"]

_BATCH_NORM = nn.modules.batchnorm._BatchNorm  # every flavour: 1d/2d/3d, Sync, Lazy, subclasses


def _in_backward() -> bool:
    """Whether the autograd engine is running: a forward here is a checkpoint's recompute."""
    return bool(torch._C._current_graph_task_id() != -1)


class _Layer:
    """One BatchNorm's pooled moments in the open window, and its buffers at the window's start."""

    __slots__ = ("count", "m2", "mean", "module", "pooled", "snapshot")

    def __init__(self, module: nn.modules.batchnorm._BatchNorm) -> None:
        self.module = module
        self.count = 0
        self.mean: torch.Tensor | None = None
        self.m2: torch.Tensor | None = None
        self.snapshot: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # every rank's moments from the latest reduction, kept apart from this rank's own: a
        # window may meet more than once (a resynchronizing first micro-batch, sync every micro-batch)
        self.pooled: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def reset(self) -> None:
        self.count, self.mean, self.m2, self.snapshot, self.pooled = 0, None, None, None, None

    def moments(self) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """(n, mean, M2) for the update: every rank's after a reduction, else this rank's."""
        if self.pooled is not None:
            return self.pooled
        if self.count == 0 or self.mean is None or self.m2 is None:
            return None
        return self.count, self.mean, self.m2

    def merge(self, n: int, mean: torch.Tensor, m2: torch.Tensor) -> None:
        """Chan's parallel merge of (n, mean, M2) into the pooled moments."""
        if self.count == 0 or self.mean is None or self.m2 is None:
            self.count, self.mean, self.m2 = n, mean, m2
            return
        total = self.count + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta * delta * (self.count * n / total)
        self.count = total

    def restore(self) -> None:
        """Put the buffers back as they were at the window's start (no-op if it never ran)."""
        if self.snapshot is not None:
            module = self.module
            for buffer, saved in zip(
                (module.running_mean, module.running_var, module.num_batches_tracked),
                self.snapshot,
                strict=True,
            ):
                assert buffer is not None
                buffer.copy_(saved)


class WindowBatchNorm:
    """The hooks and the once-per-window update of ``batchnorm_stats="window"``; built by the engine.

    :meth:`start` opens a window (before its first forward), :meth:`apply` closes it with the
    update (an applied verdict), :meth:`discard` without (a skip, a failure). Under
    torch.distributed :meth:`payload` is what this rank adds to an all-reduce and
    :meth:`receive` takes the sum back; :meth:`apply` then uses every rank's rows.
    """

    def __init__(self, model: nn.Module) -> None:
        seen: set[int] = set()
        self.layers: list[_Layer] = []
        for module in model.modules():
            if isinstance(module, _BATCH_NORM) and id(module) not in seen:
                seen.add(id(module))
                self.layers.append(_Layer(module))
        self.open = False
        # from construction to close(), holding this part weakly (step/lifetime.py says why not
        # per window): dropped without close(), the part takes its hooks off the model
        owner = weakref.ref(self)
        self._handles = [
            layer.module.register_forward_pre_hook(_hook(owner, index))
            for index, layer in enumerate(self.layers)
        ]
        self._finalizer = weakref.finalize(self, _remove, self._handles)

    def close(self) -> None:
        """The accumulator is closed: a window still open is discarded (the buffers go back to
        its start) and the hooks come off the modules."""
        self.discard()
        self._finalizer()

    def _record(self, layer: _Layer, x: torch.Tensor) -> None:
        module = layer.module
        with torch.no_grad():
            if layer.snapshot is None:  # the module's first forward this window, before its own update
                assert module.running_var is not None and module.num_batches_tracked is not None
                layer.snapshot = (
                    module.running_mean.detach().clone(),  # type: ignore[union-attr]
                    module.running_var.detach().clone(),
                    module.num_batches_tracked.detach().clone(),
                )
            if x.ndim < 2 or x.shape[1] == 0 or x.numel() == 0:
                return  # the module's own forward refuses it
            n = x.numel() // x.shape[1]
            data = x.detach()
            if data.dtype not in (torch.float32, torch.float64):
                data = data.float()  # half inputs: moments in float32 at least, as BatchNorm's kernels
            dims = [0, *range(2, data.ndim)]
            var, mean = torch.var_mean(data, dim=dims, correction=0)
            layer.merge(n, mean.to(torch.float64), var.to(torch.float64) * n)

    # -- the window ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Open a window; a window still open (an exit the step did not see) is discarded first."""
        if self.open:
            self.discard()
        for layer in self.layers:
            layer.reset()
        self.open = True

    def discard(self) -> None:
        """Close the window without an update: the buffers go back to the window's start."""
        self._close(update=False)

    def apply(self) -> None:
        """Close the window with one update per layer that ran in training mode, from its pooled
        moments (every rank's after :meth:`receive`)."""
        self._close(update=True)

    def _close(self, *, update: bool) -> None:
        """Restore every layer's buffers to the window's start, then (``update``) take its one
        update from the pooled moments; a closed window is left alone."""
        if not self.open:
            return
        self.open = False
        with torch.no_grad():
            for layer in self.layers:
                layer.restore()
                moments = layer.moments() if update else None
                if moments is not None and moments[0] > 0:
                    _update(layer.module, *moments)
                layer.reset()

    def applied(self, result: Any) -> None:
        """An ``on_step`` hook: the update was applied, so the window's statistics are too."""
        self.apply()

    # -- across ranks ---------------------------------------------------------------------------

    def _shift(self, layer: _Layer) -> torch.Tensor:
        """K: the running mean at the window's start, the same on every rank."""
        running = layer.snapshot[0] if layer.snapshot is not None else layer.module.running_mean
        assert running is not None
        return running.detach().to(torch.float64)

    def payload(self, device: torch.device) -> torch.Tensor:
        """This rank's moments as sums around K, ``[n, n d, M2 + n d^2]`` per layer (d = mean - K),
        concatenated in module order: 1 + 2C float64 values per layer, the same layout on every rank."""
        pieces: list[torch.Tensor] = []
        for layer in self.layers:
            channels = self._shift(layer).numel()
            if layer.count == 0 or layer.mean is None or layer.m2 is None:
                pieces.append(torch.zeros(1 + 2 * channels, dtype=torch.float64, device=device))
                continue
            n = float(layer.count)
            d = layer.mean - self._shift(layer).to(layer.mean.device)
            row = [torch.full((1,), n, dtype=torch.float64, device=d.device), d * n, layer.m2 + d * d * n]
            pieces.append(torch.cat(row).to(device))
        if not pieces:
            return torch.zeros(0, dtype=torch.float64, device=device)
        return torch.cat(pieces)

    def receive(self, summed: torch.Tensor | list[float]) -> None:
        """Every rank's sums (:meth:`payload` all-reduced): the moments of all ranks' rows so far,
        which :meth:`apply` uses (the step's last reduction of a window follows its last forward)."""
        total = summed if isinstance(summed, torch.Tensor) else torch.tensor(summed, dtype=torch.float64)
        start = 0
        for layer in self.layers:
            shift = self._shift(layer)
            channels = shift.numel()
            block = total[start : start + 1 + 2 * channels].to(device=shift.device, dtype=torch.float64)
            start += 1 + 2 * channels
            count = round(float(block[0]))
            if count == 0:
                layer.pooled = (0, shift, shift)
                continue
            s1, s2 = block[1 : 1 + channels], block[1 + channels :]
            layer.pooled = (count, shift + s1 / count, (s2 - s1 * s1 / count).clamp(min=0))


def _hook(owner: weakref.ref[WindowBatchNorm], index: int) -> Callable[[nn.Module, tuple[Any, ...]], None]:
    """The forward pre-hook of the part's ``index``-th layer; it holds the part weakly."""

    def record(module: nn.Module, args: tuple[Any, ...]) -> None:
        part = owner()
        if part is None or not part.open or not module.training or not module.track_running_stats:
            return
        if module.running_mean is None or not args or _in_backward():
            return
        part._record(part.layers[index], args[0])

    # eager: the bookkeeping holds Python ints and lists that a compiled graph cannot
    return torch.compiler.disable(record)


def _remove(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()


def _update(module: nn.modules.batchnorm._BatchNorm, n: int, mean: torch.Tensor, m2: torch.Tensor) -> None:
    """The buffers after one forward over n rows with these moments, as PyTorch's kernels do it."""
    running_mean, running_var, tracked = module.running_mean, module.running_var, module.num_batches_tracked
    assert running_mean is not None and running_var is not None and tracked is not None
    tracked.add_(1)
    factor = 1.0 / float(tracked) if module.momentum is None else float(module.momentum)
    unbiased = m2 / max(n - 1, 1)  # n > 1: BatchNorm's forward refuses one value per channel
    new_mean = mean * factor + running_mean.to(torch.float64) * (1 - factor)
    new_var = unbiased * factor + running_var.to(torch.float64) * (1 - factor)
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)


def window_batchnorm(engine: Any) -> WindowBatchNorm | None:
    """The engine's BatchNorm part for its ``config.batchnorm_stats``: ``None`` for PyTorch's own
    behaviour (``micro-batch``); refused where the window's rows are not one set of inputs per
    module (a pipeline's stages hold different layers; a mesh's replicas hold the same rows).

    ``engine``: a :class:`~gradaccum.step.engine.WindowEngine` (typed loosely: it imports this
    module). The part is attached where the window passes: its moments ride in the engine's
    meetings and end-of-window summary, and its update runs first among the ``on_step`` hooks, which
    run once per applied update and never for a skipped one. The engine opens it with each window
    and discards it in ``zero_grad``, which every skipped or abandoned window passes."""
    if engine.config.batchnorm_stats != "window":
        return None
    where = "PipelineAccumulator (the stages hold different layers)" if engine._pipeline else None
    if engine.layout is not None:
        where = "a DeviceMesh (tensor-parallel replicas hold the same rows)"
    if where is not None:
        raise ConfigError(
            f"AccumConfig(batchnorm_stats='window') is not supported with {where}; use "
            "batchnorm_stats='micro-batch' (PyTorch's per-forward update)"
        )
    part = WindowBatchNorm(engine.model)
    engine.meetings.batchnorm = engine.settler.batchnorm = part
    engine.on_step.insert(0, part.applied)
    return part
