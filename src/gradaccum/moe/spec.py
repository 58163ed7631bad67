"""What a load balance is: :class:`LoadBalance`, the routers, the formula's constants and the mode.

A frozen keyword-only record, checked when it is built: the routers whose outputs are captured,
the number of experts ``E`` and the ``top_k`` each row chooses, the coefficient of the balancing
term, whether the statistics are pooled over the layers (transformers' formula) or kept per layer,
how the padding is masked, and which window statistics the term uses (``mode``).
:meth:`LoadBalance.from_model` reads all of it from a transformers MoE model
(:mod:`gradaccum.moe.discover`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn

from gradaccum.batch import fields
from gradaccum.errors import ConfigError
from gradaccum.values import is_int

__all__ = ["MODES", "BalanceMode", "LoadBalance", "MaskFn"]

BalanceMode = Literal["exact", "lagged", "micro-batch"]
MODES = ("exact", "lagged", "micro-batch")
MaskFn = Callable[[Any], "torch.Tensor | None"]
"""``mask_fn(micro_batch)``: 1 for the router rows that count, 0 for padding, one value per row the
routers see (a transformers model flattens ``[batch, seq]``); ``None``: every row counts."""


def attention_mask(micro_batch: Any) -> torch.Tensor | None:
    """transformers' own mask: the micro-batch's ``attention_mask``, when it has one (any mapping,
    ``BatchEncoding`` included, a namedtuple or a dataclass: :func:`gradaccum.batch.fields`)."""
    named = fields(micro_batch)
    mask = None if named is None else named.get("attention_mask")
    return mask if isinstance(mask, torch.Tensor) else None


def _number(name: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigError(f"LoadBalance.{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadBalance:
    """The balancing term ``coef * E * sum_i f_i P_i`` made exact over the window (see :mod:`gradaccum.moe`).

    >>> balance = LoadBalance.from_model(model)                      # a transformers MoE
    >>> balance = LoadBalance(routers=[blk.router for blk in blocks], num_experts=8, top_k=2, coef=0.01)
    >>> acc = Accumulator(model, optimizer, balance=balance)
    """

    routers: Sequence[nn.Module]
    """The router modules, one per MoE layer; each returns its logits ``[rows, num_experts]`` (or a
    tuple whose ``logits_index`` item they are), captured by a forward hook."""
    num_experts: int
    """E: the experts each router chooses among."""
    top_k: int
    """The experts each row is routed to (the slots ``c_i`` counts)."""
    coef: float
    """The balancing term's coefficient (transformers' ``router_aux_loss_coef``)."""
    pooled: bool = True
    """True: ``c``, ``R`` and ``S`` summed over the layers before the product (transformers'
    ``load_balancing_loss_func``); False: one term per layer, summed over the layers."""
    mask_fn: MaskFn | None = None
    """The rows that count (padding masked as the model's formula does); ``None``: a micro-batch's
    ``attention_mask`` when it holds one (any mapping, a namedtuple or a dataclass), else every row."""
    mode: BalanceMode = "exact"
    """``exact``: the window's statistics, counted by a no-grad routing pass before the first
    backward; ``lagged``: the previous window's; ``micro-batch``: each micro-batch's own."""
    z_coef: float | None = None
    """The router z-loss coefficient (ST-MoE): ``z_coef * sum_rows logsumexp(logits)^2 / R``, per
    row, normalized by the window's routed rows; ``None``: no z-loss."""
    bias_rate: float | None = None
    """Aux-loss-free balancing (DeepSeek-V3): each router's ``bias_name`` buffer moves by
    ``bias_rate * sign(mean load - load_i)`` once per applied optimizer step, from that window's
    agreed counts (``exact``: with the update; ``lagged``/``micro-batch``: at the next window's
    count all-reduce, before its first forward), never for a skipped window; ``None``: off. The
    router is taken to select the top-k of ``softmax(logits) + bias`` (the bias steers the choice,
    not the weights), and ``c`` counts that selection."""
    bias_name: str = "e_score_correction_bias"
    """The router buffer the bias update moves (the name DeepSeek-V3's router uses)."""
    logits_index: int = 0
    """Where the logits are in a router's output tuple (transformers' routers: 0)."""

    def __post_init__(self) -> None:
        routers = tuple(self.routers) if isinstance(self.routers, (list, tuple)) else None
        if not routers or not all(isinstance(r, nn.Module) for r in routers):
            raise ConfigError(
                f"LoadBalance.routers must be a non-empty list of the router modules (nn.Module), got "
                f"{self.routers!r}; no router / experts found: a dense model has nothing to balance"
            )
        if len({id(r) for r in routers}) != len(routers):
            raise ConfigError("LoadBalance.routers lists a router twice: each MoE layer's router once")
        object.__setattr__(self, "routers", routers)
        for name in ("num_experts", "top_k"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ConfigError(f"LoadBalance.{name} must be an int >= 1, got {value!r}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"LoadBalance.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        _number("coef", self.coef, optional=False)
        _number("z_coef", self.z_coef, optional=True)
        _number("bias_rate", self.bias_rate, optional=True)
        if not isinstance(self.pooled, bool):
            raise ConfigError(f"LoadBalance.pooled must be True or False, got {self.pooled!r}")
        if self.mode not in MODES:
            raise ConfigError(f"LoadBalance.mode must be one of {MODES}, got {self.mode!r}")
        if self.mask_fn is not None and not callable(self.mask_fn):
            raise ConfigError(f"LoadBalance.mask_fn must be callable or None, got {self.mask_fn!r}")
        if not is_int(self.logits_index) or self.logits_index < 0:
            raise ConfigError(f"LoadBalance.logits_index must be an int >= 0, got {self.logits_index!r}")
        if self.bias_rate is not None:
            missing = [
                i
                for i, r in enumerate(routers)
                if not isinstance(getattr(r, self.bias_name, None), torch.Tensor)
            ]
            if missing:
                raise ConfigError(
                    f"LoadBalance(bias_rate={self.bias_rate}) moves each router's {self.bias_name!r} buffer, "
                    f"but router(s) {missing} have none; name the buffer with bias_name= or drop bias_rate"
                )

    def describe(self) -> str:
        """The settings every data rank must share (routers by count, not identity), for the ranks'
        configuration fingerprint."""
        return (
            f"{self.mode} E={self.num_experts} k={self.top_k} L={self.layers} coef={self.coef!r} "
            f"pooled={self.pooled} z={self.z_coef!r} bias={self.bias_rate!r}"
        )

    @property
    def layers(self) -> int:
        """L: the routers, one row of counts each."""
        return len(self.routers)

    def mask(self, micro_batch: Any) -> torch.Tensor | None:
        """The micro-batch's row mask (``mask_fn``, else its ``attention_mask``)."""
        return (self.mask_fn or attention_mask)(micro_batch)

    @classmethod
    def from_model(
        cls, model: nn.Module, *, mode: BalanceMode = "exact", coef: float | None = None
    ) -> LoadBalance:
        """Read a transformers MoE model (before or after DDP/FSDP2/compile wrapping): its routers,
        ``E``, ``top_k`` and ``router_aux_loss_coef`` (``coef`` overrides it), pooled over the
        layers with the attention mask, as its ``load_balancing_loss_func`` computes it.

        A model without routers is refused with a :class:`ConfigError` naming what is missing."""
        from gradaccum.moe.discover import discover

        found = discover(model)
        return cls(
            routers=found.routers,
            num_experts=found.num_experts,
            top_k=found.top_k,
            coef=found.coef if coef is None else coef,
            mode=mode,
        )
