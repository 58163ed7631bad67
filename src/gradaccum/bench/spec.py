"""What one measured configuration is, and what one run of it reports: plain frozen records.

A :class:`MeasureSpec` crosses a process boundary as JSON (the worker reads it on stdin), and so does
the :class:`RunRecord` that comes back, so both convert to and from plain dictionaries.
:class:`MeasureSettings` is how every configuration of a sweep or an acceptance run is measured:
both specs hold one, and it turns a batch plan into a :class:`MeasureSpec`.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from gradaccum.bench.memory import MemoryFigures
from gradaccum.errors import BenchError
from gradaccum.plan import BatchPlan
from gradaccum.precision import PRECISIONS
from gradaccum.step.config import SCALINGS, Scaling
from gradaccum.values import require_int

__all__ = [
    "BenchError",
    "MeasureSettings",
    "MeasureSpec",
    "Measurement",
    "PairedRecord",
    "PairedSpec",
    "RunRecord",
    "RunStatus",
]

CHECKPOINTING = ("none", "full")
"""Activation checkpointing modes (see :mod:`gradaccum.bench.checkpointing`)."""

RESULT_PREFIX = "GRADACCUM_RESULT "
"""Marks the worker's result line on stdout, so that nothing a workload prints is mistaken for it."""

RunStatus = Literal["ok", "oom", "failed", "timeout"]
"""``ok``; ``oom``: the device ran out of memory (caught, freed); ``failed``: an error or a crash;
``timeout``: the run did not finish in time and was killed."""


def _positive(name: str, value: object, *, zero_ok: bool = False) -> None:
    require_int(name, value, low=0 if zero_ok else 1, error=BenchError)


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasureSpec:
    """One configuration to measure: a workload, a batch plan, a precision and a step count."""

    workload: str
    """``MODULE:FUNCTION`` of the workload; the worker process imports it itself."""
    micro_batch: int
    """Examples per forward pass on one replica."""
    accum_steps: int
    """Micro-batches per optimizer update on one replica."""
    dp: int = 1
    """Data-parallel replicas; the process group the measurement runs in must have this many ranks."""
    precision: str = "float32"
    """``float64``/``float32``: parameters in that dtype; ``bfloat16``/``float16``: float32
    parameters under autocast (``float16`` with a GradScaler)."""
    defer_sync: bool = True
    """Synchronize gradients once per update (DDP ``no_sync`` on all but the last micro-batch)."""
    steps: int = 20
    """Measured optimizer updates per run."""
    warmup: int = 3
    """Updates run before measuring: allocator and caches warm up, DDP rebuilds its buckets, and the
    Accumulator's one-time check that all ranks agree runs."""
    seed: int = 0
    """Data of update ``u`` is ``make_batch(global_batch, seed + 1 + u)``: every configuration with
    the same global batch sees the same examples, so tokens per update match exactly."""
    device: str = "cpu"
    """``cpu``, ``cuda`` or ``cuda:N``; a data-parallel worker on CUDA uses ``cuda:LOCAL_RANK``."""
    threads: int | None = None
    """``torch.set_num_threads`` in the worker; ``None`` keeps torch's default."""
    bucket_cap_mb: float | None = None
    """DDP's gradient bucket size in MiB; ``None`` keeps DDP's default (25)."""
    max_grad_norm: float | None = None
    """Clip each update's gradient to this norm, as training will (``None``: no clipping)."""
    checkpointing: str = "none"
    """``none``, or ``full``: every repeated block of the model under activation checkpointing
    (see :mod:`gradaccum.bench.checkpointing`)."""
    fsdp: bool = False
    """Shard with FSDP2 ``fully_shard`` (each repeated block, then the root) instead of DDP;
    needs ``dp`` > 1."""
    compile: bool = False
    """Compile in place (``nn.Module.compile()``, torch's default backend): the model before DDP
    wraps it, or each block after FSDP2 shards it; the warm-up's first update then compiles, and
    its extra time is reported apart (:attr:`Measurement.compile_s`), never in the throughput."""
    scaling: Scaling = "pre"
    """The accumulator's ``AccumConfig.scaling``: ``pre`` (count the window, then backpropagate
    each micro-batch times W/N) or ``post`` (stream it, scale the gradients once after it)."""
    max_tokens: int | None = None
    """A token-budget arm: each update's global batch cut by :func:`gradaccum.split_by_tokens`
    into micro-batches of at most this many tokens, balanced across the ranks, instead of
    ``micro_batch`` rows each (``micro_batch`` is then the rows per rank, ``accum_steps`` 1).
    ``None``: fixed micro-batches."""
    balance: str | None = None
    """A routing model's load balance (``--balance``): ``exact``, ``lagged``, ``micro-batch``, ``off``;
    ``None``: the model's own choice (:func:`gradaccum.workloads.balance.choose_balance`), as
    ``train`` makes it."""

    def __post_init__(self) -> None:
        for name in ("micro_batch", "accum_steps", "dp"):
            _positive(name, getattr(self, name))
        if self.max_tokens is not None:
            _positive("max_tokens", self.max_tokens)
            if self.accum_steps != 1:
                raise BenchError(
                    f"a token-budget arm holds the global batch as rows per rank in one window "
                    f"(accum_steps 1), got accum_steps={self.accum_steps}"
                )
        _check_run_settings(self)
        if not isinstance(self.workload, str) or ":" not in self.workload:
            raise BenchError(f"workload must be MODULE:FUNCTION, got {self.workload!r}")
        if self.checkpointing not in CHECKPOINTING:
            raise BenchError(f"checkpointing must be one of {CHECKPOINTING}, got {self.checkpointing!r}")
        for flag in ("fsdp", "compile"):
            if not isinstance(getattr(self, flag), bool):
                raise BenchError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        check_scaling(self.scaling)

        if self.fsdp and self.dp < 2:
            raise BenchError(
                "FSDP2 sharding needs dp > 1 (one rank holds every shard: nothing is sharded); "
                "use --dp 2 or more, or leave fsdp2 out of --sharding"
            )

    @property
    def plan(self) -> BatchPlan:
        return BatchPlan(micro_batch=self.micro_batch, accum_steps=self.accum_steps, dp=self.dp)

    @property
    def label(self) -> str:
        """``MICROxACCUM`` (``MICROxDPxACCUM`` under data parallelism), as the CLI writes plans;
        ``tokens<=N`` for a token-budget arm."""
        return self.plan.label() if self.max_tokens is None else f"tokens<={self.max_tokens}"

    @property
    def sharding(self) -> str:
        """``fsdp2``, ``ddp`` (data-parallel replicas) or ``none`` (one process)."""
        return "fsdp2" if self.fsdp else ("ddp" if self.dp > 1 else "none")

    @property
    def row_label(self) -> str:
        """The plan's label with what else the row changes: ``8x2``, ``8x2 ckpt``,
        ``4x2x2 fsdp2``, ``4x2x2 fsdp2 no-defer`` (sync on every micro-batch)."""
        parts = [self.label]
        if self.checkpointing != "none":
            parts.append("ckpt" if self.checkpointing == "full" else f"ckpt={self.checkpointing}")
        if self.fsdp:
            parts.append("fsdp2")
        if not self.defer_sync:
            parts.append("no-defer")
        if self.compile:
            parts.append("compiled")
        if self.scaling != "pre":
            parts.append(self.scaling)
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MeasureSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise BenchError(f"unknown measurement settings {unknown}; known: {sorted(known)}")
        return cls(**data)


def check_scaling(scaling: object) -> None:
    """Refuse a scaling that ``AccumConfig`` does not know, naming both it knows."""
    if scaling not in SCALINGS:
        raise BenchError(
            f"scaling must be 'pre' (count the window first) or 'post' (stream it, scale the gradients "
            f"once after it), got {scaling!r}"
        )


def _check_run_settings(settings: MeasureSpec | MeasureSettings) -> None:
    """The checks of the settings a :class:`MeasureSpec` and :class:`MeasureSettings` share."""
    _positive("steps", settings.steps)
    _positive("warmup", settings.warmup, zero_ok=True)
    _positive("seed", settings.seed, zero_ok=True)
    if settings.threads is not None:
        _positive("threads", settings.threads)
    cap = settings.bucket_cap_mb
    if cap is not None and not (isinstance(cap, (int, float)) and 0 < cap < float("inf")):
        raise BenchError(f"bucket_cap_mb must be a positive number of MiB or None, got {cap!r}")
    if settings.precision not in PRECISIONS:
        raise BenchError(f"precision must be one of {PRECISIONS}, got {settings.precision!r}")
    norm = settings.max_grad_norm
    if norm is not None and (
        isinstance(norm, bool) or not isinstance(norm, (int, float)) or not 0 < norm < float("inf")
    ):
        raise BenchError(f"max_grad_norm must be a positive number or None (no clipping), got {norm!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasureSettings:
    """How each configuration is measured: what a sweep and an acceptance run share."""

    runs: int = 3
    """Runs per configuration, interleaved across configurations."""
    steps: int = 20
    """Measured optimizer updates per run."""
    warmup: int = 3
    """Unmeasured updates at the start of each run (see :attr:`MeasureSpec.warmup`)."""
    precision: str = "float32"
    """Production precision (see :attr:`MeasureSpec.precision`)."""
    defer_sync: bool = True
    """Defer gradient sync to the last micro-batch of each update."""
    device: str = "cpu"
    """``cpu``, ``cuda`` or ``cuda:N``."""
    threads: int | None = None
    """Torch threads per worker process; ``None``: torch's default."""
    bucket_cap_mb: float | None = None
    """DDP gradient bucket size in MiB; ``None``: DDP's default."""
    seed: int = 0
    """Model and data seed."""
    max_grad_norm: float | None = None
    """Clip each update's gradient to this norm, as training will (``None``: no clipping)."""
    compile: bool = False
    """Measure compiled models (see :attr:`MeasureSpec.compile`)."""
    balance: str | None = None
    """A routing model's load balance (see :attr:`MeasureSpec.balance`)."""

    def __post_init__(self) -> None:
        _positive("runs", self.runs)
        _check_run_settings(self)
        if not isinstance(self.compile, bool):
            raise BenchError(f"compile must be True or False, got {self.compile!r}")

    def measure_spec(
        self, workload: str, plan: BatchPlan, *, scaling: Scaling = "pre", max_tokens: int | None = None
    ) -> MeasureSpec:
        """One run's configuration: ``plan`` of ``workload`` measured with these settings, its
        accumulator scaling the gradients as ``scaling`` says (``max_tokens``: a token-budget arm,
        ``plan`` one window of the rows per rank)."""
        per_run = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "runs"}
        return MeasureSpec(
            workload=workload,
            micro_batch=plan.micro_batch,
            accum_steps=plan.accum_steps,
            dp=plan.dp,
            scaling=scaling,
            max_tokens=max_tokens,
            **per_run,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """The figures of one run of one configuration (all ranks combined under data parallelism)."""

    spec: MeasureSpec
    """What was measured."""
    unit: str
    """What the workload's ``count_fn`` counts ("tokens", "examples")."""
    step_ms: list[float]
    """Wall time of each measured update at the optimizer boundary (slowest rank under DP)."""
    micro_ms: float
    """Median forward+backward time of one micro-batch, the synchronizing final one excluded under DP."""
    sync_ms: float | None
    """Median time the final, synchronizing backward adds over the other micro-batches; ``None``
    without data parallelism or with one micro-batch per update."""
    count_ms: float
    """Median time to count the window and agree on N across ranks, before the first backward."""
    optimizer_ms: float
    """Median time from the last backward to the end of the optimizer step (norm, clip, step)."""
    tokens_per_update: list[int]
    """Exact global count of valid units of each measured update (all ranks)."""
    examples_per_update: int
    """Examples per update across all ranks: the global batch."""
    units_per_s: float
    """Valid units (tokens) per second: all measured units over all measured step time."""
    updates: int
    """Optimizer updates attempted in the measured part of the run."""
    skipped_updates: int
    """Of those, updates skipped (GradScaler overflow, non-finite loss or gradient, zero count)."""
    peak_rss_bytes: int
    """CPU: peak resident set size of the measuring process (``ru_maxrss``; the largest over ranks).
    It includes the Python runtime and torch itself: the process high-water mark."""
    fresh_process: bool
    """True when the process ran this configuration only, so its peak RSS is this configuration's."""
    peak_allocated_bytes: int | None
    """CUDA: ``torch.cuda.max_memory_allocated`` over an update, reset per update; largest update
    and rank. ``None`` on CPU."""
    peak_reserved_bytes: int | None
    """CUDA: ``torch.cuda.max_memory_reserved`` (the caching allocator's pool), reset per update."""
    gradient_bytes: int
    """Bytes of one full set of gradients: what one synchronized backward all-reduces under DDP."""
    allreduce_calls_per_update: int | None
    """Gradient all-reduce calls per update (DDP comm hook); ``None`` without data parallelism."""
    allreduce_bytes_per_update: int | None
    """Gradient bytes all-reduced per update on one rank; ``None`` without data parallelism."""
    buckets: int | None
    """All-reduce calls of one synchronized backward (DDP's bucket count); ``None`` without DP."""
    threads: int
    """``torch.get_num_threads()`` in the measuring process."""
    device_name: str
    """The device the run used, in words."""
    memory: MemoryFigures | None = None
    """Persistent and activation bytes from the tensors (and CUDA's allocator figures)."""
    allgather_calls_per_update: int | None = None
    """FSDP2: parameter all-gathers per update (each unit, each forward and each backward that
    regathers); ``None`` without FSDP2."""
    allgather_bytes_per_update: int | None = None
    """FSDP2: bytes all-gathered per update on one rank (unsharded sizes, padding included)."""
    reduce_scatter_calls_per_update: int | None = None
    """FSDP2: gradient reduce-scatters per update (each unit, each synchronizing backward)."""
    reduce_scatter_bytes_per_update: int | None = None
    """FSDP2: gradient bytes reduce-scattered per update on one rank (unsharded, padded)."""
    reduce_scatter_bytes_per_sync: int | None = None
    """FSDP2: bytes one synchronizing backward reduce-scatters (the padded gradient set, FSDP2's G)."""
    other_ms: float | None = None
    """Median over updates of what the timed phases leave of the step (step - count - every
    micro-batch - optimizer): the window's checks before the count, moving each micro-batch to the
    device between micro-batches, and the result after the optimizer; not broken down further."""
    phase_totals_ms: tuple[float, ...] | None = None
    """(count, micro-batches, optimizer, other, step) summed over the measured updates on the rank
    with the longest steps: totals add up where medians do not (step = the other four)."""
    compile_s: float | None = None
    """Compiled rows: the first warm-up update's time minus the median measured update (what
    compiling cost, slowest rank); ``None`` for eager rows."""
    recompiles: int = 0
    """Graphs compiled during the measured updates (``StepResult.recompiles``, largest rank): 0
    when the warm-up compiled everything the measured shapes need."""
    straggler: tuple[float, ...] | None = None
    """DDP on two or more ranks, per measured update: the slowest rank's window time over the ranks'
    mean, each rank's window timed from the update's start to its last gradient bucket handed to
    the all-reduce (its own work, before it waits for the others); ``None`` otherwise."""

    @property
    def step_ms_median(self) -> float:
        return float(statistics.median(self.step_ms))

    @property
    def straggler_median(self) -> float | None:
        """The median over updates of :attr:`straggler`."""
        return None if not self.straggler else float(statistics.median(self.straggler))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["spec"] = self.spec.to_dict()
        data["memory"] = None if self.memory is None else self.memory.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        values = dict(data)
        values["spec"] = MeasureSpec.from_dict(values["spec"])
        memory = values.get("memory")
        values["memory"] = None if memory is None else MemoryFigures.from_dict(memory)
        return cls(**values)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunRecord:
    """One run of one configuration: its status and, when it finished, its measurement."""

    spec: MeasureSpec
    """What was run."""
    status: RunStatus
    """How the run ended."""
    measurement: Measurement | None = None
    """The figures; ``None`` unless ``status`` is ``ok``."""
    error: str | None = None
    """Why it did not finish (the OOM message, the last lines of a traceback, the timeout)."""
    run_index: int = 0
    """Which of the configuration's runs this is (runs of different configurations interleave)."""

    def __post_init__(self) -> None:
        if (self.status == "ok") != (self.measurement is not None):
            raise BenchError(f"a run record has a measurement iff it is ok, got status {self.status!r}")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_dict(),
            "status": self.status,
            "measurement": None if self.measurement is None else self.measurement.to_dict(),
            "error": self.error,
            "run_index": self.run_index,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunRecord:
        m = data.get("measurement")
        return cls(
            spec=MeasureSpec.from_dict(data["spec"]),
            status=data["status"],
            measurement=None if m is None else Measurement.from_dict(m),
            error=data.get("error"),
            run_index=int(data.get("run_index", 0)),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class PairedSpec:
    """Two configurations measured in one process, alternating in blocks of updates (accept's run)."""

    baseline: MeasureSpec
    """The configuration in use."""
    candidate: MeasureSpec
    """The proposed one (same global batch, dp, device and precision)."""
    blocks: int
    """Blocks per configuration; they alternate A B, B A, ... so there are as many pairs."""
    block_updates: int
    """Timed updates per block (``blocks * block_updates`` per configuration)."""

    def __post_init__(self) -> None:
        _positive("blocks", self.blocks)
        _positive("block_updates", self.block_updates)
        b, c = self.baseline, self.candidate
        same = ("dp", "device", "precision", "workload", "seed", "threads")
        differ = [name for name in same if getattr(b, name) != getattr(c, name)]
        if differ:
            raise BenchError(f"the two configurations of a paired run must share {differ}")

    @property
    def dp(self) -> int:
        return self.baseline.dp

    @property
    def device(self) -> str:
        return self.baseline.device

    @property
    def label(self) -> str:
        """``8x4 vs 4x8``; with the scalings once an arm post-scales: ``4x8 pre vs 4x8 post``."""
        b, c = self.baseline, self.candidate
        if "post" in (b.scaling, c.scaling):
            return f"{b.label} {b.scaling} vs {c.label} {c.scaling}"
        return f"{b.label} vs {c.label}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline.to_dict(),
            "candidate": self.candidate.to_dict(),
            "blocks": self.blocks,
            "block_updates": self.block_updates,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PairedSpec:
        return cls(
            baseline=MeasureSpec.from_dict(data["baseline"]),
            candidate=MeasureSpec.from_dict(data["candidate"]),
            blocks=int(data["blocks"]),
            block_updates=int(data["block_updates"]),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class PairedRecord:
    """One paired run: both configurations' figures and the time of every block."""

    spec: PairedSpec
    """What was run."""
    status: RunStatus
    """How the run ended."""
    baseline: Measurement | None = None
    """The baseline's figures over all its blocks (``None`` unless ``ok``)."""
    candidate: Measurement | None = None
    """The candidate's figures over all its blocks."""
    block_seconds: tuple[tuple[float, float], ...] = ()
    """Per block pair: (baseline seconds, candidate seconds), slowest rank."""
    block_units: tuple[int, ...] = ()
    """Valid units of each block pair (the same for both: the same examples)."""
    error: str | None = None
    """Why it did not finish."""
    run_index: int = 0
    """Which run this is."""

    def __post_init__(self) -> None:
        if (self.status == "ok") != (self.baseline is not None and self.candidate is not None):
            raise BenchError(f"a paired record has measurements iff it is ok, got status {self.status!r}")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ratios(self) -> tuple[float, ...]:
        """Candidate throughput over baseline throughput, per block pair (same units, so t_A / t_B)."""
        return tuple(a / b for a, b in self.block_seconds if a > 0 and b > 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_dict(),
            "status": self.status,
            "baseline": None if self.baseline is None else self.baseline.to_dict(),
            "candidate": None if self.candidate is None else self.candidate.to_dict(),
            "block_seconds": [list(pair) for pair in self.block_seconds],
            "block_units": list(self.block_units),
            "ratios": list(self.ratios),
            "error": self.error,
            "run_index": self.run_index,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PairedRecord:
        b, c = data.get("baseline"), data.get("candidate")
        return cls(
            spec=PairedSpec.from_dict(data["spec"]),
            status=data["status"],
            baseline=None if b is None else Measurement.from_dict(b),
            candidate=None if c is None else Measurement.from_dict(c),
            block_seconds=tuple((float(x), float(y)) for x, y in data.get("block_seconds", [])),
            block_units=tuple(int(u) for u in data.get("block_units", [])),
            error=data.get("error"),
            run_index=int(data.get("run_index", 0)),
        )
