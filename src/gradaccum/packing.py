"""Documents into rows, and rows back into documents: packing, padding, document boundaries.

A *packed* row holds several tokenized documents back to back. Its ``position_ids`` restart at 0
at each document, and the label of each document's first token is ``ignore_index``: with
``shift=True`` (labels equal to the inputs, as transformers' causal LMs take them) the token at
position t is predicted from position t-1, so the first token of a document would otherwise be
predicted from the end of the previous one. A document of L tokens therefore holds L - 1
targets, packed or padded alike, and a packed row of documents L_1..L_d holds
sum(L_i) - d targets, not sum(L_i) - 1.

A *padded* row holds one document, ``attention_mask`` 1 on its tokens, labels ``ignore_index``
on the padding. :func:`pack` and :func:`pad` cut documents longer than a row the same way, so
the same documents give the same targets in both layouts.

:func:`document_segments` reads the documents of a row back from ``document_ids`` or from the
restarts of ``position_ids``; :func:`block_causal_mask` turns them into the 4D attention mask
with which a transformers model attends within each document only.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from gradaccum.errors import PlanError
from gradaccum.values import require_choice, require_int

__all__ = ["Overflow", "Packed", "block_causal_mask", "document_segments", "pack", "pad", "pieces"]

Overflow = Literal["split", "truncate", "error"]
"""What happens to a document longer than a row: cut into row-sized documents of their own,
cut to its first ``seq_len`` tokens, or refused."""

IGNORE_INDEX = -100


@dataclass(frozen=True, kw_only=True, slots=True)
class Packed:
    """Rows of documents, and what it took to make them."""

    input_ids: torch.Tensor
    """``(rows, seq_len)`` int64 token ids; ``pad_id`` where no document is."""
    labels: torch.Tensor
    """``(rows, seq_len)`` int64: the inputs (``shift=True``) or the next tokens (``shift=False``),
    ``ignore_index`` on padding and wherever a target would cross a document boundary."""
    position_ids: torch.Tensor | None
    """Packed rows: ``(rows, seq_len)`` positions restarting at 0 at each document (the padding
    at a row's end counts as one more, target-less, document). ``None`` for padded rows."""
    attention_mask: torch.Tensor | None
    """Padded rows: ``(rows, seq_len)``, 1 on tokens, 0 on padding. ``None`` for packed rows."""
    row_lengths: tuple[tuple[int, ...], ...]
    """The lengths of the documents in each row, in order."""
    seq_len: int
    """Tokens per row."""
    source_documents: int
    """Documents given (empty ones included)."""
    empty_documents: int
    """Documents with no tokens: dropped."""
    split_documents: int
    """Documents longer than ``seq_len`` that were cut into several (``overflow="split"``)."""
    truncated_tokens: int
    """Tokens dropped by ``overflow="truncate"``."""

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def documents(self) -> int:
        """Documents in the rows (a document cut by ``overflow="split"`` counts once per piece)."""
        return sum(len(lengths) for lengths in self.row_lengths)

    @property
    def tokens(self) -> int:
        """Document tokens in the rows."""
        return sum(sum(lengths) for lengths in self.row_lengths)

    @property
    def padding_tokens(self) -> int:
        """Row slots that hold no document token."""
        return self.rows * self.seq_len - self.tokens

    @property
    def padding_fraction(self) -> float:
        slots = self.rows * self.seq_len
        return self.padding_tokens / slots if slots else 0.0

    @property
    def targets(self) -> int:
        """Valid targets: each document of L tokens predicts L - 1 of them."""
        return sum(max(length - 1, 0) for lengths in self.row_lengths for length in lengths)

    @property
    def batch(self) -> dict[str, torch.Tensor]:
        """The rows as a batch: ``input_ids``, ``labels`` and ``position_ids`` (packed) or
        ``attention_mask`` (padded)."""
        out = {"input_ids": self.input_ids, "labels": self.labels}
        if self.position_ids is not None:
            out["position_ids"] = self.position_ids
        if self.attention_mask is not None:
            out["attention_mask"] = self.attention_mask
        return out

    def summary(self) -> str:
        layout = "packed" if self.position_ids is not None else "padded"
        cut = f", {self.split_documents} split" if self.split_documents else ""
        cut += f", {self.truncated_tokens} tokens truncated" if self.truncated_tokens else ""
        docs = f"{self.documents} document{'' if self.documents == 1 else 's'}"
        rows = f"{self.rows} row{'' if self.rows == 1 else 's'}"
        return (
            f"{docs} {layout} into {rows} of {self.seq_len} tokens: "
            f"{self.tokens} tokens, {self.targets} targets, {self.padding_tokens} padding "
            f"({self.padding_fraction:.1%}){cut}"
        )


@dataclass(frozen=True, slots=True)
class _Pieces:
    docs: list[list[int]]
    source: int
    empty: int
    split: int
    truncated: int


def _as_ids(doc: object, index: int) -> list[int]:
    if isinstance(doc, torch.Tensor):
        if doc.ndim != 1 or doc.is_floating_point() or doc.is_complex() or doc.dtype == torch.bool:
            raise PlanError(
                f"document {index} is a tensor of shape {tuple(doc.shape)} and dtype {doc.dtype}; a "
                "document is a 1-D integer tensor or a sequence of token ids"
            )
        ids = [int(t) for t in doc.tolist()]
    elif isinstance(doc, (str, bytes)) or not isinstance(doc, Iterable):
        raise PlanError(
            f"document {index} is a {type(doc).__name__}; documents are tokenized: sequences of "
            "token ids (tokenize text first, e.g. tokenizer(text)['input_ids'])"
        )
    else:
        try:
            ids = [operator.index(t) for t in doc if not isinstance(t, bool) or _no_bool(t, index)]
        except TypeError:
            bad = next(t for t in doc if not hasattr(t, "__index__"))
            raise PlanError(f"document {index} holds {bad!r}; token ids are integers") from None
    if any(t < 0 for t in ids):
        raise PlanError(f"document {index} holds a negative token id {min(ids)}; token ids are >= 0")
    return ids


def _no_bool(value: bool, index: int) -> bool:
    raise PlanError(f"document {index} holds {value!r}; token ids are integers, not booleans")


def pieces(documents: Iterable[Sequence[int] | torch.Tensor], seq_len: int, overflow: Overflow) -> _Pieces:
    """The documents as rows see them: empty ones dropped, long ones cut as ``overflow`` says."""
    require_int("seq_len", seq_len, low=2, error=PlanError)
    require_choice("overflow", overflow, get_args(Overflow), error=PlanError)
    out: list[list[int]] = []
    source = empty = split = truncated = 0
    for i, doc in enumerate(documents):
        source += 1
        ids = _as_ids(doc, i)
        if not ids:
            empty += 1
            continue
        if len(ids) <= seq_len:
            out.append(ids)
        elif overflow == "error":
            raise PlanError(
                f"document {i} holds {len(ids)} tokens, more than seq_len={seq_len}; raise seq_len, or "
                "pass overflow='split' (row-sized documents of their own) or overflow='truncate'"
            )
        elif overflow == "truncate":
            out.append(ids[:seq_len])
            truncated += len(ids) - seq_len
        else:
            split += 1
            out.extend(ids[start : start + seq_len] for start in range(0, len(ids), seq_len))
    if not out:
        what = (
            "the one document holds no token"
            if source == 1
            else f"none of the {source} documents holds a token"
        )
        raise PlanError(f"{what}: nothing to put into rows")
    return _Pieces(out, source, empty, split, truncated)


def _labels_for(ids: list[int], shift: bool, ignore_index: int) -> list[int]:
    """One document's labels: its first token (shift) or its last (no shift) has no target."""
    if shift:
        return [ignore_index, *ids[1:]]
    return [*ids[1:], ignore_index]


def pack(
    documents: Iterable[Sequence[int] | torch.Tensor],
    seq_len: int,
    *,
    pad_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
    shift: bool = True,
    overflow: Overflow = "split",
    order: Literal["first_fit", "in_order"] = "first_fit",
) -> Packed:
    """Pack tokenized documents into rows of ``seq_len`` tokens.

    ``order="first_fit"`` puts each document, in the order given, into the first row with room
    (less padding); ``"in_order"`` fills rows one after the other. A document never spans two
    rows: one longer than ``seq_len`` is cut as ``overflow`` says (``"split"``: into row-sized
    documents of their own, each restarting its positions). ``shift`` must match the loss's
    (:class:`gradaccum.CausalLMLoss`). The returned :class:`Packed` reports the padding it needed.
    """
    require_int("pad_id", pad_id, low=0, error=PlanError)
    if order not in ("first_fit", "in_order"):
        raise PlanError(f"order must be 'first_fit' or 'in_order', got {order!r}")
    cut = pieces(documents, seq_len, overflow)
    rows: list[list[list[int]]] = []
    room: list[int] = []
    for doc in cut.docs:
        if order == "in_order":
            target = len(rows) - 1 if rows and room[-1] >= len(doc) else None
        else:
            target = next((r for r, free in enumerate(room) if free >= len(doc)), None)
        if target is None:
            rows.append([])
            room.append(seq_len)
            target = len(rows) - 1
        rows[target].append(doc)
        room[target] -= len(doc)
    return _lay_out(cut, rows, seq_len, pad_id, ignore_index, shift, packed=True)


def pad(
    documents: Iterable[Sequence[int] | torch.Tensor],
    seq_len: int,
    *,
    pad_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
    shift: bool = True,
    overflow: Overflow = "split",
) -> Packed:
    """One document per row, right-padded to ``seq_len``: the padded counterpart of :func:`pack`
    (the same documents, cut the same way, give the same targets)."""
    require_int("pad_id", pad_id, low=0, error=PlanError)
    cut = pieces(documents, seq_len, overflow)
    return _lay_out(cut, [[doc] for doc in cut.docs], seq_len, pad_id, ignore_index, shift, packed=False)


def _lay_out(
    cut: _Pieces,
    rows: list[list[list[int]]],
    seq_len: int,
    pad_id: int,
    ignore_index: int,
    shift: bool,
    *,
    packed: bool,
) -> Packed:
    """``rows`` of documents, each row's laid left to right and right-padded to ``seq_len``; packed
    rows carry position ids that restart per document, padded rows (one document each) an attention
    mask. The counts of ``cut`` go with them."""
    input_ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), seq_len), ignore_index, dtype=torch.long)
    position_ids = torch.zeros((len(rows), seq_len), dtype=torch.long)
    attention_mask = torch.zeros((len(rows), seq_len), dtype=torch.long)
    for r, docs in enumerate(rows):
        start = 0
        for doc in docs:
            stop = start + len(doc)
            input_ids[r, start:stop] = torch.tensor(doc)
            labels[r, start:stop] = torch.tensor(_labels_for(doc, shift, ignore_index))
            position_ids[r, start:stop] = torch.arange(len(doc))
            start = stop
        attention_mask[r, :start] = 1
        # the padding is one more document (positions from 0) with no target
        position_ids[r, start:] = torch.arange(seq_len - start)
    return Packed(
        input_ids=input_ids,
        labels=labels,
        position_ids=position_ids if packed else None,
        attention_mask=None if packed else attention_mask,
        row_lengths=tuple(tuple(len(d) for d in docs) for docs in rows),
        seq_len=seq_len,
        source_documents=cut.source,
        empty_documents=cut.empty,
        split_documents=cut.split,
        truncated_tokens=cut.truncated,
    )


def document_segments(
    shape: torch.Size | tuple[int, ...],
    *,
    position_ids: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Each position's document within its row, numbered 0, 1, ... from the row's start.

    A document starts at the row's first position and wherever ``document_ids`` changes or, without
    them, wherever ``position_ids`` is 0. ``None`` when neither is given (one document per row).
    Computed on the tensors' device, without reading it.
    """
    source, what = (
        (document_ids, "document_ids") if document_ids is not None else (position_ids, "position_ids")
    )
    if source is None:
        return None
    if not isinstance(source, torch.Tensor) or source.is_floating_point() or source.dtype == torch.bool:
        raise PlanError(
            f"{what} must be an integer tensor shaped like input_ids {tuple(shape)}, got {source!r}"
        )
    if source.ndim == 1:
        source = source.unsqueeze(0)
    try:
        source = source.expand(*shape)
    except RuntimeError:
        raise PlanError(
            f"{what} has shape {tuple(source.shape)} but the rows have shape {tuple(shape)}; give one "
            "value per token"
        ) from None
    starts = torch.zeros(source.shape, dtype=torch.bool, device=source.device)
    starts[:, 0] = True
    if document_ids is not None:
        starts[:, 1:] = source[:, 1:] != source[:, :-1]
    else:
        starts[:, 1:] = source[:, 1:] == 0
    return starts.cumsum(dim=1) - 1


def block_causal_mask(
    segments: torch.Tensor, attention_mask: torch.Tensor | None = None, *, dtype: torch.dtype
) -> torch.Tensor:
    """The ``(rows, 1, seq, seq)`` additive attention mask of causal attention within documents.

    Query q attends to key k iff k <= q, both lie in the same document, and (with a 2D
    ``attention_mask``) k is not padding: 0 there, the most negative ``dtype`` value elsewhere (not
    -inf, so that a fully masked padding query gives a finite softmax, not NaN). transformers'
    eager and sdpa attention add a 4D float mask as given.
    """
    seq = segments.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segments.device).tril()
    allowed = causal & (segments[:, :, None] == segments[:, None, :])
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, :].to(torch.bool)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segments.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)
