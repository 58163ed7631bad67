"""``exact_trainer(trl.GRPOTrainer)`` and ``exact_trainer(trl.DPOTrainer)`` on two gloo processes:
each rank generates its own completions (uneven token counts), the update's count is summed over
the ranks before its first backward, and DDP's average gives the full-batch update of both ranks'
rows. Tolerance 1e-6 as in test_trl.py (TRL's float32 log-prob head; measured ~2e-7)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from gradaccum.integrations.trl import policy_batch
from gradaccum.rl import PolicyLoss, PreferenceLoss
from tests.helpers.launcher import run_ranks, values
from tests.integrations.common import distributed_env
from tests.rl import common, trl_common

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "old_per_token_logps")


def _ranks(rank: int, world: int, out: str) -> dict[str, Any]:
    import warnings

    from trl import DPOTrainer, GRPOTrainer

    from gradaccum.integrations.trl import exact_trainer

    warnings.simplefilter("ignore", FutureWarning)
    distributed_env(rank, world)
    trainer, updates = trl_common.grpo(exact_trainer(GRPOTrainer), Path(out) / f"grpo-{rank}", "dapo")
    slices = [{k: s[k] for k in KEYS if k in s} for s in trainer._buffered_inputs]
    dpo, dpo_updates = trl_common.dpo(
        exact_trainer(DPOTrainer),
        Path(out) / f"dpo-{rank}",
        pairs=trl_common.PAIRS_8,
        per_device=2,
        precompute=False,
    )
    return {
        "grads": updates.grads,
        "starts": updates.starts,
        "slices": slices,
        "world": trainer.args.world_size,
        "dpo grads": dpo_updates.grads,
        "dpo start": dpo_updates.starts,
        "dpo pairs": trl_common.pairs_batch(dpo, trl_common.model(trl_common.tokenizer())),
    }


def test_exact_grpo_and_dpo_under_two_process_ddp(tmp_path: Path) -> None:
    r0, r1 = values(run_ranks(_ranks, str(tmp_path), timeout_s=400))
    assert r0["world"] == r1["world"] == 2
    k = trl_common.K
    tokens = []
    for update in range(trl_common.UPDATES):
        parts = [s for r in (r0, r1) for s in r["slices"][update * k : (update + 1) * k]]
        rows = policy_batch({key: torch.cat([s[key] for s in parts]) for key in KEYS if key in parts[0]})
        tokens.append(
            [
                int(sum(s["completion_mask"].sum() for s in r["slices"][update * k : (update + 1) * k]))
                for r in (r0, r1)
            ]
        )
        model = trl_common.model(trl_common.tokenizer())
        model.load_state_dict(r0["starts"][update])
        loss = PolicyLoss("token-mean")
        (loss.loss_fn(model, rows) / loss.count_fn(rows)).backward()
        want = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()}
        for r in (r0, r1):
            assert common.rel_err(r["grads"][update], want) < 1e-6, update
    assert any(a != b for a, b in tokens), tokens  # the ranks' counts differ
    # DPO: 8 pairs, 2 micro-batches of 2 on each rank; the update is the mean over all of them
    model = trl_common.model(trl_common.tokenizer())
    model.load_state_dict(r0["dpo start"][0])
    trainer_rows = r0["dpo pairs"]
    loss = PreferenceLoss("dpo", beta=0.5)
    (loss.loss_fn(model, trainer_rows) / loss.count_fn(trainer_rows)).backward()
    want = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()}
    for r in (r0, r1):
        assert common.rel_err(r["dpo grads"][0], want) < 1e-6
