"""Precision names and what each means, defined once: parameter dtype, autocast dtype, the scaler.

``float64``/``float32``: the model and its floating inputs in that dtype. ``bfloat16``: float32
weights under autocast. ``float16``: float32 weights under autocast with a GradScaler (overflowed
updates are skipped and counted).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from gradaccum.names import ACCUM_DTYPES, PRECISIONS, Precision, accum_dtype_name

__all__ = [
    "ACCUM_DTYPES",
    "PRECISIONS",
    "Precision",
    "accum_dtype_name",
    "accum_dtype_of",
    "accumulation_extra_error",
    "autocast_dtype",
    "autocast_loss",
    "dtype_name",
    "dtype_of",
    "make_scaler",
    "param_dtype",
]


_AUTOCAST: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16}


_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_of(precision: str) -> torch.dtype:
    """The dtype a precision name stands for (a pure-precision cast, as the trace stage uses)."""
    return _DTYPES[precision]


def param_dtype(precision: str) -> torch.dtype:
    """The dtype of the model's parameters: float64 for ``float64``, else float32."""
    return torch.float64 if precision == "float64" else torch.float32


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a mixed precision, ``None`` for full precision."""
    return _AUTOCAST.get(precision)


def autocast_loss(loss_fn: Any, precision: str, device: torch.device | str) -> Any:
    """``loss_fn(model, micro_batch)`` under autocast for bfloat16/float16; unchanged otherwise."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        return loss_fn
    device_type = torch.device(device).type

    def loss_under_autocast(model: nn.Module, micro_batch: Any) -> torch.Tensor:
        with torch.autocast(device_type=device_type, dtype=dtype):
            return loss_fn(model, micro_batch)

    return loss_under_autocast


def make_scaler(precision: str, device: torch.device | str) -> Any:
    """A GradScaler for ``float16`` on the device's type (``"cpu"`` on CPU); ``None`` otherwise."""
    return torch.amp.GradScaler(torch.device(device).type) if precision == "float16" else None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float64`` -> ``"float64"``."""
    return str(dtype).removeprefix("torch.")


def accum_dtype_of(name: str) -> torch.dtype:
    """The torch dtype of an :data:`ACCUM_DTYPES` name."""
    return _DTYPES[name]


ACCUMULATION_ERROR_COEFFICIENT = 0.15
"""c in extra relL2 ~ c * eps * sqrt(k): a gradient summed over k micro-batches in a dtype of machine
epsilon eps is rounded k times as the sum grows. Fitted on the issue's bf16 GPT-2 (128 sequences):
the extra error, root-sum-square over the k = 1 error, is 4.2e-3 at k = 16 and 9.4e-3 at k = 64
(c = 0.14, 0.15); benchmarks/precision.py prints the figures."""


def accumulation_extra_error(dtype: torch.dtype, accum_steps: int) -> float:
    """The relative gradient error that accumulating over ``accum_steps`` micro-batches in ``dtype``
    adds (root-sum-square) to the model's own; 0 for k = 1."""
    if accum_steps <= 1:
        return 0.0
    return ACCUMULATION_ERROR_COEFFICIENT * torch.finfo(dtype).eps * accum_steps**0.5
