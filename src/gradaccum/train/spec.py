"""What a person asks ``gradaccum train`` for, before the launch is known: :class:`TrainSpec`.

``train`` has the data flow of every command: the command line parses its flags into a TrainSpec
(one field per flag), :func:`~gradaccum.train.resolve.resolve_spec` resolves it against the launch
(world size, device, run folder; known only once the process group is up) into a
:class:`~gradaccum.train.config.TrainConfig`, :func:`~gradaccum.train.loop.train` runs that, and the
command line renders the events and the result.

An accumulation setting that is a plain choice is one row of
:data:`gradaccum.train.settings.RUN_SETTINGS` and a field here of the same name: the flag, the run
card's refusal and the resolution follow from the row. Any other flag is a two-place change:

1. the flag, in ``gradaccum.cli.cmd_train.register``, with ``dest`` equal to the field's name and
   argparse's default ``None`` (the help states the real default);
2. a field here, with the default that applies when the flag is not given (``None`` only where
   "not given" must be told apart, as for the settings a run card fixes) and its check in
   ``__post_init__``.

The command line fills every field from the flag of the same name (a flag left at ``None`` keeps
the field's default), and :func:`~gradaccum.train.resolve.resolve_spec` passes every field named like
a ``TrainConfig`` field, and not resolved there, through unchanged (``--compile`` needs its
``TrainConfig`` field as well, for the loop to read). Nothing here imports torch: the command line's
``--help`` reads these defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gradaccum.errors import PlanError, TrainError
from gradaccum.names import PARAM_DTYPES, PRECISIONS, ParamDtype, Precision
from gradaccum.train.batch_schedule import LR_RULES, LrRule
from gradaccum.train.settings import RUN_SETTINGS
from gradaccum.values import require_int

__all__ = [
    "BATCH_FIELDS",
    "CARD_FIELDS",
    "DEFAULT_CHECKPOINT_EVERY",
    "DEFAULT_CHECKPOINT_MINUTES",
    "DEFAULT_GLOBAL_BATCH",
    "DEFAULT_KEEP_CHECKPOINTS",
    "DEFAULT_LR",
    "DEFAULT_MAX_GRAD_NORM",
    "DEFAULT_MAX_SKIPS",
    "DEFAULT_MICRO_BATCH",
    "DEFAULT_OPTIMIZER",
    "DEFAULT_STEPS",
    "DEFAULT_WEIGHT_DECAY",
    "OPTIMIZERS",
    "OptimizerName",
    "TrainSpec",
]

OptimizerName = Literal["adamw", "sgd", "workload"]
"""``adamw``/``sgd``: built with ``lr`` and ``weight_decay``. ``workload``: the workload's own
``optimizer_factory``; its groups' learning rates are the schedule's peak."""
OPTIMIZERS: tuple[OptimizerName, ...] = ("adamw", "sgd", "workload")

DEFAULT_GLOBAL_BATCH = 32
"""Examples per optimizer step, all ranks."""
DEFAULT_MICRO_BATCH = 8
"""Examples per forward pass on each rank."""
DEFAULT_STEPS = 200
"""Windows to train when neither steps nor tokens is given."""
DEFAULT_OPTIMIZER: OptimizerName = "adamw"
DEFAULT_LR = 1e-2
DEFAULT_WEIGHT_DECAY = 0.0
DEFAULT_MAX_GRAD_NORM = 1.0
DEFAULT_MAX_SKIPS = 10
"""Updates in a row skipped as non-finite before the run stops."""
DEFAULT_CHECKPOINT_EVERY = 100
"""Applied optimizer updates between periodic checkpoints."""
DEFAULT_CHECKPOINT_MINUTES = 30.0
"""Minutes between periodic checkpoints."""
DEFAULT_KEEP_CHECKPOINTS = 3
"""Intact checkpoints kept: the newest, and earlier ones to fall back on should it be damaged."""

CARD_FIELDS = (
    "workload",
    "global_batch",
    "micro_batch",
    "accum_steps",
    "max_tokens",
    "precision",
    "param_dtype",
    "seed",
    "optimizer",
    "lr",
    "weight_decay",
    "max_grad_norm",
    "max_consecutive_skips",
    *(setting.name for setting in RUN_SETTINGS),
)
"""The fields a run card fixes (the plan, the arithmetic of the update, the optimizer, the
accumulation settings of :data:`gradaccum.train.settings.RUN_SETTINGS`). Given beside
``runcard`` they are refused, naming the card's value, never silently ignored; so they default to
``None``, "not given"."""

BATCH_FIELDS = (
    "batch_schedule",
    "max_global_batch",
    "batch_growth",
    "batch_min_updates",
    "batch_lr_rule",
    "batch_fraction",
)
"""The batch-size schedule's fields (``None``: not given; the defaults are
:class:`~gradaccum.train.batch_schedule.CriticalBatchConfig`'s). A run card records the schedule, so
beside ``runcard`` they are refused like :data:`CARD_FIELDS`."""


_POSITIVE_OR_UNSET = (
    "global_batch",
    "micro_batch",
    "accum_steps",
    "max_tokens",
    "steps",
    "tokens",
    "max_consecutive_skips",
    "horizon",
    "eval_every",
    "max_global_batch",
    "batch_min_updates",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSpec:
    """One ``gradaccum train`` request: each field is the flag of the same name."""

    workload: str | None = None
    """``MODULE:FUNCTION`` or a whole ``hf:`` spec; ``None``: the default workload."""
    runcard: Path | None = None
    """Train exactly what this run card records (the fields of :data:`CARD_FIELDS` come from it)."""
    global_batch: int | None = None
    """Examples per optimizer step, all ranks; ``None``: :data:`DEFAULT_GLOBAL_BATCH`."""
    micro_batch: int | None = None
    """Examples per forward pass on each rank; ``None``: :data:`DEFAULT_MICRO_BATCH`."""
    accum_steps: int | None = None
    """Micro-batches per optimizer step on each rank (``gradient_accumulation_steps``); the batch
    equation global batch = micro-batch x processes x accum steps is checked against the given
    ``global_batch`` and ``micro_batch`` (:func:`gradaccum.train.resolve.resolve_spec`); ``None``:
    ``global_batch / (micro_batch x processes)``."""
    max_tokens: int | None = None
    """Instead of ``micro_batch``: micro-batches of at most this many tokens (rows x longest row),
    the window's rows sorted by length and balanced across ranks (:func:`gradaccum.split_by_tokens`);
    ``None``: fixed micro-batches."""
    balance_cost: bool = False
    """With ``max_tokens``: balance the ranks by compute cost, attention included
    (:func:`gradaccum.tokens.transformer_cost` with the model's d_model and layers), not by tokens;
    a run card that records it balances so too."""
    precision: Precision | None = None
    """Compute precision; ``None``: float32."""
    param_dtype: ParamDtype | None = None
    """The dtype the parameters are stored and trained in (:data:`PARAM_DTYPES`): ``saved``, the
    dtype the workload builds them in (an ``hf:`` folder's saved ``torch_dtype``), or a dtype name;
    ``None``: ``saved`` (float64 under ``precision`` float64)."""
    seed: int | None = None
    """Data stream and dropout seed; ``None``: 0."""
    steps: int | None = None
    """Optimizer boundaries to train; ``None``: :data:`DEFAULT_STEPS`, or none when ``tokens`` is set."""
    tokens: int | None = None
    """Stop once this many valid tokens were consumed; ``None``: no token limit."""
    optimizer: OptimizerName | None = None
    """``adamw``, ``sgd`` or ``workload``; ``None``: :data:`DEFAULT_OPTIMIZER`."""
    lr: float | None = None
    """Peak learning rate; ``None``: :data:`DEFAULT_LR`."""
    weight_decay: float | None = None
    """Weight decay; ``None``: :data:`DEFAULT_WEIGHT_DECAY`."""
    max_grad_norm: float | None = None
    """Clip the accumulated gradient to this norm, 0 turns clipping off; ``None``:
    :data:`DEFAULT_MAX_GRAD_NORM`."""
    max_consecutive_skips: int | None = None
    """Stop after this many skipped updates in a row; ``None``: :data:`DEFAULT_MAX_SKIPS`."""
    accum_dtype: str | None = None
    """Accumulate bfloat16/float16 parameters' gradients in this dtype (``AccumConfig.accum_dtype``);
    ``None``: the parameters' own dtype."""
    batchnorm_stats: str | None = None
    """BatchNorm statistics per ``micro-batch`` or per ``window`` (``AccumConfig.batchnorm_stats``);
    ``None``: ``micro-batch``."""
    balance: str | None = None
    """A routing model's load balance: ``exact``, ``lagged``, ``micro-batch`` or ``off``; ``None``:
    exact when the model's config asks for its balancing loss, else off
    (:func:`gradaccum.workloads.balance.choose_balance`)."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """Linear warmup, then cosine decay to ``min_lr_ratio`` or flat."""
    schedule_clock: Literal["steps", "tokens"] = "steps"
    """Advance the schedule per applied optimizer step or per consumed valid token."""
    warmup: int | None = None
    """Warmup in clock units; ``None``: 10% of the horizon."""
    horizon: int | None = None
    """Where the cosine ends, in clock units; ``None``: the run's length."""
    min_lr_ratio: float = 0.1
    """The cosine's floor as a fraction of the peak."""
    noise_scale: bool = False
    """Estimate the gradient noise scale from the micro-batches (the update is unchanged)."""
    scaling: Literal["pre", "post"] | None = None
    """``pre``: count each window before its first backward; ``post``: stream it and scale the
    gradients once after it (the same update); ``None``: the run card's, else ``pre``."""
    fsdp: bool = False
    """Shard with FSDP2 instead of DDP."""
    compile: bool = False
    """torch.compile the model in place before DDP (a run card that says so compiles too)."""
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY
    """Checkpoint every this many applied updates; 0: not by count."""
    checkpoint_minutes: float = DEFAULT_CHECKPOINT_MINUTES
    """Checkpoint at the first boundary this many minutes after the last one; 0: not by time."""
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS
    """Intact checkpoints kept."""
    eval_every: int | None = None
    """Evaluate every this many boundaries and at the end; ``None``: never."""
    eval_examples: int = 64
    """Held-out examples per evaluation, split across ranks."""
    batch_schedule: Literal["fixed", "critical"] | None = None
    """``critical``: grow the global batch with the measured noise scale
    (:mod:`gradaccum.train.batch_schedule`); ``None`` or ``fixed``: the plan's batch throughout."""
    max_global_batch: int | None = None
    """The schedule's largest global batch, in examples over all ranks (required with ``critical``)."""
    batch_growth: float | None = None
    """The largest factor per change; ``None``: 2."""
    batch_min_updates: int | None = None
    """Applied updates before the first change and between changes; ``None``: 20."""
    batch_lr_rule: LrRule | None = None
    """How the learning rate follows the batch: keep, sqrt or linear; ``None``: sqrt."""
    batch_fraction: float | None = None
    """The batch aimed at as a fraction of B_simple; ``None``: 1."""

    def __post_init__(self) -> None:
        for name in _POSITIVE_OR_UNSET:
            require_int(name, getattr(self, name), error=TrainError, none_ok=True)
        for name in ("keep_checkpoints", "eval_examples"):
            require_int(name, getattr(self, name), error=TrainError)
        for name in ("seed", "warmup"):
            require_int(name, getattr(self, name), low=0, error=TrainError, none_ok=True)
        require_int("checkpoint_every", self.checkpoint_every, low=0, error=TrainError)
        _choice("precision", self.precision, PRECISIONS)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        for setting in RUN_SETTINGS:
            _choice(setting.name, getattr(self, setting.name), setting.choices)
        _choice("schedule", self.schedule, ("cosine", "constant"), none_ok=False)
        _choice("scaling", self.scaling, ("pre", "post"))
        _choice("schedule_clock", self.schedule_clock, ("steps", "tokens"), none_ok=False)
        _number("lr", self.lr, above=0.0)
        for name in ("weight_decay", "max_grad_norm", "checkpoint_minutes"):
            _number(name, getattr(self, name), above=0.0, inclusive=True)
        _number("min_lr_ratio", self.min_lr_ratio, above=0.0, inclusive=True)
        _choice("batch_schedule", self.batch_schedule, ("fixed", "critical"))
        _choice("batch_lr_rule", self.batch_lr_rule, LR_RULES)
        for name in ("batch_growth", "batch_fraction"):
            _number(name, getattr(self, name), above=0.0)
        settings = [name for name in BATCH_FIELDS[1:] if getattr(self, name) is not None]
        if self.batch_schedule != "critical" and settings and self.runcard is None:
            flags = ", ".join(f"--{name.replace('_', '-')}" for name in settings)
            raise PlanError(
                f"{flags} set(s) the batch-size schedule, which is off: add --batch-schedule critical, "
                "or drop them"
            )
        if self.batch_schedule == "critical" and self.max_global_batch is None:
            raise PlanError(
                "--batch-schedule critical grows the global batch up to a declared bound: give "
                "--max-global-batch (examples per optimizer step, all ranks; a multiple of "
                "--micro-batch x processes)"
            )
        if self.max_tokens is not None and self.micro_batch is not None:
            raise PlanError(
                f"--max-tokens {self.max_tokens} cuts each window into micro-batches by tokens, instead of "
                f"--micro-batch {self.micro_batch} rows: give one of them"
            )
        if self.max_tokens is not None and self.accum_steps is not None:
            raise PlanError(
                f"--max-tokens {self.max_tokens} cuts each window into micro-batches by tokens, so their "
                f"number follows the lengths; --accum-steps {self.accum_steps} fixes it: give one of them"
            )
        _choice("param_dtype", self.param_dtype, PARAM_DTYPES)
        if self.precision == "float64" and self.param_dtype not in (None, "saved", "float64"):
            raise PlanError(
                f"--precision float64 computes in float64 with float64 parameters; --param-dtype "
                f"{self.param_dtype} would store them narrower: drop --param-dtype, or choose another "
                "--precision"
            )
        if self.max_tokens is not None and self.batch_schedule == "critical":
            raise PlanError(
                "--batch-schedule critical grows accum_steps at a fixed --micro-batch; with --max-tokens the "
                "micro-batches follow the lengths: train with one of them"
            )
        if self.min_lr_ratio > 1:
            raise TrainError(f"min_lr_ratio must be a fraction from 0 to 1, got {self.min_lr_ratio!r}")
        warmup, horizon = self.warmup, self.horizon
        if self.schedule == "cosine" and warmup is not None and horizon is not None and warmup > horizon:
            raise PlanError(
                f"--warmup {warmup} is longer than --horizon {horizon} ({self.schedule_clock}); "
                "shorten the warmup or lengthen the horizon"
            )

    def given(self) -> tuple[str, ...]:
        """The run-card fields this request sets (each would change what a card fixes)."""
        fixed = (*CARD_FIELDS, *BATCH_FIELDS)
        return tuple(name for name in fixed if getattr(self, name) is not None)


def _choice(name: str, value: object, choices: tuple[str, ...], *, none_ok: bool = True) -> None:
    if (value is None and none_ok) or value in choices:
        return
    raise TrainError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _number(name: str, value: object, *, above: float, inclusive: bool = False) -> None:
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and (value >= above if inclusive else value > above):  # type: ignore[operator]
        return
    bound = f">= {above:g}" if inclusive else f"> {above:g}"
    raise TrainError(f"{name} must be a number {bound}, got {value!r}")
