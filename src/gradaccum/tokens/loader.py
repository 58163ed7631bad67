"""Token-budget windows from an iterable of tokenized documents: padded rows or packed rows.

``gradaccum.windows(documents, max_tokens=B, global_batch=G, rank=r, world=W)`` takes G documents
per window (the same G on every rank, in the same order), lays them out as rows, and yields this
rank's micro-batches of the window (:func:`gradaccum.split_by_tokens`'s cut and balance):

* ``layout="padded"``: one document per row (:func:`gradaccum.packing.pad`), ``attention_mask``
  marking its tokens; for models that take no document boundaries.
* ``layout="packed"``: documents back to back in rows of ``max_tokens`` (:func:`gradaccum.pack`,
  first fit), ``position_ids`` restarting at each document; for models that take them
  (:class:`gradaccum.CausalLMLoss` with ``mask_documents=True``, or transformers' packed-sequence
  detection). A packed row is one micro-batch's worth of tokens with almost no padding, so the
  balance is over whole rows.

Labels follow :mod:`gradaccum.packing` (``shift=True``: equal to the inputs, ignore index on each
document's first token and on padding), so :class:`gradaccum.CausalLMLoss` counts and sums them
and the step normalizes each window by its own global count: the final short window included.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal

import torch

from gradaccum.batch import select, trim_length
from gradaccum.errors import PlanError
from gradaccum.packing import pack, pad
from gradaccum.tokens.balance import plan_tokens
from gradaccum.tokens.cost import CostFn
from gradaccum.tokens.split import split_by_tokens
from gradaccum.values import require_int

__all__ = ["Layout", "token_windows"]

Layout = Literal["padded", "packed"]
"""How documents become rows: one per row, right-padded; or back to back in rows of the budget."""

Document = Sequence[int] | torch.Tensor


def _refuse_long(docs: list[Document], max_tokens: int, first: int) -> None:
    for i, doc in enumerate(docs):
        if len(doc) > max_tokens:
            raise PlanError(
                f"document {first + i} holds {len(doc)} tokens, more than max_tokens={max_tokens}: no "
                f"micro-batch within the budget can hold it. Raise max_tokens to at least {len(doc)}, "
                "or cut or drop the documents longer than the budget first."
            )


def _packed_window(
    docs: list[Document],
    max_tokens: int,
    rank: int,
    world: int,
    equal_count: bool,
    shift: bool,
    cost: CostFn | None,
) -> list[dict[str, torch.Tensor]]:
    rows = pack(docs, max(max_tokens, 2), shift=shift, overflow="error")
    lengths = [sum(lengths) for lengths in rows.row_lengths]
    plan = plan_tokens(lengths, max_tokens, world=world, equal_count=equal_count, cost=cost)
    return [
        trim_length(select(rows.batch, torch.tensor(mb)), max(lengths[i] for i in mb))
        for mb in plan.ranks[rank]
    ]


def token_windows(
    documents: Iterable[Document],
    *,
    max_tokens: int,
    global_batch: int,
    rank: int = 0,
    world: int = 1,
    equal_count: bool = False,
    layout: Layout = "padded",
    shift: bool = True,
    cost: CostFn | None = None,
) -> Iterator[list[Any]]:
    """This rank's micro-batches of each window of ``global_batch`` documents (see the module);
    ``cost`` balances the ranks' compute cost instead of their valid tokens (a packed row's length
    is its documents' tokens together, so a cost that prices attention per row over-prices packed
    rows whose documents attend only within themselves)."""
    max_tokens = require_int("max_tokens", max_tokens, error=PlanError)
    global_batch = require_int("global_batch", global_batch, error=PlanError)
    world = require_int("world", world, error=PlanError)
    rank = require_int("rank", rank, low=0, error=PlanError)
    if rank >= world:
        raise PlanError(f"rank={rank} is not one of the world's {world} ranks (0..{world - 1})")
    if layout not in ("padded", "packed"):
        raise PlanError(f"layout must be 'padded' or 'packed', got {layout!r}")
    if cost is not None and not callable(cost):
        raise PlanError(f"cost must be a callable on a micro-batch's row lengths, got {type(cost).__name__}")
    return _windows(documents, max_tokens, global_batch, rank, world, equal_count, layout, shift, cost)


def _windows(
    documents: Iterable[Document],
    max_tokens: int,
    global_batch: int,
    rank: int,
    world: int,
    equal_count: bool,
    layout: Layout,
    shift: bool,
    cost: CostFn | None,
) -> Iterator[list[Any]]:
    window: list[Document] = []
    first = 0
    for doc in documents:
        window.append(doc)
        if len(window) == global_batch:
            yield _window(window, first, max_tokens, rank, world, equal_count, layout, shift, cost)
            first += len(window)
            window = []
    if window:
        yield _window(window, first, max_tokens, rank, world, equal_count, layout, shift, cost)


def _window(
    docs: list[Document],
    first: int,
    max_tokens: int,
    rank: int,
    world: int,
    equal_count: bool,
    layout: Layout,
    shift: bool,
    cost: CostFn | None,
) -> list[Any]:
    _refuse_long(docs, max_tokens, first)
    if layout == "packed":
        return _packed_window(docs, max_tokens, rank, world, equal_count, shift, cost)
    longest = max((len(doc) for doc in docs), default=0)
    rows = pad(docs, max(longest, 2), shift=shift, overflow="error")
    return split_by_tokens(rows.batch, max_tokens, rank=rank, world=world, equal_count=equal_count, cost=cost)
