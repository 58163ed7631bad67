"""The run folder: ``results.json`` (written atomically), ``report.md``, the plots, and for
``accept`` the ``runcard.json`` that lets the verified configuration be reproduced elsewhere."""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

from gradaccum.atomic import atomic_write_text
from gradaccum.bench.accept import AcceptResult
from gradaccum.bench.plots import plot_accept, plot_sweep
from gradaccum.bench.report import accept_markdown, sweep_markdown
from gradaccum.bench.sweep import SweepResult
from gradaccum.runcard import write_runcard

__all__ = ["new_run_folder", "write_accept_folder", "write_sweep_folder"]


def new_run_folder(root: str | Path, kind: str, *, now: datetime | None = None) -> Path:
    """A fresh folder ``root/KIND-YYYYmmdd-HHMMSS`` (with a suffix if that one exists)."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    base = Path(root) / f"{kind}-{stamp}"
    folder, n = base, 1
    while folder.exists():
        n += 1
        folder = base.with_name(f"{base.name}-{n}")
    folder.mkdir(parents=True)
    return folder


def _finite(obj: Any) -> Any:
    """JSON has no inf/NaN: write them as strings rather than emit invalid JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(_finite(data), indent=2, allow_nan=False) + "\n")


def write_sweep_folder(result: SweepResult, folder: str | Path) -> list[Path]:
    """``results.json``, ``report.md``, ``throughput.png``, ``memory.png``, and with a memory budget
    that a measured row fits, ``runcard.json`` of the advised row; returns the paths."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "results.json", result.to_dict())
    atomic_write_text(out / "report.md", sweep_markdown(result))
    written = [out / "results.json", out / "report.md"]
    if result.card is not None:
        write_runcard(result.card, out / "runcard.json")
        written.append(out / "runcard.json")
    return [*written, *plot_sweep(result, out)]


def write_accept_folder(result: AcceptResult, folder: str | Path) -> list[Path]:
    """``results.json``, ``report.md``, ``runcard.json``, ``throughput.png``, ``memory.png``."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "results.json", result.to_dict())
    write_runcard(result.card, out / "runcard.json")
    atomic_write_text(out / "report.md", accept_markdown(result))
    return [out / "results.json", out / "runcard.json", out / "report.md", *plot_accept(result, out)]
