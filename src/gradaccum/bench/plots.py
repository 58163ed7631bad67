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


def _throughput(ax: Any, configs: Sequence[ConfigSummary]) -> None:
    done = [c for c in configs if c.ok and c.units_per_s is not None]
    failed = [c for c in configs if not c.ok]
    if done:
        xs = [c.spec.micro_batch for c in done]
        med = [c.units_per_s.median for c in done if c.units_per_s]
        low = [c.units_per_s.median - c.units_per_s.low for c in done if c.units_per_s]
        high = [c.units_per_s.high - c.units_per_s.median for c in done if c.units_per_s]
        ax.errorbar(xs, med, yerr=[low, high], marker="o", capsize=4, label="median (min..max of runs)")
        for c, y in zip(done, med, strict=True):
            ax.annotate(c.spec.label, (c.spec.micro_batch, y), textcoords="offset points", xytext=(4, 4))
    for c in failed:
        ax.axvline(c.spec.micro_batch, color="tab:red", linestyle=":", label=f"{c.spec.label}: {c.status}")
    unit = configs[0].unit if configs else "tokens"
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batch (examples per forward, per replica)")
    ax.set_ylabel(f"valid {unit} / s")
    ax.legend(loc="best", fontsize="small")
    ax.grid(True, alpha=0.3)


def plot_sweep(result: SweepResult, folder: str | Path) -> list[Path]:
    """``throughput.png`` and ``memory.png`` against micro-batch; returns the files written."""
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
    done = [c for c in configs if c.ok and c.peak_memory_bytes is not None]
    kind = done[0].peak_memory_kind if done else "peak memory"
    if done:
        xs = [c.spec.micro_batch for c in done]
        ax.plot(xs, [(c.peak_memory_bytes or 0) / MIB for c in done], "o", label=f"measured: {kind}")
        reserved = [c for c in done if c.peak_reserved_bytes is not None]
        if reserved:
            ax.plot(
                [c.spec.micro_batch for c in reserved],
                [(c.peak_reserved_bytes or 0) / MIB for c in reserved],
                "s",
                label="measured: CUDA max_memory_reserved per update",
            )
    model = result.memory_model
    if model is not None:
        top = max([c.spec.micro_batch for c in configs] + [result.largest_fitting_micro_batch or 0])
        xs_line = [1, top]
        ax.plot(
            xs_line,
            [model.predict(x) / MIB for x in xs_line],
            "--",
            label=f"model: {model.persistent_bytes / MIB:.1f} MiB + "
            f"{model.per_example_bytes / MIB:.3f} MiB x micro",
        )
    if result.spec.memory_budget_bytes is not None:
        ax.axhline(result.spec.memory_budget_bytes / MIB, color="tab:red", linestyle=":", label="budget")
    ax.set_xlabel("micro-batch (examples per forward, per replica)")
    ax.set_ylabel("MiB")
    ax.set_title(f"peak memory at global batch {gb}")
    ax.legend(loc="best", fontsize="small")
    ax.grid(True, alpha=0.3)
    paths.append(out / "memory.png")
    fig.savefig(paths[1], dpi=120)
    return paths


def plot_accept(result: AcceptResult, folder: str | Path) -> list[Path]:
    """``throughput.png`` (each run, in the order run, with medians) and ``memory.png``."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    arms = (("baseline", result.baseline), ("candidate", result.candidate))

    fig = _figure()
    ax = fig.subplots()
    for arm, (name, summary) in enumerate(arms):
        # runs alternate baseline, candidate, baseline, ...
        runs = [(i + 1, r.measurement) for i, r in enumerate(result.records) if i % 2 == arm]
        xs = [i for i, m in runs if m is not None]
        ys = [m.units_per_s for _, m in runs if m is not None]
        line = ax.plot(xs, ys, "o", label=f"{name} {summary.spec.label}")[0]
        if summary.units_per_s is not None:
            ax.axhline(summary.units_per_s.median, color=line.get_color(), linestyle="--", alpha=0.7)
    gain = result.verdict.throughput_gain
    title = "throughput per run (interleaved); dashed: medians"
    if gain is not None:
        title += f"\ngain {gain:+.1%}, margin {result.verdict.margin:.1%}: {result.verdict.decision}"
    ax.set_title(title)
    ax.set_xlabel("run (in the order run)")
    ax.set_ylabel(f"valid {result.baseline.unit} / s")
    ax.legend(loc="best", fontsize="small")
    ax.grid(True, alpha=0.3)
    paths = [out / "throughput.png"]
    fig.savefig(paths[0], dpi=120)

    fig = _figure()
    ax = fig.subplots()
    names = [f"{name}\n{s.spec.label}" for name, s in arms]
    peaks = [(s.peak_memory_bytes or 0) / MIB for _, s in arms]
    ax.bar(names, peaks, color=["tab:blue", "tab:orange"])
    ax.set_ylabel(f"MiB ({result.baseline.peak_memory_kind})")
    ax.set_title("peak memory (median of runs)")
    paths.append(out / "memory.png")
    fig.savefig(paths[1], dpi=120)
    return paths
