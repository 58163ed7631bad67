"""The four aggregations of per-token policy losses, each as a weighted sum over units and a count.

verl's ``loss_agg_mode`` names them; over the window's S sequences with at least one response token
and its N response tokens (len_s tokens in sequence s):

* ``token-mean``: sum l_t / N. Unit: a response token, weight 1.
* ``seq-mean-token-mean``: (1/S) sum_s (1/len_s) sum_{t in s} l_t. Unit: a sequence, token weight 1/len_s.
* ``seq-mean-token-sum``: (1/S) sum_s sum_{t in s} l_t. Unit: a sequence, token weight 1.
* ``seq-mean-token-sum-norm``: sum l_t / (S x max_response_len) (Dr. GRPO). Unit: a sequence,
  token weight 1 / max_response_len.

**Rows without a response token** (a truncated completion masked out, a tool mask covering it all)
add nothing to the weighted sum, but conventions differ on whether they count in S: ``excluded``
(S = rows with at least one response token; verl's ``agg_loss`` with ``exclude_fully_masked_seq``)
or ``counted`` (S = every row: TRL 1.16's ``grpo``, ``sapo``, ``dr_grpo`` and ``luspo`` take the
mean over the micro-batch's rows, ``.mean()`` or ``/ (rows x max_completion_length)``). With one
such row in eight the two differ by 8/7. Token means count tokens and are the same under both.

A unit never spans micro-batches (a sequence is one row), so the accumulator's division of the
window's summed loss by its global count of units gives each aggregation's window mean exactly,
whatever the micro-batch x accumulation x data-parallel split.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

__all__ = [
    "AGGREGATIONS",
    "EMPTY_ROWS",
    "Aggregation",
    "EmptyRows",
    "token_weights",
    "unit_count",
    "unit_name",
]

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
EmptyRows = Literal["excluded", "counted"]
EMPTY_ROWS: tuple[str, ...] = get_args(EmptyRows)
"""Whether a row with no response token counts as a sequence in the sequence aggregations."""


def unit_name(aggregation: str) -> str:
    """What the count counts, for reports: ``tokens`` or ``sequences``."""
    return "tokens" if aggregation == "token-mean" else "sequences"


def token_weights(
    mask: torch.Tensor, aggregation: str, max_response_len: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """Each target's weight in the micro-batch's summed loss (0 outside the response mask)."""
    weights = mask.to(dtype)
    if aggregation == "seq-mean-token-mean":
        lengths = weights.sum(dim=1, keepdim=True).clamp(min=1.0)
        return weights / lengths
    if aggregation == "seq-mean-token-sum-norm":
        assert max_response_len is not None  # PolicyLoss refuses the aggregation without it
        return weights / float(max_response_len)
    return weights


def unit_count(mask: torch.Tensor, aggregation: str, empty_rows: str = "excluded") -> torch.Tensor:
    """The micro-batch's units (0-dim int64, on the mask's device): response tokens, or sequences:
    those holding at least one response token (``excluded``), or every row (``counted``)."""
    if aggregation == "token-mean":
        return mask.sum(dtype=torch.int64)
    if empty_rows == "counted":
        return torch.tensor(mask.shape[0], dtype=torch.int64, device=mask.device)
    return mask.any(dim=1).sum(dtype=torch.int64)
