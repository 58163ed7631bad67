"""What rank 0 of ``gradaccum train`` prints: the start banner, progress, events and the summary."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import TYPE_CHECKING, Any

from gradaccum.cli.common import console, escape
from gradaccum.cli.heartbeat import EVERY_S

if TYPE_CHECKING:
    from rich.progress import Progress

    from gradaccum.train.config import TrainConfig
    from gradaccum.train.loop import TrainResult
    from gradaccum.train.records import BatchChange, StepRecord, TrainEvent, TrainStart

__all__ = [
    "TrainRenderer",
    "budget_summary",
    "budget_words",
    "checkpoint_policy",
    "compile_seconds",
    "count",
    "evaluation_words",
    "final_batch_words",
    "fmt",
    "loss_summary",
    "param_words",
]


def count(n: int, word: str) -> str:
    plural = {"process": "processes", "boundary": "boundaries", "micro-batch": "micro-batches"}.get(
        word, word + "s"
    )
    return f"{n:,} {word if n == 1 else plural}"


class TrainRenderer:
    """Rank 0's view of the run: start banner, progress bar (or periodic lines), events, summary."""

    def __init__(self, config: TrainConfig, args: argparse.Namespace, notes: list[str]) -> None:
        self.config = config
        self.args = args
        self.notes = notes
        self.steps: list[StepRecord] = []
        self.changes: list[BatchChange] = []
        self.unit = "tokens"
        """What the workload counts (``TrainStart.unit``): the unit of B_simple."""
        self.progress: Progress | None = None
        self.task: Any = None
        self.every = max(1, (config.steps or 100) // 10)
        self.tokens, self.seconds = 0, 0.0
        """Valid units and seconds of the windows that did not compile: the throughput's figures."""
        self.last_line = time.monotonic()
        """When the last progress line was printed: at least one every ``EVERY_S`` seconds."""

    def __call__(self, event: TrainEvent) -> None:
        from gradaccum.train.records import BatchChange, CheckpointRecord, EvalRecord, StepRecord, TrainStart

        if isinstance(event, TrainStart):
            self._start(event)
        elif isinstance(event, StepRecord):
            self._step(event)
        elif isinstance(event, EvalRecord):
            self._print(
                f"eval at step {event.step}: loss {fmt(event.eval_loss)} over {event.eval_tokens:,} tokens"
            )
        elif isinstance(event, BatchChange):
            self.changes.append(event)
            self._print(
                f"global batch {event.from_global_batch:,} -> {event.global_batch:,} examples "
                f"(accum_steps {event.accum_steps}) after step {event.step}: B_simple over the last "
                f"windows ~ {event.b_simple:,.0f} {self.unit}, aiming at {event.target:,.1f} examples "
                f"(its lower bound); lr x {event.lr_scale:.3g} of the starting batch's"
            )
        elif isinstance(event, CheckpointRecord):
            self._print(
                f"checkpoint ({event.reason}) after {count(event.window, 'boundary')}: {escape(event.path)}"
            )

    def _print(self, text: str) -> None:
        (self.progress.console if self.progress is not None else console).print(text)

    def _start(self, start: TrainStart) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        cfg = self.config
        self.unit = start.unit
        if self.args.runcard is not None:
            checked = f" (from run card {escape(str(self.args.runcard))})"
        else:
            checked = f" (checked against --global-batch {cfg.plan.global_batch})"
            if getattr(self.args, "accum_steps", None) is not None:
                given = f", checked against --global-batch {cfg.plan.global_batch}"
                checked = f" (--accum-steps {cfg.plan.accum_steps}{given if self.args.global_batch else ''})"
        console.print(f"batch equation: {start.equation}{checked}")
        for line in self.notes:
            console.print(escape(line))
        if start.data is not None:
            console.print(escape(start.data))
        sched = start.schedule
        per_step = max(start.tokens_per_step, 1)
        if sched["clock"] == "steps":
            warmup_steps, warmup_tokens = float(sched["warmup"]), sched["warmup"] * per_step
        else:
            warmup_steps, warmup_tokens = sched["warmup"] / per_step, sched["warmup"]
        layout = ", FSDP2" if cfg.fsdp else ", DDP" if start.world > 1 else ""
        import torch  # loaded by now: the run has started

        threads = torch.get_num_threads()
        console.print(
            f"{count(start.world, 'process')} on {start.device}, precision {cfg.precision} (compute), "
            f"parameters {start.param_dtypes or 'unknown'}{param_words(cfg, start.param_dtypes)}{layout}; "
            f"workload {escape(cfg.workload)}; torch threads per process: {threads}"
            + (" (--threads)" if self.args.threads is not None else "")
        )
        peak = "the workload optimizer's own" if cfg.optimizer == "workload" else f"{cfg.lr:g}"
        console.print(
            f"schedule: {sched['kind']}, clock {sched['clock']}, warmup {sched['warmup']:,} and horizon "
            f"{count(sched['horizon'], sched['clock'][:-1])}; peak lr {peak}; "
            f"~{start.tokens_per_step:,} valid tokens per step; skipped updates: {sched['skipped_updates']}"
        )
        if sched["clock"] == "steps":
            steps = count(round(warmup_steps), "step")
            keeps = f"{steps} (~{warmup_tokens:,.0f} valid tokens at this global batch)"
            moves = "a larger global batch keeps the steps and adds tokens"
        else:
            keeps = f"{warmup_tokens:,} valid tokens (~{warmup_steps:,.1f} steps at this global batch)"
            moves = "a larger global batch keeps the tokens and takes fewer steps"
        console.print(f"warmup: {keeps}; {moves}")
        if start.experts is not None:
            console.print(escape(start.experts))
        if start.balance is not None:
            console.print(escape(start.balance))
        console.print(escape(checkpoint_policy(cfg)))
        evaluation = evaluation_words(cfg, start.evaluation)
        if evaluation is not None:
            console.print(escape(evaluation))
        if start.batch_schedule is not None:
            b = start.batch_schedule
            grown = [c["global_batch"] for c in b["changes"]]
            console.print(
                f"batch schedule: critical, from {b['start_global_batch']:,} up to {b['max_global_batch']:,} "
                f"examples, x{b['growth']:g} at most per change, {b['min_updates']} updates between changes, "
                f"aiming at {b['fraction']:g} x B_simple; lr rule {b['lr_rule']}"
                + (f"; grown so far to {grown[-1]:,}" if grown else "")
            )
        for skipped in start.skipped_checkpoints:
            console.print(
                f"[yellow]note:[/yellow] passed over a checkpoint that is not intact: {escape(skipped)}"
            )
        if start.resumed_from:
            console.print(f"resumed from {escape(start.resumed_from)} at boundary {start.start_window}")
        if start.resumed_layout:
            console.print(f"resumed on another layout: {escape(start.resumed_layout)}")
        if start.checkpoint_schedule is not None:
            was = start.checkpoint_schedule
            console.print(
                f"[yellow]note:[/yellow] the checkpoint's schedule was {was['kind']}, clock {was['clock']}, "
                f"warmup {was['warmup']:,}, horizon {was['horizon']:,}; from here the learning rate follows "
                "this run's"
            )
        console.print(
            "throughput: tok/s counts valid tokens over the windows' own time (drawing the data and the "
            "step), without checkpoints, evaluation, records or start-up; the summary gives both clocks"
        )
        console.print(f"run folder: {escape(start.run_dir)}")
        if console.is_terminal:
            self.progress = Progress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(
                    "loss {task.fields[loss]}  {task.fields[tps]} tok/s  skipped {task.fields[skipped]}"
                ),
                TimeElapsedColumn(),
                console=console,
            )
            self.task = self.progress.add_task(
                "train", total=start.total_windows, completed=start.start_window, loss="-", tps="-", skipped=0
            )
            self.progress.start()

    def _step(self, record: StepRecord) -> None:
        self.steps.append(record)
        if not record.recompiles:  # a window that compiled measures the compiler, not the step
            self.tokens += record.window_tokens
            self.seconds += record.step_time_ms / 1e3
        rate = f"{self.tokens / self.seconds:,.0f}" if self.seconds else "-"  # since start: less noisy
        if self.progress is not None:
            self.progress.update(
                self.task,
                completed=record.window + 1,
                loss=fmt(record.loss),
                tps=rate,
                skipped=record.skipped,
            )
        elif (
            (record.window + 1) % self.every == 0
            or not record.applied
            or len(self.steps) == 1  # the first loss at once, not after a tenth of the run
            or time.monotonic() - self.last_line >= EVERY_S
        ):
            self.last_line = time.monotonic()
            note = "" if record.applied else f"  SKIPPED: {escape(record.skip_reason or '')}"
            console.print(
                f"step {record.window + 1}: loss {fmt(record.loss)}  lr {record.lr:.3g}  "
                f"tokens {record.tokens:,}  {rate} tok/s{budget_words(record)}{note}"
            )
        if record.recompiles:  # StepResult.recompiles: a window that compiled is worth a line
            graphs = count(record.recompiles, "graph")
            console.print(f"step {record.window + 1}: torch.compile compiled {graphs}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def summary(self, result: TrainResult, resume: str) -> None:
        from gradaccum.train.loop import RUNCARD_FILE
        from gradaccum.train.records import BATCH_PNG, LOSS_PNG, METRICS_FILE

        losses = [r.loss for r in self.steps if r.loss is not None and r.applied]
        p = result.progress
        console.print(loss_summary(losses))
        if result.eval_loss is not None:
            console.print(f"eval loss {result.eval_loss:.4f}")
        if result.critical_batch is not None:
            # under a batch schedule the words describe the run's mean batch, not the final one
            mean = "over the whole run, the mean per update: " if result.batch_schedule is not None else ""
            console.print(escape(mean + result.critical_batch))
        if result.batch_schedule is not None:
            b = result.batch_schedule
            path = [b["start_global_batch"], *(c["global_batch"] for c in b["changes"])]
            console.print(
                f"batch schedule: global batch {' -> '.join(f'{g:,}' for g in path)} examples "
                f"({count(len(b['changes']), 'change')}; lr rule {b['lr_rule']}; per step in metrics.jsonl)"
            )
            final = final_batch_words(self.steps, self.changes, self.unit)
            if final is not None:
                console.print(final)
        budget = budget_summary(self.steps, self.config.max_tokens)
        if budget is not None:
            console.print(budget)
        # the same clock as the progress lines (time inside windows), then the whole wall time
        in_windows = self.tokens / self.seconds if self.seconds else 0.0
        compiled = [r for r in self.steps if r.recompiles]
        compiling_s = compile_seconds(self.steps)
        wall_rate, wall_words = result.tokens_per_s, f"the {result.wall_s:,.1f} s wall time"
        if compiled:
            graphs = count(sum(r.recompiles for r in compiled), "graph")
            console.print(
                f"compile time: {compiling_s:,.1f} s (torch.compile, {graphs} in "
                f"{count(len(compiled), 'window')}: their time beyond a window that did not compile), "
                "kept out of the tok/s below"
            )
            rest = result.wall_s - compiling_s
            wall_rate = p.tokens_consumed / rest if rest > 0 else 0.0
            wall_words = f"the {rest:,.1f} s wall time without compiling"
        started = getattr(self.args, "started", None)
        command = "" if started is None else f" of the {time.monotonic() - started:,.1f} s command"
        console.print(
            f"{result.stopped}: {count(p.windows, 'boundary')}, "
            f"{count(p.steps_applied, 'update')} applied, "
            f"{p.steps_skipped} skipped; {p.tokens_consumed:,} tokens consumed; {in_windows:,.0f} tok/s in "
            + ("the training windows that did not compile" if compiled else "training windows")
            + f" (over their own {self.seconds:,.2f} s: the step lines' figure)"
            + f", {wall_rate:,.0f} tok/s over {wall_words} (with checkpoints, evaluation and records)"
            + (f"{command} (start-up, model and data loading included)" if command else "")
            + (f"; loss scale {result.loss_scale:g}" if result.loss_scale is not None else "")
        )
        run_dir = result.run_dir
        pngs = f"{run_dir / LOSS_PNG}"
        if result.critical_batch is not None:  # --noise-scale: the batch figure is drawn too
            pngs += f", {run_dir / BATCH_PNG}"
        console.print(
            escape(
                f"records: {run_dir / RUNCARD_FILE}, {run_dir / METRICS_FILE}, {pngs}"
                + (f"; checkpoint {result.checkpoints[-1]}" if result.checkpoints else "")
            )
        )
        if result.stopped != "completed":
            console.print(escape(f"resume with: {resume}"))


def param_words(cfg: TrainConfig, stored: str) -> str:
    """Where the parameters' dtype comes from, and what the layers compute in when no autocast
    narrows them (precision float32 on bfloat16 parameters computes in bfloat16)."""
    source = (
        " (float64 for --precision float64)"
        if cfg.precision == "float64"
        else " (--param-dtype saved: as the folder saved them)"
        if cfg.param_dtype == "saved" and cfg.workload.startswith("hf:")
        else " (--param-dtype saved: as the workload builds them)"
        if cfg.param_dtype == "saved"
        else f" (--param-dtype {cfg.param_dtype})"
    )
    narrow = next((name for name in ("bfloat16", "float16") if stored.startswith(name)), None)
    if narrow is not None and cfg.precision == "float32":
        source += f", computing in {narrow} (no autocast at precision float32)"
    if cfg.accum.accum_dtype is not None:
        source += f", gradients summed in {cfg.accum.accum_dtype} (--accum-dtype)"
    return source


def evaluation_words(cfg: TrainConfig, held_out: str | None) -> str | None:
    """The evaluation line: what is held out, and whether and when it is evaluated."""
    if cfg.eval_every is None:
        if held_out is None or "evaluation is refused" in held_out:
            return held_out
        return f"{held_out}; not evaluated: no --eval-every (add --eval-every N to evaluate them)"
    when = f"every {count(cfg.eval_every, 'boundary')} and at the end"
    if held_out is None:
        return f"evaluation: {when}, on {count(cfg.eval_examples, 'example')} of the workload's held-out draw"
    return f"{held_out}; evaluated {when}, on {count(cfg.eval_examples, 'example')} drawn from them each time"


def budget_words(record: StepRecord) -> str:
    """A token-budget window on a progress line: its micro-batches (all ranks) and its padding."""
    if record.micro_batches is None or not record.computed_tokens or record.padding_tokens is None:
        return ""
    share = record.padding_tokens / record.computed_tokens
    return f"  {count(record.micro_batches, 'micro-batch')}, padding {share:.1%}"


def budget_summary(steps: list[StepRecord], max_tokens: int | None) -> str | None:
    """What a token budget made of the windows: micro-batches per window (all ranks) and the padding
    of the token positions computed; ``None`` without a budget."""
    rows = [r for r in steps if r.micro_batches is not None and r.computed_tokens]
    if max_tokens is None or not rows:
        return None
    counts = [r.micro_batches or 0 for r in rows]
    computed = sum(r.computed_tokens or 0 for r in rows)
    padding = sum(r.padding_tokens or 0 for r in rows)
    spread = f" ({min(counts)} to {max(counts)})" if min(counts) != max(counts) else ""
    return (
        f"token budget max_tokens {max_tokens:,}: {statistics.fmean(counts):.1f} micro-batches per window"
        f"{spread}, all ranks; padding {padding:,} of the {computed:,} token positions computed "
        f"({padding / computed:.1%})"
    )


def final_batch_words(steps: list[StepRecord], changes: list[BatchChange], unit: str) -> str | None:
    """The final global batch against the last B_simple estimate, both in ``unit`` (what count_fn
    counts), the batch in examples beside it. The last estimate is the schedule's own (B_recent at
    its last change); before any change, the run's smoothed B_simple after the last window."""
    last = steps[-1] if steps else None
    if last is None:
        return None
    known = last.global_batch is not None and unit != "examples"  # else the units are the examples
    examples = f"{last.global_batch:,} examples = " if known else ""
    batch = f"final global batch {examples}{last.window_tokens:,} {unit} (the last window)"
    if changes:
        estimate, source = changes[-1].b_simple, f"B_recent at the change after step {changes[-1].step}"
    elif last.b_simple is not None:
        estimate, source = last.b_simple, "smoothed over the run, after the last window"
    else:
        return f"{batch}; no B_simple estimate"
    return (
        f"{batch} is {last.window_tokens / estimate:.2g}x the last B_simple estimate ~ {estimate:,.0f} "
        f"{unit} ({source})"
    )


def compile_seconds(steps: list[StepRecord]) -> float:
    """Seconds torch.compile took: each window that compiled, less the median window that did not
    (a compiling window also did a window's work). Without such a window, the compiling windows'
    whole time: an upper bound. 0.0 when nothing compiled (eager)."""
    compiled = [r.step_time_ms for r in steps if r.recompiles]
    if not compiled:
        return 0.0
    plain = [r.step_time_ms for r in steps if not r.recompiles]
    typical = statistics.median(plain) if plain else 0.0
    return sum(max(0.0, ms - typical) for ms in compiled) / 1e3


def loss_summary(losses: list[float]) -> str:
    """The training loss from start to end, meaningful however short the run: the means of the
    first and last updates never overlap, and a run of ten updates or fewer shows every loss."""
    if not losses:
        return "no update applied: no training loss to show"
    if len(losses) == 1:
        return f"one update applied: loss {losses[0]:.4f} (too short to show a trend)"
    k = min(5, len(losses) // 2)
    head, tail = statistics.fmean(losses[:k]), statistics.fmean(losses[-k:])
    text = (
        f"start loss {head:.4f} -> end loss {tail:.4f} ({tail - head:+.4f}; means of the first and last "
        f"{count(k, 'update')} of {len(losses)}"
    )
    if len(losses) <= 10:
        return text + "; every loss: " + ", ".join(f"{x:.4f}" for x in losses) + ")"
    return text + f"; first {losses[0]:.4f}, last {losses[-1]:.4f})"


def checkpoint_policy(cfg: TrainConfig) -> str:
    when = []
    if cfg.checkpoint_every is not None:
        when.append(f"every {count(cfg.checkpoint_every, 'applied update')}")
    if cfg.checkpoint_minutes is not None:
        when.append(f"every {cfg.checkpoint_minutes:g} minutes")
    cadence = " or ".join(when) + (", whichever comes first," if len(when) == 2 else "")
    cadence = f"{cadence} and at the end" if when else "at the end only"
    return (
        f"checkpoints: {cadence} (and on SIGUSR1, SIGINT or SIGTERM); the newest "
        f"{cfg.keep_checkpoints} kept in {cfg.run_dir / 'checkpoints'}"
    )


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
