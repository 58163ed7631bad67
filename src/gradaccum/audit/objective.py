"""The full batch's objective of a token-loss model, written out in float64: what an accumulated
update is meant to reproduce.

    L = (1/N) sum_t l_t  +  coef * E * sum_i f_i P_i

The first term is the cross-entropy summed over every target of the window's examples and divided
once by N, the targets the model predicts (for a causal LM each row's labels shifted by one; not
the trainer's own count). The second is present for a routing model only (``output_router_logits``
with a non-zero ``router_aux_loss_coef``): transformers' balancing loss, with f_i the fraction of
routed (token, layer) slots that chose expert i and P_i its mean router probability, both pooled over
every layer and every unpadded token of the whole window, as one batch of all of them would pool
them. The examples run in their micro-batches (a causal model's right padding changes no valid
token's logits), but every micro-batch is divided by the window's N and weighted by the window's f:
f is computed first, without gradient, and the term is linear in P, so each micro-batch's share
``coef * E * sum_i f_i P_i^(j)`` adds up to the whole batch's term exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradaccum.audit.measure import gradients

__all__ = ["FullBatch", "Routing", "full_batch"]

Prepare = Callable[[Any], Mapping[str, Any]]
"""Turns a collated micro-batch into the model's keyword inputs, labels included (the trainer's
``_prepare_inputs``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Routing:
    """A routing model's balancing term, as its config declares it."""

    coef: float
    """``router_aux_loss_coef``."""
    top_k: int
    """``num_experts_per_tok``."""


@dataclass(frozen=True, slots=True)
class FullBatch:
    """The full batch's gradient, with the balancing term's part apart."""

    grads: list[torch.Tensor]
    """Gradient of the whole objective, float64, in parameter order."""
    balance_grads: list[torch.Tensor] | None
    """Gradient of the balancing term alone (``None`` for a model without one)."""
    units: int
    """N: the targets the model predicts over the window."""


def _labels(inputs: Mapping[str, Any], shift: bool) -> tuple[torch.Tensor, bool]:
    if "shift_labels" in inputs:  # the collator already aligned them with the logits
        return inputs["shift_labels"], False
    return inputs["labels"], shift


def _token_sum(
    logits: torch.Tensor, labels: torch.Tensor, *, shift: bool, ignore_index: int, smoothing: float
) -> torch.Tensor:
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    flat = logits.reshape(-1, logits.shape[-1]).to(torch.float64)
    return F.cross_entropy(
        flat,
        labels.reshape(-1).to(flat.device),
        ignore_index=ignore_index,
        reduction="sum",
        label_smoothing=smoothing,
    )


def _routed(router_logits: Sequence[torch.Tensor], mask: torch.Tensor | None, top_k: int) -> Any:
    """(choices per expert, mean-probability sums per expert, routed slots), pooled over layers."""
    experts = router_logits[0].shape[-1]
    m = None if mask is None else mask.reshape(-1).to(torch.float64)
    chosen = torch.zeros(experts, dtype=torch.float64, device=router_logits[0].device)
    probs = torch.zeros_like(chosen)
    slots = torch.zeros((), dtype=torch.float64, device=chosen.device)
    for logits in router_logits:
        p = torch.softmax(logits.to(torch.float64), dim=-1)
        picks = F.one_hot(torch.topk(p, top_k, dim=-1).indices, experts).sum(1).to(torch.float64)
        w = torch.ones(p.shape[0], dtype=torch.float64, device=p.device) if m is None else m.to(p.device)
        chosen = chosen + (picks * w[:, None]).sum(0)
        probs = probs + (p * w[:, None]).sum(0)
        slots = slots + w.sum()
    return chosen.detach(), probs, slots


def full_batch(
    model: nn.Module,
    micro_batches: Sequence[Any],
    prepare: Prepare,
    *,
    shift: bool,
    ignore_index: int,
    smoothing: float,
    routing: Routing | None,
) -> FullBatch:
    """The gradient of the window's full-batch objective (module docstring) on ``model`` (float64)."""

    def forward(mb: Any) -> tuple[Any, torch.Tensor, bool, torch.Tensor | None]:
        inputs = dict(prepare(mb))
        labels, shifted = _labels(inputs, shift)
        # the labels stay: a model may need them in its forward (its own loss is not read here)
        if routing is not None:
            inputs["output_router_logits"] = True
        mask = inputs.get("attention_mask")
        return model(**inputs), labels, shifted, mask if isinstance(mask, torch.Tensor) else None

    units = 0
    for mb in micro_batches:
        labels, shifted = _labels(prepare(mb), shift)
        units += int((labels[..., 1:] if shifted else labels).ne(ignore_index).sum())
    n = max(units, 1)  # an all-padding window: zero gradients, never NaN
    choices = slots = None
    if routing is not None:
        with torch.no_grad():
            pooled = []
            for mb in micro_batches:
                out, _, _, mask = forward(mb)
                pooled.append(_routed(out.router_logits, mask, routing.top_k))
        choices = sum(c for c, _, _ in pooled)
        slots = sum(s for _, _, s in pooled)
    model.zero_grad(set_to_none=True)
    params = [p for p in model.parameters()]
    balance = [torch.zeros_like(p, dtype=torch.float64) for p in params] if routing is not None else None
    for mb in micro_batches:
        out, labels, shifted, mask = forward(mb)
        logits = out if isinstance(out, torch.Tensor) else out["logits"]
        loss = _token_sum(logits, labels, shift=shifted, ignore_index=ignore_index, smoothing=smoothing) / n
        if routing is not None and balance is not None and choices is not None and slots is not None:
            experts = out.router_logits[0].shape[-1]
            _, probs, _ = _routed(out.router_logits, mask, routing.top_k)
            term = routing.coef * experts * ((choices / slots) * (probs / slots)).sum()
            parts = torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
            for acc, part in zip(balance, parts, strict=True):
                if part is not None:
                    acc += part.to(torch.float64)
            loss = loss + term
        loss.backward()
    grads = gradients(model)
    model.zero_grad(set_to_none=True)
    return FullBatch(grads, balance, units)
