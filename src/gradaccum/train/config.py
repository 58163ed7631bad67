"""What one training run is: a frozen record that :func:`gradaccum.train.resolve_spec` builds from a
:class:`~gradaccum.train.TrainSpec` (or a library caller writes) and :func:`gradaccum.train.train` runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gradaccum.errors import TrainError
from gradaccum.names import DEFAULT_WORKLOAD, PARAM_DTYPES, PRECISIONS, ParamDtype, Precision
from gradaccum.plan import BatchPlan
from gradaccum.step.config import AccumConfig
from gradaccum.train.batch_schedule import CriticalBatchConfig
from gradaccum.train.schedule import ScheduleConfig
from gradaccum.train.settings import BALANCE_CHOICES
from gradaccum.train.spec import (
    DEFAULT_CHECKPOINT_EVERY,
    DEFAULT_CHECKPOINT_MINUTES,
    DEFAULT_KEEP_CHECKPOINTS,
    DEFAULT_LR,
    DEFAULT_MAX_GRAD_NORM,
    DEFAULT_MAX_SKIPS,
    DEFAULT_OPTIMIZER,
    DEFAULT_WEIGHT_DECAY,
    OPTIMIZERS,
    OptimizerName,
)
from gradaccum.values import require_int

__all__ = [
    "DEFAULT_CHECKPOINT_EVERY",
    "DEFAULT_CHECKPOINT_MINUTES",
    "DEFAULT_KEEP_CHECKPOINTS",
    "DEFAULT_WORKLOAD",
    "OptimizerName",
    "Precision",
    "TrainConfig",
    "TrainError",
]


def _positive(name: str, value: object, *, allow_none: bool = True) -> None:
    require_int(name, value, error=TrainError, none_ok=allow_none)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """One training run. ``None`` means unset; the run's length is ``steps`` and/or ``tokens``."""

    plan: BatchPlan
    """Micro-batch, data-parallel degree (must equal the world size) and accumulation steps."""
    run_dir: Path
    """Where the run card, metrics, loss curve and checkpoints go (rank 0 writes the records)."""
    workload: str = DEFAULT_WORKLOAD
    """``MODULE:FUNCTION`` of the workload; recorded in the run card and checkpoints."""
    steps: int | None = None
    """Stop after this many windows (optimizer boundaries, skipped ones included)."""
    tokens: int | None = None
    """Stop at the first boundary where this many valid units have been consumed."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Warmup + cosine or constant, and the clock they advance on."""
    optimizer: OptimizerName = DEFAULT_OPTIMIZER
    """Which optimizer to build."""
    lr: float = DEFAULT_LR
    """Peak learning rate (``adamw``/``sgd``); the schedule multiplies it by its factor."""
    weight_decay: float = DEFAULT_WEIGHT_DECAY
    """Decoupled weight decay (``adamw``) or L2 penalty (``sgd``)."""
    precision: Precision = "float32"
    """Compute precision; see :data:`Precision`."""
    param_dtype: ParamDtype = "saved"
    """The dtype the parameters are stored, trained and checkpointed in: ``saved``, as the workload
    builds them (an ``hf:`` folder's saved ``torch_dtype``; float64 under precision float64), or a
    dtype name (:func:`gradaccum.train.build.build_model`)."""
    accum: AccumConfig = field(
        default_factory=lambda: AccumConfig(
            max_grad_norm=DEFAULT_MAX_GRAD_NORM, track_grad_norm=True, max_consecutive_skips=DEFAULT_MAX_SKIPS
        )
    )
    """The Accumulator's settings: clipping, skip policy, consecutive-skip limit."""
    seed: int = 0
    """Selects the data stream (see :mod:`gradaccum.train.data`) and seeds torch's RNG (dropout)."""
    device: str = "cpu"
    """``cpu``, ``cuda`` or ``cuda:N``; the CLI picks ``cuda:LOCAL_RANK`` under torchrun."""
    fsdp: bool = False
    """Shard with FSDP2 ``fully_shard`` instead of replicating with DDP (multi-process runs)."""
    compile: bool = False
    """Compile in place (``nn.Module.compile()``, torch's default backend): the model before DDP
    wraps it, or under FSDP2 each block after ``fully_shard`` (see
    :func:`gradaccum.distributed.wrap.wrap_model`); ``StepResult.recompiles`` says when a window
    compiled."""
    checkpoint_every: int | None = DEFAULT_CHECKPOINT_EVERY
    """Checkpoint once this many optimizer updates were applied since the last checkpoint; ``None``:
    not by count. Whichever of this and ``checkpoint_minutes`` comes first triggers; checkpoints are
    also written at the end of the run and on request."""
    checkpoint_minutes: float | None = DEFAULT_CHECKPOINT_MINUTES
    """Checkpoint at the first boundary this many minutes after the last checkpoint (or the start);
    ``None``: not by time. Every rank's clock is consulted, so all checkpoint at the same boundary."""
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS
    """Intact checkpoints kept on disk; older ones are deleted once a newer one is complete."""
    eval_every: int | None = None
    """Evaluate (no grad, eval mode) every this many windows; ``None``: never."""
    eval_examples: int = 64
    """Held-out examples per evaluation, split across the data-parallel ranks."""
    resume: Path | None = None
    """A checkpoint folder, or a run folder (its latest checkpoint), to continue from."""
    max_tokens: int | None = None
    """Cut each window's global batch into micro-batches of at most this many tokens (rows x
    longest row), balanced across the ranks (:func:`gradaccum.split_by_tokens`; equal counts under
    FSDP2), instead of ``plan.micro_batch`` rows each; the plan then holds the global batch as
    ``global_batch / dp`` rows per rank and one window. ``None``: fixed micro-batches."""
    balance_cost: bool = False
    """With ``max_tokens``: balance the ranks' compute cost, attention included, instead of their
    valid tokens (:func:`gradaccum.tokens.transformer_cost` with the d_model and layers the
    workload's model declares); the update is the same, only which rows each rank runs differs."""
    balance: str | None = None
    """A routing (mixture-of-experts) model's load balance: ``exact``, ``lagged``, ``micro-batch``
    (:class:`gradaccum.moe.LoadBalance` modes) or ``off``; ``None``: the model's own choice, exact
    when its config asks for its balancing loss (``output_router_logits=True``), else off
    (:func:`gradaccum.workloads.balance.choose_balance`). A dense model takes ``None`` or ``off``."""
    batch_schedule: CriticalBatchConfig | None = None
    """Grow the global batch with the measured noise scale (``accum_steps`` rises, ``plan`` is the
    start); needs ``accum.noise_scale``. ``None``: the plan's batch throughout."""

    def equation(self, window_tokens: int | None = None) -> str:
        """The batch equation; with ``max_tokens``, the window in rows and in tokens (``window_tokens``:
        the valid tokens of a window, when known) and the budget of each micro-batch."""
        if self.max_tokens is None:
            return self.plan.equation()
        tokens = "" if window_tokens is None else f" = {window_tokens:,} valid tokens in the first window"
        return (
            f"global_batch = {self.plan.global_batch} rows{tokens}, over dp {self.plan.dp}; micro-batches "
            f"of at most max_tokens {self.max_tokens} tokens (rows x longest row), balanced by "
            + ("compute cost (attention included)" if self.balance_cost else "tokens")
        )

    def __post_init__(self) -> None:
        if not isinstance(self.plan, BatchPlan):
            raise TrainError(f"plan must be a BatchPlan, got {type(self.plan).__name__}")
        _positive("steps", self.steps)
        _positive("tokens", self.tokens)
        if self.steps is None and self.tokens is None:
            raise TrainError("a run needs a length: set steps (windows) or tokens (valid units), or both")
        _positive("checkpoint_every", self.checkpoint_every)
        minutes = self.checkpoint_minutes
        if minutes is not None and (
            isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not minutes > 0
        ):
            raise TrainError(f"checkpoint_minutes must be a positive number or None, got {minutes!r}")
        _positive("eval_every", self.eval_every)
        _positive("max_tokens", self.max_tokens)
        if self.max_tokens is not None and self.batch_schedule is not None:
            raise TrainError(
                "max_tokens and batch_schedule cannot be combined: the schedule grows accum_steps"
            )
        _positive("keep_checkpoints", self.keep_checkpoints, allow_none=False)
        _positive("eval_examples", self.eval_examples, allow_none=False)
        if self.precision not in PRECISIONS:
            raise TrainError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.param_dtype not in PARAM_DTYPES:
            raise TrainError(
                f"param_dtype must be one of {', '.join(PARAM_DTYPES)}, got {self.param_dtype!r}"
            )
        if self.balance is not None and self.balance not in BALANCE_CHOICES:
            raise TrainError(
                f"balance must be one of {', '.join(BALANCE_CHOICES)} or None, got {self.balance!r}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise TrainError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise TrainError(f"lr must be a positive number, got {self.lr!r}")
        if not (isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0):
            raise TrainError(f"weight_decay must be a non-negative number, got {self.weight_decay!r}")
        if not isinstance(self.compile, bool):
            raise TrainError(f"compile must be True or False, got {self.compile!r}")
        if not isinstance(self.balance_cost, bool):
            raise TrainError(f"balance_cost must be True or False, got {self.balance_cost!r}")
        if self.balance_cost and self.max_tokens is None:
            raise TrainError(
                "--balance-cost balances the ranks' micro-batches of a token budget by compute cost, "
                f"and this run cuts fixed micro-batches of {self.plan.micro_batch} rows (no --max-tokens): "
                "give --max-tokens N with it, or drop --balance-cost"
            )
        if self.fsdp and self.accum.noise_scale:
            raise TrainError(
                "the noise scale (accum.noise_scale: --noise-scale, or --batch-schedule critical) is "
                "measured under DDP or on one process, not under FSDP2 (--fsdp): train without one of them"
            )
        if self.batch_schedule is not None:
            if not isinstance(self.batch_schedule, CriticalBatchConfig):
                raise TrainError(
                    "batch_schedule must be a CriticalBatchConfig or None, got "
                    f"{type(self.batch_schedule).__name__}"
                )
            if not self.accum.noise_scale:
                raise TrainError(
                    "batch_schedule follows the measured noise scale: set accum.noise_scale=True "
                    "(--batch-schedule critical turns it on)"
                )
            self.batch_schedule.check(self.plan)
        if self.precision == "float16" and not self.accum.skip_nonfinite:
            raise TrainError(
                "precision float16 needs accum.skip_nonfinite=True: an overflowed window must be skipped "
                "on every rank and counted, not applied"
            )
