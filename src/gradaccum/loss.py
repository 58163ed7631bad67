"""Counting valid units and summing losses over them.

The exact rule needs each micro-batch's *summed* loss and the window's *global* count of the units
that loss is summed over. These helpers give both for the common cases: causal-LM labels with an
``ignore_index`` (shifted or not), and one unit per example.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from gradaccum.batch import batch_size
from gradaccum.errors import CountTypeError

__all__ = [
    "IGNORE_INDEX",
    "count_examples",
    "count_tokens",
    "summed_cross_entropy",
    "valid_tokens",
]

IGNORE_INDEX = -100
"""PyTorch's default ``ignore_index`` for cross-entropy: label positions that do not count."""


def valid_tokens(
    labels: torch.Tensor, *, ignore_index: int = IGNORE_INDEX, shift: bool = False
) -> torch.Tensor:
    """Number of label positions that contribute to a token loss, as a 0-dim int64 tensor.

    ``shift=True`` is for unshifted causal-LM labels (labels == inputs, as in Hugging Face models):
    position 0 of each row predicts nothing, so it is not counted. ``shift=False`` is for labels that
    are already aligned with the logits. The count stays on the labels' device (no host sync).
    """
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise CountTypeError(
            f"labels must be an integer tensor of class ids (ignore_index={ignore_index} for positions "
            f"that do not count), got dtype {labels.dtype}"
        )
    if shift:
        labels = labels[..., 1:]
    return (labels != ignore_index).sum()


def count_tokens(
    key: str | int = "labels", *, ignore_index: int = IGNORE_INDEX, shift: bool = False
) -> Callable[[Any], torch.Tensor]:
    """A ``count_fn`` counting valid tokens of ``micro_batch[key]`` (see :func:`valid_tokens`)."""

    def count_fn(micro_batch: Any) -> torch.Tensor:
        labels = micro_batch[key] if isinstance(micro_batch, (Mapping, tuple, list)) else micro_batch  # type: ignore[index]
        return valid_tokens(labels, ignore_index=ignore_index, shift=shift)

    count_fn.__qualname__ = f"count_tokens({key!r}, ignore_index={ignore_index}, shift={shift})"
    return count_fn


def count_examples(micro_batch: Any) -> int:
    """A ``count_fn`` counting examples: the shared dim 0 of the micro-batch's tensors."""
    return batch_size(micro_batch)


def summed_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    shift: bool = False,
) -> torch.Tensor:
    """Cross-entropy summed over valid positions: the numerator of the token-mean loss.

    A micro-batch with no valid position gives an exact zero whose gradient is zero (not NaN), so
    an all-padding micro-batch contributes nothing.
    """
    if shift:
        logits = logits[..., :-1, :]
        labels = labels[..., 1:]
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()  # a sum over many tokens in half precision drops digits
    return F.cross_entropy(flat, labels.reshape(-1), ignore_index=ignore_index, reduction="sum")
