"""PreferenceLoss (DPO, IPO): one unit per pair, exact under every split (float64, 1e-10 as in
test_policy.py); TRL's mean of per-micro-batch means over uneven micro-batches is the control."""

from __future__ import annotations

import pytest
import torch

import gradaccum
from gradaccum.errors import ConfigError
from gradaccum.rl import PreferenceLoss
from tests.rl import common

TOL = 1e-10


@pytest.mark.parametrize("objective", ["dpo", "ipo"])
def test_every_split_matches_the_mean_over_all_pairs(objective: str) -> None:
    batch = common.pairs()
    want = common.reference_preference_grads(batch, objective)
    loss = PreferenceLoss(objective, beta=common.BETA)
    assert int(loss.count_fn(batch)) == len(common.PAIR_SHAPES)
    for sizes in ([8], [4, 4], [1] * 8, [3, 1, 4]):
        model = common.TinyPolicy()
        acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
        acc.step(gradaccum.split(batch, sizes=sizes), loss.loss_fn, loss.count_fn)
        assert common.rel_err(common.grads(model), want) < TOL, (objective, sizes)
    # the control: each micro-batch's mean over its pairs, divided by k (TRL's DPOTrainer)
    model = common.TinyPolicy()
    parts = gradaccum.split(batch, sizes=[3, 1, 4])
    for part in parts:
        (loss.loss_fn(model, part) / loss.count_fn(part) / len(parts)).backward()
    assert common.rel_err(common.grads(model), want) > 1e-2


def test_verify_passes_with_the_audit_on_the_response_tokens() -> None:
    loss = PreferenceLoss("dpo", beta=common.BETA)
    report = gradaccum.verify(common.TinyPolicy, common.pairs(), loss.loss_fn, loss.count_fn, micro_batch=2)
    assert report.passed, report.summary()
    assert all(a.status == "consistent" for a in report.audit)


def test_bad_input_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="objective must be one of"):
        PreferenceLoss("kto")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="beta must be a finite number > 0"):
        PreferenceLoss(beta=0.0)
    batch = common.pairs()
    loss = PreferenceLoss()
    with pytest.raises(ConfigError, match=r"no \['rejected_response_mask'\]"):
        loss.count_fn({k: v for k, v in batch.items() if k != "rejected_response_mask"})
    with pytest.raises(ConfigError, match="ref_chosen_logprobs must be a floating \\(8,\\) tensor"):
        loss.count_fn({**batch, "ref_chosen_logprobs": torch.zeros(8, common.SEQ, dtype=torch.float64)})
    with pytest.raises(ConfigError, match="rejected_input_ids must have the shape of chosen_input_ids"):
        loss.count_fn({**batch, "rejected_input_ids": batch["rejected_input_ids"][:, :5]})
