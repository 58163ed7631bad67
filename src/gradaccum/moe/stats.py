"""The routing statistics of one forward, of a window, and the balancing term built from them.

For the routers' logits of one forward (one tensor ``[rows, E]`` per router call), :func:`route`
computes per layer ``l`` and expert ``i``

    c_li = sum over counted rows of [i in top-k(softmax(logits))]   (routed slots; no gradient)
    R_l  = counted rows                                            (the mask's sum)
    S_li = sum over counted rows of softmax(logits)_i               (probability sums; gradient)
    Z_l  = sum over counted rows of logsumexp(logits)^2             (for the z-loss; gradient)

exactly as transformers' ``load_balancing_loss_func`` does (softmax in the logits' dtype, at least
float32; top-k of the probabilities; padding rows weighted 0). :class:`WindowStats` is ``(c, R)``
summed over a window's micro-batches and data ranks, packed into one float64 vector for the count
all-reduce (integers: exact below 2**53). :func:`balance_term` is the part of the window's term
that one micro-batch contributes: linear in its ``S``, so the micro-batches' parts add up to the
window's term, value and gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradaccum.errors import ConfigError

__all__ = ["Routed", "WindowStats", "balance_term", "route", "z_term"]


@dataclass(frozen=True, slots=True)
class Routed:
    """One forward's routing on this rank, per layer (router)."""

    counts: torch.Tensor
    """c: ``[L, E]`` float64, routed slots per expert (detached)."""
    rows: torch.Tensor
    """R: ``[L]`` float64, counted rows."""
    probs: torch.Tensor
    """S: ``[L, E]`` probability sums, carrying the router's gradient."""
    z: torch.Tensor
    """Z: ``[L]`` sums of squared logsumexp, carrying the router's gradient."""


@dataclass(frozen=True, slots=True)
class WindowStats:
    """``(c, R)`` over a window (or a micro-batch), float64 on the device, and the micro-batches it holds."""

    counts: torch.Tensor
    """``[L, E]`` routed slots per layer and expert."""
    rows: torch.Tensor
    """``[L]`` counted rows per layer."""
    micro_batches: torch.Tensor
    """0-dim: micro-batches over the window and the ranks (the M of micro-batch mode's 1/M)."""

    def pack(self) -> torch.Tensor:
        """One float64 vector ``[L*E + L + 1]`` for the count all-reduce."""
        return torch.cat([self.counts.reshape(-1), self.rows, self.micro_batches.reshape(1)])

    @classmethod
    def unpack(cls, vector: torch.Tensor, layers: int, experts: int) -> WindowStats:
        """The inverse of :meth:`pack`."""
        cut = layers * experts
        return cls(vector[:cut].reshape(layers, experts), vector[cut : cut + layers], vector[cut + layers])

    @classmethod
    def zeros(cls, layers: int, experts: int, device: torch.device) -> WindowStats:
        z = torch.zeros(layers * experts + layers + 1, dtype=torch.float64, device=device)
        return cls.unpack(z, layers, experts)


def route(
    captured: Sequence[tuple[int, torch.Tensor]],
    mask: torch.Tensor | None,
    *,
    layers: int,
    num_experts: int,
    top_k: int,
    device: torch.device,
    biases: Sequence[torch.Tensor] | None = None,
    selection_only: bool = False,
) -> Routed:
    """The routing statistics of one forward from its captured ``(layer, logits)`` pairs.

    ``mask``: one weight per row (``[batch, seq]`` is flattened as transformers' routers flatten
    their input), or ``None`` for every row. A router called twice adds into its layer's row.
    ``biases``: aux-loss-free balancing's per-router expert bias, added to the probabilities for
    the selection only (as DeepSeek-V3 routes), so that ``c`` counts the slots actually routed.
    ``selection_only``: ``c`` and ``R`` only (the routing pass), ``probs`` and ``z`` left zero."""
    counts = [torch.zeros(num_experts, dtype=torch.float64, device=device) for _ in range(layers)]
    rows = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(layers)]
    probs: list[torch.Tensor | None] = [None] * layers
    zs: list[torch.Tensor | None] = [None] * layers
    flat = None if mask is None else mask.reshape(-1).to(device=device, dtype=torch.float64)
    for layer, raw in captured:
        logits = raw.reshape(-1, raw.shape[-1])
        if logits.shape[-1] != num_experts:
            raise ConfigError(
                f"router {layer} returned logits of {logits.shape[-1]} experts, "
                f"LoadBalance.num_experts={num_experts}"
            )
        if flat is not None and flat.numel() != logits.shape[0]:
            raise ConfigError(
                f"the mask holds {flat.numel()} rows, router {layer} routed {logits.shape[0]}: mask_fn must "
                "return one weight per routed row (transformers: the attention_mask the model was given)"
            )
        work = logits.to(torch.promote_types(logits.dtype, torch.float32))
        p = torch.softmax(work, dim=-1)
        scores = p.detach() if biases is None else p.detach() + biases[layer].to(p.dtype)
        chosen = torch.topk(scores, top_k, dim=-1).indices.reshape(-1)
        weight = flat if flat is not None else torch.ones(logits.shape[0], dtype=torch.float64, device=device)
        counts[layer] = counts[layer].scatter_add(0, chosen.to(device), weight.repeat_interleave(top_k))
        rows[layer] = rows[layer] + weight.sum()
        if selection_only:
            continue
        w = weight.to(p.dtype)
        s = (p * w.unsqueeze(-1)).sum(0).to(torch.float64)
        z = (torch.logsumexp(work, dim=-1).square() * w).sum().to(torch.float64)
        probs[layer] = s if probs[layer] is None else probs[layer] + s  # type: ignore[operator]
        zs[layer] = z if zs[layer] is None else zs[layer] + z  # type: ignore[operator]
    zero_e = torch.zeros(num_experts, dtype=torch.float64, device=device)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    return Routed(
        counts=torch.stack(counts),
        rows=torch.stack(rows),
        probs=torch.stack([zero_e if s is None else s for s in probs]),
        z=torch.stack([zero if z is None else z for z in zs]),
    )


def balance_term(
    probs: torch.Tensor,
    counts: torch.Tensor,
    rows: torch.Tensor,
    *,
    num_experts: int,
    coef: float,
    pooled: bool,
) -> torch.Tensor:
    """One micro-batch's part of ``coef * E * sum_i f_i P_i`` given the window's ``(c, R)``.

    Pooled: ``coef * E / R^2 * sum_i c_i S_i`` with ``c``, ``R``, ``S`` summed over the layers; per
    layer: the same per layer, summed over the layers. ``probs`` is this micro-batch's ``S``
    (``[L, E]``); ``counts``/``rows`` the window's (``[L, E]``/``[L]``). Linear in ``S``: summed over
    a window's micro-batches (and ranks) it is the window's term, value and gradient."""
    if pooled:
        r = rows.sum().clamp(min=1)
        return (counts.sum(0) * probs.sum(0)).sum() * (coef * num_experts) / (r * r)
    r = rows.clamp(min=1)
    return ((counts * probs).sum(1) / (r * r)).sum() * (coef * num_experts)


def z_term(z: torch.Tensor, rows: torch.Tensor, *, z_coef: float, pooled: bool) -> torch.Tensor:
    """One micro-batch's part of the router z-loss ``z_coef * sum logsumexp^2 / R``: per routed row,
    normalized by the window's rows (pooled over layers, or per layer and summed)."""
    if pooled:
        return z.sum() * z_coef / rows.sum().clamp(min=1)
    return (z / rows.clamp(min=1)).sum() * z_coef
