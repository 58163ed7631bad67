"""Tables and Markdown reports of a sweep or an acceptance run.

The table builders return plain headers and rows of strings; the CLI renders them with rich and
:func:`sweep_markdown` / :func:`accept_markdown` as Markdown, so both say the same thing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gradaccum.bench.accept import AcceptResult
from gradaccum.bench.models import CommModel, MemoryModel
from gradaccum.bench.quality import QualityResult
from gradaccum.bench.stats import ConfigSummary
from gradaccum.bench.sweep import SweepResult

__all__ = [
    "accept_markdown",
    "comm_rows",
    "fmt_bytes",
    "fsdp2_rows",
    "memory_predictions",
    "memory_rows",
    "phase_lines",
    "quality_lines",
    "quality_table",
    "sweep_markdown",
    "time_rows",
    "verdict_rows",
]

Table = tuple[list[str], list[list[str]]]


def fmt_bytes(value: float | None) -> str:
    """Bytes in binary units, e.g. ``312.4 MiB``; ``-`` for None."""
    if value is None:
        return "-"
    sign = "-" if value < 0 else ""
    size = abs(float(value))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{sign}{size:.0f} {unit}" if unit == "B" else f"{sign}{size:.1f} {unit}"
        size /= 1024
    return f"{sign}{size:.1f} TiB"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _status(c: ConfigSummary) -> str:
    return c.status if c.runs_ok == c.runs else f"{c.status} ({c.runs_ok}/{c.runs} ok)"


def time_rows(configs: Sequence[ConfigSummary]) -> Table:
    """Throughput (median, min..max of runs) and phase times, one row per configuration."""
    unit = configs[0].unit if configs else "tokens"
    headers = [
        "config",
        "status",
        f"{unit}/s",
        "min..max (spread)",
        "step ms",
        "count ms",
        "micro ms",
        "sync ms",
        "optim ms",
        "other ms",
        "skipped",
    ]
    rows = []
    for c in configs:
        u = c.units_per_s
        rows.append(
            [
                c.spec.row_label,
                _status(c),
                "-" if u is None else f"{u.median:,.0f}",
                "-" if u is None else f"{u.low:,.0f}..{u.high:,.0f} ({u.relative:.0%})",
                "-" if c.step_ms is None else f"{c.step_ms.median:.2f}",
                _ms(c.count_ms),
                _ms(c.micro_ms),
                _ms(c.sync_ms),
                _ms(c.optimizer_ms),
                _ms(c.other_ms),
                f"{c.skipped_updates}/{c.updates}",
            ]
        )
    return headers, rows


def phase_lines(configs: Sequence[ConfigSummary]) -> list[str]:
    """Where a step's time goes, as means per update that add up, with what is not broken down."""
    lines = [
        "Where a step goes, mean ms per update over every run (means add up; the table's medians need "
        "not): count: counting the window's units (and agreeing on them across ranks); micro-batches: "
        "their forwards and backwards (the synchronizing one included); optimizer: the agreement, host "
        "reads, clipping and the step; other: the rest, not broken down (the window's checks before the "
        "count, moving each micro-batch to the device, the result after the step)."
    ]
    for c in configs:
        means = c.phase_means_ms
        if means is None:
            continue
        count_ms, micro, optim, other, step = means
        k = c.spec.accum_steps
        each = f" ({k} x {micro / k:.2f})" if c.spec.max_tokens is None else ""  # a budget varies k
        lines.append(
            f"- {c.spec.row_label}: count {count_ms:.2f} + micro-batches {micro:.2f}{each} "
            f"+ optimizer {optim:.2f} + other {other:.2f} = step {step:.2f} ms"
        )
    return lines


def memory_predictions(result: SweepResult) -> list[float | None]:
    """The plain memory model's prediction per row; ``None`` where it does not apply (rows with
    checkpointing or FSDP2 follow other lines) or no model was fitted."""
    mm = result.memory_model
    return [
        None
        if mm is None or c.spec.checkpointing != "none" or c.spec.fsdp or c.spec.max_tokens is not None
        else mm.predict(c.spec.micro_batch)
        for c in result.configs
    ]


def memory_rows(configs: Sequence[ConfigSummary], predictions: Sequence[float | None] | None = None) -> Table:
    """Memory from the tensors (persistent, activation, gradients held), CUDA's peaks, peak RSS and
    all-reduces."""
    headers = [
        "config",
        "persistent",
        "activations / micro-batch",
        "of which recomputed",
        "gradients held (window)",
        "CUDA max allocated",
        "CUDA max reserved",
        "peak RSS (process)",
        "all-reduces/upd",
        "all-reduced/upd",
    ]
    if predictions is not None:
        headers.insert(5, "model predicts")
    rows = []
    for i, c in enumerate(configs):
        m = c.memory
        row = [
            c.spec.row_label,
            fmt_bytes(None if m is None else m.persistent_bytes),
            fmt_bytes(None if m is None else m.activation_bytes),
            "-" if m is None or c.spec.checkpointing == "none" else fmt_bytes(m.recompute_bytes),
            fmt_bytes(None if m is None else m.held_gradient_bytes),
            fmt_bytes(c.peak_allocated_bytes),
            fmt_bytes(c.peak_reserved_bytes),
            fmt_bytes(c.peak_rss_bytes),
            "-" if c.allreduce_calls_per_update is None else str(c.allreduce_calls_per_update),
            fmt_bytes(c.allreduce_bytes_per_update),
        ]
        if predictions is not None:
            row.insert(5, fmt_bytes(predictions[i]))
        rows.append(row)
    return headers, rows


def fsdp2_rows(configs: Sequence[ConfigSummary]) -> Table:
    """FSDP2 rows side by side, sync deferred against sync on every micro-batch: what deferral
    saves in communication and costs in gradient memory per rank."""
    headers = [
        "config",
        "persistent/rank",
        "reduce-scattered/upd: deferred | every",
        "all-gathered/upd: deferred | every",
        "gradients held/rank: deferred | every",
        "units/s: deferred | every",
    ]
    pairs: dict[tuple[str, str], dict[bool, ConfigSummary]] = {}
    for c in configs:
        if c.spec.fsdp:
            pairs.setdefault((c.spec.label, c.spec.checkpointing), {})[c.spec.defer_sync] = c
    rows = []
    for (label, mode), both in pairs.items():
        on, off = both.get(True), both.get(False)

        def pair(
            get: Callable[[ConfigSummary], str],
            on: ConfigSummary | None = on,
            off: ConfigSummary | None = off,
        ) -> str:
            return " | ".join("-" if c is None or not c.ok else get(c) for c in (on, off))

        first = on or off
        persistent = first.memory.persistent_bytes if first is not None and first.memory else None
        rows.append(
            [
                label + (" ckpt" if mode != "none" else ""),
                fmt_bytes(persistent),
                pair(lambda c: fmt_bytes(c.reduce_scatter_bytes_per_update)),
                pair(lambda c: fmt_bytes(c.allgather_bytes_per_update)),
                pair(lambda c: fmt_bytes(None if c.memory is None else c.memory.held_gradient_bytes)),
                pair(lambda c: "-" if c.units_per_s is None else f"{c.units_per_s.median:,.0f}"),
            ]
        )
    if configs:
        headers[-1] = f"{configs[0].unit}/s: deferred | every"
    return headers, rows


def comm_rows(configs: Sequence[ConfigSummary], models: Sequence[CommModel | None]) -> Table:
    """The communication model beside the measured bytes, per configuration."""
    headers = [
        "config",
        "k",
        "gradient G",
        "naive k x G",
        "deferred 1 x G",
        "mode",
        "measured/upd",
        "matches",
    ]
    rows = []
    for c, m in zip(configs, models, strict=True):
        if m is None:
            k = "-" if c.spec.max_tokens is not None else str(c.spec.accum_steps)
            rows.append([c.spec.row_label, k, "-", "-", "-", "-", "-", "-"])
            continue
        matches = m.matches
        rows.append(
            [
                c.spec.row_label,
                str(m.accum_steps),
                fmt_bytes(m.gradient_bytes),
                fmt_bytes(m.naive_bytes),
                fmt_bytes(m.deferred_bytes),
                "deferred" if m.defer_sync else "naive",
                "- (no DP)" if m.measured_bytes is None else fmt_bytes(m.measured_bytes),
                "-" if matches is None else ("yes" if matches else "NO"),
            ]
        )
    return headers, rows


def verdict_rows(result: AcceptResult) -> Table:
    headers = ["criterion", "figure", "result"]
    rows = [[c.name, c.figure, "PASS" if c.passed else "FAIL"] for c in result.verdict.criteria]
    return headers, rows


def _markdown_table(table: Table) -> str:
    headers, rows = table
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def memory_lines(model: MemoryModel | None, note: str | None, advice: str | None) -> list[str]:
    """The memory model in words, and the budget's advice."""
    if model is None:
        return [f"No memory model: {note}."]
    lines = [
        f"peak ~ {fmt_bytes(model.persistent_bytes)} persistent + {fmt_bytes(model.fixed_bytes)} + "
        f"{fmt_bytes(model.per_example_bytes)} x micro_batch of activations ({model.fit_words}). "
        "Accumulation shrinks only the activation term; the persistent term is the same for every "
        "factorization.",
    ]
    if advice is not None:
        lines.append(f"Budget: {advice}.")
    return lines


def sweep_markdown(result: SweepResult) -> str:
    spec, settings = result.spec, result.spec.settings
    first = result.configs[0] if result.configs else None
    ok = [c for c in result.configs if c.ok]
    predictions = memory_predictions(result)
    lines = [
        f"# gradaccum bench: {spec.workload} at global batch {spec.global_batch}",
        "",
        f"- global batch = micro-batch x dp {spec.dp} x accumulation = {spec.global_batch} for every row",
        f"- activation checkpointing: {', '.join(spec.checkpointing)}; sharding: {', '.join(spec.sharding)}"
        + (
            "; FSDP2 rows with sync deferred and on every micro-batch (`no-defer`)"
            if "fsdp2" in spec.sharding
            else ""
        ),
        f"- precision {settings.precision}, device {settings.device}, gradient sync "
        f"{'deferred to the last micro-batch' if settings.defer_sync else 'on every micro-batch (naive)'}",
        f"- {settings.runs} runs per configuration, interleaved; {settings.steps} measured updates per "
        f"run after {settings.warmup} warm-up updates; each run in a fresh process",
        "- throughput: valid units over measured step time (slowest rank); spread: min..max of runs",
        "- peak memory: "
        + (first.peak_memory_kind if first else "-")
        + "; CUDA reserved is the caching allocator's pool",
        "",
        _markdown_table(time_rows(result.configs)),
        "",
        *phase_lines(result.configs),
        "",
        _markdown_table(memory_rows(result.configs, predictions)),
        "",
        "## Valid units per update",
        "",
    ]
    if ok:
        tokens = ok[0].tokens_per_update
        same = all(c.tokens_per_update == tokens and c.tokens_identical_across_runs for c in ok)
        lines.append(
            f"Exact global counts of each measured update ({ok[0].unit}): {tokens}. Identical in every "
            f"configuration and run: {'yes' if same else 'NO'}."
        )
    lines += [
        "",
        "## Memory model",
        "",
        *memory_lines(result.memory_model, result.memory_model_note, result.budget_advice),
        "",
    ]
    if result.advice is not None:
        lines += [
            "## Advice",
            "",
            f"Budget {fmt_bytes(result.advice.budget_bytes)} per rank: {result.advice.sentence}.",
        ]
        if result.card is not None:
            lines.append(
                f"`runcard.json` records {result.advice.chosen.label if result.advice.chosen else '-'} "
                "(the plan, precision and accumulator settings `train --runcard` replays; checkpointing "
                "and sharding in its `extra`)."
            )
        lines += [
            "",
            "The advisor compares the rows' measured figures: CUDA's max reserved over an update where "
            "present, else the peak from the tensors (parameters + optimizer state + gradients held + one "
            "micro-batch's activations), which leaves out the runtime and kernels' workspace.",
            "",
        ]
    if "full" in spec.checkpointing:
        lines += ["## Activation checkpointing", "", *checkpointing_lines(result), ""]
    if True in spec.compile:
        lines += ["## Compiled rows", "", *compile_lines(result.configs), ""]
    if any(c.spec.fsdp for c in result.configs):
        lines += [
            "## FSDP2: sync deferral",
            "",
            "Deferring sync reduce-scatters the gradients once per update instead of once per micro-batch, "
            "but until the final micro-batch every rank holds the *unsharded* gradients (the whole set, "
            "not 1/dp of it): memory traded back for communication. Gradients held are the most a rank "
            "held at a micro-batch boundary; bytes are per rank and per update, padding included.",
            "",
            _markdown_table(fsdp2_rows(result.configs)),
            "",
        ]
    lines += [
        "## Communication model",
        "",
    ]
    lines.append(
        "Naive accumulation all-reduces the full gradient on every micro-batch (k x G per update); "
        "deferred sync once (1 x G), as one large batch would."
    )
    lines += ["", _markdown_table(comm_rows(result.configs, result.comm)), ""]
    failed = [c for c in result.configs if not c.ok]
    if failed:
        lines += ["## Configurations that did not finish", ""]
        lines += [
            f"- {c.spec.label}: {c.status}: {(c.error or '').splitlines()[0] if c.error else ''}"
            for c in failed
        ]
        lines.append("")
    return "\n".join(lines)


def compile_lines(configs: Sequence[ConfigSummary]) -> list[str]:
    """Compile time apart from throughput: the rows' throughput excludes the warm-up that compiled."""
    lines = [
        "Compiled rows (`compiled`) ran `nn.Module.compile()` (torch's default backend) before DDP; the "
        "first warm-up update compiled, and what it took beyond a measured update is the compile time "
        "(median of runs), kept out of the throughput above. Recompiles: graphs compiled during the "
        "measured updates, over all runs (0: the warm-up compiled every shape the rows need)."
    ]
    for c in configs:
        if c.spec.compile and c.ok:
            seconds = c.compile_s or 0.0
            lines.append(f"- {c.spec.row_label}: compile {seconds:.1f} s, recompiles {c.recompiles}")
    return lines


def checkpointing_lines(result: SweepResult) -> list[str]:
    """How checkpointed rows were measured, and their float64 check."""
    lines = [
        "Checkpointed rows run each repeated block under non-reentrant `torch.utils.checkpoint`. Their "
        "activation figure is what the forward keeps (the blocks' inputs, which the checkpoint saves "
        "for the recomputation, and everything outside the blocks) plus the largest block's own saved "
        "tensors, which its recomputation holds during that block's backward (the `of which "
        "recomputed` column): a bound on the activations alive at once, not the forward's saving alone."
    ]
    check = result.checkpointing_check
    if check is not None:
        lines += ["", f"Checkpointed against plain, float64: {check.describe()}."]
    plain = {c.spec.row_label: c for c in result.configs if c.ok and c.spec.checkpointing == "none"}
    for c in result.configs:
        if not c.ok or c.spec.checkpointing == "none" or c.memory is None or c.units_per_s is None:
            continue
        twin_label = c.spec.row_label.replace(" ckpt", "")
        twin = plain.get(twin_label)
        if twin is None or twin.memory is None or twin.units_per_s is None or not c.memory.activation_bytes:
            continue
        less = twin.memory.activation_bytes / c.memory.activation_bytes
        lines.append(
            f"- {c.spec.row_label}: activations {fmt_bytes(c.memory.activation_bytes)} against "
            f"{fmt_bytes(twin.memory.activation_bytes)} without ({less:.2f}x less), at "
            f"{c.units_per_s.median / twin.units_per_s.median:.2f}x the {c.unit}/s"
        )
    return lines


def verdict_lines(result: AcceptResult) -> list[str]:
    """The decision in words: what it rests on, what would resolve it, what to watch."""
    v, spec = result.verdict, result.spec
    chosen = result.card.plan
    scaling = f", scaling {result.card.accum.scaling}" if "post" in spec.scalings else ""
    if result.card.max_tokens is not None:  # a token-budget candidate: the plan is the whole window
        scaling += f", micro-batches of at most max_tokens {result.card.max_tokens} tokens"
    lines = [f"{v.decision}: the run card records {chosen.label()} ({chosen.equation()}){scaling}."]
    if v.interval is not None and v.throughput_gain is not None:
        runs = len(v.run_ratios)
        what = (
            f"the geometric mean of {runs} runs' median paired ratios, the centre of its interval"
            if runs > 1
            else "one run's median paired ratio"
        )
        lines.append(
            f"The gain (candidate over baseline {result.baseline.unit}/s; {what}) is "
            f"{v.throughput_gain:+.1%} with a 95% interval of [{v.interval[0]:+.1%}, "
            f"{v.interval[1]:+.1%}] against a margin of {spec.margin:.1%}."
        )
    if v.inconclusive:
        more = (
            f" {v.runs_to_resolve} runs (--runs {v.runs_to_resolve}) would resolve it if the gain and the "
            "runs' spread stay as measured (the same interval, computed at that many runs)."
            if v.runs_to_resolve is not None
            else ""
        )
        lines.append(
            "The interval does not decide: it reaches both a gain below the margin and one above it."
            + more
            + " Until then keep the baseline; exit code 3 says so to a script."
        )
    lines += [f"Warning: {w}." for w in v.warnings]
    return lines


def quality_table(quality: QualityResult) -> Table:
    """Each arm's final evaluation loss per seed, its mean and 95 % interval."""
    seeds = quality.baseline.seeds
    headers = ["arm", "plan", "trained as", *[f"seed {s}" for s in seeds], "mean", "95% interval"]
    rows = []
    for name, arm in (("baseline", quality.baseline), ("candidate", quality.candidate)):
        rows.append(
            [
                name,
                arm.label,
                arm.trained,
                *[f"{x:.4f}" for x in arm.eval_losses],
                f"{arm.mean:.4f}",
                f"[{arm.low:.4f}, {arm.high:.4f}]",
            ]
        )
    rows.append(
        [
            "candidate - baseline",
            "",
            "",
            *[f"{d:+.2e}" for d in quality.paired_differences],
            f"{quality.difference:+.4f}",
            f"[{quality.difference_low:+.4f}, {quality.difference_high:+.4f}] (Welch)",
        ]
    )
    return headers, rows


def quality_lines(result: AcceptResult) -> list[str]:
    """Why a representative quality run is needed (what the scan found), and its result if it ran."""
    spec, reasons, quality = result.spec, result.quality_reasons, result.quality
    lines = []
    if reasons:
        lines.append(
            "The equivalence check proves one update exact, but the scan found what it had to switch off "
            "or could not make exact, so a change of micro-batch can change training beyond one update:"
        )
        lines += [f"- {r}" for r in reasons]
        lines.append("")
    else:
        lines.append(
            "Short equivalence checks cannot guarantee final convergence; a change of physical "
            "micro-batch or of randomness still needs a representative quality run."
        )
    if quality is None and spec.candidate_max_tokens is not None:
        lines.append(
            "No quality run is offered for a token-budget candidate: it regroups the same rows, and "
            "the float64 check above shows its update is the baseline's."
        )
        return lines
    if quality is None:
        ask = "**A representative quality run is needed**" if reasons else "To run one"
        scalings = "".join(
            f" --{arm}-scaling {spec.scaling_of(arm)}"
            for arm in ("baseline", "candidate")
            if spec.scaling_of(arm) != "pre"
        )
        lines.append(
            f"{ask}: `gradaccum accept --baseline {spec.baseline.label()} --candidate "
            f"{spec.candidate.label()}{scalings} --quality-steps N --seeds 3` trains both from each seed "
            "and compares their final evaluation loss."
        )
        return lines
    lines += [
        " ".join(
            [
                f"Both configurations trained {quality.spec.steps} updates from each of",
                f"{len(quality.baseline.seeds)} seeds through `gradaccum.train` with production settings",
                f"(dropout on, BatchNorm as it is, precision {quality.spec.precision}, the measured",
                "accumulator settings; train's AdamW and warmup + cosine), then evaluated on",
                f"{quality.spec.eval_examples} held-out examples (mean loss over the counted",
                f"{quality.unit}).",
                "A seed picks the data, the dropout draws and the held-out examples, the same for both arms.",
            ]
        ),
        "",
        _markdown_table(quality_table(quality)),
        "",
        f"**{quality.describe()[0].upper() + quality.describe()[1:]}.**",
        "",
        "Intervals: each arm's mean +- t(0.975, S-1) s / sqrt(S) over its S seeds; the difference of the "
        "means with a Welch interval (Welch-Satterthwaite degrees of freedom, rounded down). Welch "
        "treats the arms as independent, which is conservative: both arms of a seed share its data. "
        "The per-seed differences are shown, not used: arms exact in arithmetic differ per seed by "
        "float rounding alone.",
    ]
    lines += [f"Note: {n}." for n in quality.notes]
    return lines


def accept_markdown(result: AcceptResult) -> str:
    spec, settings = result.spec, result.spec.settings
    v = result.verdict
    lines = [
        f"# gradaccum accept: {v.decision}",
        "",
        f"Baseline {spec.label_of('baseline')} vs candidate {spec.label_of('candidate')} (micro-batch x "
        f"accumulation{', scaling' if 'post' in spec.scalings else ''}) on `{spec.workload}`; "
        f"global batch {spec.baseline.global_batch}; dp "
        f"{spec.baseline.dp}; precision {settings.precision}; clipping at "
        f"{'off' if settings.max_grad_norm is None else settings.max_grad_norm}; device {settings.device}; "
        f"margin {spec.margin:.1%}.",
        "",
        "## Verdict",
        "",
        _markdown_table(verdict_rows(result)),
        "",
        *(f"**{line}**" if i == 0 else line for i, line in enumerate(verdict_lines(result))),
    ]
    if not result.equivalence_passed:
        lines += [
            "",
            "The equivalence checks FAILED: the accumulated update does not match the full batch. "
            "This is an arithmetic or model problem (see `results.json` for the likely causes), not noise.",
        ]
    lines += [
        "",
        "## How it was measured",
        "",
        f"Throughput: {settings.runs} paired runs, each a fresh process holding both configurations. After "
        f"{settings.warmup} warm-up updates of each, the two alternate in blocks of {spec.block_updates} "
        f"updates (baseline, candidate; candidate, baseline; ...), {spec.blocks} blocks each. A block pair's "
        "ratio (candidate over baseline throughput on the same examples) is taken from adjacent blocks, "
        "so drift in the machine's speed lands on both sides of it. Each run gives its median ratio. "
        "The runs are the independent replicates (pairs within one process are not): the 95% interval "
        "is a Student-t interval of the runs' median log-ratios (wide with three runs), and the gain is "
        "its centre, the geometric mean of the runs' median ratios. The table's per-arm throughputs are "
        "medians over runs of each arm alone, shown for scale; their ratio is not the paired estimate.",
        "",
        "Memory: a short run of each configuration in a fresh process. Persistent bytes (parameters, "
        "gradients, optimizer state) and activation bytes (what one micro-batch's forward saves for "
        "backward) are counted from the tensors, on any device; on CUDA the allocator's peaks are beside "
        "them. The process's peak RSS is mostly the Python and torch runtime.",
        "",
        _markdown_table(time_rows([result.baseline, result.candidate])),
        "",
        *phase_lines([result.baseline, result.candidate]),
        "",
        _markdown_table(memory_rows([result.baseline, result.candidate])),
        "",
        *memory_lines(result.memory_model, "no memory figures", result.budget_advice),
        "",
        _markdown_table(comm_rows([result.baseline, result.candidate], result.comm)),
        "",
        "## Equivalence",
        "",
        *[
            f"- {p.label}: {'PASS' if p.passed else 'FAIL'}: gradient relative error "
            f"{p.grad_max_rel_err:.2e} (tolerance {p.grad_tol:.0e}), parameter difference "
            f"{p.param_max_abs_diff:.2e} (tolerance {p.param_tol:.0e})"
            + "".join(f"\n  - likely cause: {cause}" for cause in p.causes)
            for p in result.equivalence.params
        ],
        f"- traces at {settings.precision} over {spec.trace_steps} updates: "
        f"{'PASS' if result.equivalence.trace.passed else 'FAIL'}: {result.equivalence.trace.figure}",
        "",
        "## Quality run",
        "",
        *quality_lines(result),
        "",
        "## Files",
        "",
        "`results.json` (every figure and run), `runcard.json` (the configuration to reproduce, with every "
        "setting that changes the update), `throughput.png`, `memory.png`.",
        "",
    ]
    return "\n".join(lines)
