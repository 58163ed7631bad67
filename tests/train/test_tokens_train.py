"""Training by a token budget on two real gloo processes (DDP, and FSDP2 with equal counts) gives
the one-process run with fixed micro-batches on the same global batch.

Both runs draw the same windows (window w is ``make_batch(16, seed)`` whatever the plan), so only
the grouping into micro-batches and ranks differs, which the exact step does not see. Tolerances as
in tests/train/test_distributed.py (float64, AdamW): 1e-11 relative on parameters, 1e-12 on losses.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaccum.plan import BatchPlan
from gradaccum.runcard import read_runcard
from gradaccum.tokens.split import split_by_tokens
from gradaccum.train import train
from gradaccum.train.data import train_seed
from tests.helpers.launcher import run_ranks, values
from tests.helpers.reference import max_rel_err
from tests.train.common import config, final_params, gpt, one_thread

pytestmark = pytest.mark.distributed

STEPS = 4
BUDGET = 96  # the tiny GPT's rows hold 4..32 tokens: 3 to 24 rows per micro-batch


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"kind": "step"' in line]


def _ranks(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    window = BatchPlan(micro_batch=8, accum_steps=1, dp=2)  # 16 rows a window, cut by tokens
    for name, fsdp in (("ddp", False), ("fsdp", True)):
        run = dataclasses.replace(
            config(Path(tmp) / name, dp=2, steps=STEPS, fsdp=fsdp), plan=window, max_tokens=BUDGET
        )
        out[name] = final_params(train(run))
    return out


def test_token_budget_training_on_two_ranks_matches_one_process(tmp_path: Path) -> None:
    r0, r1 = values(run_ranks(_ranks, str(tmp_path), timeout_s=300))
    with one_thread():
        want = final_params(train(config(tmp_path / "one", steps=STEPS)))  # 4 rows x 4 micro-batches
    reference = torch.tensor([s["loss"] for s in _steps(tmp_path / "one")])
    for name in ("ddp", "fsdp"):
        assert all(torch.equal(r0[name][k], r1[name][k]) for k in r0[name]), name
        assert max_rel_err(r0[name], want) < 1e-11, name
        steps = _steps(tmp_path / name)
        losses = torch.tensor([s["loss"] for s in steps])
        assert max_rel_err({"loss": losses}, {"loss": reference}) < 1e-12, name
        # rank 0's micro-batches per window: split_by_tokens of that window, equal counts under FSDP2
        counts = [
            len(split_by_tokens(gpt().make_batch(16, train_seed(0, w)), BUDGET, world=2, equal_count=fsdp))
            for w, fsdp in ((w, name == "fsdp") for w in range(STEPS))
        ]
        assert [s["accum_steps"] for s in steps] == counts, name
        assert read_runcard(tmp_path / name / "runcard.json").max_tokens == BUDGET
