"""The names the command line offers before anything heavy loads: precisions, loss normalizations,
the dtypes the checks declare tolerances for, the default workload and the ``hf:`` spec's defaults.

Defined once here, with no torch, so that ``gradaccum --help`` and every ``gradaccum CMD --help``
list choices and defaults without importing torch; :mod:`gradaccum.precision`,
:mod:`gradaccum.loss`, :mod:`gradaccum.check.workload` and :mod:`gradaccum.workloads.spec`
re-export them where their users look.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "DEFAULT_SEQ_LEN",
    "DEFAULT_TEXT_FIELD",
    "DEFAULT_WORKLOAD",
    "HF_PREFIX",
    "MAX_TRACE_STEPS",
    "NORMALIZATIONS",
    "PRECISIONS",
    "TRACE_DTYPES",
    "VERIFY_DTYPES",
    "Normalization",
    "Precision",
]

Precision = Literal["float64", "float32", "bfloat16", "float16"]
PRECISIONS: tuple[Precision, ...] = ("float64", "float32", "bfloat16", "float16")
"""Every precision a command, a run card or a training run takes."""

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
