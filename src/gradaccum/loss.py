"""Counting valid units and summing losses over them.

The exact rule needs each micro-batch's *summed* loss and the window's *global* count of the units
that loss is summed over. These helpers give both for the common cases: causal-LM labels with an
``ignore_index`` (shifted or not), one unit per example, and :class:`CausalLMLoss`, whose three
normalizations (token, sequence, document) each define their own unit.

The shift, one convention for every helper here:

* ``shift=True``: the labels equal the inputs, as transformers' causal LMs take them (``labels ==
  input_ids``, padding set to ``ignore_index``). The logits at position t predict the label at t+1,
  so each row's first label is never a target and a row of L labels holds at most L - 1 targets.
* ``shift=False``: the labels are already aligned with the logits (the label at t is the target of
  the logits at t), as a model that shifts its own data provides.

:class:`CausalLMLoss` is a causal-LM loss by name: it shifts by default (``shift=True``), and its
``count_fn`` and ``loss_fn`` always agree with each other. :func:`count_tokens`,
:func:`summed_cross_entropy` and :func:`valid_tokens` take any labels, so they have no default: a
call that omits ``shift`` is refused (:class:`~gradaccum.errors.ConfigError`) naming it, because
the wrong guess is silently one target per row off. Count and sum with the same value:
``count_tokens("labels", shift=True)`` counts exactly the positions
``summed_cross_entropy(logits, labels, shift=True)`` and ``CausalLMLoss("token")`` sum over.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradaccum.batch import batch_size, fields
from gradaccum.errors import ConfigError, CountError, CountTypeError, LossError
from gradaccum.fielddocs import document_fields
from gradaccum.names import NORMALIZATIONS, Normalization
from gradaccum.packing import block_causal_mask, document_segments
from gradaccum.values import require_choice

__all__ = [
    "IGNORE_INDEX",
    "NORMALIZATIONS",
    "CausalLMLoss",
    "Normalization",
    "count_examples",
    "count_tokens",
    "logits_of",
    "summed_cross_entropy",
    "valid_tokens",
]

IGNORE_INDEX = -100
"""PyTorch's default ``ignore_index`` for cross-entropy: label positions that do not count."""


_SHIFT_HELP = (
    "shift=True for labels equal to the inputs, as Hugging Face causal LMs take them (the logits at t "
    "predict the label at t+1, so each row's first label is never a target); shift=False for labels "
    "already aligned with the logits. Count and sum with the same value (see gradaccum.loss)"
)
"""What each value of ``shift`` is for, as the refusal of an omitted ``shift`` says it."""


def _require_shift(shift: bool | None, who: str) -> bool:
    """``shift`` as given to ``who``, refused (:class:`ConfigError`) when omitted or not a bool."""
    if shift is None:
        raise ConfigError(f"{who}: give shift explicitly, it has no default: {_SHIFT_HELP}")
    if not isinstance(shift, bool):
        raise ConfigError(f"{who}: shift must be True or False, got {shift!r}: {_SHIFT_HELP}")
    return shift


def valid_tokens(
    labels: torch.Tensor, *, ignore_index: int = IGNORE_INDEX, shift: bool | None = None
) -> torch.Tensor:
    """Number of label positions that contribute to a token loss, as a 0-dim int64 tensor.

    ``shift`` must be given (see the module's docstring): ``True`` for unshifted causal-LM labels
    (labels == inputs, as in Hugging Face models), where position 0 of each row predicts nothing and
    is not counted; ``False`` for labels already aligned with the logits. The count stays on the
    labels' device (no host sync).
    """
    return _count_valid(labels, ignore_index, _require_shift(shift, "valid_tokens"))


def _count_valid(labels: torch.Tensor, ignore_index: int, shift: bool) -> torch.Tensor:
    """:func:`valid_tokens` with ``shift`` already checked: what a ``count_fn`` calls per micro-batch."""
    _check_label_dtype(labels, ignore_index)
    if shift:
        labels = labels[..., 1:]
    return (labels != ignore_index).sum()


_LABEL_DTYPES = frozenset(
    d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype) and not (d.is_floating_point or d.is_complex or d == torch.bool)
)
"""The dtypes a label tensor may have: one set lookup per micro-batch instead of three tests."""


def _check_label_dtype(labels: torch.Tensor, ignore_index: int) -> None:
    dtype = labels.dtype
    if dtype in _LABEL_DTYPES:
        return
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise CountTypeError(
            f"labels must be an integer tensor of class ids (ignore_index={ignore_index} for positions "
            f"that do not count), got dtype {labels.dtype}"
        )


def count_tokens(
    key: str | int = "labels", *, ignore_index: int = IGNORE_INDEX, shift: bool | None = None
) -> Callable[[Any], torch.Tensor]:
    """A ``count_fn`` counting valid tokens of ``micro_batch[key]`` (see :func:`valid_tokens`).

    ``shift`` must be given, as in the loss that sums over them: ``count_tokens("labels",
    shift=True)`` for labels equal to the inputs (a Hugging Face causal LM; what
    ``summed_cross_entropy(..., shift=True)`` and :class:`CausalLMLoss` sum over),
    ``shift=False`` for labels already aligned with the logits. Omitting it is refused here, at the
    call, not at the first micro-batch.
    """
    shift = _require_shift(shift, f"count_tokens({key!r})")

    # shift is checked once, here; isinstance stops at the first type that matches, so a tuple or
    # a list never reaches Mapping's ABC check (a Python call)
    def count_fn(micro_batch: Any) -> torch.Tensor:
        named = fields(micro_batch) if isinstance(key, str) else None
        if named is not None:
            labels = named[key]
        elif isinstance(micro_batch, (tuple, list, Mapping)):
            labels = micro_batch[key]  # type: ignore[index]
        else:
            labels = micro_batch
        return _count_valid(labels, ignore_index, shift)

    count_fn.__qualname__ = f"count_tokens({key!r}, ignore_index={ignore_index}, shift={shift})"
    return count_fn


def count_examples(micro_batch: Any) -> int:
    """A ``count_fn`` counting examples: the shared dim 0 of the micro-batch's tensors."""
    return batch_size(micro_batch)


_HALF = frozenset((torch.float16, torch.bfloat16))
"""Logits summed in float32 (a sum over many tokens in half precision drops digits)."""


def summed_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    shift: bool | None = None,
) -> torch.Tensor:
    """Cross-entropy summed over valid positions: the numerator of the token-mean loss.

    ``shift`` must be given (see the module's docstring): ``True`` drops the last logits and the
    first label of each row (labels equal to the inputs), ``False`` takes them as aligned. Count
    with the same value (``count_tokens("labels", shift=...)``).

    A micro-batch with no valid position gives an exact zero whose gradient is zero (not NaN), so
    an all-padding micro-batch contributes nothing.
    """
    if _require_shift(shift, "summed_cross_entropy"):
        logits = logits[..., :-1, :]
        labels = labels[..., 1:]
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.dtype in _HALF:
        flat = flat.float()  # a sum over many tokens in half precision drops digits
    return F.cross_entropy(flat, labels.reshape(-1), ignore_index=ignore_index, reduction="sum")


# -- causal-LM loss with a choice of denominator ---------------------------------------------------

_UNITS = {"token": "tokens", "sequence": "sequences", "document": "documents"}
_MODEL_KEYS = ("input_ids", "attention_mask", "position_ids")


class _Targets(NamedTuple):
    labels: torch.Tensor
    """Aligned with the (shifted) logits; ``ignore_index`` wherever no target counts."""
    valid: torch.Tensor
    """Bool, same shape: the targets that count."""
    unit: torch.Tensor | None
    """Int64, same shape: each target's unit (row * seq + document); None for tokens."""
    first: torch.Tensor | None
    """Bool, same shape: the targets of each row's first document; None without documents."""
    slots: int
    """An upper bound on the unit indices (rows * seq)."""
    segments: torch.Tensor | None
    """Each input position's document within its row (None without position_ids/document_ids)."""


def logits_of(out: Any, rows: torch.Tensor, *, who: str, against: str) -> torch.Tensor:
    """The logits ``(rows, seq, vocab)`` of a causal LM's output (the tensor itself, or a
    transformers output's ``.logits``), checked against ``rows`` (the micro-batch's ``against``
    tensor, ``(rows, seq)``); ``who`` names the loss in the error."""
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise LossError(
            f"{who}: the model returned {type(out).__name__}; it must return the logits or an output "
            "with .logits (a transformers CausalLMOutput)"
        )
    if logits.ndim != 3 or logits.shape[:2] != rows.shape:
        raise LossError(
            f"{who}: logits of shape {tuple(logits.shape)} do not match {against} {tuple(rows.shape)}; "
            "expected (rows, seq, vocab)"
        )
    return logits


@document_fields
@dataclass(frozen=True, slots=True)
class CausalLMLoss:
    """Next-token cross-entropy summed over counted units, for ``Accumulator.step`` and ``verify``.

    >>> loss = gradaccum.CausalLMLoss("document")
    >>> acc.step(window, loss.loss_fn, loss.count_fn)

    A micro-batch is a mapping with ``input_ids`` and ``labels`` ``(rows, seq)``, and optionally
    ``attention_mask``, ``position_ids`` (restarting at 0 at each document of a packed row) or
    ``document_ids`` (one id per token; a document is a run of equal ids within a row). The model
    is called as ``model(input_ids=..., attention_mask=..., position_ids=...)`` with only the keys
    present; its output is the logits or has ``.logits``.

    The mean the window's update follows, and the unit ``count_fn`` counts:

    * ``"token"``: every valid target of the window weighs the same; unit: a valid target.
    * ``"sequence"``: each row's token mean, averaged over the rows with at least one valid
      target; unit: such a row. ``loss_fn`` weighs each target by 1/n_row, so a row adds its mean.
    * ``"document"``: each document's token mean, averaged over the documents with at least one
      valid target; unit: such a document (a row without ``position_ids``/``document_ids`` is one
      document). Each target weighs 1/n_document.

    So ``loss_fn`` returns a sum over units of their (weighted) losses, ``count_fn`` the number of
    units, and ``Accumulator`` divides by the window's global count: exact across uneven
    micro-batches and ranks, because no unit is split between micro-batches (a micro-batch holds
    whole rows and a document lies within one row). A row whose ``position_ids`` do not start at 0
    continues a sequence or document from another row; under ``"sequence"`` and ``"document"``
    ``count_fn`` refuses it (``CountError``) instead of counting that unit twice.

    Wherever documents are marked, no target crosses a document boundary: with ``shift=True`` the
    first token of a document is never predicted from the previous document, whatever its label.
    ``mask_documents=True`` also hands the model a ``(rows, 1, seq, seq)`` additive mask of causal
    attention within documents (in the model's dtype; transformers' eager and sdpa attention take
    it), so that a packed row computes what its documents would compute alone.
    """

    normalization: Normalization = "token"
    """``"token"``, ``"sequence"`` or ``"document"``: the denominator of the mean."""
    shift: bool = True
    """True (the default: a causal LM) for labels equal to the inputs (transformers' causal LMs):
    logits at t predict the label at t+1. False for labels already aligned with the logits. The
    one convention of every helper in :mod:`gradaccum.loss` (its docstring)."""
    ignore_index: int = IGNORE_INDEX
    """Label value of positions that are not targets."""
    mask_documents: bool = False
    """Pass a block-diagonal causal 4D attention mask built from the documents to the model."""

    def __post_init__(self) -> None:
        require_choice("CausalLMLoss normalization", self.normalization, NORMALIZATIONS)
        for name in ("shift", "mask_documents"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"CausalLMLoss {name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.ignore_index, int) or isinstance(self.ignore_index, bool):
            raise ConfigError(f"CausalLMLoss ignore_index must be an integer, got {self.ignore_index!r}")

    @property
    def unit(self) -> str:
        """What ``count_fn`` counts, for reports: tokens, sequences or documents."""
        return _UNITS[self.normalization]

    def count_fn(self, micro_batch: Any) -> torch.Tensor:
        """The micro-batch's units (0-dim int64 on the labels' device).

        Under ``"sequence"``/``"document"`` with ``position_ids`` this reads the device once, to
        refuse a row that continues a unit from another row.
        """
        targets = self._targets(micro_batch)
        if self.normalization != "token":
            self._refuse_continued(micro_batch, targets)
        if targets.unit is None:
            return targets.valid.sum()
        return (_unit_sizes(targets) > 0).sum()

    def positions(self, micro_batch: Any) -> torch.Tensor:
        """The target positions ``loss_fn`` puts a loss on (0-dim int64): what the denominator audit
        of ``verify`` checks the model's output against when the unit is a sequence or a document."""
        return self._targets(micro_batch).valid.sum()

    def loss_fn(self, model: nn.Module, micro_batch: Any) -> torch.Tensor:
        """The micro-batch's loss summed over its units: token losses weighted 1, 1/n_row or 1/n_doc."""
        targets = self._targets(micro_batch)
        named = _named(micro_batch)
        inputs = {key: named[key] for key in _MODEL_KEYS if key in named}
        if self.mask_documents and targets.segments is not None:
            given = inputs.get("attention_mask")
            if given is None or given.ndim == 2:
                inputs["attention_mask"] = block_causal_mask(
                    targets.segments, given, dtype=_float_dtype(model)
                )
        logits = logits_of(model(**inputs), named["labels"], who="CausalLMLoss", against="labels")
        if self.shift:
            logits = logits[:, :-1, :]
        flat = logits.reshape(-1, logits.shape[-1])
        if flat.dtype in (torch.float16, torch.bfloat16):
            flat = flat.float()  # a sum over many tokens in half precision drops digits
        per_token = F.cross_entropy(
            flat, targets.labels.reshape(-1), ignore_index=self.ignore_index, reduction="none"
        )
        if targets.unit is None:
            return per_token.sum()
        sizes = _unit_sizes(targets).to(per_token.dtype).clamp_(min=1)
        weights = targets.valid.reshape(-1).to(per_token.dtype) / sizes[targets.unit.reshape(-1)]
        return (per_token * weights).sum()

    def _targets(self, micro_batch: Any) -> _Targets:
        """The counted targets, aligned with the (shifted) logits, and each one's unit."""
        labels = _labels(micro_batch, self.ignore_index)
        rows, seq = labels.shape
        segments = document_segments(
            labels.shape,
            position_ids=_named(micro_batch).get("position_ids"),
            document_ids=_named(micro_batch).get("document_ids"),
        )
        if segments is not None:
            segments = segments.to(labels.device)
        if self.shift:
            aligned = labels[:, 1:]
            # the target at t is predicted from t-1: it counts only inside one document
            same = None if segments is None else segments[:, 1:] == segments[:, :-1]
            owner = None if segments is None else segments[:, 1:]
        else:
            aligned = labels
            # the label at t is token t+1: the last token of a document has no target in it
            same = None
            if segments is not None:
                tail = torch.ones((rows, 1), dtype=torch.bool, device=labels.device)
                same = torch.cat([segments[:, 1:] == segments[:, :-1], tail], dim=1)
            owner = segments
        valid = aligned != self.ignore_index
        if same is not None:
            valid = valid & same
        masked = aligned if same is None else aligned.masked_fill(~valid, self.ignore_index)
        unit = None
        if self.normalization != "token":
            row = torch.arange(rows, device=labels.device).unsqueeze(1) * seq
            if self.normalization == "document" and owner is not None:
                unit = row + owner
            else:
                unit = row.expand(aligned.shape)
        # what a row whose positions do not start at 0 continues: its first document's targets
        first = None if owner is None else owner == 0
        return _Targets(masked, valid, unit, first, rows * seq, segments)

    def _refuse_continued(self, micro_batch: Any, targets: _Targets) -> None:
        """A row whose positions do not start at 0 continues a unit from another row: refuse it
        when its first document has a target (the padding of a left-padded row has none)."""
        positions = _named(micro_batch).get("position_ids")
        if positions is None or targets.first is None or targets.unit is None:
            return
        if positions.ndim == 1:
            positions = positions.unsqueeze(0)
        positions = positions.expand(targets.valid.shape[0], -1)
        continued = (positions[:, 0] != 0) & (targets.valid & targets.first).any(dim=1)
        if bool(continued.any()):
            rows = continued.nonzero().flatten().tolist()
            starts = positions[continued, 0].tolist()
            raise CountError(
                f"normalization={self.normalization!r}: row(s) {rows} of this micro-batch start at "
                f"position_ids {starts}, not 0, so they continue a {self.normalization} begun in another "
                f"row, which this micro-batch cannot see: its mean would be split across rows and "
                "micro-batches. Keep each document inside one row (gradaccum.pack cuts long documents "
                "into row-sized documents of their own), or use normalization='token', which any split "
                "leaves exact."
            )


def _named(micro_batch: Any) -> Mapping[Any, Any]:
    """The micro-batch's fields (:func:`gradaccum.batch.fields`), holding 'input_ids' and 'labels'."""
    named = fields(micro_batch)
    if named is None or "labels" not in named or "input_ids" not in named:
        keys = sorted(map(str, named)) if named is not None else type(micro_batch).__name__
        raise LossError(
            f"CausalLMLoss needs a micro-batch mapping with 'input_ids' and 'labels' (and optionally "
            f"'attention_mask', 'position_ids', 'document_ids'), got {keys}"
        )
    return named


def _labels(micro_batch: Any, ignore_index: int) -> torch.Tensor:
    labels = _named(micro_batch)["labels"]
    if not isinstance(labels, torch.Tensor) or labels.ndim != 2:
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise CountTypeError(f"CausalLMLoss: labels must be a (rows, seq) tensor, got {shape}")
    _check_label_dtype(labels, ignore_index)
    return labels


def _unit_sizes(targets: _Targets) -> torch.Tensor:
    """Valid targets per unit, indexed by unit (int64, flat)."""
    assert targets.unit is not None
    valid = targets.valid.reshape(-1).to(torch.long)
    sizes = torch.zeros(targets.slots, dtype=torch.long, device=valid.device)
    return sizes.scatter_add_(0, targets.unit.reshape(-1), valid)


def _float_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
