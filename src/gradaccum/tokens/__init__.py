"""Micro-batches by a token budget: rows sorted by length, cut within the budget, balanced across
ranks (:mod:`gradaccum.tokens.balance`), by valid tokens or by a compute cost
(:func:`transformer_cost`, :mod:`gradaccum.tokens.cost`); one window's batch into this rank's
micro-batches (:func:`gradaccum.split_by_tokens`, :mod:`gradaccum.tokens.split`); token-budget
windows from tokenized documents, padded or packed (``gradaccum.windows(..., max_tokens=)``,
:mod:`gradaccum.tokens.loader`)."""

from __future__ import annotations

from gradaccum.tokens.cost import TransformerCost, transformer_cost

__all__ = ["TransformerCost", "transformer_cost"]
