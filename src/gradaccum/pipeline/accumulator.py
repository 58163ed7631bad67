"""Exact accumulation through a ``torch.distributed.pipelining`` schedule.

A pipeline schedule runs the window's micro-batches itself (GPipe, 1F1B, interleaved), calling
``loss_fn(output, target)`` on the last stage for each one; the step cannot reach in between. So
the denominator must be known before ``schedule.step``: every rank of the pipeline is given the
whole window, counts it, and the counts are summed over the mesh (the stages and TP ranks of one
pipeline count the same tokens, and are counted once: see :mod:`gradaccum.mesh`). The schedule's
loss is then the user's *summed* loss times the exact factor F/N, so micro-batches with uneven
tokens and a short final window are exact, whatever the schedule, within the lengths the schedule
runs: torch 2.13's 1F1B needs k >= the number of stages, Interleaved1F1B k a multiple of its
max(1, k // pp) rounds; other lengths are refused on every rank before the gradients are touched
(every data replica must hold the same k: the stages exchange activations micro-batch by
micro-batch, and the count all-reduce compares the lengths).

PyTorch's schedules divide the gradients by ``n_microbatches`` by default (``scale_grads=True``,
right for a loss that averages per micro-batch); the factor here already normalizes, so the
schedules are built with ``scale_grads=False``, and a schedule passed in with it on is refused.
Gradient synchronization stays the schedule's: it defers DDP/FSDP2 reductions to the last
backward of each stage itself, so this module adds no deferral of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from gradaccum.errors import ConfigError
from gradaccum.mesh.layout import MeshLayout
from gradaccum.mesh.step import check_ddp_group
from gradaccum.moe.runner import refuse_balance
from gradaccum.step.config import AccumConfig, StepResult
from gradaccum.step.engine import WindowEngine
from gradaccum.step.face import EngineFace
from gradaccum.step.reduction import ReductionCheck
from gradaccum.step.window import Accumulated, CountFn

__all__ = ["SCHEDULES", "PipelineAccumulator", "StageLossFn"]

StageLossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, target)``: the loss of one micro-batch on the last stage, *summed* over its units."""

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
"""The schedules by name: one stage per rank for the first two, two or more for the interleaved one."""


def _schedule_class(name: str) -> type:
    from torch.distributed import pipelining

    classes = {
        "GPipe": pipelining.ScheduleGPipe,
        "1F1B": pipelining.Schedule1F1B,
        "Interleaved1F1B": pipelining.ScheduleInterleaved1F1B,
    }
    return classes[name]


class PipelineAccumulator(EngineFace):
    """One exact optimizer step per window through a pipeline schedule, on a mesh.

    >>> acc = PipelineAccumulator([stage], optimizer, loss_fn, schedule="1F1B", mesh=mesh)
    >>> result = acc.step(window, count_fn)   # window: [(inputs, target), ...] on every rank

    ``stages``: this rank's ``PipelineStage`` objects (one; two or more for ``Interleaved1F1B``),
    their submodules sharded with FSDP2 over the data dimensions where there are several, or
    wrapped in DDP over them (1F1B and Interleaved1F1B only: see :func:`_check_ddp`).
    ``optimizer`` holds their parameters. ``schedule``: a name from :data:`SCHEDULES`, or a
    schedule built by the caller (its ``n_microbatches`` must equal each window's length, and
    ``scale_grads=False``). The settings (clipping, skipping) are :class:`AccumConfig`'s.
    """

    def __init__(
        self,
        stages: Sequence[Any],
        optimizer: torch.optim.Optimizer,
        loss_fn: StageLossFn,
        *,
        schedule: str | Any = "1F1B",
        mesh: Any,
        mesh_dims: Mapping[str, str] | None = None,
        scheduler: Any = None,
        config: AccumConfig | None = None,
        balance: Any = None,
    ) -> None:
        """``balance``: refused (a :class:`ConfigError` saying why); only ``Accumulator`` balances."""
        refuse_balance(
            balance,
            "PipelineAccumulator",
            "each stage holds some of the routers, so the window's routing counts would have to be "
            "gathered across the pipeline stages before the schedule runs",
        )
        stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        if not stages or not all(hasattr(s, "submod") and hasattr(s, "is_last") for s in stages):
            raise ConfigError(
                "stages must be this rank's torch.distributed.pipelining.PipelineStage objects (a list)"
            )
        if mesh is None:
            raise ConfigError("PipelineAccumulator needs mesh=: the DeviceMesh with a 'pp' dimension")
        if not callable(loss_fn):
            raise ConfigError(f"loss_fn must be callable as loss_fn(output, target), got {loss_fn!r}")
        self._schedule_name = self._check_schedule(schedule, len(stages))
        self._given_schedule = None if isinstance(schedule, str) else schedule
        self._stages = stages
        self._loss_fn = loss_fn
        # the first window's losses are read for a mean passed as a sum (step/reduction.py)
        self._reduction = ReductionCheck("sum", True if config is None else config.check_loss_reduction)
        self._schedules: dict[int, Any] = {}
        modules = nn.ModuleList([s.submod for s in stages])
        if config is not None and config.scaling != "pre":
            raise ConfigError(
                f"scaling={config.scaling!r} is not supported by PipelineAccumulator: its schedule runs "
                "the whole window at once, so the window is in hand and counted up front anyway. "
                "Leave scaling at 'pre'."
            )
        if config is not None and config.loss_reduction != "sum":
            raise ConfigError(
                f"AccumConfig.loss_reduction={config.loss_reduction!r} is not supported by "
                "PipelineAccumulator: the schedule hands loss_fn's value straight to its backward, "
                "where no per-micro-batch count can multiply a mean back. Return the loss summed "
                "over count_fn's units (reduction='sum') and leave loss_reduction at 'sum'."
            )
        if config is not None and config.accum_dtype is not None:
            raise ConfigError(
                f"AccumConfig.accum_dtype={config.accum_dtype!r} is not supported with a pipeline schedule: "
                "its stages' backwards and reductions run inside the schedule, where the float32 sum "
                "cannot reach the optimizer unchanged. Leave accum_dtype=None."
            )
        self._engine = WindowEngine(
            modules,
            optimizer,
            config if config is not None else AccumConfig(),
            scheduler=scheduler,
            mesh=mesh,
            mesh_dims=mesh_dims,
            pipeline=True,
            synced=stages[0].submod,
        )
        layout = self._engine.layout
        assert layout is not None
        _check_ddp([s.submod for s in stages], self._schedule_name, mesh, layout)
        stage_count = stages[0].num_stages
        if stage_count != layout.pp * len(stages):
            raise ConfigError(
                f"the pipeline has {stage_count} stages but the mesh has pp={layout.pp} "
                f"ranks holding {len(stages)} stage(s) each"
            )

    @staticmethod
    def _check_schedule(schedule: str | Any, local_stages: int) -> str:
        if isinstance(schedule, str):
            if schedule not in SCHEDULES:
                raise ConfigError(
                    f"schedule must be one of {list(SCHEDULES)} or a schedule object, got {schedule!r}"
                )
            name = schedule
        else:
            if getattr(schedule, "scale_grads", False):
                raise ConfigError(
                    f"the schedule {type(schedule).__name__} was built with scale_grads=True: it divides "
                    "the gradients by n_microbatches, on top of the exact factor. Build it with "
                    "scale_grads=False (or pass the schedule's name and let the accumulator build it)."
                )
            return type(schedule).__name__
        interleaved = name == "Interleaved1F1B"
        if interleaved != (local_stages > 1):
            raise ConfigError(
                f"schedule {name!r} runs {'two or more stages' if interleaved else 'one stage'} per rank; "
                f"this rank holds {local_stages}"
            )
        return name

    def _schedule(self, k: int) -> Any:
        """The schedule for a window of ``k`` micro-batches (built once per length)."""
        given = self._given_schedule
        if given is not None:
            n = getattr(given, "_n_microbatches", None)
            if n != k:
                raise ConfigError(
                    f"the schedule runs n_microbatches={n} but the window holds {k} micro-batches; "
                    "build the schedule for the window's length (or pass its name, and the "
                    "accumulator builds one per length)"
                )
            return given
        if k not in self._schedules:
            cls = _schedule_class(self._schedule_name)
            stage: Any = self._stages if self._schedule_name == "Interleaved1F1B" else self._stages[0]
            rule = _short_window_rule(self._schedule_name, k, self._stages)
            if rule is not None:
                raise ConfigError(rule)
            try:
                built = cls(stage, n_microbatches=k, loss_fn=self._scaled_loss, scale_grads=False)
            except ValueError as exc:  # a rule of a later torch: still refused before anything runs
                raise ConfigError(
                    f"torch's {cls.__name__} cannot run a window of {k} micro-batches ({exc}); "
                    "give the windows a length it accepts"
                ) from exc
            self._schedules[k] = built
        return self._schedules[k]

    def _scaled_loss(self, output: Any, target: Any) -> torch.Tensor:
        # called by the schedule on the last stage, once per micro-batch, in order
        loss = self._loss_fn(output, target)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise ConfigError(f"loss_fn must return a 0-dim tensor (the summed loss), got {loss!r}")
        if self._reduction.pending:  # the count is not at hand here: a mean reduction is refused
            self._reduction.judge(loss, None, len(self._losses))
        self._losses.append(loss.detach().to(torch.float64))
        return loss * self._scale.to(loss.dtype)

    def step(self, window: Sequence[tuple[Any, Any]], count_fn: CountFn) -> StepResult:
        """Count the window on every rank, run the schedule over it with the exact loss, step once."""
        engine = self._engine
        micro_batches, failure = engine.open(window)
        counted = engine.count(micro_batches, lambda mb: count_fn(_target(mb)), failure)
        k = len(micro_batches)
        if counted.global_host == 0:
            return engine.skip(0, 0, k, None, "the window holds zero valid units on every rank")
        # every rank holds k micro-batches now (the count refused unequal lengths), so every rank
        # refuses a length the schedule cannot run alike, before the gradients are touched
        schedule = self._schedule(k)
        engine.zero_grad()
        inputs, targets = _stack(micro_batches)
        # each micro-batch adds sum_t l_t * F / N; the reductions divide by F: the full-batch mean
        self._scale = counted.scale()
        self._losses: list[torch.Tensor] = []
        first = any(s.is_first for s in self._stages)
        last = any(s.is_last for s in self._stages)
        args = (inputs,) if first else ()
        engine.emit("micro_start", 0)
        if last:
            schedule.step(*args, target=targets, losses=[])
        else:
            schedule.step(*args)
        engine.emit("micro_end", k - 1)
        # the schedule's first step also calls the loss once while it infers the stages' buffers:
        # the window's own losses are the last k calls
        losses = self._losses[-k:] if last else []
        self._reduction.pending = False
        zero = torch.zeros((), dtype=torch.float64, device=engine.device)
        loss = torch.stack(losses).sum() if losses else zero
        return engine.conclude(counted, Accumulated(loss, zero, False, k))


_DDP_SCHEDULES = ("1F1B", "Interleaved1F1B", "Schedule1F1B", "ScheduleInterleaved1F1B")
"""The schedules in which DDP stage modules were measured exact (float64, several windows)."""


def _check_ddp(submods: list[nn.Module], schedule: str, mesh: Any, layout: MeshLayout) -> None:
    """DDP stage modules: only in the schedules where they were measured exact, and only reducing
    over this rank's data-parallel ranks (the ``F`` of F/N is their number).

    The schedules run every DDP forward under ``no_sync`` and prepare the reducer by hand before
    each stage's last backward. In 1F1B and Interleaved1F1B that reduces once per window, an
    average over DDP's group (tests/mesh/test_pipeline.py: exact over two windows). GPipe runs every
    forward before the first backward, and torch 2.13's reducer fails its second window with an
    internal assert (``params_.size() == rebuilt_param_indices_.size()``), so it is refused here,
    before anything runs. A DDP whose group is not the data ranks would average over other
    stages' or TP ranks' gradients.
    """
    from torch.nn.parallel import DistributedDataParallel

    ddp = [m for m in submods if isinstance(m, DistributedDataParallel)]
    if not ddp:
        return
    if schedule not in _DDP_SCHEDULES:
        raise ConfigError(
            f"a pipeline stage's module is wrapped in DistributedDataParallel, which torch 2.13's "
            f"{schedule} schedule does not drive correctly (GPipe: the reducer fails its second "
            "window with an internal assert). Use schedule='1F1B' or 'Interleaved1F1B' with DDP, "
            "or shard the stage modules with FSDP2 (fully_shard over the data dimensions)."
        )
    for module in ddp:
        check_ddp_group(module, mesh, layout, "a pipeline stage's")


def _short_window_rule(name: str, k: int, stages: Sequence[Any]) -> str | None:
    """Why torch 2.13's schedule ``name`` cannot run ``k`` micro-batches over these stages (None:
    it can). Its own check raises inside the schedule's constructor, after the count."""
    total = int(stages[0].num_stages)
    if name == "1F1B" and k < total:
        return (
            f"schedule '1F1B' runs at least as many micro-batches as pipeline stages, and this "
            f"window holds {k} for {total} stages (torch 2.13's rule: n_microbatches >= num_stages). "
            f"Give every window at least {total} micro-batches, or use schedule='GPipe' (stage "
            "modules under FSDP2), which runs any length."
        )
    if name == "Interleaved1F1B":
        pp = int(stages[0].group_size)
        rounds = max(1, k // pp)
        if k % rounds:
            fits = sorted({n for n in range(max(1, k - pp), k + pp + 1) if n % max(1, n // pp) == 0})
            return (
                f"schedule 'Interleaved1F1B' runs the window in rounds of micro-batches: with pp={pp} "
                f"ranks a window of k micro-batches has max(1, k // {pp}) rounds and k must be a "
                f"multiple of them (torch 2.13's rule). This window holds k={k}: {rounds} rounds, "
                f"{k} % {rounds} = {k % rounds}. Lengths near it that run: {fits}."
            )
    return None


def _target(micro_batch: Any) -> Any:
    if not isinstance(micro_batch, (tuple, list)) or len(micro_batch) != 2:
        raise ConfigError(
            f"a pipeline window is a list of (inputs, target) micro-batches, got {type(micro_batch).__name__}"
        )
    return micro_batch[1]


def _stack(micro_batches: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The window as one batch, which the schedule splits back into the same micro-batches.

    The schedule splits along dim 0 into equal chunks, so every micro-batch must have the same
    number of rows (and, for the stages' fixed buffers, the same shape)."""
    inputs = [mb[0] for mb in micro_batches]
    targets = [mb[1] for mb in micro_batches]
    shapes = {tuple(x.shape) for x in inputs}
    if len(shapes) != 1:
        raise ConfigError(
            f"pipeline micro-batches must share one shape (the stages exchange fixed-size buffers, "
            f"and the schedule splits the window into equal chunks); got {sorted(shapes)}. Pad them "
            "to one length; padded positions count zero units."
        )
    return torch.cat(inputs), torch.cat(targets)
