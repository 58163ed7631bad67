"""The names the command line offers before anything heavy loads: precisions, loss normalizations,
the dtypes the checks declare tolerances for, the default workload and the ``hf:`` spec's defaults.

Defined once here, with no torch, so that ``gradaccum --help`` and every ``gradaccum CMD --help``
list choices and defaults without importing torch; :mod:`gradaccum.precision`,
:mod:`gradaccum.loss`, :mod:`gradaccum.check.workload` and :mod:`gradaccum.workloads.spec`
re-export them where their users look.
"""

from __future__ import annotations

import sys
from typing import Literal, get_args

from gradaccum.errors import ConfigError

__all__ = [
    "ACCUM_DTYPES",
    "DEFAULT_SEQ_LEN",
    "DEFAULT_TEXT_FIELD",
    "DEFAULT_WORKLOAD",
    "HF_PREFIX",
    "MAX_TRACE_STEPS",
    "NORMALIZATIONS",
    "PARAM_DTYPES",
    "PRECISIONS",
    "TRACE_DTYPES",
    "VERIFY_DTYPES",
    "Normalization",
    "ParamDtype",
    "Precision",
    "accum_dtype_name",
]

Precision = Literal["float64", "float32", "bfloat16", "float16"]
PRECISIONS: tuple[Precision, ...] = ("float64", "float32", "bfloat16", "float16")
"""Every precision a command, a run card or a training run takes."""

ParamDtype = Literal["saved", "float32", "bfloat16", "float16", "float64"]
PARAM_DTYPES: tuple[ParamDtype, ...] = ("saved", "float32", "bfloat16", "float16", "float64")
"""What ``train --param-dtype`` stores the parameters in: ``saved``, the dtype the workload builds
them in (an ``hf:`` folder's saved ``torch_dtype``), or that dtype; the compute precision is apart."""

VERIFY_DTYPES: tuple[Precision, ...] = ("float64", "float32")
"""The dtypes the equivalence check's first stage declares tolerances for (the keys of
:data:`gradaccum.check.tolerances.GRAD_TOLERANCES`; a test keeps the two equal)."""
TRACE_DTYPES: tuple[Precision, ...] = PRECISIONS
"""The dtypes the trace stage declares tolerances for (the keys of ``TRACE_TOLERANCES``)."""
MAX_TRACE_STEPS = 50
"""The longest window the trace tolerances are declared for."""

Normalization = Literal["token", "sequence", "document"]
NORMALIZATIONS: tuple[str, ...] = get_args(Normalization)
"""The denominators of a causal-LM loss: valid tokens, sequences or documents."""

DEFAULT_WORKLOAD = "gradaccum.examples:tiny_gpt"
"""The bundled tiny character GPT: what every command runs when no ``--workload`` is given."""

HF_PREFIX = "hf:"
"""Specs starting with this name a model folder and a data file (:mod:`gradaccum.workloads`)."""

DEFAULT_SEQ_LEN = 128
"""Tokens per row of an ``hf:`` workload when its spec names none."""
DEFAULT_TEXT_FIELD = "text"
"""The ``.jsonl`` field an ``hf:`` workload reads each document's text from."""


ACCUM_DTYPES = ("float32", "float64")
"""The dtypes gradients may be accumulated in (``AccumConfig.accum_dtype``): wider than bf16/fp16."""


def accum_dtype_name(value: object) -> str | None:
    """``AccumConfig.accum_dtype`` as a dtype name: ``torch.float32`` and ``"float32"`` alike.

    Anything else (``"int8"``, ``torch.bfloat16``, a typo) is refused here, when the config is
    built: an accumulation dtype no wider than bf16 would add the rounding it exists to remove.
    torch is not imported (``--help`` builds configs without it): a ``torch.dtype`` can only be
    given once torch is loaded, so it is looked up in ``sys.modules``.
    """
    if value is None:
        return None
    torch = sys.modules.get("torch")
    name = value
    if torch is not None and isinstance(value, torch.dtype):
        name = str(value).removeprefix("torch.")
    if isinstance(name, str) and name in ACCUM_DTYPES:
        return name
    raise ConfigError(
        f"AccumConfig.accum_dtype must be None (accumulate in the parameters' dtype), torch.float32 "
        f"or 'float32' (or float64), got {value!r}: gradients are accumulated in a dtype wider "
        "than bfloat16/float16 parameters, never a narrower or integer one"
    )
