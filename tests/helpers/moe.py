"""Tiny float64 transformers MoE models, padded token windows, and the full batch's objective by hand.

The reference is the full batch's objective written in float64: the summed next-token
cross-entropy over every valid target divided by N, plus ``coef * E * sum_i f_i P_i`` with ``f``
and ``P`` pooled over the layers and every unpadded row of the whole batch (transformers' own
``load_balancing_loss_func`` sums in float32, so it is not used). One forward over the whole batch,
one backward, one SGD step with lr=1: the update is minus the gradient.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 32
Batch = dict[str, torch.Tensor]


def tiny_moe(family: str = "mixtral", *, seed: int = 0, coef: float = 0.05, layers: int = 2) -> nn.Module:
    """A float64 MoE causal LM of width 16, 4 experts, top-2 (eager experts: float64 on CPU)."""
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        num_experts_per_tok=2,
        router_aux_loss_coef=coef,
        experts_implementation="eager",
        tie_word_embeddings=False,
    )
    if family == "mixtral":
        config = tf.MixtralConfig(num_local_experts=4, **common)
        cls = tf.MixtralForCausalLM
    elif family == "qwen2_moe":
        config = tf.Qwen2MoeConfig(
            num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16, **common
        )
        cls = tf.Qwen2MoeForCausalLM
    elif family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=16, head_dim=8, **common)
        cls = tf.Qwen3MoeForCausalLM
    elif family == "olmoe":
        config = tf.OlmoeConfig(num_experts=4, **common)
        cls = tf.OlmoeForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(config).to(torch.float64)
    with torch.no_grad():  # Qwen/OLMoE routers start at zero: every expert ties, top-k is arbitrary
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
    return model


def sequences(lengths: Sequence[int], *, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]


def pad(seqs: Sequence[torch.Tensor], width: int | None = None) -> Batch:
    """Right-padded ``input_ids``/``attention_mask``/``labels`` (-100 on padding)."""
    width = width or max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = s
        mask[row, : len(s)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def window(seqs: Sequence[torch.Tensor], sizes: Sequence[int]) -> list[Batch]:
    """The sequences cut into micro-batches of the given sizes, each padded to its own width."""
    out, start = [], 0
    for size in sizes:
        out.append(pad(seqs[start : start + size]))
        start += size
    assert start == len(seqs)
    return out


def ce_sum(model: nn.Module, mb: Batch) -> torch.Tensor:
    """The summed next-token cross-entropy (the loss_fn: cross-entropy only)."""
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), mb["labels"][:, 1:].reshape(-1), reduction="sum"
    )


def tokens(mb: Batch) -> torch.Tensor:
    return (mb["labels"][:, 1:] != -100).sum()


def routing_by_hand(
    router_logits: Sequence[torch.Tensor], mask: torch.Tensor, experts: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(c, S, R)`` pooled over the layers, padding masked, in float64 (S carries the gradient)."""
    m = mask.reshape(-1).to(torch.float64)
    counts = torch.zeros(experts, dtype=torch.float64)
    probs = torch.zeros(experts, dtype=torch.float64)
    rows = torch.zeros((), dtype=torch.float64)
    for logits in router_logits:
        p = torch.softmax(logits.to(torch.float64), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices
        counts = counts + (F.one_hot(chosen, experts).sum(1).to(torch.float64) * m[:, None]).sum(0)
        probs = probs + (p * m[:, None]).sum(0)
        rows = rows + m.sum()
    return counts.detach(), probs, rows


def balance_by_hand(
    router_logits: Sequence[torch.Tensor], mask: torch.Tensor, experts: int, top_k: int
) -> torch.Tensor:
    """``E * sum_i f_i P_i`` pooled over the layers, padding masked, in float64."""
    counts, probs, rows = routing_by_hand(router_logits, mask, experts, top_k)
    return experts * ((counts / rows) * (probs / rows)).sum()


def reference_update(
    model: nn.Module, seqs: Sequence[torch.Tensor], *, coef: float, z_coef: float | None = None
) -> list[torch.Tensor]:
    """The full batch's SGD(lr=1) update: minus the gradient of CE/N + coef * balance (+ z-loss)."""
    ref = copy.deepcopy(model)
    batch = pad(seqs)
    out = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
    logits = out.logits
    labels = batch["labels"][:, 1:].reshape(-1)
    n = (labels != -100).sum()
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels, reduction="sum") / n
    experts, top_k = out.router_logits[0].shape[-1], ref.config.num_experts_per_tok
    objective = ce + coef * balance_by_hand(out.router_logits, batch["attention_mask"], experts, top_k)
    if z_coef is not None:
        m = batch["attention_mask"].reshape(-1).to(torch.float64)
        z = sum((torch.logsumexp(lg.to(torch.float64), -1).square() * m).sum() for lg in out.router_logits)
        objective = objective + z_coef * z / (m.sum() * len(out.router_logits))
    objective.backward()
    return [-p.grad.detach().clone() for p in ref.parameters()]


def update_of(model: nn.Module, before: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]


def rel_l2(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    num = sum(float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True))
    den = sum(float(y.pow(2).sum()) for y in b)
    return (num / den) ** 0.5
