"""gradaccum.moe's spec, discovery and refusals, on one process (tiny float64 transformers models)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from gradaccum import Accumulator, CachedAccumulator, ConfigError
from gradaccum.moe import FAMILIES, LoadBalance, WindowStats, balance_term
from tests.helpers import moe as h


@pytest.fixture(scope="module")
def mixtral() -> nn.Module:
    return h.tiny_moe()


def test_from_model_reads_the_config_and_the_routers(mixtral: nn.Module) -> None:
    balance = LoadBalance.from_model(mixtral)
    gates = [layer.mlp.gate for layer in mixtral.model.layers]
    assert list(balance.routers) == gates
    assert (balance.num_experts, balance.top_k, balance.coef, balance.mode) == (4, 2, 0.05, "exact")
    assert balance.pooled
    assert LoadBalance.from_model(mixtral, mode="lagged", coef=0.2).coef == 0.2


def test_from_model_accepts_the_compiled_model(mixtral: nn.Module) -> None:
    compiled = torch.compile(mixtral, backend="eager")
    assert list(LoadBalance.from_model(compiled).routers) == list(LoadBalance.from_model(mixtral).routers)


def test_a_dense_model_is_refused_naming_routers_and_experts() -> None:
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
    )
    with pytest.raises(ConfigError, match="no router / experts"):
        LoadBalance.from_model(tf.LlamaForCausalLM(config))
    with pytest.raises(ConfigError, match="no router / experts"):
        LoadBalance.from_model(nn.Linear(2, 2))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"routers": []}, "no router / experts"),
        ({"top_k": 5}, "top_k=5 exceeds num_experts=4"),
        ({"mode": "global"}, "mode must be one of"),
        ({"coef": -1.0}, "coef must be a finite number"),
        ({"num_experts": 0}, "num_experts must be an int >= 1"),
        ({"bias_rate": 0.01}, "e_score_correction_bias"),
    ],
)
def test_load_balance_refuses_bad_settings(kwargs: dict, match: str) -> None:
    settings = {"routers": [nn.Linear(2, 4)], "num_experts": 4, "top_k": 2, "coef": 0.01, **kwargs}
    with pytest.raises(ConfigError, match=match):
        LoadBalance(**settings)


def test_the_families_read_are_named() -> None:
    assert FAMILIES == ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def test_post_scaling_and_other_front_ends_are_refused_saying_why(mixtral: nn.Module) -> None:
    m = copy.deepcopy(mixtral)
    sgd = torch.optim.SGD(m.parameters(), lr=1.0)
    with pytest.raises(ConfigError, match="scaling='post'"):
        Accumulator(m, sgd, scaling="post", balance=LoadBalance.from_model(m))
    with pytest.raises(ConfigError, match="CachedAccumulator does not take balance="):
        CachedAccumulator(m, sgd, balance=LoadBalance.from_model(m))
    from gradaccum.pipeline import PipelineAccumulator

    with pytest.raises(ConfigError, match="PipelineAccumulator does not take balance="):
        PipelineAccumulator([], sgd, lambda out, target: out, mesh=None, balance=LoadBalance.from_model(m))


def test_the_term_is_linear_in_the_probability_sums() -> None:
    """Parts over micro-batches add up to the whole: the step's decomposition, checked alone."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 9, (3, 4), generator=gen).to(torch.float64)
    rows = torch.tensor([5.0, 6.0, 7.0], dtype=torch.float64)
    parts = [torch.rand(3, 4, generator=gen, dtype=torch.float64) for _ in range(3)]
    for pooled in (True, False):
        whole = balance_term(sum(parts), counts, rows, num_experts=4, coef=0.1, pooled=pooled)
        split = sum(balance_term(p, counts, rows, num_experts=4, coef=0.1, pooled=pooled) for p in parts)
        assert float(split) == pytest.approx(float(whole), rel=1e-14)
    stats = WindowStats(counts, rows, torch.tensor(3.0, dtype=torch.float64))
    back = WindowStats.unpack(stats.pack(), 3, 4)
    assert (
        torch.equal(back.counts, counts) and torch.equal(back.rows, rows) and float(back.micro_batches) == 3.0
    )


def test_a_state_of_another_mode_is_refused(mixtral: nn.Module) -> None:
    m = copy.deepcopy(mixtral)
    acc = Accumulator(
        m, torch.optim.SGD(m.parameters(), lr=0.1), balance=LoadBalance.from_model(m, mode="lagged")
    )
    state = acc.state_dict()
    assert state["balance"] == {"mode": "lagged", "carried": None, "bias_due": False}
    other = Accumulator(m, torch.optim.SGD(m.parameters(), lr=0.1), balance=LoadBalance.from_model(m))
    with pytest.raises(ConfigError, match="mode='lagged'"):
        other.load_state_dict(state)
    with pytest.raises(ConfigError, match="'balance' part"):
        acc.load_state_dict({**state, "balance": {"mode": "lagged", "carried": [1.0], "bias_due": False}})


def test_a_model_that_adds_its_own_balancing_loss_is_refused(mixtral: nn.Module) -> None:
    m = copy.deepcopy(mixtral)
    m.config.output_router_logits = True
    with pytest.raises(ConfigError, match="output_router_logits=True"):
        Accumulator(m, torch.optim.SGD(m.parameters(), lr=1.0), balance=LoadBalance.from_model(m))
