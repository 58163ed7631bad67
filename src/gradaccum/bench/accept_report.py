"""The Markdown report of an acceptance run (``accept``): the verdict and what it rests on, how both
configurations were measured, the equivalence checks and the quality run."""

from __future__ import annotations

from gradaccum.bench.accept import AcceptResult
from gradaccum.bench.quality import QualityResult
from gradaccum.bench.tables import (
    Table,
    comm_rows,
    markdown_table,
    memory_lines,
    memory_rows,
    phase_lines,
    time_rows,
)

__all__ = ["accept_markdown", "quality_lines", "quality_table", "verdict_lines", "verdict_rows"]


def verdict_rows(result: AcceptResult) -> Table:
    headers = ["criterion", "figure", "result"]
    rows = [[c.name, c.figure, "PASS" if c.passed else "FAIL"] for c in result.verdict.criteria]
    return headers, rows


def verdict_lines(result: AcceptResult) -> list[str]:
    """The decision in words: what it rests on, what would resolve it, what to watch."""
    v, spec = result.verdict, result.spec
    card = result.card  # a token-budget candidate is named by its budget, not a plan it did not use
    scaling = f", scaling {card.accum.scaling}" if "post" in spec.scalings else ""
    lines = [f"{v.decision}: the run card records {card.label()} ({card.equation()}){scaling}."]
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
        markdown_table(quality_table(quality)),
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
        markdown_table(verdict_rows(result)),
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
        markdown_table(time_rows([result.baseline, result.candidate])),
        "",
        *phase_lines([result.baseline, result.candidate]),
        "",
        markdown_table(memory_rows([result.baseline, result.candidate])),
        "",
        *memory_lines(result.memory_model, "no memory figures", result.budget_advice),
        "",
        markdown_table(comm_rows([result.baseline, result.candidate], result.comm)),
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
