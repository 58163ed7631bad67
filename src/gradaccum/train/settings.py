"""The accumulation settings a run can use, declared once for every command that takes them.

Each :class:`RunSetting` row is one setting: the :class:`~gradaccum.TrainSpec` field and
``AccumConfig`` field of its name (or, for ``balance``, the run's load balance), its flag, its
choices and the commands that take it. From these rows alone:

* ``gradaccum train`` declares the flags (:func:`gradaccum.cli.cmd_train.register`), and ``bench``
  and ``accept`` those rows that name them;
* :func:`~gradaccum.train.resolve.resolve_spec` builds the ``AccumConfig`` from the given ones, and
  refuses them beside ``--runcard`` (the card fixes them; :data:`gradaccum.train.spec.CARD_FIELDS`
  holds them), naming the card's value;
* the run card records them (``accum``, or ``balance``) and ``train --runcard`` replays them.

Every other ``AccumConfig`` field is either set by a flag of its own shape
(:data:`OTHER_FLAGS`: 0 turns clipping off, a switch turns the noise scale on) or listed in
:data:`NOT_RUN_SETTINGS` with the reason it is no setting of a run. tests/train/test_settings.py
walks the fields and fails on one that is in neither, so a new field cannot be forgotten.
Nothing here imports torch: ``--help`` reads these rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.names import ACCUM_DTYPES
from gradaccum.step.config import BATCHNORM_STATS

__all__ = [
    "ACCUM_SETTINGS",
    "BALANCE",
    "BALANCE_CHOICES",
    "NOT_RUN_SETTINGS",
    "OTHER_FLAGS",
    "RUN_SETTINGS",
    "RunSetting",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSetting:
    """One setting of a run: ``--flag CHOICE``, the field ``name`` of TrainSpec (and of AccumConfig,
    for the rows of :data:`ACCUM_SETTINGS`)."""

    name: str
    """The field: ``TrainSpec.<name>`` (``None``: not given) and ``AccumConfig.<name>``."""
    flag: str
    """The command-line flag."""
    choices: tuple[str, ...]
    """Its values; another is refused by the parser (exit 2, naming the flag)."""
    help: str
    """The flag's help, its default included."""
    commands: tuple[str, ...]
    """The commands that take it (``train`` always; ``bench``/``accept`` where it changes what they
    measure)."""


BALANCE_CHOICES = ("exact", "lagged", "micro-batch", "off")
"""``gradaccum.moe.MODES`` and ``off`` (no balancing term)."""

ACCUM_SETTINGS = (
    RunSetting(
        name="accum_dtype",
        flag="--accum-dtype",
        choices=ACCUM_DTYPES,
        help="accumulate the gradients of bfloat16/float16 parameters over the window in this dtype, "
        "rounded once into the parameters' dtype before the optimizer step; refused on parameters "
        "it cannot widen (float32 ones: see --param-dtype) (default: none, the parameters' own dtype, "
        "as torch does)",
        commands=("train",),
    ),
    RunSetting(
        name="batchnorm_stats",
        flag="--batchnorm-stats",
        choices=BATCHNORM_STATS,
        help="BatchNorm running statistics: micro-batch (PyTorch's update per forward) or window (once "
        "per optimizer step, from the whole window's rows, as the full batch would) (default "
        "micro-batch)",
        commands=("train",),
    ),
)
"""The ``AccumConfig`` fields that are plain choices: one flag each, the same name. Both are
``train``'s only: ``bench`` and ``accept`` measure float32 parameters (``precision.param_dtype``:
bfloat16 runs under autocast), on which ``accum_dtype`` changes nothing; ``batchnorm_stats``
changes the running statistics, not the update accept checks, and its small per-micro-batch cost
(one pass over each BatchNorm input for its moments) is not measured by bench."""

BALANCE = RunSetting(
    name="balance",
    flag="--balance",
    choices=BALANCE_CHOICES,
    help="a mixture-of-experts model's load-balancing term over the window: exact (the window's "
    "routing statistics), lagged (the previous window's), micro-batch (each micro-batch's own, "
    "as plain accumulation computes it) or off (default: exact when the model's config asks for "
    "its balancing loss, output_router_logits=True, else off; the banner and the run card say which)",
    commands=("train", "verify", "bench"),
)
"""The load balance (:class:`gradaccum.moe.LoadBalance`; an Accumulator argument, not an AccumConfig
field): one rule for every command (:func:`gradaccum.workloads.balance.choose_balance`)."""

RUN_SETTINGS = (*ACCUM_SETTINGS, BALANCE)
"""Every row."""

OTHER_FLAGS = {
    "max_grad_norm": "--max-grad-norm (train; 0 turns clipping off)",
    "max_consecutive_skips": "--max-consecutive-skips (train)",
    "noise_scale": "--noise-scale (train; --batch-schedule critical turns it on)",
    "scaling": "--scaling (train), --baseline-scaling/--candidate-scaling (accept)",
    "defer_sync": "--no-defer-sync (bench, accept)",
}
"""``AccumConfig`` fields set by flags of their own shape: field -> the flags."""

NOT_RUN_SETTINGS = {
    "loss_reduction": "the workload's loss_fn returns a sum over its counted units (the Workload "
    "contract), so the commands always run 'sum'; 'mean' is for library callers whose loss is a mean",
    "check_loss_reduction": "the workload's loss_fn returns a sum over its counted units (the "
    "Workload contract), so the commands always read the first window's losses and refuse a mean",
    "track_grad_norm": "a report, not a setting: train always records the pre-clip norm",
    "skip_nonfinite": "always on in the commands: a non-finite window is skipped on every rank and "
    "counted (float16's GradScaler needs it); turning it off would apply a NaN update",
    "agree_on_failure": "always on in the commands: without it a rank that fails mid-window leaves "
    "the others waiting in the all-reduce until the process-group timeout",
    "sync_policy": "defer and every follow defer_sync (--no-defer-sync); defer_replicate needs an "
    "HSDP mesh (dp_replicate x dp_shard), which only library callers build",
}
"""``AccumConfig`` fields that are deliberately no setting of a run: field -> why."""
