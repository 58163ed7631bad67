"""The training loop, built on :class:`gradaccum.Accumulator`, on one process or many.

Per window (one optimizer boundary):

1. draw window ``w`` of the deterministic stream, at the batch-size schedule's current plan when
   there is one; every rank knows its global count N;
2. set the learning rate from the schedule's clock after this update (steps: applied + 1;
   tokens: consumed + N), recomputed from the counters, never from a scheduler's own count, times
   the batch-size schedule's lr rule;
3. ``Accumulator.step``: the exact update (or a skip on every rank, which advances no clock);
4. update the counters, report, let the batch-size schedule decide the next window's batch
   (:mod:`gradaccum.train.batch_schedule`), evaluate if due;
5. agree across ranks on pending checkpoint/stop requests and on whether the checkpoint interval
   has passed, and checkpoint at this boundary if a request, the periodic cadence (applied updates
   or minutes since the last checkpoint, whichever comes first) or the end of the run calls for it.

Requests from signal handlers (:class:`TrainControl`) are only read at step 5, so a request that
arrives mid-window is served at the next boundary; requests are counted, never cleared blindly, so
none is lost. A stop requested before the first window (while the model and data are built) ends
the run before it trains or writes anything. The loop prints nothing: it hands records to
``on_event``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from gradaccum.check.workload import Workload, load_workload
from gradaccum.distributed import dist
from gradaccum.names import HF_PREFIX
from gradaccum.precision import autocast_loss, make_scaler
from gradaccum.runcard import RunCard, environment, write_runcard
from gradaccum.step.accumulator import Accumulator, CountFn, LossFn, StepResult
from gradaccum.step.noise import NoiseScale
from gradaccum.tokens.cost import TransformerCost
from gradaccum.train.batch_schedule import BatchChange, CriticalBatchSchedule
from gradaccum.train.build import (
    build_cost,
    build_model,
    build_optimizer,
    check_resumed_dtype,
    param_dtypes,
    stored_dtype,
)
from gradaccum.train.checkpoint import (
    TrainProgress,
    load_checkpoint,
    remove_partial_checkpoints,
    save_checkpoint,
)
from gradaccum.train.config import TrainConfig, TrainError
from gradaccum.train.data import ShardedStream
from gradaccum.train.evaluation import evaluate, held_out_summary
from gradaccum.train.layout import Layout, moved_layout
from gradaccum.train.records import (
    CheckpointRecord,
    EvalRecord,
    Recorder,
    StepRecord,
    TrainEvent,
    TrainStart,
)
from gradaccum.train.run_folder import RUNCARD_FILE, check_run_folder
from gradaccum.train.schedule import Schedule, apply_lr, resolve_schedule
from gradaccum.workloads.balance import BalanceChoice, choose_balance
from gradaccum.workloads.experts import eager_experts

__all__ = ["RUNCARD_FILE", "TrainControl", "TrainResult", "train"]


class TrainControl:
    """Checkpoint and stop requests from outside the loop, served at the next optimizer boundary.

    Safe to call from a signal handler: each request only increments a counter.
    """

    def __init__(self) -> None:
        self.checkpoint_requests = 0
        self.stop_requests = 0
        self._served_checkpoints = 0

    def request_checkpoint(self) -> None:
        """Checkpoint at the next boundary and carry on."""
        self.checkpoint_requests += 1

    def request_stop(self) -> None:
        """Checkpoint at the next boundary and end the run there."""
        self.stop_requests += 1

    @property
    def stop_pending(self) -> bool:
        """Whether a stop was requested (it stays requested once asked)."""
        return self.stop_requests > 0

    def take(self) -> tuple[bool, bool]:
        """(checkpoint requested since the last take, stop requested); called at boundaries."""
        seen = self.checkpoint_requests
        wants_checkpoint = seen > self._served_checkpoints
        self._served_checkpoints = seen
        return wants_checkpoint, self.stop_requests > 0


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainResult:
    """How a run (or this segment of a resumed run) ended."""

    run_dir: Path
    """The run folder."""
    progress: TrainProgress
    """Counters at the end: windows, applied and skipped steps, consumed and seen tokens."""
    first_loss: float | None
    """Loss of this segment's first applied window."""
    last_loss: float | None
    """Loss of its last applied window."""
    eval_loss: float | None
    """The last evaluation's loss (None without evaluation)."""
    lr: float
    """The learning rate of the last window."""
    loss_scale: float | None
    """The GradScaler's final scale (float16 only)."""
    stopped: str
    """``completed`` (reached steps/tokens), ``stop requested`` (checkpointed at a boundary) or
    ``interrupted before the first window`` (nothing trained, nothing written)."""
    checkpoints: tuple[Path, ...]
    """Checkpoint folders written by this segment, in order."""
    resumed_from: Path | None
    """The checkpoint this segment continued from."""
    wall_s: float
    """Wall time of this segment's loop: windows, evaluations, checkpoints and records."""
    tokens_per_s: float
    """Valid units seen per second of that wall time."""
    window_s: float = 0.0
    """Time spent inside windows alone (data, the step; what the progress lines measure)."""

    @property
    def window_tokens_per_s(self) -> float:
        """Valid units seen per second spent in windows: the figure the progress lines show."""
        seen = self.tokens_per_s * self.wall_s
        return seen / self.window_s if self.window_s > 0 else 0.0

    noise_scale: NoiseScale | None = None
    """The gradient noise scale at the end (``accum.noise_scale``; this segment's windows)."""
    critical_batch: str | None = None
    """Where the global batch stands against B_simple, in words (``accum.noise_scale``)."""
    batch_schedule: dict[str, Any] | None = None
    """The batch-size schedule's settings and every change so far (``config.batch_schedule``)."""


@dataclass(kw_only=True, slots=True)
class _Session:
    """What a run holds while it trains; built once by :func:`_setup`."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    acc: Accumulator
    stream: ShardedStream
    schedule: Schedule
    loss_fn: LossFn
    count_fn: CountFn
    device: torch.device
    progress: TrainProgress
    resumed_from: Path | None
    skipped_checkpoints: tuple[str, ...]
    checkpoint_schedule: dict[str, Any] | None
    tokens_per_step: int
    eval_batches: list[Any]
    batch: CriticalBatchSchedule | None = None
    balance: BalanceChoice | None = None
    layout: Layout | None = None
    resumes: tuple[dict[str, Any], ...] = ()
    """Every resume of the run so far, this one last: where from, at which boundary, on which layouts."""


def _setup(config: TrainConfig, workload: Workload) -> _Session:
    """Model, optimizer, scaler and data for this rank; restored from a checkpoint when resuming."""
    world, rank = dist.world_size(), dist.rank()
    if config.plan.dp != world:
        raise TrainError(
            f"the plan has dp={config.plan.dp} data-parallel replicas but {world} process(es) are "
            f"running; launch {config.plan.dp} processes or solve the plan for dp={world}"
        )
    point = check_run_folder(config)
    device = torch.device(config.device)
    torch.manual_seed(config.seed)  # dropout and other model randomness; the data has its own seeds
    model = build_model(workload, config, device)
    optimizer = build_optimizer(config, workload, model)
    apply_lr(optimizer, 1.0)  # records each group's peak as initial_lr before any state is loaded
    scaler = make_scaler(config.precision, device)
    stream = ShardedStream(
        workload.make_batch,
        workload.count_fn,
        config.plan,
        rank=rank,
        seed=config.seed,
        device=device,
        float_dtype=torch.float64 if config.precision == "float64" else None,
        max_tokens=config.max_tokens,
        equal_count=config.fsdp,  # FSDP2 gathers parameters in every forward
        cost=build_cost(config, model),
    )
    # a routing model: the window's balancing term (or none), chosen once by the commands' one rule
    balance, choice = choose_balance(model, config.balance, scaling=config.accum.scaling)
    acc = Accumulator.from_config(model, optimizer, config.accum, scaler=scaler, balance=balance)
    progress, resumed_from, checkpoint_schedule, skipped = TrainProgress(), None, None, ()
    layout, resumes = Layout.of(config.plan, max_tokens=config.max_tokens, fsdp=config.fsdp), ()
    if point is not None:
        progress, meta = load_checkpoint(
            point,
            model=model,
            optimizer=optimizer,
            scaler=scaler,
            accumulator=acc,
            plan=config.plan,
            precision=config.precision,
            layout=layout,
            seed=config.seed,
            workload=config.workload,
        )
        check_resumed_dtype(meta, model)
        resumed_from, checkpoint_schedule = Path(meta["path"]), meta.get("schedule")
        skipped = tuple(meta["skipped"])
        resumes = (*meta.get("resumes", ()), layout.resume_record(meta, asdict(progress)))
    batch = _batch_schedule(config, None if point is None else meta.get("batch_schedule"), resumed_from)
    per_step, grows = stream.window(0).global_count, batch is not None
    schedule = resolve_schedule(
        config.schedule, steps=config.steps, tokens=config.tokens, tokens_per_step=per_step, grows=grows
    )
    return _Session(
        model=model,
        optimizer=optimizer,
        scaler=scaler,
        acc=acc,
        stream=stream,
        schedule=schedule,
        loss_fn=autocast_loss(workload.loss_fn, config.precision, device),
        count_fn=workload.count_fn,
        device=device,
        progress=progress,
        resumed_from=resumed_from,
        skipped_checkpoints=skipped,
        checkpoint_schedule=checkpoint_schedule if checkpoint_schedule != schedule.to_dict() else None,
        tokens_per_step=per_step,
        eval_batches=stream.eval_batches(config.eval_examples) if config.eval_every else [],
        batch=batch,
        balance=choice,
        layout=layout,
        resumes=resumes,
    )


def _batch_schedule(
    config: TrainConfig, state: dict[str, Any] | None, resumed_from: Path | None
) -> CriticalBatchSchedule | None:
    """The run's batch-size schedule, continued from a checkpoint's state; a checkpoint written with
    a schedule resumed without one (or the reverse) is refused: the windows would change size."""
    if config.batch_schedule is None:
        if state is not None:
            grown = state["accum_steps"] * config.plan.micro_batch * config.plan.dp
            raise TrainError(
                f"checkpoint {resumed_from} was written by a run with --batch-schedule critical (its "
                f"global batch had grown to {grown}); "
                "resume it with the same --batch-schedule flags, or start a new run"
            )
        return None
    batch = CriticalBatchSchedule(config.batch_schedule, config.plan)
    if resumed_from is not None:
        if state is None:
            raise TrainError(
                f"checkpoint {resumed_from} was written without --batch-schedule critical; resume it "
                "without it (a fixed global batch), or start a new run"
            )
        batch.load_state_dict(state)
    return batch


def _train_window(s: _Session) -> StepRecord:
    """One optimizer boundary: learning rate from the clock, the exact step, the counters."""
    t0 = time.perf_counter()
    p = s.progress
    plan = s.stream.plan if s.batch is None else s.batch.plan
    window = s.stream.window(p.windows, plan)
    clock_after = (
        p.steps_applied + 1 if s.schedule.clock == "steps" else p.tokens_consumed + window.global_count
    )
    lr_scale = 1.0 if s.batch is None else s.batch.lr_scale  # the batch-size schedule's lr rule
    lr = apply_lr(s.optimizer, s.schedule.factor(clock_after) * lr_scale)
    result = s.acc.step(window.micro_batches, s.loss_fn, s.count_fn)
    if result.global_count != window.global_count:
        raise TrainError(
            f"count_fn counts {window.global_count} units in window {window.index}'s global batch but "
            f"{result.global_count} over its micro-batches: count_fn must add up over examples "
            "(count valid tokens or examples, not a per-batch statistic)"
        )
    s.progress = _advance(p, result, s.acc, plan.global_batch)
    elapsed = time.perf_counter() - t0
    n = result.global_count
    return StepRecord(
        window=window.index,
        step=s.progress.steps_applied,
        loss=result.loss,
        grad_norm=result.grad_norm,
        lr=lr,
        tokens=s.progress.tokens_consumed,
        window_tokens=n,
        applied=result.applied,
        skipped=s.progress.steps_skipped,
        skip_reason=result.skip_reason,
        loss_scale=float(s.scaler.get_scale()) if s.scaler is not None else None,
        step_time_ms=elapsed * 1e3,
        tokens_per_s=n / elapsed if elapsed > 0 else 0.0,
        b_simple=s.acc.noise_scale.b_simple if s.acc.config.noise_scale else None,
        global_batch=plan.global_batch,
        accum_steps=len(window.micro_batches),  # this rank's: a token budget varies it
        recompiles=result.recompiles,
        micro_batches=window.all_micro_batches,
        computed_tokens=window.computed_tokens,
        padding_tokens=None
        if window.computed_tokens is None or window.present_tokens is None
        else window.computed_tokens - window.present_tokens,
    )


def _grow_batch(s: _Session, record: StepRecord) -> BatchChange | None:
    """The batch-size schedule's decision after this window (the next window uses it)."""
    if s.batch is None or record.global_batch is None:
        return None
    return s.batch.decide(
        step=s.progress.steps_applied,
        window=s.progress.windows,
        noise=s.acc.noise_scale,
        units_per_example=record.window_tokens / record.global_batch,
    )


def _advance(p: TrainProgress, result: StepResult, acc: Accumulator, rows: int) -> TrainProgress:
    """The counters after one window of ``rows`` global rows; a skipped window's tokens are seen
    but not consumed."""
    n = result.global_count
    return replace(
        p,
        windows=p.windows + 1,
        steps_applied=acc.steps_applied,
        steps_skipped=acc.steps_skipped,
        consecutive_skips=acc.consecutive_skips,
        tokens_consumed=p.tokens_consumed + (n if result.applied else 0),
        tokens_seen=p.tokens_seen + n,
        rows_seen=p.rows_seen + rows,
    )


def _agree(flags: tuple[bool, ...], device: torch.device) -> tuple[bool, ...]:
    """Every rank's flags, OR-ed: all ranks checkpoint and stop at the same boundary."""
    if not dist.is_distributed():
        return flags
    total = dist.all_reduce_sum_(
        torch.tensor([float(f) for f in flags], device=device), what="the checkpoint and stop requests"
    ).tolist()
    return tuple(t > 0 for t in total)


def _checkpoint_reason(
    *, finished: bool, stop: bool, asked: bool, steps_due: bool, time_due: bool
) -> str | None:
    for reason, due in (
        ("final", finished),
        ("stop", stop),
        ("requested", asked),
        ("periodic", steps_due),
        ("timed", time_due),
    ):
        if due:
            return reason
    return None


def _critical_batch(workload: Workload, s: _Session) -> tuple[NoiseScale | None, str | None]:
    """The noise scale and, in words, where the run's mean global batch (in units) stands."""
    if not s.acc.config.noise_scale:
        return None, None
    p, noise = s.progress, s.acc.noise_scale
    units = p.tokens_seen / p.windows if p.windows else float(s.tokens_per_step)
    return noise, noise.describe(units, workload.unit)


def _write_runcard(config: TrainConfig, workload: Workload, s: _Session) -> None:
    noise, words = _critical_batch(workload, s)
    card = RunCard(
        workload=config.workload,
        plan=config.plan,
        accum=config.accum,
        precision=config.precision,
        optimizer=config.optimizer,
        lr=None if config.optimizer == "workload" else config.lr,
        weight_decay=None if config.optimizer == "workload" else config.weight_decay,
        denominator=workload.unit,
        tokens_per_step=s.tokens_per_step,
        seed=config.seed,
        compile=config.compile,
        max_tokens=config.max_tokens,
        balance_cost=s.stream.cost.to_dict() if isinstance(s.stream.cost, TransformerCost) else None,
        balance=None if s.balance is None else s.balance.to_dict(),
        param_dtype=stored_dtype(s.model),
        **environment(s.device),
        extra={
            "schedule": s.schedule.to_dict(),
            "train": {
                "steps": config.steps,
                "tokens": config.tokens,
                "optimizer": config.optimizer,
                "lr": config.lr,
                "weight_decay": config.weight_decay,
                "fsdp": config.fsdp,
                "data": "window w = make_batch(global_batch, train_seed(seed, w)), 1 + w for seed 0; "
                "rank r takes "
                "examples [r * local_batch, (r + 1) * local_batch)",
                "resumed_from": str(s.resumed_from) if s.resumed_from is not None else None,
                "layout": None if s.layout is None else s.layout.to_dict(),
                "resumes": list(s.resumes),
            },
            **({} if noise is None else {"noise_scale": {**noise.to_dict(), "critical_batch": words}}),
            **({} if s.batch is None else {"batch_schedule": s.batch.to_dict()}),
            **({"evaluation": held} if (held := held_out_summary(workload)) else {}),
            **({"data": workload.extras["data"]} if "data" in workload.extras else {}),
        },
    )
    write_runcard(card, config.run_dir / RUNCARD_FILE)


def _open_records(config: TrainConfig, workload: Workload, s: _Session, emit: Recorder) -> None:
    """Rank 0 writes the run card and opens the metrics once the first window has trained, so a run
    that fails before any step (bad counts, a non-scalar loss) leaves nothing in its run folder; from
    then on every record is flushed as it comes, so a later crash loses nothing."""
    if emit.run_dir is None or emit.opened:
        return
    config.run_dir.mkdir(parents=True, exist_ok=True)
    _write_runcard(config, workload, s)
    emit.open()


def train(
    config: TrainConfig,
    *,
    workload: Workload | None = None,
    control: TrainControl | None = None,
    on_event: Callable[[TrainEvent], None] | None = None,
) -> TrainResult:
    """Train ``config`` (resuming from ``config.resume`` if set); collective on every rank.

    ``workload`` overrides loading ``config.workload`` (tests pass instrumented ones). ``on_event``
    receives every record on every rank; only rank 0 writes the run folder, and only once the first
    window has trained.
    """
    workload = workload if workload is not None else load_workload(config.workload)
    experts = None
    if config.precision == "float64" and config.workload.startswith(HF_PREFIX):
        # a transformers MoE folder's fused expert kernels take no float64: the eager one, said
        workload, experts = eager_experts(workload, flag="--precision", what="float64 training")
    control = control if control is not None else TrainControl()
    s = _setup(config, workload)
    emit = Recorder(
        config.run_dir if dist.rank() == 0 else None,
        on_event,
        resume_window=s.progress.windows if s.resumed_from is not None else None,
    )
    emit(
        TrainStart(
            equation=config.equation(s.tokens_per_step),
            world=dist.world_size(),
            device=str(s.device),
            schedule=s.schedule.to_dict(),
            tokens_per_step=s.tokens_per_step,
            start_window=s.progress.windows,
            total_windows=config.steps,
            resumed_from=str(s.resumed_from) if s.resumed_from is not None else None,
            skipped_checkpoints=s.skipped_checkpoints,
            checkpoint_schedule=s.checkpoint_schedule,
            run_dir=str(config.run_dir),
            batch_schedule=None if s.batch is None else s.batch.to_dict(),
            unit=workload.unit,
            evaluation=held_out_summary(workload).get("summary"),
            balance=None if s.balance is None else s.balance.describe(),
            param_dtypes=param_dtypes(s.model),
            experts=experts,
            resumed_layout=moved_layout(s.resumes),
            data=workload.extras.get("data", {}).get("summary"),
        )
    )
    meta: dict[str, Any] = {"workload": config.workload, "precision": config.precision, "seed": config.seed}
    meta |= {
        "schedule": s.schedule.to_dict(),
        "resumes": list(s.resumes),
        "param_dtype": stored_dtype(s.model),
    }

    def done() -> bool:
        p = s.progress
        return (config.steps is not None and p.windows >= config.steps) or (
            config.tokens is not None and p.tokens_consumed >= config.tokens
        )

    losses: list[float] = []
    checkpoints: list[Path] = []
    eval_loss: float | None = None
    lr = float(s.optimizer.param_groups[0]["lr"])
    stopped = "completed"
    started, seen_at_start = time.perf_counter(), s.progress.tokens_seen
    window_s = 0.0
    # the checkpoint interval counts from the start of this segment (a resumed run's checkpoint)
    last_steps, last_time = s.progress.steps_applied, time.monotonic()
    every_s = config.checkpoint_minutes * 60 if config.checkpoint_minutes is not None else None
    try:
        if not done() and _agree((control.stop_pending,), s.device)[0]:
            # asked to stop while the model and data were built: nothing trained, nothing to save
            stopped = "interrupted before the first window"
        elif emit.run_dir is not None and s.resumed_from is not None:
            remove_partial_checkpoints(config.run_dir)  # what an interrupted save may have left
        while stopped == "completed" and not done():
            record = _train_window(s)
            window_s += record.step_time_ms / 1e3
            _open_records(config, workload, s, emit)
            lr = record.lr
            if record.applied and record.loss is not None:
                losses.append(record.loss)
            emit(record)
            change = _grow_batch(s, record)
            if change is not None:
                emit(change)
            finished, p = done(), s.progress
            if config.eval_every and (p.windows % config.eval_every == 0 or finished):
                eval_loss, count = evaluate(s.model, s.eval_batches, s.loss_fn, s.count_fn, device=s.device)
                emit(
                    EvalRecord(window=p.windows, step=p.steps_applied, eval_loss=eval_loss, eval_tokens=count)
                )
            wants_checkpoint, wants_stop = control.take()
            late = every_s is not None and time.monotonic() - last_time >= every_s
            asked, stop, time_due = _agree((wants_checkpoint, wants_stop, late), s.device)
            every = config.checkpoint_every
            steps_due = every is not None and p.steps_applied - last_steps >= every
            reason = _checkpoint_reason(
                finished=finished, stop=stop, asked=asked, steps_due=steps_due, time_due=time_due
            )
            if reason is not None:
                path = save_checkpoint(
                    config.run_dir,
                    model=s.model,
                    optimizer=s.optimizer,
                    accumulator=s.acc,
                    scaler=s.scaler,
                    progress=p,
                    plan=config.plan,
                    meta=meta,
                    keep=config.keep_checkpoints,
                    device=s.device,
                    batch_schedule=None if s.batch is None else s.batch.state_dict(),
                    layout=s.layout,
                )
                last_steps, last_time = p.steps_applied, time.monotonic()
                checkpoints.append(path)
                emit(CheckpointRecord(window=p.windows, step=p.steps_applied, path=str(path), reason=reason))
            if stop and not finished:
                stopped = "stop requested"
                break
        if stopped != "interrupted before the first window":
            _open_records(config, workload, s, emit)  # a resumed run that had nothing left still records
            if config.accum.noise_scale and emit.run_dir is not None:
                _write_runcard(config, workload, s)  # the card records the run's final noise scale
    finally:
        emit.close()  # on every exit: the records and the curve show what stopped a run too
    wall_s = time.perf_counter() - started
    noise, words = _critical_batch(workload, s)
    return TrainResult(
        run_dir=config.run_dir,
        progress=s.progress,
        first_loss=losses[0] if losses else None,
        last_loss=losses[-1] if losses else None,
        eval_loss=eval_loss,
        lr=lr,
        loss_scale=float(s.scaler.get_scale()) if s.scaler is not None else None,
        stopped=stopped,
        checkpoints=tuple(checkpoints),
        resumed_from=s.resumed_from,
        wall_s=wall_s,
        tokens_per_s=(s.progress.tokens_seen - seen_at_start) / wall_s if wall_s > 0 else 0.0,
        window_s=window_s,
        noise_scale=noise,
        critical_batch=words,
        batch_schedule=None if s.batch is None else s.batch.to_dict(),
    )
