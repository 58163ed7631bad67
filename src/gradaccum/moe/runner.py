"""Where the accumulators meet a load balance: building it, the routing pass's forward, and one
micro-batch's forward with its term. Kept here so that the step's front ends hold a line each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from gradaccum.distributed.sync import sync_kind
from gradaccum.errors import ConfigError
from gradaccum.moe.balancer import WindowBalance
from gradaccum.moe.discover import unwrap
from gradaccum.moe.spec import LoadBalance
from gradaccum.step.checks import check_loss

__all__ = ["balanced_forward", "balancer_for", "refuse_balance", "routing_forward"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def balancer_for(balance: LoadBalance | None, model: nn.Module, config: Any) -> WindowBalance | None:
    """The running balance an :class:`~gradaccum.Accumulator` drives, or a :class:`ConfigError`
    naming what it cannot be combined with."""
    if balance is None:
        return None
    if not isinstance(balance, LoadBalance):
        raise ConfigError(f"balance must be a gradaccum.moe.LoadBalance, got {type(balance).__name__}")
    if config.scaling == "post":
        raise ConfigError(
            "balance= is not supported with scaling='post': a streamed window's micro-batches "
            "backpropagate before the window's routing counts (c, R) and N are known, and the "
            "balancing term does not scale with the loss's W/N. Use scaling='pre'."
        )
    if balance.mode == "exact" and sync_kind(model) in ("fsdp", "fsdp2"):
        raise ConfigError(
            "LoadBalance(mode='exact') routes every micro-batch once more before the first backward; "
            "under FSDP that forward gathers parameters in collectives the ranks would have to repeat "
            "in step, which ranks with different micro-batch counts do not. Use mode='lagged'."
        )
    if getattr(getattr(unwrap(model), "config", None), "output_router_logits", False) is True:
        raise ConfigError(
            "the model's config has output_router_logits=True, so its forward adds its own "
            "per-micro-batch balancing loss to .loss, and the step would add the window's on top. Set "
            "model.config.output_router_logits = False (loss_fn returns the cross-entropy only)."
        )
    params = [p for p in model.parameters()]
    device = params[0].device if params else torch.device("cpu")
    return WindowBalance(balance, device, model=unwrap(model))


def routing_forward(model: nn.Module, loss_fn: LossFn) -> Callable[[Any], Any]:
    """The routing pass's forward: ``loss_fn`` on the module inside DDP, whose own forward would
    broadcast buffers (a collective) once per call."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return lambda mb: loss_fn(inner, mb)


def balanced_forward(
    balance: WindowBalance, index: int, mb: Any, model: nn.Module, loss_fn: LossFn
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Micro-batch ``index``'s summed loss, its part of the window's balancing term (from the
    statistics the count phase agreed on), and its veto."""
    window = balance.window
    if window is None:
        raise ConfigError("the load balance has no agreed window statistics: the count phase did not run")
    with balance.capture.recording(graph=True) as records:
        loss = check_loss(loss_fn(model, mb), index)
    silent = sorted(set(range(balance.spec.layers)) - {layer for layer, _ in records})
    if silent:
        raise ConfigError(
            f"LoadBalance.routers {silent} ran no forward hook in micro-batch {index}'s training forward, "
            "so their balancing term would be zero. A torch.compile graph traced before the step registered "
            "its router hooks runs without them (dynamo does not guard module hooks): build the Accumulator "
            "before the first call of the compiled model (or compiled loss_fn), or call "
            "torch.compiler.reset() after building it; or the loss_fn does not run those routers."
        )
    term, rejected = balance.term(window, index, mb, records)
    return loss, term, rejected


def refuse_balance(balance: Any, front_end: str, why: str) -> None:
    """A front end that cannot run a load balance refuses ``balance=`` by name, saying why."""
    if balance is not None:
        raise ConfigError(
            f"{front_end} does not take balance=: {why}. Use gradaccum.Accumulator(..., balance=...)."
        )
