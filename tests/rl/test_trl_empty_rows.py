"""``ExactGRPOTrainer`` with a response-less row reproduces TRL's own full-batch objective.

A GRPO run of two updates (4 rows each, k = 2 micro-batches of 2) where one completion of the
generation batch is masked out entirely, as ``mask_truncated_completions`` or a tool mask leave it.
TRL 1.16's dr_grpo divides by rows x max_completion_length and grpo by rows (``.mean()``), every
row counted; the reference is TRL's own ``_compute_loss`` over the update's rows as one micro-batch
(k = 1), with float64 log-probs. The training ran TRL's fused head, whose log-probs are float32:
measured ~2e-7 relative (as tests/rl/test_trl.py), asserted below 1e-6; counting only the rows
with a completion token makes the update with the empty row 4/3 of it (an error of 0.33).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from trl import GRPOTrainer

from gradaccum.integrations.trl import _Float64Head, _keys, exact_trainer
from tests.rl import common, trl_common

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

TRL_TOL = 1e-6
EMPTIED = 3  # the generation batch's row whose completion is masked out


class _OneEmptyCompletion(exact_trainer(GRPOTrainer)):  # type: ignore[misc]
    def _generate_and_score_completions(self, inputs: Any) -> Any:
        out = super()._generate_and_score_completions(inputs)
        out["completion_mask"][EMPTIED] = 0
        return out


def _trl_full_batch_grads(trainer: Any, updates: Any, update: int) -> dict[str, torch.Tensor]:
    """TRL's own loss over the update's rows in one micro-batch, from the update's start weights."""
    slices = trainer._buffered_inputs[update * trl_common.K : (update + 1) * trl_common.K]
    batch = {key: torch.cat([s[key] for s in slices]) for key in _keys(slices[0])}
    model = _Float64Head(trl_common.start_model(updates, update), float(trainer.args.temperature))
    saved = trainer.current_gradient_accumulation_steps
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    try:
        GRPOTrainer._compute_loss(trainer, model, batch).backward()
    finally:
        trainer.current_gradient_accumulation_steps = saved
    return {
        n.removeprefix("model."): torch.zeros_like(p) if p.grad is None else p.grad
        for n, p in model.named_parameters()
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("grpo-empty")
    return {loss: trl_common.grpo(_OneEmptyCompletion, out, loss) for loss in ("dr_grpo", "grpo")}


@pytest.mark.parametrize("loss_type", ["dr_grpo", "grpo"])
def test_a_response_less_row_counts_as_trl_counts_it(runs: dict[str, Any], loss_type: str) -> None:
    trainer, updates = runs[loss_type]
    empty = [
        u
        for u in range(trl_common.UPDATES)
        for s in trainer._buffered_inputs[u * trl_common.K : (u + 1) * trl_common.K]
        if not s["completion_mask"].any(dim=1).all()
    ]
    assert len(empty) == 1  # one update holds the response-less row: it is the one that can fail
    for update in range(trl_common.UPDATES):
        want = _trl_full_batch_grads(trainer, updates, update)
        err = common.rel_err(updates.grads[update], want)
        assert err < TRL_TOL, (loss_type, update, err)
