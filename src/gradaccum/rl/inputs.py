"""Reading a policy micro-batch: the contract's keys, checked once, aligned with the targets.

A micro-batch is a mapping with ``input_ids`` (prompt and response, ``(rows, seq)``),
``response_mask`` (1 on response tokens whose log-prob is trained), ``old_logprobs`` (per token,
aligned with ``input_ids``), ``advantages`` (one per row, or per token) and optionally
``ref_logprobs``, ``attention_mask`` and ``position_ids`` (handed to the model). Anything else is
refused with a :class:`~gradaccum.errors.ConfigError` naming the key, its shape and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from gradaccum.batch import fields
from gradaccum.errors import ConfigError

__all__ = ["MODEL_KEYS", "PolicyInputs", "policy_inputs"]

MODEL_KEYS = ("input_ids", "attention_mask", "position_ids")
"""The micro-batch keys handed to the model."""

_REQUIRED = ("input_ids", "response_mask", "old_logprobs", "advantages")


class PolicyInputs(NamedTuple):
    """One micro-batch's tensors, each aligned with the targets ``input_ids[:, 1:]``."""

    mask: torch.Tensor
    """Bool ``(rows, seq - 1)``: the response tokens whose log-prob is trained."""
    old_logprobs: torch.Tensor
    """``(rows, seq - 1)``, zero outside the mask."""
    advantages: torch.Tensor
    """``(rows, 1)`` (one per row) or ``(rows, seq - 1)``, zero outside the mask (a row's one
    advantage is zero where the row has no response token)."""
    ref_logprobs: torch.Tensor | None
    """``(rows, seq - 1)``, zero outside the mask; None when absent."""
    first_masked: torch.Tensor
    """0-dim bool: does ``response_mask`` mark position 0, which has no log-prob?"""


def policy_inputs(micro_batch: Any, *, need_ref: bool) -> PolicyInputs:
    """The micro-batch's tensors, checked (shapes and dtypes; no device read)."""
    named = fields(micro_batch)
    if named is None:
        raise ConfigError(
            f"PolicyLoss needs a micro-batch mapping with {list(_REQUIRED)} (and optionally "
            f"'ref_logprobs'), got {type(micro_batch).__name__}"
        )
    micro_batch = named
    missing = [key for key in _REQUIRED if key not in micro_batch]
    if need_ref and "ref_logprobs" not in micro_batch:
        missing.append("ref_logprobs")
    if missing:
        why = " (kl_coef > 0 needs the reference model's log-probs)" if "ref_logprobs" in missing else ""
        raise ConfigError(
            f"PolicyLoss: the micro-batch has no {missing}{why}; it holds {sorted(micro_batch)}. A policy "
            f"micro-batch needs {list(_REQUIRED)}: response_mask is 1 on the response tokens whose "
            "log-prob is trained, old_logprobs and ref_logprobs are per token and aligned with input_ids"
        )
    ids = micro_batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.dtype.is_floating_point or ids.shape[1] < 2:
        raise ConfigError(
            f"PolicyLoss: input_ids must be an integer (rows, seq) tensor, seq >= 2; got {_desc(ids)}"
        )
    shape = tuple(ids.shape)
    raw_mask = _per_token(micro_batch, "response_mask", shape)
    if raw_mask.dtype.is_floating_point and not bool(((raw_mask == 0) | (raw_mask == 1)).all()):
        raise ConfigError(
            "PolicyLoss: response_mask must hold 0 and 1 only (it selects tokens, it does not weigh them)"
        )
    mask = raw_mask[:, 1:] != 0
    old = _per_token(micro_batch, "old_logprobs", shape, floating=True)[:, 1:]
    advantages = micro_batch["advantages"]
    if not isinstance(advantages, torch.Tensor) or not advantages.dtype.is_floating_point:
        raise ConfigError(f"PolicyLoss: advantages must be a floating tensor, got {_desc(advantages)}")
    rows = shape[0]
    if advantages.shape in ((rows,), (rows, 1)):
        adv = advantages.reshape(rows, 1)
    elif tuple(advantages.shape) == shape:
        adv = advantages[:, 1:]
    else:
        raise ConfigError(
            f"PolicyLoss: advantages of shape {tuple(advantages.shape)} fit neither one per row ({rows},) "
            f"nor one per token {shape} (aligned with input_ids)"
        )
    ref = None
    if "ref_logprobs" in micro_batch and micro_batch["ref_logprobs"] is not None:
        ref = _per_token(micro_batch, "ref_logprobs", shape, floating=True)[:, 1:]
    zero = torch.zeros((), dtype=old.dtype, device=old.device)
    old = torch.where(mask, old, zero)
    # an advantage where no token is trained is never read: zeroed alike per token and per row (a
    # NaN there would otherwise reach every token of its row through 0 * NaN, and skip the window)
    trained = mask if adv.shape[1] > 1 else mask.any(dim=1, keepdim=True)
    adv = torch.where(trained, adv, zero.to(adv.dtype))
    if ref is not None:
        ref = torch.where(mask, ref, zero.to(ref.dtype))
    return PolicyInputs(mask, old, adv, ref, raw_mask[:, 0] != 0)


def _per_token(
    micro_batch: Mapping[str, Any], key: str, shape: tuple[int, ...], *, floating: bool = False
) -> torch.Tensor:
    value = micro_batch[key]
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
        raise ConfigError(
            f"PolicyLoss: {key} must be a tensor of the shape of input_ids {shape} (one value per token, "
            f"aligned with input_ids), got {_desc(value)}"
        )
    if floating and not value.dtype.is_floating_point:
        raise ConfigError(
            f"PolicyLoss: {key} must be a floating tensor of log-probs, got dtype {value.dtype}"
        )
    return value


def _desc(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
