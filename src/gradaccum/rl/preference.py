"""``PreferenceLoss``: DPO and IPO over (chosen, rejected) pairs, one unit per pair.

A pair's loss depends on its two responses' summed log-probs against the reference model's:
with h_c = lp(chosen) - ref(chosen) and h_r = lp(rejected) - ref(rejected),

* ``dpo``: -log sigmoid(beta (h_c - h_r));
* ``ipo``: (h_c / len_c - h_r / len_r - 1 / (2 beta))^2 (per-token means, as TRL computes it).

``loss_fn`` returns the sum over the micro-batch's pairs and ``count_fn`` the number of pairs, so
the window's update is the mean over all its pairs on all ranks, however they are split. (TRL's
``DPOTrainer`` averages each micro-batch's pairs and divides by the accumulation steps: exact only
when every micro-batch on every rank holds as many pairs.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradaccum.batch import fields
from gradaccum.errors import ConfigError
from gradaccum.fielddocs import document_fields
from gradaccum.rl.objective import token_logprobs
from gradaccum.rl.policy import model_logits
from gradaccum.values import require_choice

__all__ = ["PREFERENCE_OBJECTIVES", "PreferenceLoss", "PreferenceObjective"]

PreferenceObjective = Literal["dpo", "ipo"]
PREFERENCE_OBJECTIVES: tuple[str, ...] = get_args(PreferenceObjective)
_SIDES = ("chosen", "rejected")
_PER_TOKEN = ("input_ids", "response_mask")


@document_fields
@dataclass(frozen=True, slots=True)
class PreferenceLoss:
    """A DPO-family loss summed over pairs, for ``Accumulator.step`` and ``verify``.

    >>> loss = gradaccum.rl.PreferenceLoss("dpo", beta=0.1)
    >>> acc.step(window, loss.loss_fn, loss.count_fn)

    A micro-batch is a mapping with ``chosen_input_ids``, ``chosen_response_mask``,
    ``rejected_input_ids``, ``rejected_response_mask`` (all ``(pairs, seq)``, the same ``seq``),
    ``ref_chosen_logprobs`` and ``ref_rejected_logprobs`` (``(pairs,)``: the reference model's
    log-prob of each response, summed over its tokens), and optionally ``chosen_attention_mask`` and
    ``rejected_attention_mask``. The model runs once on the chosen rows followed by the rejected rows.
    """

    objective: PreferenceObjective = "dpo"
    """``dpo`` (the sigmoid loss) or ``ipo``."""
    beta: float = 0.1
    """DPO's inverse temperature, IPO's regularization (tau); > 0."""

    def __post_init__(self) -> None:
        require_choice("PreferenceLoss objective", self.objective, PREFERENCE_OBJECTIVES)
        beta = self.beta
        if (
            isinstance(beta, bool)
            or not isinstance(beta, (int, float))
            or not math.isfinite(beta)
            or beta <= 0
        ):
            raise ConfigError(f"PreferenceLoss beta must be a finite number > 0, got {beta!r}")

    @property
    def unit(self) -> str:
        """What ``count_fn`` counts: pairs."""
        return "pairs"

    def count_fn(self, micro_batch: Any) -> torch.Tensor:
        """The micro-batch's pairs (0-dim int64)."""
        ids = _pairs(micro_batch)["chosen_input_ids"]
        return torch.tensor(ids.shape[0], dtype=torch.int64, device=ids.device)

    def positions(self, micro_batch: Any) -> torch.Tensor:
        """Response tokens of both sides (0-dim int64): where ``loss_fn`` reaches the model's output,
        for the denominator audit of ``verify``."""
        batch = _pairs(micro_batch)
        return sum((batch[f"{side}_response_mask"][:, 1:] != 0).sum() for side in _SIDES)  # type: ignore[return-value]

    def loss_fn(self, model: nn.Module, micro_batch: Any) -> torch.Tensor:
        """The micro-batch's pair losses, summed."""
        batch = _pairs(micro_batch)
        pairs = batch["chosen_input_ids"].shape[0]
        joint: dict[str, torch.Tensor] = {
            "input_ids": torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]]),
        }
        if "chosen_attention_mask" in batch:
            joint["attention_mask"] = torch.cat(
                [batch["chosen_attention_mask"], batch["rejected_attention_mask"]]
            )
        logits = model_logits(model, joint, "PreferenceLoss")
        logprobs = token_logprobs(logits, joint["input_ids"])
        mask = torch.cat([batch[f"{side}_response_mask"] for side in _SIDES])[:, 1:] != 0
        summed = torch.where(
            mask, logprobs, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
        ).sum(1)
        ref = torch.cat([batch["ref_chosen_logprobs"], batch["ref_rejected_logprobs"]]).to(summed.dtype)
        ratio = summed - ref
        if self.objective == "dpo":
            margin = ratio[:pairs] - ratio[pairs:]
            return -F.logsigmoid(self.beta * margin).sum()
        lengths = mask.sum(dim=1).clamp(min=1).to(summed.dtype)
        mean = ratio / lengths
        return ((mean[:pairs] - mean[pairs:] - 1.0 / (2.0 * self.beta)) ** 2).sum()


def _pairs(micro_batch: Any) -> Mapping[str, torch.Tensor]:
    """The micro-batch, checked: both sides' tensors of one shape, one reference log-prob per pair."""
    keys = [f"{side}_{key}" for side in _SIDES for key in _PER_TOKEN] + [
        f"ref_{side}_logprobs" for side in _SIDES
    ]
    named = fields(micro_batch)
    if named is None:
        raise ConfigError(
            f"PreferenceLoss needs a micro-batch mapping with {keys}, got {type(micro_batch).__name__}"
        )
    micro_batch = named
    missing = [key for key in keys if key not in micro_batch]
    if missing:
        raise ConfigError(f"PreferenceLoss: the micro-batch has no {missing}; it holds {sorted(micro_batch)}")
    ids = micro_batch["chosen_input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.dtype.is_floating_point or ids.shape[1] < 2:
        raise ConfigError(
            "PreferenceLoss: chosen_input_ids must be an integer (pairs, seq) tensor with seq >= 2"
        )
    shape = tuple(ids.shape)
    optional = [f"{side}_attention_mask" for side in _SIDES if f"{side}_attention_mask" in micro_batch]
    if len(optional) == 1:
        raise ConfigError(f"PreferenceLoss: {optional[0]} is given for one side only; give both or neither")
    for key in [k for k in keys if not k.startswith("ref_")] + optional:
        value = micro_batch[key]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ConfigError(
                f"PreferenceLoss: {key} must have the shape of chosen_input_ids {shape} (pad both sides "
                f"of a pair to one length), got {got}"
            )
    for side in _SIDES:
        ref = micro_batch[f"ref_{side}_logprobs"]
        if (
            not isinstance(ref, torch.Tensor)
            or tuple(ref.shape) != shape[:1]
            or not ref.dtype.is_floating_point
        ):
            got = tuple(ref.shape) if isinstance(ref, torch.Tensor) else type(ref).__name__
            raise ConfigError(
                f"PreferenceLoss: ref_{side}_logprobs must be a floating ({shape[0]},) tensor (the reference "
                f"log-prob of each response, summed over its tokens), got {got}"
            )
    return micro_batch
