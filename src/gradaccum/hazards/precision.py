"""The precision rule of ``scan``: bf16/fp16 gradients summed over many micro-batches in their dtype.

Called by :func:`gradaccum.hazards.scanner.scan`; the
expected figure is :func:`gradaccum.precision.accumulation_extra_error`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from gradaccum.hazards.finding import Finding
from gradaccum.precision import accumulation_extra_error

__all__ = ["LOW_PRECISION_ACCUM_STEPS", "precision_findings"]

LOW_PRECISION_ACCUM_STEPS = 16
"""From this k on, ``scan`` warns of bf16/fp16 gradients accumulated in their dtype (1.2x the k=1
error at k=16 on a bf16 GPT-2, 1.8x at k=64)."""


def precision_findings(model: nn.Module, k: int) -> list[Finding]:
    """bf16/fp16 gradients summed over k >= 16 micro-batches in their own dtype."""
    narrow = [p for p in model.parameters() if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)]
    if k < LOW_PRECISION_ACCUM_STEPS or not narrow:
        return []
    dtype = narrow[0].dtype
    name = "bfloat16 (bf16)" if dtype == torch.bfloat16 else "float16 (fp16)"
    extra = accumulation_extra_error(dtype, k)
    figures = {
        "accum_steps": float(k),
        "parameters": float(sum(p.numel() for p in narrow)),
        "extra_rel_l2": extra,
    }
    return [
        Finding(
            code="low-precision-accumulation",
            severity="warning",
            path="",
            kind=type(model).__name__,
            summary=f"accumulates {name} gradients over {k} micro-batches in {name.split()[0]}",
            explanation=f"{int(figures['parameters'])} parameters hold {name} gradients; torch adds each "
            f"micro-batch's gradient into .grad in that dtype, rounding the growing sum {k} times: about "
            f"{extra:.1e} relative error on top of the model's own (root-sum-square; 0.15 * eps * sqrt(k), "
            "about 1.8x the k=1 error at k=64 on a bf16 GPT-2).",
            fix="Accumulate in float32: Accumulator(..., accum_dtype=torch.float32) or "
            "AccumConfig(accum_dtype='float32'); the sum is rounded once before the step, at 4 bytes "
            "per parameter while accumulating (FSDP2: MixedPrecisionPolicy(reduce_dtype=torch.float32)).",
            figures=figures,
        )
    ]
