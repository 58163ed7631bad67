"""TRL's GRPOTrainer and DPOTrainer made exact: each update against a full-batch reference on the
same rollout, with TRL's plain trainer on the same rollout as the control.

Tolerances. TRL's fused LM head computes log-probs in float32 even for a float64 model, so a TRL
update matches the float64 reference (``gradaccum.rl.PolicyLoss``/``PreferenceLoss``, independent
of TRL) to float32 rounding: measured 1.8e-7..2.4e-7 relative, asserted below 1e-6.
``verify_accumulation`` runs TRL's own loss with float64 log-probs: ~1e-16, its tolerance 1e-10.
The controls are off by 4e-2 (dapo: each update divided by the generation batch's average count)
and more (bnpo, DPO: means of micro-batch means).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from trl import DPOTrainer, GRPOTrainer

from gradaccum.errors import ConfigError
from gradaccum.integrations.trl import ExactGRPOConfig, exact_trainer
from gradaccum.rl import PolicyLoss, PreferenceLoss
from tests.rl import common, trl_common

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

TRL_TOL = 1e-6
ExactGRPO = exact_trainer(GRPOTrainer)


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("grpo")
    return {
        "exact": trl_common.grpo(ExactGRPO, out, "dapo"),
        "plain": trl_common.grpo(GRPOTrainer, out, "dapo"),
        "generation": trl_common.grpo(ExactGRPO, out, "dapo", exact=ExactGRPOConfig(normalize="generation")),
        "bnpo": trl_common.grpo(ExactGRPO, out, "bnpo"),
    }


def _reference(run: Any, update: int, aggregation: str = "token-mean") -> dict[str, torch.Tensor]:
    trainer, updates = run
    rows = trl_common.update_rows(trainer, update)
    model = trl_common.start_model(updates, update)
    loss = PolicyLoss(aggregation, clip_eps=trainer.epsilon_low)  # type: ignore[arg-type]
    (loss.loss_fn(model, rows) / loss.count_fn(rows)).backward()
    return {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["exact", "bnpo"])
def test_each_grpo_update_equals_its_own_full_batch_reference(grpo_runs: dict, name: str) -> None:
    trainer, updates = grpo_runs[name]
    assert trainer.exact_aggregation == "token-mean"
    for update in range(trl_common.UPDATES):
        err = common.rel_err(updates.grads[update], _reference(grpo_runs[name], update))
        assert err < TRL_TOL, (name, update, err)


def test_plain_dapo_differs_by_the_generation_batch_factor(grpo_runs: dict) -> None:
    exact, plain = grpo_runs["exact"][0], grpo_runs["plain"][0]
    for a, b in zip(exact._buffered_inputs, plain._buffered_inputs, strict=True):
        assert torch.equal(a["completion_ids"], b["completion_ids"])  # the same rollout
    tokens = [int(trl_common.update_rows(exact, u)["response_mask"].sum()) for u in range(trl_common.UPDATES)]
    factors = [n * trl_common.UPDATES / sum(tokens) for n in tokens]
    assert max(abs(f - 1) for f in factors) > 1e-2, tokens  # uneven updates: the control can fail
    for update, factor in enumerate(factors):
        want = {n: factor * g for n, g in _reference(grpo_runs["plain"], update).items()}
        assert common.rel_err(grpo_runs["plain"][1].grads[update], want) < TRL_TOL, update
    assert common.rel_err(grpo_runs["plain"][1].grads[0], _reference(grpo_runs["plain"], 0)) > 1e-2


def test_generation_normalization_is_what_trl_dapo_computes(grpo_runs: dict) -> None:
    got, want = grpo_runs["generation"][1], grpo_runs["plain"][1]
    for update in range(trl_common.UPDATES):
        assert common.rel_err(got.grads[update], want.grads[update]) < 1e-12, update


def test_logged_loss_is_the_update_mean(grpo_runs: dict) -> None:
    trainer, updates = grpo_runs["exact"]
    logged = [e["loss"] for e in trainer.state.log_history if "loss" in e and "train_runtime" not in e]
    for update in range(trl_common.UPDATES):
        rows = trl_common.update_rows(trainer, update)
        loss = PolicyLoss("token-mean", clip_eps=trainer.epsilon_low)
        with torch.no_grad():
            want = float(loss.loss_fn(trl_common.start_model(updates, update), rows) / loss.count_fn(rows))
        assert abs(logged[update] - want) <= 1e-5 * max(abs(want), 1e-3), (logged, want)


def test_grpo_verify_accumulation_passes(grpo_runs: dict) -> None:
    report = grpo_runs["exact"][0].verify_accumulation()
    assert report.passed, report.summary()
    assert report.grad_max_rel_err < 1e-12


def _build_grpo(out: Path, steps_per_generation: int, policy: Callable[[Any], Any] = trl_common.model) -> Any:
    """An ExactGRPO of k = 2 micro-batches of 2 completions (2 per prompt): building it is what refuses."""
    from datasets import Dataset
    from trl import GRPOConfig

    tok = trl_common.tokenizer()
    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        steps_per_generation=steps_per_generation,
        num_generations=2,
        **trl_common.COMMON,
    )
    return ExactGRPO(
        model=policy(tok),
        reward_funcs=[trl_common.reward],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": trl_common.PROMPTS}),
        processing_class=tok,
    )


def test_grpo_refuses_an_update_spanning_two_generations(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"steps_per_generation \(1\) to be a multiple of"):
        _build_grpo(tmp_path, steps_per_generation=1)
    with pytest.raises(ConfigError, match="normalize must be one of"):
        ExactGRPOConfig(normalize="window")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="takes a transformers.Trainer subclass"):
        exact_trainer(int)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def dpo_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("dpo")
    return {"exact": trl_common.dpo(exact_trainer(DPOTrainer), out), "plain": trl_common.dpo(DPOTrainer, out)}


def test_dpo_update_is_the_mean_over_all_pairs(dpo_runs: dict) -> None:
    trainer, updates = dpo_runs["exact"]
    pairs = trl_common.pairs_batch(trainer)
    model = trl_common.start_model(updates, 0)
    loss = PreferenceLoss("dpo", beta=0.5)
    (loss.loss_fn(model, pairs) / loss.count_fn(pairs)).backward()
    want = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()}
    assert common.rel_err(updates.grads[0], want) < TRL_TOL
    assert common.rel_err(dpo_runs["plain"][1].grads[0], want) > 1e-2  # (mean of 4 + mean of 2) / 2
    report = trainer.verify_accumulation()
    assert report.passed and report.sizes == (4, 2), report.summary()


def test_grpo_refuses_an_moe_policy_with_its_balancing_loss(tmp_path: Path) -> None:
    from tests.helpers.moe import tiny_moe

    def moe_policy(tok: Any) -> Any:
        policy = tiny_moe("mixtral", layers=1)  # 4 experts, top-2, router_aux_loss_coef=0.05
        policy.resize_token_embeddings(len(tok))
        return policy

    with pytest.raises(
        ConfigError, match=r"MoE policy with its balancing loss \(router_aux_loss_coef=0.05\)"
    ):
        _build_grpo(tmp_path, steps_per_generation=2, policy=moe_policy)
