"""Tables and Markdown reports of a sweep or an acceptance run.

The table builders return plain headers and rows of strings; the CLI renders them with rich and
:func:`sweep_markdown` / :func:`accept_markdown` as Markdown, so both say the same thing.
"""

from __future__ import annotations

from collections.abc import Sequence

from gradaccum.bench.accept import AcceptResult
from gradaccum.bench.models import CommModel
from gradaccum.bench.stats import ConfigSummary
from gradaccum.bench.sweep import SweepResult

__all__ = [
    "accept_markdown",
    "comm_rows",
    "fmt_bytes",
    "memory_rows",
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
        "micro ms",
        "sync ms",
        "optim ms",
        "skipped",
    ]
    rows = []
    for c in configs:
        u = c.units_per_s
        rows.append(
            [
                c.spec.label,
                _status(c),
                "-" if u is None else f"{u.median:,.0f}",
                "-" if u is None else f"{u.low:,.0f}..{u.high:,.0f} ({u.relative:.0%})",
                "-" if c.step_ms is None else f"{c.step_ms.median:.2f}",
                _ms(c.micro_ms),
                _ms(c.sync_ms),
                _ms(c.optimizer_ms),
                f"{c.skipped_updates}/{c.updates}",
            ]
        )
    return headers, rows


def memory_rows(configs: Sequence[ConfigSummary], predictions: Sequence[float | None] | None = None) -> Table:
    """Peak memory (with the memory model's prediction) and all-reduces, one row per configuration."""
    kind = next((c.peak_memory_kind for c in configs if c.ok), "peak memory")
    headers = ["config", kind, "CUDA reserved", "all-reduces/upd", "all-reduced/upd"]
    if predictions is not None:
        headers.insert(2, "model predicts")
    rows = []
    for i, c in enumerate(configs):
        row = [
            c.spec.label,
            fmt_bytes(c.peak_memory_bytes),
            fmt_bytes(c.peak_reserved_bytes),
            "-" if c.allreduce_calls_per_update is None else str(c.allreduce_calls_per_update),
            fmt_bytes(c.allreduce_bytes_per_update),
        ]
        if predictions is not None:
            row.insert(2, fmt_bytes(predictions[i]))
        rows.append(row)
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
            rows.append([c.spec.label, str(c.spec.accum_steps), "-", "-", "-", "-", "-", "-"])
            continue
        matches = m.matches
        rows.append(
            [
                c.spec.label,
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


def _memory_lines(result: SweepResult) -> list[str]:
    mm = result.memory_model
    if mm is None:
        return [f"No memory model: {result.memory_model_note}."]
    lines = [
        f"peak = {fmt_bytes(mm.persistent_bytes)} + {fmt_bytes(mm.per_example_bytes)} x micro_batch "
        f"(least squares over {mm.points} configurations of {mm.kind}; rms residual "
        f"{fmt_bytes(mm.residual_bytes)}).",
    ]
    if mm.per_example_bytes <= 0:
        lines.append(
            "The fit finds no growth with the micro-batch: at this size the activations are lost in "
            "the noise of the measured figure, so the model sets no micro-batch limit."
        )
    budget = result.spec.memory_budget_bytes
    if budget is not None:
        largest = result.largest_fitting_micro_batch
        plan = result.largest_fitting_plan
        said = "no limit from the model" if largest is None else f"micro-batch <= {largest}"
        lines.append(
            f"Budget {fmt_bytes(budget)}: {said}; largest factorization of the global batch that fits: "
            + ("none" if plan is None else plan.label())
            + "."
        )
    return lines


def sweep_markdown(result: SweepResult) -> str:
    spec, settings = result.spec, result.spec.settings
    first = result.configs[0] if result.configs else None
    ok = [c for c in result.configs if c.ok]
    predictions = [
        None if result.memory_model is None else result.memory_model.predict(c.spec.micro_batch)
        for c in result.configs
    ]
    lines = [
        f"# gradaccum bench: {spec.workload} at global batch {spec.global_batch}",
        "",
        f"- global batch = micro-batch x dp {spec.dp} x accumulation = {spec.global_batch} for every row",
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
    lines += ["", "## Memory model", "", *_memory_lines(result), "", "## Communication model", ""]
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


def accept_markdown(result: AcceptResult) -> str:
    spec, settings = result.spec, result.spec.settings
    v = result.verdict
    chosen = result.card.plan
    lines = [
        f"# gradaccum accept: {v.decision}",
        "",
        f"Baseline {spec.baseline.label()} vs candidate {spec.candidate.label()} (micro-batch x "
        f"accumulation) on `{spec.workload}`; global batch {spec.baseline.global_batch}; dp "
        f"{spec.baseline.dp}; precision {settings.precision}; device {settings.device}; "
        f"margin {spec.margin:.1%}.",
        "",
        "## Verdict",
        "",
        _markdown_table(verdict_rows(result)),
        "",
        f"**{v.decision}**: the run card records {chosen.label()} ({chosen.equation()}).",
    ]
    if not result.equivalence_passed:
        lines += [
            "",
            "The equivalence checks FAILED: the accumulated update does not match the full batch. "
            "This is an arithmetic or model problem (see `results.json` for the likely causes), not noise.",
        ]
    lines += [
        "",
        "## Measurements",
        "",
        f"{settings.runs} runs each, interleaved (baseline, candidate, baseline, ...), {settings.steps} "
        f"measured updates per run after {settings.warmup} warm-up updates, each run in a fresh process.",
        "",
        _markdown_table(time_rows([result.baseline, result.candidate])),
        "",
        _markdown_table(memory_rows([result.baseline, result.candidate])),
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
        "Short equivalence checks cannot guarantee final convergence; a change of physical micro-batch "
        "still needs a representative quality run.",
        "",
        "## Files",
        "",
        "`results.json` (every figure and run), `runcard.json` (the configuration to reproduce), "
        "`throughput.png`, `memory.png`.",
        "",
    ]
    return "\n".join(lines)
