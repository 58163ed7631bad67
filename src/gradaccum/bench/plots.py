"""PNG plots of a sweep or an acceptance run (matplotlib, Agg; imported only when plotting).

Figures are built with ``matplotlib.figure.Figure`` directly, not ``pyplot``, so no global backend
or figure registry is touched and nothing needs a display.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradaccum.bench.stats import ConfigSummary

if TYPE_CHECKING:
    from gradaccum.bench.accept import AcceptResult
    from gradaccum.bench.sweep import SweepResult

__all__ = ["plot_accept", "plot_sweep"]

MIB = 1024**2


def _figure() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    return Figure(figsize=(6.4, 4.0), layout="constrained")


def _kind(c: ConfigSummary) -> str:
    """What a row changes besides the factorization: one plotted series per kind."""
    parts = c.spec.row_label.split(" ")[1:]
    return " ".join(parts) if parts else "plain"


def _throughput(ax: Any, configs: Sequence[ConfigSummary]) -> None:
    """Every row: fixed micro-batches against the micro-batch; a token budget's rows, which have no
    fixed micro-batch, as a horizontal line at their median across the plot with the runs' band."""
    done = [c for c in configs if c.ok and c.units_per_s is not None and c.spec.max_tokens is None]
    failed = [c for c in configs if not c.ok and c.spec.max_tokens is None]
    _budget_rows(ax, [c for c in configs if c.spec.max_tokens is not None])
    kinds = list(dict.fromkeys(_kind(c) for c in done))
    for kind in kinds:
        series = sorted((c for c in done if _kind(c) == kind), key=lambda c: c.spec.micro_batch)
        xs = [c.spec.micro_batch for c in series]
        med = [c.units_per_s.median for c in series if c.units_per_s]
        low = [c.units_per_s.median - c.units_per_s.low for c in series if c.units_per_s]
        high = [c.units_per_s.high - c.units_per_s.median for c in series if c.units_per_s]
        name = "median (min..max of runs)" if kinds == ["plain"] else f"{kind}: median (min..max)"
        ax.errorbar(xs, med, yerr=[low, high], marker="o", capsize=4, label=name)
        for c, y in zip(series, med, strict=True):
            ax.annotate(c.spec.label, (c.spec.micro_batch, y), textcoords="offset points", xytext=(4, 4))
    for c in failed:
        ax.axvline(
            c.spec.micro_batch, color="tab:red", linestyle=":", label=f"{c.spec.row_label}: {c.status}"
        )
    unit = configs[0].unit if configs else "tokens"
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batch (examples per forward, per replica)")
    ax.set_ylabel(f"valid {unit} / s")
    ax.legend(loc="best", fontsize="small")
    ax.grid(True, alpha=0.3)


def _budget_rows(ax: Any, budgets: Sequence[ConfigSummary]) -> None:
    """Token-budget rows: a dashed line at the median (a band from the slowest to the fastest run),
    or, for a row that did not finish, its status in the legend."""
    for c in budgets:
        spread = c.units_per_s
        if not c.ok or spread is None:
            ax.plot([], [], color="tab:red", linestyle=":", label=f"{c.spec.row_label}: {c.status}")
            continue
        line = ax.axhline(
            spread.median, linestyle="--", label=f"{c.spec.row_label} (a token budget): median (min..max)"
        )
        ax.axhspan(spread.low, spread.high, color=line.get_color(), alpha=0.15)


def _memory_bars(ax: Any, labels: list[str], configs: Sequence[ConfigSummary], budget: int | None) -> None:
    """Stacked persistent + activation bars from zero, each segment's value written on it; a
    configuration whose memory was not measured (its probe failed) gets no bar, only the words."""
    xs = list(range(len(configs)))
    measured = [(x, c.memory) for x, c in zip(xs, configs, strict=True) if c.memory is not None]
    mx = [x for x, _ in measured]
    persistent = [m.persistent_bytes / MIB for _, m in measured]
    activation = [m.activation_bytes / MIB for _, m in measured]
    ax.bar(mx, persistent, color="tab:blue", label="persistent: parameters + gradients + optimizer state")
    ax.bar(
        mx,
        activation,
        bottom=persistent,
        color="tab:orange",
        label="activations: saved for backward (+ recomputed block), one micro-batch",
    )
    top = max([p + a for p, a in zip(persistent, activation, strict=True)] + [0.0])
    for x, p, a in zip(mx, persistent, activation, strict=True):
        ax.text(x, p / 2, f"{p:.2f}", ha="center", va="center", fontsize="small")
        ax.text(x, p + a / 2, f"{a:.2f}", ha="center", va="center", fontsize="small")
    for x, c in zip(xs, configs, strict=True):
        if c.memory is None:
            why = c.status if not c.ok else "probe failed"
            ax.text(
                x, 0, f"not measured\n({why})", ha="center", va="bottom", fontsize="small", color="tab:red"
            )
    cuda = [(x, m.max_allocated_bytes) for x, m in measured if m.max_allocated_bytes is not None]
    if cuda:
        ys = [b / MIB for _, b in cuda]
        ax.plot([x for x, _ in cuda], ys, "k_", markersize=30, label="CUDA max_memory_allocated per update")
        top = max([top, *ys])
    if budget is not None:
        ax.axhline(budget / MIB, color="tab:red", linestyle=":", label="budget")
        top = max(top, budget / MIB)
    ax.set_xticks(xs, labels)
    ax.set_ylim(0, top * 1.25 if top > 0 else 1)
    ax.set_ylabel("MiB (from the tensors)")
    ax.legend(loc="upper left", fontsize="small")
    ax.grid(True, axis="y", alpha=0.3)


def plot_sweep(result: SweepResult, folder: str | Path) -> list[Path]:
    """``throughput.png`` against micro-batch and ``memory.png`` (stacked bars); returns the files."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    configs = result.configs
    gb = result.spec.global_batch

    fig = _figure()
    ax = fig.subplots()
    _throughput(ax, configs)
    ax.set_title(f"throughput at global batch {gb}")
    paths = [out / "throughput.png"]
    fig.savefig(paths[0], dpi=120)

    fig = _figure()
    ax = fig.subplots()
    done = [c for c in configs if c.ok]
    _memory_bars(ax, [c.spec.row_label for c in done], done, result.spec.memory_budget_bytes)
    ax.set_title(f"memory per configuration at global batch {gb}")
    paths.append(out / "memory.png")
    fig.savefig(paths[1], dpi=120)
    return paths


def plot_accept(result: AcceptResult, folder: str | Path) -> list[Path]:
    """``throughput.png`` (every paired ratio by run, the median and its interval, the margin) and
    ``memory.png`` (stacked persistent + activation bars of both configurations)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    v = result.verdict

    fig = _figure()
    ax = fig.subplots()
    x = 0
    for r in result.records:
        gains = [100 * (g - 1) for g in r.ratios]
        ax.plot(range(x, x + len(gains)), gains, "o", label=f"run {r.run_index + 1}")
        x += len(gains)
    if v.throughput_gain is not None:
        ax.axhline(
            100 * v.throughput_gain,
            color="black",
            linestyle="--",
            label=f"gain {v.throughput_gain:+.1%} (centre of the interval)",
        )
    if v.interval is not None:
        ax.axhspan(100 * v.interval[0], 100 * v.interval[1], color="grey", alpha=0.2, label="95% interval")
    ax.axhline(100 * v.margin, color="tab:green", linestyle=":", label=f"margin {v.margin:.1%}")
    ax.axhline(0, color="tab:red", linewidth=0.8)
    labels = f"candidate {result.spec.label_of('candidate')} over baseline {result.spec.label_of('baseline')}"
    ax.set_title(f"{labels}, per block pair: {v.decision}")
    ax.set_xlabel("block pair (in the order run)")
    ax.set_ylabel("throughput gain, %")
    ax.legend(loc="best", fontsize="small")
    ax.grid(True, alpha=0.3)
    paths = [out / "throughput.png"]
    fig.savefig(paths[0], dpi=120)

    fig = _figure()
    ax = fig.subplots()
    arms = [result.baseline, result.candidate]
    _memory_bars(
        ax,
        [f"baseline {result.spec.label_of('baseline')}", f"candidate {result.spec.label_of('candidate')}"],
        arms,
        result.spec.memory_budget_bytes,
    )
    ax.set_title("memory per configuration\nactivations follow the micro-batch; the persistent term stays")
    paths.append(out / "memory.png")
    fig.savefig(paths[1], dpi=120)
    return paths
