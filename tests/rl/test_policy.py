"""PolicyLoss: every aggregation's accumulated update equals one pass over the same rollout batch.

Float64 and a causal model without batch coupling: the accumulated gradient differs from the
independent reference (tests/rl/common.py) only by summation order, ~1e-16 relative; 1e-10
leaves a wide margin and still fails any weighting error (the controls are off by > 1e-2).
"""

from __future__ import annotations

import pytest
import torch

import gradaccum
from gradaccum.errors import ConfigError, CountError
from gradaccum.rl import AGGREGATIONS, PolicyLoss
from tests.rl import common

TOL = 1e-10
SPLITS = {"1x8": 8, "2x4": 4, "8x1": 1}  # accumulation steps x micro-batch rows


@pytest.mark.parametrize("per_token", [False, True], ids=["row-advantages", "token-advantages"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_every_split_matches_the_full_batch(aggregation: str, per_token: bool) -> None:
    batch = common.rollout(per_token=per_token)
    want = common.reference_grads(batch, aggregation)
    loss = PolicyLoss(**common.loss_kwargs(aggregation))
    for name, rows in SPLITS.items():
        model = common.TinyPolicy()
        acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
        acc.step(gradaccum.split(batch, micro_batch=rows), loss.loss_fn, loss.count_fn)
        assert common.rel_err(common.grads(model), want) < TOL, (aggregation, name)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_a_mean_of_micro_batch_means_is_the_control_that_fails(aggregation: str) -> None:
    batch = common.rollout()
    want = common.reference_grads(batch, aggregation)
    loss = PolicyLoss(**common.loss_kwargs(aggregation))
    model = common.TinyPolicy()
    parts = gradaccum.split(batch, micro_batch=2)
    for part in parts:  # TRL's bnpo / grpo: each micro-batch's own mean, divided by k
        (loss.loss_fn(model, part) / loss.count_fn(part).clamp(min=1) / len(parts)).backward()
    assert common.rel_err(common.grads(model), want) > 1e-2


def test_verify_passes_and_the_audit_reads_the_declared_positions() -> None:
    batch = common.rollout()
    loss = PolicyLoss(**common.loss_kwargs("seq-mean-token-mean"))
    report = gradaccum.verify(common.TinyPolicy, batch, loss.loss_fn, loss.count_fn, sizes=[3, 1, 4])
    assert report.passed, report.summary()
    assert all(a.status == "consistent" for a in report.audit)


def test_counts_are_tokens_or_sequences_with_a_response() -> None:
    batch = common.rollout()
    tokens = sum(r for _, r in common.SHAPES)
    sequences = sum(1 for _, r in common.SHAPES if r)
    assert int(PolicyLoss("token-mean").count_fn(batch)) == tokens
    for aggregation in AGGREGATIONS[1:]:
        assert int(PolicyLoss(**common.loss_kwargs(aggregation)).count_fn(batch)) == sequences


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"aggregation": "seq-mean"}, "aggregation must be one of"),
        ({"aggregation": "seq-mean-token-sum-norm"}, "pass max_response_len"),
        ({"aggregation": "token-mean", "max_response_len": 8}, "used only by"),
        ({"clip_eps": 1.5}, "clip_eps must lie in"),
        ({"kl_coef": -0.1}, "kl_coef must be >= 0"),
    ],
)
def test_bad_settings_are_refused_naming_them(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PolicyLoss(**kwargs)


def test_bad_micro_batches_are_refused_naming_the_key() -> None:
    batch = common.rollout()
    model = common.TinyPolicy()
    loss = PolicyLoss(kl_coef=0.1)
    no_mask = {k: v for k, v in batch.items() if k != "response_mask"}
    with pytest.raises(ConfigError, match=r"no \['response_mask'\]"):
        loss.count_fn(no_mask)
    with pytest.raises(ConfigError, match="advantages of shape \\(8, 3\\) fit neither"):
        loss.loss_fn(model, {**batch, "advantages": torch.zeros(8, 3, dtype=torch.float64)})
    with pytest.raises(ConfigError, match="kl_coef > 0 needs the reference"):
        loss.loss_fn(model, {k: v for k, v in batch.items() if k != "ref_logprobs"})
    with pytest.raises(ConfigError, match="old_logprobs must be a tensor of the shape of input_ids"):
        loss.count_fn({**batch, "old_logprobs": batch["old_logprobs"][:, 1:]})
    first = batch["response_mask"].clone()
    first[0, 0] = 1
    with pytest.raises(ConfigError, match="marks position 0"):
        loss.count_fn({**batch, "response_mask": first})
    with pytest.raises(CountError, match="more than max_response_len=4"):
        PolicyLoss("seq-mean-token-sum-norm", max_response_len=4).count_fn(batch)


def test_a_micro_batch_without_responses_adds_zero_not_nan() -> None:
    batch = gradaccum.split(common.rollout(), sizes=[3, 1, 4])[1]  # row 3: no response
    model = common.TinyPolicy()
    loss = PolicyLoss("seq-mean-token-mean").loss_fn(model, batch)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert all(torch.isfinite(g).all() and not g.any() for g in common.grads(model).values())
