"""Mixture-of-experts load balancing made exact over the accumulation window.

The balancing loss of Switch/GShard/Mixtral is ``coef * E * sum_i f_i P_i``, with ``f_i`` the
fraction of routed slots that chose expert ``i`` and ``P_i`` the mean router probability of ``i``,
both over the *batch*; transformers' ``load_balancing_loss_func`` pools them over all layers and
masks padding with the attention mask. Over a window of micro-batches ``m`` (on every data rank)

    f_i = c_i / R,   P_i = S_i / R,   c_i = sum_m c_i^(m),  R = sum_m R^(m),  S_i = sum_m S_i^(m)

(``c_i`` routed slots choosing ``i``, ``R`` routed rows, ``S_i`` sums of router probabilities), so

    grad( coef * E * sum_i f_i P_i ) = coef * E / R^2 * sum_i c_i * sum_m grad S_i^(m)

since ``c`` is piecewise constant (top-k selects, it has no gradient). Once ``(c, R)`` are known,
the term is linear in each micro-batch's ``S^(m)``: micro-batch ``m`` backpropagates
``coef * E / R^2 * sum_i c_i S_i^(m)``, and the parts add up to the full batch's term, value and
gradient. ``(c, R)`` are window statistics exactly like the token count N: counted before the first
backward and summed over micro-batches and data ranks in the step's one count all-reduce (never
over tensor-parallel ranks, which hold the same tokens). Under DDP, which averages gradients over W
ranks, the term is scaled by W like the loss's ``W/N``.

Modes (:class:`LoadBalance` ``mode``):

* ``"exact"``: a no-grad routing pass over the window (same weights, RNG state replayed, each
  forward ended after the last router, the model's buffers left as found:
  :mod:`gradaccum.moe.routing`) counts ``(c, R)``. A training forward that routes differently
  from its routing pass vetoes the update on every rank.
* ``"lagged"``: the last applied window's agreed counts; one forward per micro-batch. Until a
  window is applied (nothing carried yet) each micro-batch uses its own statistics; a skipped
  window's counts are dropped. The carried counts are the ``"balance"`` part of the accumulator's
  ``state_dict``, so a resumed run is bitwise the same.
* ``"micro-batch"``: each micro-batch's own statistics, averaged over the window's micro-batches:
  what per-micro-batch balancing (the usual implementations) computes; for comparison.

Options: the router z-loss (``z_coef``: per routed row, normalized by the window's rows) and
aux-loss-free balancing (``bias_rate``: DeepSeek-V3's expert bias, moved once per applied
optimizer step from that window's agreed counts, identically on every rank).

Public API::

    LoadBalance.from_model(model, *, mode="exact", coef=None)   # transformers MoE families
    LoadBalance(routers=[...], num_experts=, top_k=, coef=, pooled=True, mask_fn=...)
    Accumulator(model, optimizer, ..., balance=LoadBalance(...))  # loss_fn returns the summed CE only

and, for a front end that runs its own micro-batch loop: :class:`RouterCapture` (hooks that record
the routers' logits inside ``recording()``), :func:`route` (a forward's ``c``, ``R``, ``S``, ``Z``
from recorded logits), :class:`WindowStats` (``(c, R)`` packed for an all-reduce) and
:func:`balance_term` / :func:`z_term` (one micro-batch's part of the window's term given the
window's statistics). :class:`WindowBalance` is the whole of it as the step's engine drives it:
``WindowEngine(..., balance=WindowBalance(spec, device))``, ``WindowBalance.use(forward)`` with
:func:`gradaccum.moe.runner.routing_forward` before ``engine.count``, each micro-batch's forward through
:func:`gradaccum.moe.runner.balanced_forward` (loss, term, veto); then
``WindowBalance.finish()`` and ``engine.conclude(..., rejection=WindowBalance.rejection)``, with
``WindowBalance.applied`` among the engine's ``on_step`` hooks, as :class:`gradaccum.Accumulator` does.
"""

from __future__ import annotations

from gradaccum.moe.balancer import BalanceWindow, WindowBalance
from gradaccum.moe.capture import RouterCapture
from gradaccum.moe.discover import FAMILIES, Discovered, discover
from gradaccum.moe.spec import MODES, BalanceMode, LoadBalance, MaskFn
from gradaccum.moe.stats import Routed, WindowStats, balance_term, route, z_term

__all__ = [
    "FAMILIES",
    "MODES",
    "BalanceMode",
    "BalanceWindow",
    "Discovered",
    "LoadBalance",
    "MaskFn",
    "Routed",
    "RouterCapture",
    "WindowBalance",
    "WindowStats",
    "balance_term",
    "discover",
    "route",
    "z_term",
]
