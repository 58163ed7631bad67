"""What a run reports: one record per window, evaluation and checkpoint; metrics JSONL; a loss curve.

The loop hands every record to the caller's callback (the CLI renders a progress bar from them) and,
on rank 0, appends it to ``metrics.jsonl`` in the run folder, one JSON object per line, flushed as
it is written so a crashed run keeps its history. A resumed run first drops the lines of windows
after its checkpoint (they are about to be trained again). Nothing is written until the first
window has trained: a run that fails before it leaves no half-made records behind.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, TypeAlias

from gradaccum.atomic import atomic_write_text
from gradaccum.train.batch_schedule import BatchChange

__all__ = [
    "BATCH_PNG",
    "LOSS_PNG",
    "METRICS_FILE",
    "BatchChange",
    "CheckpointRecord",
    "EvalRecord",
    "MetricsLog",
    "Recorder",
    "StepRecord",
    "TrainEvent",
    "TrainStart",
    "batch_figure",
    "loss_figure",
    "plot_loss",
    "read_metrics",
]

METRICS_FILE = "metrics.jsonl"
LOSS_PNG = "loss.png"
BATCH_PNG = "batch.png"
"""The global batch and B_simple per window, in the workload's units (with ``--noise-scale``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainStart:
    """Sent once, after the model, data and any checkpoint are ready and before the first window."""

    equation: str
    """The batch equation of the run's plan."""
    world: int
    """Processes in the job (the plan's dp)."""
    device: str
    """The training device of rank 0."""
    schedule: dict[str, Any]
    """The resolved schedule, its clock and skipped-update policy."""
    tokens_per_step: int
    """Valid units in the first window's global batch (the estimate horizons are converted with)."""
    start_window: int
    """The first window this run trains (0, or the resumed data position)."""
    total_windows: int | None
    """Windows the run will train in all, when its length is given in steps."""
    resumed_from: str | None
    """The checkpoint folder the run continued from."""
    skipped_checkpoints: tuple[str, ...] = ()
    """Checkpoints newer than the resumed one that were passed over, each with why (not intact)."""
    checkpoint_schedule: dict[str, Any] | None = None
    """The resumed checkpoint's schedule when it differs from this run's (e.g. a longer run moves
    a derived horizon); the learning rate follows this run's schedule from the resumed boundary."""
    run_dir: str = ""
    """The run folder."""
    batch_schedule: dict[str, Any] | None = None
    """The batch-size schedule's settings and changes so far (``--batch-schedule critical``)."""
    unit: str = "tokens"
    """What the workload's count_fn counts (``Workload.unit``): the unit of B_simple and of the
    batch in valid units."""
    evaluation: str | None = None
    """The rows held out of training for evaluation, in words (an ``hf:`` workload's split)."""
    balance: str | None = None
    """A routing model's load balance, in words: mode, coefficient and why
    (:meth:`gradaccum.workloads.balance.BalanceChoice.describe`); ``None``: the model does not route."""
    param_dtypes: str = ""
    """The dtypes the model's trainable parameters are stored in (beside the compute precision)."""
    experts: str | None = None
    """Set when an ``hf:`` MoE model's experts were switched to the eager kernel for float64, in words."""
    resumed_layout: str | None = None
    """Set when the run resumed a checkpoint written on another layout, in words: that layout and
    this one (:mod:`gradaccum.train.layout`); the trajectory is the same."""
    data: str | None = None
    """An ``hf:`` workload's data file in words: its documents and the lines skipped (blank, or with
    no text), so that nothing is dropped unsaid; ``None`` for a workload that makes its own batches."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepRecord:
    """One window: what the optimizer step did, and the counters after it."""

    window: int
    """Index of the window in the data stream."""
    step: int
    """Optimizer updates applied so far (the steps clock)."""
    loss: float | None
    """The window's mean loss over its global count; None for a window with no valid units."""
    grad_norm: float | None
    """Pre-clip global gradient norm (None when skipped)."""
    lr: float
    """Learning rate of the first parameter group for this window."""
    tokens: int
    """Valid units consumed by applied updates so far (the tokens clock)."""
    window_tokens: int
    """Valid units in this window, all ranks."""
    applied: bool
    """Whether the update was applied."""
    skipped: int
    """Skipped updates so far."""
    skip_reason: str | None
    """Why this window's update was skipped."""
    loss_scale: float | None
    """The GradScaler's scale after the step (float16 only)."""
    step_time_ms: float
    """Wall time of the window, from drawing its data to the end of the optimizer step."""
    tokens_per_s: float
    """This window's valid units divided by its wall time."""
    b_simple: float | None = None
    """The gradient noise scale B_simple after this window, in the workload's units (``--noise-scale``;
    None without it, or before it has an estimate)."""
    global_batch: int | None = None
    """Examples in this window's global batch (all ranks); it changes under a batch-size schedule."""
    accum_steps: int | None = None
    """Micro-batches per rank in this window."""
    recompiles: int = 0
    """Graphs torch.compile compiled during this window (``StepResult.recompiles``; 0 eager)."""
    micro_batches: int | None = None
    """With a token budget: the window's micro-batches over every rank (``None``: fixed ones,
    ``accum_steps`` per rank)."""
    computed_tokens: int | None = None
    """With a token budget: token positions the window computed, padding included (rows x longest
    row of each micro-batch, all ranks)."""
    padding_tokens: int | None = None
    """With a token budget: of ``computed_tokens``, the padding positions."""
    kind: str = "step"


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalRecord:
    """One evaluation (no grad, eval mode) at an optimizer boundary."""

    window: int
    """Windows done when it ran."""
    step: int
    """Applied updates when it ran."""
    eval_loss: float | None
    """Mean loss over the held-out examples' valid units (all ranks); None if they hold none."""
    eval_tokens: int
    """Valid units evaluated, all ranks."""
    kind: str = "eval"


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointRecord:
    """A checkpoint written at an optimizer boundary."""

    window: int
    """Windows done: the resumed run starts with this window."""
    step: int
    """Applied updates."""
    path: str
    """The checkpoint folder."""
    reason: str
    """``periodic`` (applied updates), ``timed`` (minutes), ``requested``, ``stop`` or ``final``."""
    kind: str = "checkpoint"


TrainEvent: TypeAlias = TrainStart | StepRecord | EvalRecord | CheckpointRecord | BatchChange


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf; a skipped window's non-finite figures are written as null
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    """Appends records to ``metrics.jsonl``; ``resume_window`` drops lines of windows >= it first."""

    def __init__(self, path: Path, *, resume_window: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_window is not None and self.path.exists():
            kept = [
                line
                for line in self.path.read_text(encoding="utf-8").splitlines()
                if line.strip() and _window_of(line) < resume_window
            ]
            atomic_write_text(self.path, "".join(f"{line}\n" for line in kept))
        elif resume_window is None:
            self.path.write_text("", encoding="utf-8")
        self._handle: IO[str] | None = self.path.open("a", encoding="utf-8")

    def write(self, record: StepRecord | EvalRecord | CheckpointRecord | BatchChange) -> None:
        if self._handle is None:
            raise ValueError(f"metrics log {self.path} is closed")
        data = {key: _clean(value) for key, value in asdict(record).items()}
        self._handle.write(json.dumps(data) + "\n")
        self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


class Recorder:
    """Hands every event to the caller's callback and, on the writing rank, to the run's records.

    ``run_dir`` None: a rank that writes nothing. The metrics file is opened (and a resumed one
    trimmed) only by :meth:`open`, or by the first record after the start: a run that fails before
    its first window leaves the run folder as it found it. Closing draws the loss curve when
    matplotlib (the ``cli`` extra) is installed; the core needs torch alone, so without it only the
    metrics are written.
    """

    def __init__(
        self,
        run_dir: Path | None,
        on_event: Callable[[TrainEvent], None] | None,
        *,
        resume_window: int | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.on_event = on_event
        self.resume_window = resume_window
        self.metrics: MetricsLog | None = None
        self.unit = "tokens"
        """What count_fn counts (``TrainStart.unit``), for the batch figure's axis."""
        self._closed = False

    @property
    def opened(self) -> bool:
        """Whether the metrics file has been opened (always False on a rank that writes nothing)."""
        return self.metrics is not None

    def open(self) -> None:
        """Open ``metrics.jsonl`` on the writing rank; a no-op when already open or not writing."""
        if self.run_dir is None or self.metrics is not None or self._closed:
            return
        self.metrics = MetricsLog(self.run_dir / METRICS_FILE, resume_window=self.resume_window)

    def __call__(self, event: TrainEvent) -> None:
        if isinstance(event, TrainStart):
            self.unit = event.unit
        else:
            self.open()
            if self.metrics is not None:
                self.metrics.write(event)
        if self.on_event is not None:
            self.on_event(event)

    def close(self) -> None:
        self._closed = True
        if self.metrics is not None and self.run_dir is not None:
            self.metrics.close()
            self.metrics = None
            if importlib.util.find_spec("matplotlib") is not None:
                plot_loss(self.run_dir / METRICS_FILE, self.run_dir / LOSS_PNG)
                batch = batch_figure(self.run_dir / METRICS_FILE, self.unit)
                if batch is not None:
                    batch.savefig(self.run_dir / BATCH_PNG)


def _window_of(line: str) -> int:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:  # a line cut short by a crash
        return 1 << 62
    # a step record's window is the window it trained; eval/checkpoint records count windows done
    window = int(record.get("window", 0))
    return window if record.get("kind") == "step" else window - 1


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``, skipping a final line cut short by a crash."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def plot_loss(metrics_path: Path, png_path: Path) -> Path | None:
    """Draw training (and evaluation) loss per optimizer boundary; None if there is nothing to draw.

    matplotlib is imported here, not at module import, and drawn on an Agg canvas without pyplot,
    so training never needs a display or touches global plotting state.
    """
    figure = loss_figure(metrics_path)
    if figure is None:
        return None
    png_path = Path(png_path)
    figure.savefig(png_path)
    return png_path


def loss_figure(metrics_path: Path) -> Any:
    """The loss curve of a ``metrics.jsonl`` as a matplotlib ``Figure`` (None if nothing to draw):
    skipped updates as red lines, batch-size changes as dashed green lines before the first window
    at the new batch."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(metrics_path)
    steps = [r for r in records if r.get("kind") == "step" and r.get("loss") is not None]
    if not steps:
        return None
    evals = [r for r in records if r.get("kind") == "eval" and r.get("eval_loss") is not None]
    figure = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    axes.plot([r["window"] + 1 for r in steps], [r["loss"] for r in steps], label="train loss", lw=1)
    if evals:
        axes.plot([r["window"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    skipped = [r for r in records if r.get("kind") == "step" and not r.get("applied")]
    for r in skipped:
        axes.axvline(r["window"] + 1, color="red", alpha=0.3, lw=0.8)
    changes = [r for r in records if r.get("kind") == "batch"]
    for r in changes:  # the first window at the new batch is window r["window"], drawn at x = window + 1
        axes.axvline(r["window"] + 0.5, color="green", alpha=0.6, lw=1, ls="--")
        axes.annotate(
            f"batch {r['global_batch']}",
            (r["window"] + 0.5, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            color="green",
        )
    axes.set_xlabel("optimizer boundary (window)")
    axes.set_ylabel("mean loss per valid unit")
    title = "training loss"
    notes = [f"{len(skipped)} skipped updates in red"] if skipped else []
    if changes:
        notes.append(f"{len(changes)} batch changes dashed green")
    if notes:
        title += f" ({'; '.join(notes)})"
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    return figure


def batch_figure(metrics_path: Path, unit: str = "tokens") -> Any:
    """The global batch and the B_simple estimates per window of a ``metrics.jsonl``, in ``unit``
    (what count_fn counts), as a matplotlib ``Figure``; None without a noise-scale estimate.

    The batch is each window's valid units; B_simple the run's smoothed estimate after each window;
    a batch schedule's own estimate (B_recent over its last windows) is marked where it changed the
    batch. Logarithmic y: the batch grows by factors, and B_simple is noisy early.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(metrics_path)
    steps = [r for r in records if r.get("kind") == "step"]
    estimated = [r for r in steps if r.get("b_simple") is not None and r["b_simple"] > 0]
    if not estimated:
        return None
    changes = [r for r in records if r.get("kind") == "batch"]
    figure = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    axes.plot(
        [r["window"] + 1 for r in steps], [r["window_tokens"] for r in steps], label="global batch", lw=1.2
    )
    axes.plot(
        [r["window"] + 1 for r in estimated],
        [r["b_simple"] for r in estimated],
        label="B_simple (smoothed over the run)",
        lw=1,
    )
    if changes:
        axes.plot(
            [r["window"] + 0.5 for r in changes],
            [r["b_simple"] for r in changes],
            "o",
            label="B_recent where the batch grew",
        )
    axes.set_yscale("log")
    axes.set_xlabel("optimizer boundary (window)")
    axes.set_ylabel(f"valid {unit} per window")
    axes.set_title(f"global batch and B_simple, in {unit}")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    return figure
