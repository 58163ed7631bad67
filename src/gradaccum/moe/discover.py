"""Find the routers of a transformers MoE model, and the constants of its balancing loss.

transformers records router logits with an ``OutputRecorder(<Family>TopKRouter, index=0)`` in the
base model's ``_can_record_outputs``; the same router classes are the modules this package hooks.
The families read here share one formula (``load_balancing_loss_func``: softmax, top-k, counts and
probability sums pooled over the layers, rows masked by ``attention_mask``; ``E * sum f_i P_i``),
and their configs name E, top-k and the coefficient: Mixtral (``num_local_experts``), Qwen2-MoE,
Qwen3-MoE and OLMoE (``num_experts``). A family that balances differently is refused by name
instead of being balanced with the wrong formula; a hand-written :class:`LoadBalance` covers it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from gradaccum.errors import ConfigError

__all__ = ["FAMILIES", "Discovered", "discover", "unwrap"]

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
"""transformers ``model_type`` values whose balancing loss :func:`discover` reads."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Discovered:
    """What :func:`discover` read from a model."""

    routers: tuple[nn.Module, ...]
    """The router modules, in the model's module order (the layer order)."""
    num_experts: int
    top_k: int
    coef: float
    """The config's ``router_aux_loss_coef``."""
    family: str
    """The config's ``model_type``."""


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers. FSDP2
    shards in place, so its module is the model itself."""
    seen = 0
    while seen < 8:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model, seen = inner, seen + 1
    return model


def _router_class(model: nn.Module) -> type | None:
    """The class transformers records router logits from, found on any submodule."""
    for module in model.modules():
        recorders = getattr(type(module), "_can_record_outputs", None)
        recorder = recorders.get("router_logits") if isinstance(recorders, dict) else None
        if recorder is None:
            continue
        target = getattr(recorder, "target_class", recorder)
        if isinstance(target, type) and getattr(recorder, "index", 0) == 0:
            return target
    return None


def discover(model: nn.Module) -> Discovered:
    """The routers and balancing constants of a transformers MoE model, or a :class:`ConfigError`."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"LoadBalance.from_model takes a torch.nn.Module, got {type(model).__name__}")
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    family = getattr(config, "model_type", None)
    router_class = _router_class(inner)
    routers = tuple(m for m in inner.modules() if router_class is not None and isinstance(m, router_class))
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not routers or not experts:
        raise ConfigError(
            f"LoadBalance.from_model found no router / experts in {type(inner).__name__} "
            f"(routers: {len(routers)}, num_experts: {experts!r}): a dense model has no load to balance. "
            "For a hand-written MoE pass LoadBalance(routers=[...], num_experts=..., top_k=..., coef=...)."
        )
    if family not in FAMILIES:
        raise ConfigError(
            f"LoadBalance.from_model reads the balancing loss of {list(FAMILIES)}; {type(inner).__name__} "
            f"(model_type {family!r}) may balance with another formula. Build LoadBalance(routers=[...], "
            "num_experts=..., top_k=..., coef=...) for it by hand."
        )
    top_k = getattr(config, "num_experts_per_tok", None)
    coef = getattr(config, "router_aux_loss_coef", None)
    if not isinstance(top_k, int) or not isinstance(coef, (int, float)):
        raise ConfigError(
            f"{type(inner).__name__}'s config lacks num_experts_per_tok ({top_k!r}) or "
            f"router_aux_loss_coef ({coef!r}); pass LoadBalance(...) by hand"
        )
    return Discovered(routers=routers, num_experts=int(experts), top_k=top_k, coef=float(coef), family=family)
