"""A checkpoint resumes on another layout and ends where the uninterrupted run ends.

``gradaccum train`` of the bundled default workload (float64, global batch 12, seed 3, a constant
schedule, a checkpoint every 2 steps), as real gloo processes run it under torchrun: a 2-process run
cut at step 4 resumes on 1 process, on 3, on 2 with another micro-batch, and from FSDP2 onto 1
process; a 1-process checkpoint goes back onto FSDP2 on 3 processes. Each run of 8 steps ends on
the uninterrupted 2-process run.

All runs share one module fixture: one 2-process launch, the 1-process resumes in the test's own
process, one 3-process launch (each launch costs seconds of start-up on a shared machine).

Tolerance: every layout draws the same 12 examples per window and the accumulation is exact, so
layouts differ only in the order float64 sums are taken (per micro-batch, per rank, then across
ranks): ~1e-16 relative per gradient. Eight AdamW steps of the tiny GPT carry that to ~1e-13
(uninterrupted runs on 1, 2 and 3 processes end within 1e-12 of each other), so 1e-10 passes every
reordering and fails any real error (a replayed or skipped window, a lost optimizer moment, a
wrong denominator: each moves the parameters by ~1e-3).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaccum.cli.main import main
from tests.helpers.launcher import run_ranks, values

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

FLAGS = [
    "train",
    "--precision",
    "float64",
    "--global-batch",
    "12",
    "--seed",
    "3",
    "--schedule",
    "constant",
    "--warmup",
    "1",  # the same warmup for the 4-step cut and the 8-step runs (by default it follows --steps)
    "--checkpoint-every",
    "2",
    "--threads",
    "1",
]
TOL = 1e-10  # float64 max abs parameter difference after 8 steps (module docstring)


def _train(root: Path, name: str, steps: int, *flags: str, resume: str | None = None) -> int:
    more = ["--resume", str(root / resume)] if resume else []
    return int(main([*FLAGS, *flags, "--steps", str(steps), "--run-dir", str(root / name), *more]))


def _on_two(rank: int, world: int, tmp: str) -> list[int]:
    root = Path(tmp)
    return [
        _train(root, "reference", 8, "--micro-batch", "3"),
        _train(root, "cut", 4, "--micro-batch", "3"),
        _train(root, "cut-fsdp", 4, "--micro-batch", "3", "--fsdp"),
        # 2 processes again, micro-batch 2 x 3 accumulation steps where the checkpoint had 3 x 2
        _train(root, "micro2", 8, "--micro-batch", "2", resume="cut/checkpoints/step-00000004"),
    ]


def _on_three(rank: int, world: int, tmp: str) -> list[int]:
    root = Path(tmp)
    return [
        _train(root, "on3", 8, "--micro-batch", "2", resume="cut/checkpoints/step-00000004"),
        # back onto FSDP2: the 1-process run's checkpoint after 6 steps, resharded over 3 processes
        _train(root, "back-fsdp", 8, "--micro-batch", "4", "--fsdp", resume="on1/checkpoints/step-00000006"),
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("layouts")
    codes = values(run_ranks(_on_two, str(root), world=2, timeout_s=300))
    assert codes == [[0] * 4] * 2
    # one process, in this one: the DDP cut and the FSDP2 cut, at micro-batch 6 x 2 steps
    assert _train(root, "on1", 8, "--micro-batch", "6", resume="cut/checkpoints/step-00000004") == 0
    assert _train(root, "fsdp-on1", 8, "--micro-batch", "6", resume="cut-fsdp/checkpoints/step-00000004") == 0
    codes = values(run_ranks(_on_three, str(root), world=3, timeout_s=300))
    assert codes == [[0] * 2] * 3
    return root


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / "checkpoints" / "step-00000008" / "state.pt", weights_only=True)
    return dict(state["model"])


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("name", ["on1", "on3", "micro2", "fsdp-on1", "back-fsdp"])
def test_a_resume_on_another_layout_ends_on_the_uninterrupted_run(runs: Path, name: str) -> None:
    err = _max_abs_diff(_final(runs / name), _final(runs / "reference"))
    assert err <= TOL, f"{name}: max abs parameter difference {err:.2e} after 8 steps"


def test_the_run_card_records_the_resume_and_both_layouts(runs: Path) -> None:
    card = json.loads((runs / "fsdp-on1" / "runcard.json").read_text())
    train: dict[str, Any] = card["extra"]["train"]
    (resume,) = train["resumes"]
    assert resume["from"] == str(runs / "cut-fsdp" / "checkpoints" / "step-00000004")
    assert (resume["window"], resume["step"], resume["rows"]) == (4, 4, 48)  # 4 windows of 12 rows
    assert resume["written_on"] == {
        "world": 2,
        "micro_batch": 3,
        "accum_steps": 2,
        "max_tokens": None,
        "fsdp": True,
    }
    assert resume["resumed_on"] == train["layout"]
    assert train["layout"] == {
        "world": 1,
        "micro_batch": 6,
        "accum_steps": 2,
        "max_tokens": None,
        "fsdp": False,
    }
    # a resume of a resumed run keeps the history: on1's resume, then back-fsdp's
    history = json.loads((runs / "back-fsdp" / "runcard.json").read_text())["extra"]["train"]["resumes"]
    assert [(r["window"], r["written_on"]["world"], r["resumed_on"]["world"]) for r in history] == [
        (4, 2, 1),
        (6, 1, 3),
    ]
    assert history[1]["resumed_on"]["fsdp"] is True
