"""From a :class:`~gradaccum.train.spec.TrainSpec` and the launch to the
:class:`~gradaccum.train.config.TrainConfig` that :func:`~gradaccum.train.loop.train` runs.

The decisions live here, not in the command line: the plan is solved for the world size, a run card
fixes the plan, precision, seed, accumulation and optimizer (and refuses flags that would change
them), unset settings take their defaults, and 0 turns clipping or a checkpoint trigger off. The
launch itself (the device, the process group, the run folder) is the command line's: it reads
torchrun's environment.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from gradaccum.errors import PlanError, RunCardError
from gradaccum.names import DEFAULT_WORKLOAD, HF_PREFIX
from gradaccum.plan import BatchPlan
from gradaccum.runcard import RunCard, read_runcard
from gradaccum.step.config import AccumConfig
from gradaccum.train.batch_schedule import CriticalBatchConfig
from gradaccum.train.config import TrainConfig
from gradaccum.train.schedule import ScheduleConfig
from gradaccum.train.settings import ACCUM_SETTINGS, RUN_SETTINGS
from gradaccum.train.spec import (
    BATCH_FIELDS,
    DEFAULT_GLOBAL_BATCH,
    DEFAULT_LR,
    DEFAULT_MAX_GRAD_NORM,
    DEFAULT_MAX_SKIPS,
    DEFAULT_MICRO_BATCH,
    DEFAULT_OPTIMIZER,
    DEFAULT_STEPS,
    DEFAULT_WEIGHT_DECAY,
    TrainSpec,
)

__all__ = ["ResolvedSpec", "resolve_spec"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ResolvedSpec:
    """What a request resolves to on this launch."""

    config: TrainConfig
    """The run."""
    notes: tuple[str, ...]
    """What was taken from the run card, one line each, for the start banner (empty without one)."""


# the fields resolve_spec computes; every other TrainSpec field named like a TrainConfig field
# passes through unchanged (a new flag needs no line here)
_RESOLVED = frozenset(
    {
        "workload",
        "runcard",
        "global_batch",
        "micro_batch",
        "accum_steps",
        "max_tokens",
        "balance_cost",
        "precision",
        "param_dtype",
        "seed",
        "steps",
        "optimizer",
        "lr",
        "weight_decay",
        "max_grad_norm",
        "max_consecutive_skips",
        "schedule",
        "schedule_clock",
        "warmup",
        "horizon",
        "min_lr_ratio",
        "noise_scale",
        "scaling",
        "compile",
        "checkpoint_every",
        "checkpoint_minutes",
        *BATCH_FIELDS,
        *(setting.name for setting in RUN_SETTINGS),
    }
)
_CONFIG_FIELDS = frozenset(f.name for f in fields(TrainConfig))


def resolve_spec(
    spec: TrainSpec, *, world: int, device: str, run_dir: Path, resume: Path | None
) -> ResolvedSpec:
    """The run ``spec`` asks for with ``world`` processes on ``device``, writing to ``run_dir`` and
    continuing from ``resume`` (or starting fresh)."""
    notes: tuple[str, ...] = ()
    if spec.runcard is not None:
        plan, fixed, notes = _from_card(spec, spec.runcard, world)
    else:
        plan, fixed = _from_flags(spec, world)
    steps = spec.steps if spec.steps is not None or spec.tokens is not None else DEFAULT_STEPS
    passed = {
        name: getattr(spec, name)
        for name in (f.name for f in fields(TrainSpec))
        if name in _CONFIG_FIELDS and name not in _RESOLVED
    }
    config = TrainConfig(
        plan=plan,
        run_dir=run_dir,
        steps=steps,
        schedule=ScheduleConfig(
            kind=spec.schedule,
            clock=spec.schedule_clock,
            warmup=spec.warmup,
            horizon=spec.horizon,
            min_lr_ratio=spec.min_lr_ratio,
        ),
        device=device,
        # 0 turns a checkpoint trigger off
        checkpoint_every=spec.checkpoint_every if spec.checkpoint_every > 0 else None,
        checkpoint_minutes=spec.checkpoint_minutes if spec.checkpoint_minutes > 0 else None,
        resume=resume,
        **fixed,
        **passed,
    )
    return ResolvedSpec(config=config, notes=notes)


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def _token_plan(global_batch: int, world: int) -> BatchPlan:
    """With ``--max-tokens`` the plan holds the global batch only: ``global_batch / dp`` rows per
    rank in one window (the micro-batches follow the lengths)."""
    if global_batch % world:
        raise PlanError(
            f"--max-tokens: --global-batch {global_batch} is not a multiple of the {world} processes; the "
            f"run card records the plan as rows per rank. Use a multiple of {world}."
        )
    return BatchPlan(micro_batch=global_batch // world, accum_steps=1, dp=world)


def _accum_plan(spec: TrainSpec, k: int, world: int) -> BatchPlan:
    """``--accum-steps K``: global batch = micro-batch x processes x K, with the micro-batch (or the
    global batch) given or by default; a contradiction with the given flags is refused on one line,
    naming the flags, their values and what would fit."""
    processes = f"{world:,} {'process' if world == 1 else 'processes'}"
    if spec.global_batch is None:
        micro = _given(spec.micro_batch, DEFAULT_MICRO_BATCH)
        return BatchPlan(micro_batch=micro, accum_steps=k, dp=world)
    g = spec.global_batch
    if spec.micro_batch is None:
        if g % (world * k) == 0:
            return BatchPlan(micro_batch=g // (world * k), accum_steps=k, dp=world)
        steps = _nearest([d for d in range(1, g + 1) if g % (world * d) == 0], k)
        other = f"--accum-steps {' or '.join(map(str, steps))}, or " if steps else ""
        raise PlanError(
            f"--global-batch {g} with --accum-steps {k} on {processes}: global batch = micro-batch x "
            f"processes x accum steps, and {g} is not a multiple of {world} x {k} = {world * k}; use "
            f"{other}--global-batch {' or '.join(map(str, _multiples(g, world * k)))}"
        )
    m = spec.micro_batch
    if m * world * k == g:
        return BatchPlan(micro_batch=m, accum_steps=k, dp=world)
    hints = [] if g % (m * world) else [f"--accum-steps {g // (m * world)} for --global-batch {g}"]
    raise PlanError(
        f"--global-batch {g} contradicts --micro-batch {m} x {processes} x --accum-steps {k} = "
        f"{m * world * k} (global batch = micro-batch x processes x accum steps); use "
        + " or ".join([*hints, f"--global-batch {m * world * k}", "two of the three flags"])
    )


def _nearest(values: list[int], k: int) -> list[int]:
    """The one or two ``values`` nearest ``k`` (below and above)."""
    below = [v for v in values if v < k]
    above = [v for v in values if v > k]
    return [*below[-1:], *above[:1]]


def _multiples(g: int, step: int) -> list[int]:
    """The multiples of ``step`` nearest ``g``."""
    below = (g // step) * step
    return [m for m in (below, below + step) if m > 0]


def _from_flags(spec: TrainSpec, world: int) -> tuple[BatchPlan, dict[str, Any]]:
    global_batch = _given(spec.global_batch, DEFAULT_GLOBAL_BATCH)
    if spec.max_tokens is not None:
        plan = _token_plan(global_batch, world)
    elif spec.accum_steps is not None:
        plan = _accum_plan(spec, spec.accum_steps, world)
    else:
        plan = BatchPlan.solve(
            global_batch=global_batch, micro_batch=_given(spec.micro_batch, DEFAULT_MICRO_BATCH), dp=world
        )
    max_norm = _given(spec.max_grad_norm, DEFAULT_MAX_GRAD_NORM)
    batch = _batch_schedule(spec)
    accum = AccumConfig(
        max_grad_norm=max_norm if max_norm != 0 else None,  # 0 turns clipping off
        track_grad_norm=True,
        max_consecutive_skips=_given(spec.max_consecutive_skips, DEFAULT_MAX_SKIPS),
        noise_scale=spec.noise_scale or batch is not None,  # the schedule follows the estimate
        scaling=_given(spec.scaling, "pre"),
        # the plain choices of gradaccum.train.settings, by name; unset ones keep AccumConfig's default
        **{s.name: getattr(spec, s.name) for s in ACCUM_SETTINGS if getattr(spec, s.name) is not None},
    )
    fixed = {
        "workload": _given(spec.workload, DEFAULT_WORKLOAD),
        "precision": _given(spec.precision, "float32"),
        "param_dtype": _given(spec.param_dtype, "saved"),
        "seed": _given(spec.seed, 0),
        "accum": accum,
        "optimizer": _given(spec.optimizer, DEFAULT_OPTIMIZER),
        "lr": _given(spec.lr, DEFAULT_LR),
        "weight_decay": _given(spec.weight_decay, DEFAULT_WEIGHT_DECAY),
        "batch_schedule": batch,
        "compile": spec.compile,
        "max_tokens": spec.max_tokens,
        "balance_cost": spec.balance_cost,
        "balance": spec.balance,
    }
    return plan, fixed


def _batch_schedule(spec: TrainSpec) -> CriticalBatchConfig | None:
    """``--batch-schedule critical`` and its settings; unset ones take the config's defaults."""
    if spec.batch_schedule != "critical" or spec.max_global_batch is None:
        return None  # TrainSpec refused settings without the schedule and the schedule without a max
    names = {"batch_growth": "growth", "batch_min_updates": "min_updates", "batch_lr_rule": "lr_rule"}
    names["batch_fraction"] = "fraction"
    given = {field: getattr(spec, name) for name, field in names.items() if getattr(spec, name) is not None}
    return CriticalBatchConfig(max_global_batch=spec.max_global_batch, **given)


def _card_batch_schedule(card: RunCard, path: Path) -> CriticalBatchConfig | None:
    """The batch-size schedule a run card records (``extra.batch_schedule``), or None."""
    recorded = card.extra.get("batch_schedule")
    if recorded is None:
        return None
    settings = ("max_global_batch", "growth", "min_updates", "lr_rule", "fraction")
    try:
        return CriticalBatchConfig(**{name: recorded[name] for name in settings})
    except (KeyError, TypeError, PlanError) as exc:
        raise RunCardError(f"run card {path} records a batch schedule that cannot be used: {exc}") from exc


def _from_card(spec: TrainSpec, path: Path, world: int) -> tuple[BatchPlan, dict[str, Any], tuple[str, ...]]:
    """The plan and settings a run card fixes, and the lines that say what was taken from it."""
    card = read_runcard(path)
    given = spec.given()
    if given:
        clashes = "; ".join(
            f"{_flag(name)} {_word(getattr(spec, name))} (the card has {_card_value(card, name)})"
            for name in given
        )
        raise PlanError(
            f"--runcard {path} fixes what was verified, and these flags would change it: "
            f"{clashes}. Drop them, or train without --runcard."
        )
    if card.plan.dp != world:
        processes = f"{world:,} {'process' if world == 1 else 'processes'}"
        raise PlanError(
            f"run card {path} was verified with dp={card.plan.dp} ({card.plan.equation()}), but "
            f"this job has {processes}. Launch with torchrun --nproc-per-node "
            f"{card.plan.dp}, or verify a plan for this world size."
        )
    if card.optimizer in ("adamw", "sgd") and card.lr is None:
        raise RunCardError(
            f"run card {path} names optimizer {card.optimizer} but no lr; it cannot be trained "
            "as recorded (write lr into the card, or run accept again)"
        )
    # track_grad_norm and noise_scale only add figures to the records; they do not change the update,
    # nor does scaling (pre- and post-scaling agree to float roundoff: tests/equivalence)
    batch = _card_batch_schedule(card, path)
    noise = card.accum.noise_scale or spec.noise_scale or batch is not None
    fixed = {
        "workload": card.workload,
        "precision": card.precision,
        "param_dtype": _card_param_dtype(card),
        "seed": card.seed,
        "accum": replace(
            card.accum,
            track_grad_norm=True,
            noise_scale=noise,
            scaling=_given(spec.scaling, card.accum.scaling),
        ),
        "batch_schedule": batch,
        "optimizer": card.optimizer,
        "lr": card.lr if card.lr is not None else DEFAULT_LR,
        "weight_decay": card.weight_decay if card.weight_decay is not None else DEFAULT_WEIGHT_DECAY,
        # compiling does not change the update: a compiled card compiles, --compile compiles any card
        "compile": card.compile or spec.compile,
        "max_tokens": card.max_tokens,
        # the balance by cost does not change the update (the same rows, counted the same); a card
        # that ran it runs it again, and --balance-cost asks for it on any token-budget card
        "balance_cost": card.balance_cost is not None or spec.balance_cost,
        # a card from a routing model records the balance it ran; one without (a dense model, or a
        # card older than the field) leaves the model's own choice
        "balance": None if card.balance is None else card.balance["mode"],
    }
    if card.optimizer == "workload":
        optimizer = "the workload's own optimizer_factory (its learning rates are the schedule's peak)"
    else:
        optimizer = f"{card.optimizer}, lr {card.lr:g}, weight decay {_word(fixed['weight_decay'])}"
    # the loss check is said only where a card turns it off: it is on in every run the commands make
    words = {k: v for k, v in card.accum.to_dict().items() if k != "track_grad_norm"}
    if words.get("check_loss_reduction") is True:
        del words["check_loss_reduction"]
    accum = ", ".join(f"{k} {_word(v)}" for k, v in words.items())
    notes: tuple[str, ...] = (
        f"from run card {path}: workload {card.workload}; {card.equation()}; precision "
        f"{card.precision}"
        + (" (with a GradScaler)" if card.precision == "float16" else "")
        + f"; seed {card.seed}"
        + f"; parameters {_param_words(str(fixed['param_dtype']), card.precision)}"
        + ("; compiled (torch.compile)" if card.compile else ""),
        f"from run card: optimizer {optimizer}",
        f"from run card: accumulation {accum}",
    )
    if card.balance is not None:
        notes += (f"from run card: load balance {_balance_words(card.balance)}",)
    if card.balance_cost is not None:
        cost = card.balance_cost
        notes += (
            f"from run card: ranks balanced by compute cost (transformer, d_model {cost['d_model']}, "
            f"layers {cost['layers']}; read from the model again)",
        )
    if batch is not None:
        notes += (
            f"from run card: batch schedule critical, up to {batch.max_global_batch:,} examples, growth "
            f"{batch.growth:g}, {batch.min_updates} updates between changes, lr rule {batch.lr_rule}, "
            f"fraction {batch.fraction:g} (decided again with these settings)",
        )
    return card.plan, fixed, notes


def _card_param_dtype(card: RunCard) -> str:
    """The parameters' dtype a card records; a card written before the field: float32 for an ``hf:``
    folder (which trained float32 parameters then), else the workload's own (``saved``)."""
    if card.param_dtype is not None:
        return card.param_dtype
    return "float32" if card.workload.startswith(HF_PREFIX) else "saved"


def _param_words(param_dtype: str, precision: str) -> str:
    if precision == "float64":
        return "float64"
    return "as the workload builds them" if param_dtype == "saved" else param_dtype


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _card_value(card: RunCard, name: str) -> str:
    values = {
        "workload": card.workload,
        "global_batch": f"{card.plan.global_batch} ({card.plan.equation()})",
        "accum_steps": f"{card.plan.accum_steps} ({card.plan.equation()})"
        if card.max_tokens is None
        else f"max_tokens {card.max_tokens}, accum steps by the lengths",
        "param_dtype": card.param_dtype or "none recorded (float32 for hf: folders)",
        "micro_batch": f"{card.plan.micro_batch} ({card.plan.equation()})"
        if card.max_tokens is None
        else f"max_tokens {card.max_tokens}, no fixed micro-batch",
        "max_tokens": "no max_tokens (fixed micro-batches)" if card.max_tokens is None else card.max_tokens,
        "precision": card.precision,
        "seed": card.seed,
        "optimizer": card.optimizer,
        "lr": "none (the workload's optimizer)" if card.lr is None else f"{card.lr:g}",
        "weight_decay": "none (the workload's optimizer)"
        if card.weight_decay is None
        else f"{card.weight_decay:g}",
        "max_grad_norm": _word(card.accum.max_grad_norm),
        "max_consecutive_skips": _word(card.accum.max_consecutive_skips),
    }
    values |= {s.name: _word(getattr(card.accum, s.name)) for s in ACCUM_SETTINGS}
    values["balance"] = "no balance recorded" if card.balance is None else _balance_words(card.balance)
    if name in values:
        return str(values[name])
    recorded = card.extra.get("batch_schedule")
    if recorded is None:
        return "no batch schedule (a fixed global batch)"
    field = {"batch_schedule": None, "batch_growth": "growth", "batch_min_updates": "min_updates"}
    field |= {
        "batch_lr_rule": "lr_rule",
        "batch_fraction": "fraction",
        "max_global_batch": "max_global_batch",
    }
    key = field[name]
    return "critical" if key is None else _word(recorded.get(key))


def _balance_words(recorded: dict[str, Any]) -> str:
    coef = recorded.get("coef")
    return str(recorded["mode"]) + ("" if coef is None else f", coefficient {coef:g}")


def _word(value: Any) -> str:
    """A setting as a person writes it: no Python ``None``/``True``."""
    if value is None:
        return "off"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:g}" if isinstance(value, float) else str(value)
