"""Measure one configuration in this process, with the library's own :class:`Accumulator`.

Every timed update is one ``Accumulator.step``; its ``observer`` marks the phase boundaries, so the
per-phase figures come from the same step a user runs, not from a copy of its loop. On CUDA every
clock read is preceded by a device synchronize (kernels are asynchronous; without it the clock
measures launch time), and peak memory is reset at the start of each update. Under an initialized
process group the model is wrapped in DDP with a counting comm hook, and the ranks' figures are
combined (slowest step, largest peak) so that every rank returns the same :class:`Measurement`.
"""

from __future__ import annotations

import gc
import platform
import resource
import statistics
import sys
import time
import traceback

import torch
from torch.nn.parallel import DistributedDataParallel

from gradaccum import precision
from gradaccum.batch import Batch, cast, split, take
from gradaccum.bench.spec import Measurement, MeasureSpec, RunRecord
from gradaccum.check.workload import Workload
from gradaccum.distributed import dist
from gradaccum.distributed.comm import CommCounter, count_allreduces
from gradaccum.distributed.wrap import wrap_model
from gradaccum.errors import BenchError
from gradaccum.step.accumulator import Accumulator

__all__ = ["measure", "measure_safely", "peak_rss_bytes"]


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

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def __call__(self, event: str, index: int) -> None:
        key = (event, 0 if event == "window_start" else index)
        self.marks[key] = self.now()

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


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def measure(workload: Workload, spec: MeasureSpec, *, fresh_process: bool = False) -> Measurement:
    """Run ``spec.warmup`` then ``spec.steps`` timed updates of ``workload`` and return the figures.

    Under an initialized process group of ``spec.dp`` ranks this is a collective: every rank calls
    it with the same spec and gets the same, combined result. ``fresh_process`` says whether the
    process ran nothing else, i.e. whether its peak RSS belongs to this configuration alone.
    """
    world, rank = dist.world_size(), dist.rank()
    if world != spec.dp:
        raise BenchError(
            f"the configuration asks for dp={spec.dp} data-parallel replicas but this process group has "
            f"{world} rank(s); launch {spec.dp} ranks (torchrun --nproc-per-node {spec.dp}) or set dp={world}"
        )
    device = torch.device(spec.device)
    param_dtype = precision.param_dtype(spec.precision)
    plan = spec.plan
    local = plan.local_batch

    torch.manual_seed(spec.seed)
    base = workload.build_model().to(device=device, dtype=param_dtype)
    gradient_bytes = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
    model = wrap_model(base, device, bucket_cap_mb=spec.bucket_cap_mb)
    counter: CommCounter | None = None
    if isinstance(model, DistributedDataParallel):
        counter = count_allreduces(model)
    optimizer = workload.optimizer_factory(model.parameters())
    scaler = precision.make_scaler(spec.precision, device)
    clock = _Clock(device)
    acc = Accumulator(model, optimizer, scaler=scaler, defer_sync=spec.defer_sync, observer=clock)
    loss_fn = precision.autocast_loss(workload.loss_fn, spec.precision, device)

    def window(update: int) -> list[Batch]:
        # the same global examples for every configuration of this global batch; this rank's slice
        batch = workload.make_batch(plan.global_batch, spec.seed + 1 + update)
        mine = take(batch, rank * local, (rank + 1) * local)
        return split(cast(mine, param_dtype, device), micro_batch=spec.micro_batch)

    for u in range(spec.warmup):
        acc.step(window(u), loss_fn, workload.count_fn)

    buckets: int | None = None
    if counter is not None:
        # one plain synchronized backward: DDP all-reduces each bucket once
        counter.reset()
        (loss_fn(model, window(0)[0]) * 0).backward()
        buckets = counter.calls
        optimizer.zero_grad(set_to_none=True)

    step_ms: list[float] = []
    micro_ms: list[float] = []
    sync_ms: list[float] = []
    count_ms: list[float] = []
    opt_ms: list[float] = []
    tokens: list[int] = []
    skipped = 0
    calls: list[int] = []
    sent: list[int] = []
    peak_alloc = peak_reserved = 0
    k = spec.accum_steps
    for u in range(spec.warmup, spec.warmup + spec.steps):
        micro_batches = window(u)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        if counter is not None:
            counter.reset()
        clock.marks.clear()
        start = clock.now()
        result = acc.step(micro_batches, loss_fn, workload.count_fn)
        step_ms.append((clock.now() - start) * 1e3)
        if device.type == "cuda":
            peak_alloc = max(peak_alloc, torch.cuda.max_memory_allocated(device))
            peak_reserved = max(peak_reserved, torch.cuda.max_memory_reserved(device))
        counting, micro, optimizing = clock.phases(k)
        if world > 1 and len(micro) > 1:
            # the final backward synchronizes; what it adds over the others is the exposed sync time
            micro_ms.extend(micro[:-1])
            sync_ms.append(micro[-1] - statistics.median(micro[:-1]))
        else:
            micro_ms.extend(micro)
        if counting is not None:
            count_ms.append(counting)
        if optimizing is not None:
            opt_ms.append(optimizing)
        tokens.append(result.global_count)
        skipped += int(not result.applied)
        if counter is not None:
            calls.append(counter.calls)
            sent.append(counter.bytes)

    mine_figures = {
        "step_ms": step_ms,
        "micro_ms": _median(micro_ms),
        "sync_ms": _median(sync_ms) if sync_ms else None,
        "count_ms": _median(count_ms),
        "optimizer_ms": _median(opt_ms),
        "peak_rss": peak_rss_bytes(),
        "peak_alloc": peak_alloc,
        "peak_reserved": peak_reserved,
        "calls": max(calls) if calls else None,
        "bytes": max(sent) if sent else None,
    }
    everyone = dist.all_gather_objects(mine_figures)
    # the slowest rank bounds every update; memory is the largest rank's
    combined_steps = [max(r["step_ms"][i] for r in everyone) for i in range(spec.steps)]

    def slowest(key: str) -> float | None:
        got = [r[key] for r in everyone if r[key] is not None]
        return max(got) if got else None

    total_s = sum(combined_steps) / 1e3
    return Measurement(
        spec=spec,
        unit=workload.unit,
        step_ms=combined_steps,
        micro_ms=float(slowest("micro_ms") or 0.0),
        sync_ms=slowest("sync_ms"),
        count_ms=float(slowest("count_ms") or 0.0),
        optimizer_ms=float(slowest("optimizer_ms") or 0.0),
        tokens_per_update=tokens,
        examples_per_update=plan.global_batch,
        units_per_s=sum(tokens) / total_s if total_s > 0 else float("inf"),
        updates=spec.steps,
        skipped_updates=skipped,
        peak_rss_bytes=int(max(r["peak_rss"] for r in everyone)),
        fresh_process=fresh_process,
        peak_allocated_bytes=int(max(r["peak_alloc"] for r in everyone)) if device.type == "cuda" else None,
        peak_reserved_bytes=int(max(r["peak_reserved"] for r in everyone)) if device.type == "cuda" else None,
        gradient_bytes=gradient_bytes,
        allreduce_calls_per_update=None if counter is None else int(slowest("calls") or 0),
        allreduce_bytes_per_update=None if counter is None else int(slowest("bytes") or 0),
        buckets=buckets,
        threads=torch.get_num_threads(),
        device_name=_device_name(device),
    )


def measure_safely(
    workload: Workload, spec: MeasureSpec, *, fresh_process: bool = False, run_index: int = 0
) -> RunRecord:
    """:func:`measure`, with a CUDA out-of-memory error caught, memory freed and reported as ``oom``.

    Other exceptions propagate: they are bugs or bad input, not a property of the configuration.
    """
    oom: str | None = None
    try:
        m = measure(workload, spec, fresh_process=fresh_process)
        return RunRecord(spec=spec, status="ok", measurement=m, run_index=run_index)
    except torch.cuda.OutOfMemoryError as exc:  # untested here: no CUDA device on the build machine
        oom = (str(exc).strip().splitlines() or ["CUDA out of memory"])[0]
        traceback.clear_frames(exc.__traceback__)
    # outside the except block the traceback, and the frames holding the model, are gone
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return RunRecord(spec=spec, status="oom", error=oom, run_index=run_index)
