"""Which load balance a command runs on a workload's model: one rule for ``train``, ``verify`` and
``bench`` (and the same as :func:`gradaccum.integrations.transformers.exact_trainer`'s).

A model that routes (:meth:`gradaccum.moe.LoadBalance.from_model` finds its routers) is balanced
over the window when asked (``--balance exact|lagged|micro-batch``) or, by default, when its config
asks for its balancing loss (``output_router_logits=True``, a non-zero ``router_aux_loss_coef``): the
window's exact term then replaces the model's own per-forward one, which is turned off on the model
(the term would otherwise count twice). Otherwise the balance is off: the loss is the workload's
``loss_fn`` alone. A model without routers has nothing to balance: ``--balance off`` (or none) is
fine, another mode is refused by name. Whatever is chosen is said (:meth:`BalanceChoice.describe`)
and recorded (:meth:`BalanceChoice.to_dict`, the run card's ``balance``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from gradaccum.errors import ConfigError
from gradaccum.moe.discover import unwrap
from gradaccum.moe.spec import LoadBalance

__all__ = ["BalanceChoice", "asks_for_balance", "choose_balance"]


@dataclass(frozen=True, kw_only=True, slots=True)
class BalanceChoice:
    """The load balance a routing model runs with, and why."""

    mode: str
    """``exact``, ``lagged``, ``micro-batch`` or ``off``."""
    coef: float
    """The balancing term's coefficient (the model's ``router_aux_loss_coef``)."""
    asked: bool
    """Whether the model's config asks for its balancing loss (``output_router_logits=True``)."""
    given: bool
    """Whether the mode was given (``--balance``) rather than the model's default."""
    flag: str = "--balance"
    """The flag that gives it, for the words."""

    def describe(self) -> str:
        """One line for a banner: the mode, the coefficient, and why."""
        if self.mode == "off":
            if self.given:
                why = f"{self.flag} off" + (
                    "; the model's own per-micro-batch term is dropped too" if self.asked else ""
                )
            else:
                why = (
                    "by default: the model's config does not ask for its balancing loss, "
                    f"output_router_logits is not True; {self.flag} exact adds the window's exact term"
                )
            return f"load balance: off, no balancing term (coefficient {self.coef:g} unused): {why}"
        why = (
            f"{self.flag} {self.mode}"
            if self.given
            else "by default: the model's config asks for its balancing loss, output_router_logits=True"
        )
        return f"load balance: {self.mode}, coefficient {self.coef:g} (router_aux_loss_coef): {why}"

    def to_dict(self) -> dict[str, Any]:
        """What a run card records: ``{"mode": ..., "coef": ...}``."""
        return {"mode": self.mode, "coef": self.coef}


def asks_for_balance(model: nn.Module) -> bool:
    """Whether ``model``'s config asks for its balancing loss (``output_router_logits=True``)."""
    config = getattr(unwrap(model), "config", None)
    return getattr(config, "output_router_logits", None) is True


def choose_balance(
    model: nn.Module, requested: str | None, *, scaling: str = "pre", flag: str = "--balance"
) -> tuple[LoadBalance | None, BalanceChoice | None]:
    """The load balance to run ``model`` with (``None``: no balancing term) and the choice in words
    (``None``: the model does not route). ``requested``: ``exact``, ``lagged``, ``micro-batch``,
    ``off`` or ``None`` (the model's default). A balance turns the model's own term off
    (``output_router_logits=False`` on its config), which the window's term replaces."""
    try:
        spec = LoadBalance.from_model(model)
    except ConfigError:
        if requested not in (None, "off"):
            raise ConfigError(
                f"{flag} {requested}: the model has no mixture-of-experts routers, so there is no "
                f"balancing term to apply; drop {flag} (or give {flag} off)"
            ) from None
        return None, None
    asked = asks_for_balance(model)
    mode = requested or ("exact" if asked and spec.coef != 0 else "off")
    choice = BalanceChoice(
        mode=mode, coef=float(spec.coef), asked=asked, given=requested is not None, flag=flag
    )
    if mode == "off":
        return None, choice
    if scaling == "post":
        how = (
            f"{flag} {mode}"
            if requested
            else f"the model's config asks for its balancing loss ({flag} {mode})"
        )
        raise ConfigError(
            f"{how}, but --scaling post streams the window, and the balancing term needs the "
            f"window's routing statistics before its first backward: use --scaling pre, or {flag} off"
        )
    if asked:
        config: Any = unwrap(model).config
        config.output_router_logits = False  # the window's term replaces the model's own
    return dataclasses.replace(spec, mode=mode), choice  # type: ignore[arg-type]
