"""Workloads (``--workload tests.helpers.moe_workloads:NAME``) for the commands' MoE and dtype tests:
a tiny float64 Mixtral whose config asks for its balancing loss (``routing_mixtral``), the same
model whose config does not (``quiet_mixtral``), and the bundled tiny GPT with bfloat16 parameters
(``bf16_gpt``). Padded rows of varied lengths, so micro-batches hold different token counts."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from gradaccum import CausalLMLoss
from gradaccum.examples import tiny_gpt
from gradaccum.workloads.base import Workload
from tests.helpers import moe as h

COEF = 0.05


def sequences(n_examples: int, seed: int) -> list[torch.Tensor]:
    """The token rows of ``make_batch(n_examples, seed)``, unpadded: 3 to 11 tokens each."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (n_examples,), generator=gen).tolist()
    return h.sequences(lengths, seed=seed)


def _batch(n_examples: int, seed: int) -> dict[str, torch.Tensor]:
    return h.pad(sequences(n_examples, seed), width=12)


def _mixtral(asks: bool) -> Workload:
    def build() -> nn.Module:
        model = h.tiny_moe("mixtral", coef=COEF)
        model.config.output_router_logits = asks
        return model

    loss = CausalLMLoss("token")
    return Workload(
        name="routing-mixtral" if asks else "quiet-mixtral",
        build_model=build,
        make_batch=_batch,
        loss_fn=loss.loss_fn,
        count_fn=loss.count_fn,
        batch_size=8,
        micro_batch=2,
        unit=loss.unit,
        description="a tiny float64 Mixtral, 4 experts top-2, padded rows",
    )


def routing_mixtral() -> Workload:
    """Its config asks for its balancing loss (``output_router_logits=True``)."""
    return _mixtral(True)


def quiet_mixtral() -> Workload:
    """Its config does not (``output_router_logits=False``)."""
    return _mixtral(False)


def bf16_gpt() -> Workload:
    """The bundled tiny GPT, its parameters stored in bfloat16."""
    base = tiny_gpt()
    build = base.build_model
    return dataclasses.replace(base, name="tiny-gpt-bf16", build_model=lambda: build().to(torch.bfloat16))
