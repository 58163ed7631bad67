"""Shared pieces of the training tests: small configs, instrumented workloads, final parameters."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaccum.check.workload import Workload
from gradaccum.cli.main import main
from gradaccum.examples import tiny_gpt
from gradaccum.plan import BatchPlan
from gradaccum.runcard import RunCard, write_runcard
from gradaccum.step.accumulator import Accumulator
from gradaccum.step.config import AccumConfig
from gradaccum.train import TrainConfig, TrainResult
from gradaccum.train.schedule import ScheduleConfig


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread: tiny models on a shared 2-core machine only lose from more."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def config(
    run_dir: Path, *, global_batch: int = 16, micro_batch: int = 4, dp: int = 1, **kw: Any
) -> TrainConfig:
    """A float64 run of the tiny GPT: 8 windows of 16 sequences, AdamW with warmup + cosine."""
    plan = BatchPlan.solve(global_batch=global_batch, micro_batch=micro_batch, dp=dp)
    defaults: dict[str, Any] = {
        "steps": 8,
        "precision": "float64",
        "lr": 1e-2,
        "schedule": ScheduleConfig(warmup=2),
    }
    defaults.update(kw)
    return TrainConfig(plan=plan, run_dir=run_dir, **defaults)


def on_loss_call(workload: Workload, call: int, action: Callable[[], None]) -> Workload:
    """``workload`` whose ``loss_fn`` runs ``action`` just before its ``call``-th call (0-based).

    With ``accum_steps`` micro-batches per window, call ``w * accum_steps + j`` is micro-batch ``j``
    of window ``w``: a signal or a crash arriving mid-window.
    """
    calls = [0]
    inner = workload.loss_fn

    def loss_fn(model: torch.nn.Module, micro_batch: Any) -> torch.Tensor:
        if calls[0] == call:
            action()
        calls[0] += 1
        return inner(model, micro_batch)

    return dataclasses.replace(workload, loss_fn=loss_fn)


def overflow_at(workload: Workload, windows: set[int], accum_steps: int, factor: float = 1e36) -> Workload:
    """``workload`` whose loss is multiplied by ``factor`` in the given windows' first micro-batch.

    1e36 times a GradScaler scale of 2**16 exceeds float32's 3.4e38: a genuine overflow.
    """
    calls = [0]
    inner = workload.loss_fn

    def loss_fn(model: torch.nn.Module, micro_batch: Any) -> torch.Tensor:
        window, micro = divmod(calls[0], accum_steps)
        calls[0] += 1
        loss = inner(model, micro_batch)
        return loss * factor if (window in windows and micro == 0) else loss

    return dataclasses.replace(workload, loss_fn=loss_fn)


def gpt() -> Workload:
    return tiny_gpt()


def final_params(result: TrainResult) -> dict[str, torch.Tensor]:
    """The model a run ended with, as its last checkpoint holds it (rank 0 writes the full state)."""
    state = torch.load(result.checkpoints[-1] / "state.pt", map_location="cpu", weights_only=True)
    return state["model"]


def train_from_runcard(
    card: Path, run_dir: Path, monkeypatch: pytest.MonkeyPatch, steps: int = 2
) -> list[Accumulator]:
    """``gradaccum train --runcard card`` for ``steps`` steps; the accumulators it built, to read
    their configs (what the card fixed must reach the step, not only the records)."""
    built: list[Accumulator] = []
    from_config = Accumulator.from_config

    def spy(*args: Any, **kwargs: Any) -> Accumulator:
        built.append(from_config(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(Accumulator, "from_config", spy)
    assert main(["train", "--runcard", str(card), "--steps", str(steps), "--run-dir", str(run_dir)]) == 0
    return built


def train_from_accum_card(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    workload: str,
    plan: BatchPlan,
    accum: AccumConfig,
    steps: int = 2,
) -> tuple[Path, list[Accumulator], dict[str, Any]]:
    """A run card of ``workload`` at ``plan`` with the settings ``accum``, trained from
    (:func:`train_from_runcard`, into ``tmp_path / "run"``): the card, the accumulators train built,
    and the ``accum`` settings of the run card train wrote."""
    card = tmp_path / "card.json"
    write_runcard(RunCard(workload=workload, plan=plan, accum=accum), card)
    built = train_from_runcard(card, tmp_path / "run", monkeypatch, steps=steps)
    trained = json.loads((tmp_path / "run" / "runcard.json").read_text())
    return card, built, trained["accum"]
