"""``PolicyLoss``: a policy-gradient loss (PPO/GRPO clipped surrogate, optional KL) for ``Accumulator.step``.

Like :class:`gradaccum.CausalLMLoss`, it fits the engine's rule without touching it: ``loss_fn``
returns the micro-batch's per-token losses summed with each aggregation's weights
(:mod:`gradaccum.rl.aggregation`), ``count_fn`` the number of units, and the accumulator divides
the window's sum by the window's global count. So ``token-mean`` divides by the update's response
tokens on all ranks, not by each micro-batch's (TRL's ``bnpo``, a mean of means), and the
sequence means divide by the update's sequences, not by each micro-batch's rows (``grpo``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from gradaccum.batch import fields
from gradaccum.errors import ConfigError, CountError
from gradaccum.fielddocs import document_fields
from gradaccum.loss import logits_of
from gradaccum.rl.aggregation import (
    AGGREGATIONS,
    EMPTY_ROWS,
    Aggregation,
    EmptyRows,
    token_weights,
    unit_count,
    unit_name,
)
from gradaccum.rl.inputs import MODEL_KEYS, policy_inputs
from gradaccum.rl.objective import per_token_loss, token_logprobs
from gradaccum.values import require_choice

__all__ = ["PolicyLoss", "model_logits"]


@document_fields
@dataclass(frozen=True, slots=True)
class PolicyLoss:
    """The clipped policy-gradient loss summed over counted units, for ``Accumulator.step`` and ``verify``.

    >>> loss = gradaccum.rl.PolicyLoss("seq-mean-token-mean", clip_eps=0.2)
    >>> acc.step(window, loss.loss_fn, loss.count_fn)

    A micro-batch is a mapping with ``input_ids``, ``response_mask``, ``old_logprobs``,
    ``advantages`` (one per row or per token) and optionally ``ref_logprobs`` (see
    :mod:`gradaccum.rl.inputs`); the model returns the logits or an output with ``.logits``, and
    token t's log-prob comes from the logits at t - 1 (so position 0 is never a response token).
    The per-token loss is in :mod:`gradaccum.rl.objective`, the aggregations in
    :mod:`gradaccum.rl.aggregation`.
    """

    aggregation: Aggregation = "token-mean"
    """``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum`` or ``seq-mean-token-sum-norm``."""
    clip_eps: float = 0.2
    """The importance ratio is clipped to [1 - clip_eps, 1 + clip_eps] (PPO/GRPO); in (0, 1)."""
    kl_coef: float = 0.0
    """Weight of the KL estimate against ``ref_logprobs`` (0: no KL term, no reference needed)."""
    max_response_len: int | None = None
    """Dr. GRPO's constant normalizer, for ``seq-mean-token-sum-norm`` only (and required there)."""
    empty_rows: EmptyRows = "excluded"
    """Whether a row with no response token counts as a sequence in the sequence aggregations:
    ``excluded`` (S = rows with a response token) or ``counted`` (S = every row, as TRL 1.16's
    grpo/dr_grpo divide); see :mod:`gradaccum.rl.aggregation`."""

    def __post_init__(self) -> None:
        require_choice("PolicyLoss aggregation", self.aggregation, AGGREGATIONS)
        require_choice("PolicyLoss empty_rows", self.empty_rows, EMPTY_ROWS)
        for name in ("clip_eps", "kl_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"PolicyLoss {name} must be a finite number, got {value!r}")
        if not 0.0 < self.clip_eps < 1.0:
            raise ConfigError(f"PolicyLoss clip_eps must lie in (0, 1), got {self.clip_eps!r}")
        if self.kl_coef < 0:
            raise ConfigError(f"PolicyLoss kl_coef must be >= 0, got {self.kl_coef!r}")
        norm = self.aggregation == "seq-mean-token-sum-norm"
        given = self.max_response_len is not None
        if given and (
            isinstance(self.max_response_len, bool)
            or not isinstance(self.max_response_len, int)
            or self.max_response_len < 1
        ):
            raise ConfigError(
                f"PolicyLoss max_response_len must be a positive int, got {self.max_response_len!r}"
            )
        if norm and not given:
            raise ConfigError(
                "PolicyLoss(aggregation='seq-mean-token-sum-norm') divides by sequences x "
                "max_response_len: pass max_response_len (the generation limit)"
            )
        if given and not norm:
            raise ConfigError(
                f"PolicyLoss max_response_len={self.max_response_len} is used only by "
                f"aggregation='seq-mean-token-sum-norm', not {self.aggregation!r}; drop it"
            )

    @property
    def unit(self) -> str:
        """What ``count_fn`` counts, for reports: ``tokens`` or ``sequences``."""
        return unit_name(self.aggregation)

    def count_fn(self, micro_batch: Any) -> torch.Tensor:
        """The micro-batch's units (0-dim int64): response tokens, or sequences (``empty_rows``).

        Reads the device once, to refuse a response mask on position 0 (no logits predict it) and,
        under ``seq-mean-token-sum-norm``, a response longer than ``max_response_len``.
        """
        inputs = policy_inputs(micro_batch, need_ref=False)
        longest = (
            inputs.mask.sum(dim=1).max()
            if inputs.mask.shape[0]
            else inputs.mask.new_zeros((), dtype=torch.long)
        )
        first, length = torch.stack([inputs.first_masked.any().long(), longest.long()]).tolist()
        if first:
            raise ConfigError(
                "PolicyLoss: response_mask marks position 0 of a row, whose log-prob no logits "
                "predict (token t's log-prob comes from the logits at t - 1). Mark only response "
                "tokens, which follow at least one prompt token."
            )
        if self.max_response_len is not None and length > self.max_response_len:
            raise CountError(
                f"PolicyLoss: a response holds {length} tokens, more than max_response_len="
                f"{self.max_response_len}: Dr. GRPO's normalizer must bound every response. Pass the "
                "generation limit as max_response_len."
            )
        return unit_count(inputs.mask, self.aggregation, self.empty_rows)

    def positions(self, micro_batch: Any) -> torch.Tensor:
        """The target positions ``loss_fn`` puts a gradient on (0-dim int64), for the denominator
        audit of ``verify``: response tokens, less those whose advantage is zero when there is no KL
        term (their gradient is exactly zero). Clipped tokens also get none: verify with
        ``audit=False`` from weights where the ratio is clipped."""
        inputs = policy_inputs(micro_batch, need_ref=False)
        if self.kl_coef == 0.0:
            return (inputs.mask & (inputs.advantages != 0)).sum()
        return inputs.mask.sum()

    def loss_fn(self, model: nn.Module, micro_batch: Any) -> torch.Tensor:
        """The micro-batch's per-token losses summed with the aggregation's weights."""
        inputs = policy_inputs(micro_batch, need_ref=self.kl_coef > 0)
        logits = model_logits(model, micro_batch, "PolicyLoss")
        logprobs = token_logprobs(logits, fields_of(micro_batch, "PolicyLoss")["input_ids"])
        dtype = logprobs.dtype
        losses = per_token_loss(
            logprobs,
            inputs.old_logprobs.to(dtype),
            inputs.advantages.to(dtype),
            None if inputs.ref_logprobs is None else inputs.ref_logprobs.to(dtype),
            clip_eps=float(self.clip_eps),
            kl_coef=float(self.kl_coef),
        )
        weights = token_weights(inputs.mask, self.aggregation, self.max_response_len, dtype)
        return (losses * weights).sum()


def model_logits(model: nn.Module, micro_batch: Any, who: str) -> torch.Tensor:
    """Call ``model`` on the micro-batch's model keys; its logits ``(rows, seq, vocab)``."""
    named = fields_of(micro_batch, who)
    out = model(**{key: named[key] for key in MODEL_KEYS if key in named})
    return logits_of(out, named["input_ids"], who=who, against="input_ids")


def fields_of(micro_batch: Any, who: str) -> Mapping[Any, Any]:
    """The micro-batch's named fields (:func:`gradaccum.batch.fields`), or a ``ConfigError``."""
    named = fields(micro_batch)
    if named is None:
        raise ConfigError(
            f"{who} needs a micro-batch of named tensors (a mapping, a namedtuple or a dataclass), "
            f"got {type(micro_batch).__name__}"
        )
    return named
