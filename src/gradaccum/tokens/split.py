"""One window's global batch into this rank's micro-batches by a token budget.

Fixed micro-batches of ``micro_batch`` rows must be sized for the longest sequence, so on
variable-length data most of what they compute is padding. Cutting by tokens lets a micro-batch of
short rows hold many of them and one of long rows few, each trimmed to its own longest row.

Why this is exact with :class:`gradaccum.Accumulator`: the step counts the whole window (every
rank's micro-batches) before the first backward and scales each micro-batch's summed loss by W/N,
so how rows are grouped into micro-batches, and how many micro-batches each rank runs, does not
enter the update. A trainer that averages per micro-batch (``loss / k``) would weigh a token of a
micro-batch of short rows above one of long rows; the peers that split by tokens have kept
breaking their normalization that way.
"""

from __future__ import annotations

from typing import Any

import torch

from gradaccum.batch import Batch, batch_size, fields, select, trim_length
from gradaccum.errors import PlanError
from gradaccum.loss import IGNORE_INDEX
from gradaccum.tokens.balance import TokenPlan, plan_tokens
from gradaccum.tokens.cost import CostFn
from gradaccum.values import require_int

__all__ = ["plan_batch", "split_by_tokens"]


def _tokens(batch: Batch) -> torch.Tensor:
    """Where each row holds a token, ``(rows, seq)`` bool on the host: the ``attention_mask``, or
    for a batch without one the labels that are not the ignore index (-100)."""
    named = fields(batch)
    key = "attention_mask" if named is not None and "attention_mask" in named else "labels"
    if named is None or key not in named:
        got = sorted(map(str, named)) if named is not None else type(batch).__name__
        raise PlanError(
            f"split_by_tokens reads each row's length from batch['attention_mask'] (or, without one, "
            f"batch['labels']), got {got}; pass the window's global batch as a mapping of right-padded "
            "tensors with an attention_mask (1 on tokens, 0 on padding)"
        )
    marks = named[key]
    if not isinstance(marks, torch.Tensor) or marks.ndim != 2 or marks.shape[1] == 0:
        shape = tuple(marks.shape) if isinstance(marks, torch.Tensor) else type(marks).__name__
        raise PlanError(f"{key} must be a (rows, seq) tensor with seq >= 1, got {shape}")
    batch_size(batch)  # every tensor shares dim 0
    marks = marks.detach().to("cpu")
    return marks != 0 if key == "attention_mask" else marks != IGNORE_INDEX


def _tokens_tensor(batch: Batch) -> torch.Tensor:
    """The tensor :func:`_tokens` read the rows' tokens from (on the batch's device)."""
    named = fields(batch)
    assert named is not None  # _tokens refused a batch without names
    marks: torch.Tensor = named["attention_mask" if "attention_mask" in named else "labels"]
    return marks


def plan_batch(
    batch: Batch, max_tokens: int, *, world: int = 1, equal_count: bool = False, cost: CostFn | None = None
) -> TokenPlan:
    """Every rank's micro-batches of ``batch`` as row indices, with what they compute
    (:class:`gradaccum.tokens.balance.TokenPlan`): what :func:`split_by_tokens` cuts by. ``cost``:
    balance the ranks' compute cost instead of their valid tokens (see :func:`split_by_tokens`)."""
    present = _tokens(batch)
    positions = torch.arange(1, present.shape[1] + 1).expand_as(present)
    # a row's length is the position after its last token: what trimming must keep (at least 1,
    # so that a row without a token still has a shape the model takes)
    lengths = (positions * present).amax(dim=1).clamp(min=1)
    valid = present.sum(dim=1)
    return plan_tokens(
        [int(n) for n in lengths.tolist()],
        max_tokens,
        world=world,
        equal_count=equal_count,
        valid=[int(n) for n in valid.tolist()],
        cost=cost,
    )


def split_by_tokens(
    batch: Any,
    max_tokens: int,
    *,
    rank: int = 0,
    world: int = 1,
    equal_count: bool = False,
    cost: CostFn | None = None,
) -> list[Any]:
    """This rank's micro-batches of one window's global ``batch``, each within ``max_tokens``.

    >>> for batch in loader:  # each a window's global batch, the same on every rank
    ...     window = gradaccum.split_by_tokens(batch, 4096, rank=rank, world=world)
    ...     acc.step(window, loss.loss_fn, loss.count_fn)

    ``batch`` is a mapping of right-padded tensors sharing dim 0 with an ``attention_mask`` (without
    one, the labels that are not -100 mark the tokens); every rank passes the same one. The rows
    are sorted by length (longest first, ties by position: the result is deterministic) and cut
    into micro-batches of at most ``max_tokens`` computed tokens, rows x longest; each micro-batch
    holds the same keys, trimmed to its own longest row. Every row lies in exactly one micro-batch
    of one rank; every rank gets at least one.

    What is balanced: the ranks' **valid tokens**, by Karmarkar-Karp's largest differencing over the
    micro-batches, then single rows moved or swapped from the heaviest rank to the lightest where a
    micro-batch has room (see :mod:`gradaccum.tokens.balance`). Valid tokens, not tokens plus an
    attention term, because every rank's micro-batches come out of the same length-sorted cut with
    the same budget, so a rank's computed tokens (padding included) follow its valid ones; and at
    the lengths a budget bounds, a transformer's time grows with tokens through its projections
    and MLPs far more than through attention's length-squared term. They are also the units the
    gradient weighs.

    ``cost`` balances the ranks' **compute cost** instead: a callable called on one micro-batch's
    row lengths (its rows' valid tokens, a sequence of ints) that returns its cost, a sum over rows
    or not; the plan balances the ranks' totals of what it returns (:mod:`gradaccum.tokens.cost`).
    ``gradaccum.tokens.transformer_cost(d_model, layers)`` prices a row of L tokens at
    ``L * (1 + L / (6 * d_model))``: attention's length-squared term, which on long-tailed lengths
    (a few long rows beside many short ones) makes the rank with the long rows the straggler at the
    same token total. The cut, the budget, the trimming and the exactness are unchanged: only which
    rows go to which rank and micro-batch differs, and the step counts the same rows.

    ``equal_count=True`` gives every rank the same number of micro-batches: FSDP, FSDP2 and meshes
    gather parameters in every forward, and the step refuses unequal counts there. Without it the
    counts may differ between ranks (DDP steps them exactly). It is refused only for a window that
    has no equal plan: when no multiple of ``world`` lies between the fewest micro-batches the
    budget allows and the window's rows.

    A row longer than ``max_tokens`` is refused (:class:`gradaccum.PlanError`, naming its length
    and the budget), as are fewer rows than ranks.
    """
    world = require_int("world", world, error=PlanError)
    rank = require_int("rank", rank, low=0, error=PlanError)
    if rank >= world:
        raise PlanError(f"rank={rank} is not one of the world's {world} ranks (0..{world - 1})")
    plan = plan_batch(batch, max_tokens, world=world, equal_count=equal_count, cost=cost)
    out = []
    device = _tokens_tensor(batch).device
    for rows in plan.ranks[rank]:
        longest = max(plan.lengths[i] for i in rows)
        index = torch.tensor(rows, dtype=torch.long, device=device)
        out.append(trim_length(select(batch, index), longest))
    return out
