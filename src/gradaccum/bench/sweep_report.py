"""The Markdown report of a sweep (``bench``): its settings, the tables of every configuration, the
memory model and advice, and the sections of checkpointed, compiled and FSDP2 rows."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gradaccum.bench.stats import ConfigSummary
from gradaccum.bench.sweep import SweepResult
from gradaccum.bench.tables import (
    Table,
    comm_rows,
    fmt_bytes,
    markdown_table,
    memory_lines,
    memory_rows,
    phase_lines,
    straggler_lines,
    time_rows,
)

__all__ = [
    "checkpointing_lines",
    "compile_lines",
    "fsdp2_rows",
    "memory_predictions",
    "sweep_markdown",
]


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
        markdown_table(time_rows(result.configs)),
        "",
        *phase_lines(result.configs),
        *straggler_lines(result.configs),
        "",
        markdown_table(memory_rows(result.configs, predictions)),
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
            markdown_table(fsdp2_rows(result.configs)),
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
    lines += ["", markdown_table(comm_rows(result.configs, result.comm)), ""]
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
