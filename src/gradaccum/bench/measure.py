"""Measure configurations in this process, with the library's own :class:`Accumulator`.

Every timed update is one ``Accumulator.step``; its ``observer`` marks the phase boundaries, so the
per-phase figures come from the same step a user runs, not from a copy of its loop. On CUDA every
clock read is preceded by a device synchronize (kernels are asynchronous; without it the clock
measures launch time), and peak memory is reset at the start of each update. Under an initialized
process group the model is wrapped in DDP with a counting comm hook, and the ranks' figures are
combined (slowest step, largest peak) so that every rank returns the same figures. With
``spec.fsdp`` the model is sharded with FSDP2 instead, its all-gathers and reduce-scatters counted
through FSDP2's custom-collective hooks; with ``spec.checkpointing`` its repeated blocks run under
activation checkpointing (:mod:`gradaccum.bench.checkpointing`).

Two ways to measure: :func:`measure` runs one configuration (the sweep's unit: one run in a fresh
process); :func:`measure_paired` holds two configurations in one process and alternates them in
short blocks of updates, baseline-candidate then candidate-baseline (ABBA), so that drift in the
machine's speed (a neighbour's job, frequency scaling) lands on both arms of every pair alike.
The first warm-up update of each configuration counts the bytes its forwards save for backward
(and, with checkpointing, what each block's recomputation holds) and the gradient bytes held at
every micro-batch boundary; the timed updates run without those hooks.
"""

from __future__ import annotations

import gc
import platform
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from gradaccum import precision
from gradaccum.batch import Batch, cast, split, take
from gradaccum.bench.checkpointing import RecomputeProbe, apply_checkpointing, checkpoint_blocks
from gradaccum.bench.memory import (
    GradientCensus,
    MemoryFigures,
    accum_buffer_bytes,
    persistent_bytes,
    saved_bytes,
)
from gradaccum.bench.spec import Measurement, MeasureSpec, PairedRecord, PairedSpec, RunRecord
from gradaccum.check.workload import Workload
from gradaccum.distributed import dist
from gradaccum.distributed.comm import CommCounter, Fsdp2CommCounter, count_allreduces, count_fsdp2_comms
from gradaccum.distributed.wrap import fsdp2_units, wrap_model
from gradaccum.errors import BenchError
from gradaccum.step.accumulator import Accumulator
from gradaccum.tokens.split import split_by_tokens
from gradaccum.workloads.balance import choose_balance

__all__ = ["measure", "measure_paired", "measure_paired_safely", "measure_safely", "peak_rss_bytes"]


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    return f"cpu ({platform.processor() or platform.machine() or 'unknown'})"


class _Clock:
    """The Accumulator observer: one timestamp per phase boundary of the current update."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks: dict[tuple[str, int], float] = {}
        self.listener: Callable[[str, int], None] | None = None
        """Called after each mark while set (the counted warm-up update's gradient census)."""

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def __call__(self, event: str, index: int) -> None:
        key = (event, 0 if event == "window_start" else index)
        self.marks[key] = self.now()
        if self.listener is not None:
            self.listener(event, index)

    def phases(self, k: int) -> tuple[float | None, list[float], float | None]:
        """(count ms, per-micro-batch ms, optimizer ms) of the update just run."""
        m = self.marks
        micro = [
            (m[("micro_end", i)] - m[("micro_start", i)]) * 1e3
            for i in range(k)
            if ("micro_start", i) in m and ("micro_end", i) in m
        ]
        count = None
        if ("window_start", 0) in m and ("micro_start", 0) in m:
            count = (m[("micro_start", 0)] - m[("window_start", 0)]) * 1e3
        opt = None
        if ("optimizer_start", 0) in m and ("optimizer_end", 0) in m:
            opt = (m[("optimizer_end", 0)] - m[("optimizer_start", 0)]) * 1e3
        return count, micro, opt


@dataclass(slots=True)
class _Update:
    """One timed update's raw figures on this rank."""

    step_ms: float
    count_ms: float | None
    micro_ms: list[float]
    optimizer_ms: float | None
    tokens: int
    skipped: bool
    calls: int | None
    sent: int | None
    allocated: int
    reserved: int
    gathers: tuple[int, int] | None = None
    """FSDP2: (all-gather calls, bytes) of this update."""
    other_ms: float = 0.0
    """What the timed phases leave of the step: step - count - micro-batches - optimizer."""
    scatters: tuple[int, int] | None = None
    """FSDP2: (reduce-scatter calls, bytes) of this update."""
    own_ms: float | None = None
    """DDP on several ranks: from the update's start to this rank's last gradient bucket handed to
    the all-reduce, i.e. its own work before it waits for the others (its window time)."""


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


class _Arm:
    """One configuration set up in this process: model, optimizer, accumulator and its data."""

    def __init__(self, workload: Workload, spec: MeasureSpec) -> None:
        world, self.rank = dist.world_size(), dist.rank()
        if world != spec.dp:
            raise BenchError(
                f"the configuration asks for dp={spec.dp} data-parallel replicas but this process group "
                f"has {world} rank(s); launch {spec.dp} ranks (torchrun --nproc-per-node {spec.dp}) or "
                f"set dp={world}"
            )
        self.workload, self.spec = workload, spec
        self.world = world
        self.device = device = torch.device(spec.device)
        self.param_dtype = precision.param_dtype(spec.precision)
        torch.manual_seed(spec.seed)
        base = workload.build_model().to(device=device, dtype=self.param_dtype)
        self.gradient_bytes = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
        self.probe: RecomputeProbe | None = None
        if spec.checkpointing != "none":
            self.probe = RecomputeProbe()
            apply_checkpointing(checkpoint_blocks(workload, base), self.probe)
        self.model: nn.Module = wrap_model(
            base, device, fsdp=spec.fsdp, bucket_cap_mb=spec.bucket_cap_mb, compile=spec.compile
        )
        self.counter: CommCounter | None = None
        if isinstance(self.model, DistributedDataParallel):
            self.counter = count_allreduces(self.model)
        self.fsdp_counter: Fsdp2CommCounter | None = (
            count_fsdp2_comms(fsdp2_units(self.model)) if spec.fsdp else None
        )
        self.optimizer = workload.optimizer_factory(self.model.parameters())
        self.clock = _Clock(device)
        # a routing model runs the balance train would (the same rule, the same flag)
        balance, _ = choose_balance(self.model, spec.balance, scaling=spec.scaling)
        self.acc = Accumulator(
            self.model,
            self.optimizer,
            max_grad_norm=spec.max_grad_norm,
            scaler=precision.make_scaler(spec.precision, device),
            defer_sync=spec.defer_sync,
            observer=self.clock,
            scaling=spec.scaling,
            balance=balance,
            # a measurement times the update, whatever the loss's form: the equivalence checks of
            # verify and accept (their denominator audit) judge it, and name a mean
            check_loss_reduction=False,
        )
        self.loss_fn = precision.autocast_loss(workload.loss_fn, spec.precision, device)
        self.buckets: int | None = None
        self.scatter_bytes_per_sync: int | None = None
        self.activation_bytes = 0
        self.recompute_bytes = 0
        self.held_gradient_bytes = 0
        self.next_update = 0
        self.first_update_ms = 0.0
        self.recompiles = 0

    def window(self, update: int) -> list[Batch]:
        """Update ``update``'s micro-batches: the same global examples for every configuration of
        this global batch (so tokens per update match exactly), this rank's slice of them."""
        spec, plan = self.spec, self.spec.plan
        batch = self.workload.make_batch(plan.global_batch, spec.seed + 1 + update)
        if spec.max_tokens is not None:  # every rank cuts the same global batch the same way
            parts = split_by_tokens(
                batch, spec.max_tokens, rank=self.rank, world=plan.dp, equal_count=spec.fsdp
            )
            return [cast(part, self.param_dtype, self.device) for part in parts]
        mine = take(batch, self.rank * plan.local_batch, (self.rank + 1) * plan.local_batch)
        return split(cast(mine, self.param_dtype, self.device), micro_batch=spec.micro_batch)

    def warm_up(self) -> None:
        """``spec.warmup`` unmeasured updates (allocator, caches, DDP's bucket rebuild, the rank
        check); the first one counts the memory (:meth:`_counted_update`) and, compiled, compiles."""
        start = time.perf_counter()
        self._counted_update(0)
        self.first_update_ms = (time.perf_counter() - start) * 1e3
        for u in range(1, self.spec.warmup):
            self.acc.step(self.window(u), self.loss_fn, self.workload.count_fn)
        if self.counter is not None:
            # one plain synchronized backward: DDP all-reduces each bucket once
            self.counter.reset()
            (self.loss_fn(self.model, self.window(0)[0]) * 0).backward()
            self.buckets = self.counter.calls
            self.optimizer.zero_grad(set_to_none=True)
        if self.fsdp_counter is not None:
            # likewise: one synchronizing backward reduce-scatters the (padded) gradient set once
            self.fsdp_counter.reset()
            (self.loss_fn(self.model, self.window(0)[0]) * 0).backward()
            self.scatter_bytes_per_sync = self.fsdp_counter.reduce_scatter_bytes
            self.optimizer.zero_grad(set_to_none=True)
        self.next_update = self.spec.warmup

    def _counted_update(self, update: int) -> None:
        """One unmeasured update that counts the memory: the bytes each forward saves for backward,
        what each checkpointed block's recomputation holds, and the gradient bytes held at every
        micro-batch boundary. (With no warm-up asked for, it is one extra update of window 0, which
        the measured updates then start with again.)"""
        saved: list[int] = []
        held: list[int] = []
        census = GradientCensus(self.model)
        probe = self.probe

        def counted_loss(model: nn.Module, micro_batch: Any) -> torch.Tensor:
            if probe is not None:
                probe.active = True
            try:
                with saved_bytes(model) as counter:
                    loss = self.loss_fn(model, micro_batch)
            finally:
                if probe is not None:
                    probe.active = False
            saved.append(counter.bytes)
            return loss

        def at_boundary(event: str, index: int) -> None:
            if event == "micro_end":
                held.append(census.held_bytes())

        self.clock.listener = at_boundary
        try:
            with census.watching():
                self.acc.step(self.window(update), counted_loss, self.workload.count_fn)
        finally:
            self.clock.listener = None
        self.recompute_bytes = probe.largest_bytes if probe is not None else 0
        self.activation_bytes = max(saved) + self.recompute_bytes
        self.held_gradient_bytes = max(held, default=0)

    def run(self, updates: int) -> list[_Update]:
        """The next ``updates`` timed updates."""
        out = []
        device, clock, counter = self.device, self.clock, self.counter
        fsdp = self.fsdp_counter
        for u in range(self.next_update, self.next_update + updates):
            micro_batches = self.window(u)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            if counter is not None:
                counter.reset()
            if fsdp is not None:
                fsdp.reset()
            clock.marks.clear()
            start = clock.now()
            result = self.acc.step(micro_batches, self.loss_fn, self.workload.count_fn)
            step_ms = (clock.now() - start) * 1e3
            own_ms = None
            if counter is not None and self.world > 1 and counter.calls:
                own_ms = (counter.last_call_s - start) * 1e3
            self.recompiles += result.recompiles
            counting, micro, optimizing = clock.phases(len(micro_batches))  # a token budget varies k
            out.append(
                _Update(
                    other_ms=step_ms - (counting or 0.0) - sum(micro) - (optimizing or 0.0),
                    step_ms=step_ms,
                    count_ms=counting,
                    micro_ms=micro,
                    optimizer_ms=optimizing,
                    tokens=result.global_count,
                    skipped=not result.applied,
                    calls=None if counter is None else counter.calls,
                    sent=None if counter is None else counter.bytes,
                    allocated=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
                    reserved=torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0,
                    gathers=None if fsdp is None else (fsdp.allgather_calls, fsdp.allgather_bytes),
                    scatters=None if fsdp is None else (fsdp.reduce_scatter_calls, fsdp.reduce_scatter_bytes),
                    own_ms=own_ms,
                )
            )
        self.next_update += updates
        return out

    def measurement(self, updates: list[_Update], *, fresh_process: bool) -> Measurement:
        """The figures of ``updates`` (in order), combined over ranks: a collective under DP."""
        micro_ms: list[float] = []
        sync_ms: list[float] = []
        for up in updates:
            if self.world > 1 and len(up.micro_ms) > 1:
                # the final backward synchronizes; what it adds over the others is the exposed sync time
                micro_ms.extend(up.micro_ms[:-1])
                sync_ms.append(up.micro_ms[-1] - statistics.median(up.micro_ms[:-1]))
            else:
                micro_ms.extend(up.micro_ms)
        param, grad, state = persistent_bytes(self.model, self.optimizer)
        cuda = self.device.type == "cuda"
        mine = {
            "step_ms": [up.step_ms for up in updates],
            "micro_ms": _median(micro_ms),
            "sync_ms": _median(sync_ms) if sync_ms else None,
            "count_ms": _median([up.count_ms for up in updates if up.count_ms is not None]),
            "optimizer_ms": _median([up.optimizer_ms for up in updates if up.optimizer_ms is not None]),
            "other_ms": _median([up.other_ms for up in updates]),
            # totals over the updates, which add up: step = count + micro-batches + optimizer + other
            "totals": (
                sum(up.count_ms or 0.0 for up in updates),
                sum(sum(up.micro_ms) for up in updates),
                sum(up.optimizer_ms or 0.0 for up in updates),
                sum(up.other_ms for up in updates),
                sum(up.step_ms for up in updates),
            ),
            "peak_rss": peak_rss_bytes(),
            "peak_alloc": max((up.allocated for up in updates), default=0),
            "peak_reserved": max((up.reserved for up in updates), default=0),
            "calls": max((up.calls for up in updates if up.calls is not None), default=None),
            "bytes": max((up.sent for up in updates if up.sent is not None), default=None),
            "gathers": max((up.gathers for up in updates if up.gathers is not None), default=None),
            "scatters": max((up.scatters for up in updates if up.scatters is not None), default=None),
            "memory": (param, grad, state, self.activation_bytes),
            "recompute": self.recompute_bytes,
            "held": self.held_gradient_bytes,
            "compile_ms": self.first_update_ms - _median([up.step_ms for up in updates]),
            "recompiles": self.recompiles,
            "own_ms": [up.own_ms for up in updates],
        }
        everyone = dist.all_gather_objects(mine)
        # the slowest rank bounds every update; memory is the largest rank's
        steps = [max(r["step_ms"][i] for r in everyone) for i in range(len(updates))]

        def slowest(key: str) -> float | None:
            got = [r[key] for r in everyone if r[key] is not None]
            return max(got) if got else None

        tokens = [up.tokens for up in updates]
        total_s = sum(steps) / 1e3
        worst = max(everyone, key=lambda r: sum(r["memory"]))
        worst_memory = worst["memory"]
        gathers = worst["gathers"] if self.fsdp_counter is not None else None
        scatters = worst["scatters"] if self.fsdp_counter is not None else None
        return Measurement(
            spec=self.spec,
            unit=self.workload.unit,
            step_ms=steps,
            micro_ms=float(slowest("micro_ms") or 0.0),
            sync_ms=slowest("sync_ms"),
            count_ms=float(slowest("count_ms") or 0.0),
            optimizer_ms=float(slowest("optimizer_ms") or 0.0),
            other_ms=slowest("other_ms"),
            phase_totals_ms=tuple(max(everyone, key=lambda r: r["totals"][4])["totals"]),
            tokens_per_update=tokens,
            examples_per_update=self.spec.plan.global_batch,
            units_per_s=sum(tokens) / total_s if total_s > 0 else float("inf"),
            updates=len(updates),
            skipped_updates=sum(int(up.skipped) for up in updates),
            peak_rss_bytes=int(max(r["peak_rss"] for r in everyone)),
            fresh_process=fresh_process,
            peak_allocated_bytes=int(max(r["peak_alloc"] for r in everyone)) if cuda else None,
            peak_reserved_bytes=int(max(r["peak_reserved"] for r in everyone)) if cuda else None,
            gradient_bytes=self.gradient_bytes,
            allreduce_calls_per_update=None if self.counter is None else int(slowest("calls") or 0),
            allreduce_bytes_per_update=None if self.counter is None else int(slowest("bytes") or 0),
            buckets=self.buckets,
            threads=torch.get_num_threads(),
            device_name=_device_name(self.device),
            memory=MemoryFigures(
                parameter_bytes=int(worst_memory[0]),
                gradient_bytes=int(worst_memory[1]),
                optimizer_state_bytes=int(worst_memory[2]),
                activation_bytes=int(worst_memory[3]),
                max_allocated_bytes=int(max(r["peak_alloc"] for r in everyone)) if cuda else None,
                max_reserved_bytes=int(max(r["peak_reserved"] for r in everyone)) if cuda else None,
                recompute_bytes=int(worst["recompute"]),
                held_gradient_bytes=int(max(r["held"] for r in everyone)),
                accum_buffer_bytes=accum_buffer_bytes(self.model, self.acc.config.accum_dtype),
            ),
            allgather_calls_per_update=None if gathers is None else int(gathers[0]),
            allgather_bytes_per_update=None if gathers is None else int(gathers[1]),
            reduce_scatter_calls_per_update=None if scatters is None else int(scatters[0]),
            reduce_scatter_bytes_per_update=None if scatters is None else int(scatters[1]),
            reduce_scatter_bytes_per_sync=self.scatter_bytes_per_sync,
            compile_s=float(slowest("compile_ms") or 0.0) / 1e3 if self.spec.compile else None,
            recompiles=int(max(r["recompiles"] for r in everyone)),
            straggler=_straggler([r["own_ms"] for r in everyone]),
        )


def measure(workload: Workload, spec: MeasureSpec, *, fresh_process: bool = False) -> Measurement:
    """Run ``spec.warmup`` then ``spec.steps`` timed updates of ``workload`` and return the figures.

    Under an initialized process group of ``spec.dp`` ranks this is a collective: every rank calls
    it with the same spec and gets the same, combined result. ``fresh_process`` says whether the
    process ran nothing else, i.e. whether its peak RSS belongs to this configuration alone.
    """
    arm = _Arm(workload, spec)
    arm.warm_up()
    return arm.measurement(arm.run(spec.steps), fresh_process=fresh_process)


def measure_paired(workload: Workload, spec: PairedSpec, *, run_index: int = 0) -> PairedRecord:
    """Both configurations of ``spec`` in this process, alternating in blocks: A B, B A, A B, ...

    Each block is ``spec.block_updates`` updates of one configuration; both configurations see
    update ``u``'s same examples, so a pair's throughput ratio is the inverse ratio of its times.
    Collective under DP (every rank runs the same schedule).
    """
    arms = (_Arm(workload, spec.baseline), _Arm(workload, spec.candidate))
    for arm in arms:
        arm.warm_up()
    done: tuple[list[_Update], list[_Update]] = ([], [])
    block_seconds: list[tuple[float, float]] = []
    block_units: list[int] = []
    for block in range(spec.blocks):
        took = [0.0, 0.0]
        order = (0, 1) if block % 2 == 0 else (1, 0)
        for which in order:
            updates = arms[which].run(spec.block_updates)
            done[which].extend(updates)
            took[which] = _slowest_rank_seconds(updates)
        block_seconds.append((took[0], took[1]))
        block_units.append(sum(up.tokens for up in done[0][-spec.block_updates :]))
    return PairedRecord(
        spec=spec,
        status="ok",
        baseline=arms[0].measurement(done[0], fresh_process=False),
        candidate=arms[1].measurement(done[1], fresh_process=False),
        block_seconds=tuple(block_seconds),
        block_units=tuple(block_units),
        run_index=run_index,
    )


def straggler_ratio(window_ms: list[float]) -> float:
    """The slowest rank's window time over the ranks' mean (1.0: every rank done together)."""
    mean = sum(window_ms) / len(window_ms)
    return max(window_ms) / mean if mean > 0 else 1.0


def _straggler(own_ms: list[list[float | None]]) -> tuple[float, ...] | None:
    """Per update, :func:`straggler_ratio` of the ranks' own window times; ``None`` unless every
    rank timed every update (DDP on two or more ranks)."""
    if len(own_ms) < 2 or any(ms is None for rank in own_ms for ms in rank):
        return None
    return tuple(straggler_ratio([rank[i] for rank in own_ms]) for i in range(len(own_ms[0])))  # type: ignore[misc]


def _slowest_rank_seconds(updates: list[_Update]) -> float:
    """A block's wall time: the slowest rank's sum of step times (every rank waits for it)."""
    mine = sum(up.step_ms for up in updates) / 1e3
    return float(max(dist.all_gather_objects(mine)))


def _oom_message(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or ["CUDA out of memory"])[0]


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _safely(attempt: Callable[[], Any]) -> tuple[Any, str | None]:
    """``attempt()``, or (None, the OOM's first line) with memory freed on an out-of-memory error.

    Other exceptions propagate: they are bugs or bad input, not a property of the configuration.
    """
    oom: str | None = None
    try:
        return attempt(), None
    except torch.cuda.OutOfMemoryError as exc:
        oom = _oom_message(exc)
        traceback.clear_frames(exc.__traceback__)
    # outside the except block the traceback, and the frames holding the model, are gone
    _release()
    return None, oom


def measure_safely(
    workload: Workload, spec: MeasureSpec, *, fresh_process: bool = False, run_index: int = 0
) -> RunRecord:
    """:func:`measure`, with an out-of-memory error caught, memory freed and reported as ``oom``."""
    m, oom = _safely(lambda: measure(workload, spec, fresh_process=fresh_process))
    if m is not None:
        return RunRecord(spec=spec, status="ok", measurement=m, run_index=run_index)
    return RunRecord(spec=spec, status="oom", error=oom, run_index=run_index)


def measure_paired_safely(workload: Workload, spec: PairedSpec, *, run_index: int = 0) -> PairedRecord:
    """:func:`measure_paired`, with an out-of-memory error reported as ``oom``."""
    record, oom = _safely(lambda: measure_paired(workload, spec, run_index=run_index))
    if record is not None:
        return record
    return PairedRecord(spec=spec, status="oom", error=oom, run_index=run_index)
