"""A transformers mixture-of-experts model in float64: its experts on the eager kernel.

transformers runs the experts of its MoE families through a kernel chosen by
``config.experts_implementation`` (``@use_experts_implementation``); the fused ones (``grouped_mm``,
``batched_mm``, the default on a saved folder) take float32, bfloat16 and float16 matrices only, so
the float64 check of ``verify`` would stop with torch's "Expected mat_a to be Float32, BFloat16 or
Float16 matrix, got Double". The eager kernel (a loop over the experts) computes the same function
in any dtype, so for the check every model of the workload is switched to it
(``set_experts_implementation("eager")``, on the copy the check builds). A model whose kernel
cannot be switched is refused by name, with the way out: ``--check-precision float32``.
``train --precision float64`` on an ``hf:`` folder does the same (``--precision float32``).

:func:`eager_experts_on` is the switch itself, on one model the caller owns (a copy): the Trainer
checks (``audit_trainer``, ``ExactTrainer.verify_accumulation`` and ``verify_at_start``) and the
audit's float64 copies run it on the copies they build, so the user's model keeps its kernel.
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from gradaccum.errors import GradAccumError, WorkloadError
from gradaccum.workloads.base import Workload

__all__ = ["EAGER_FIX", "eager_experts", "eager_experts_on", "fused_kernel", "kernel_words"]

EAGER = "eager"

EAGER_FIX = (
    "build the model with experts_implementation='eager' (from_pretrained(..., "
    "experts_implementation='eager'), or model.set_experts_implementation('eager') before the check)"
)
"""The way out for a model whose experts a float64 check cannot switch (the Trainer checks)."""


def _switchable(model: nn.Module) -> bool:
    """Whether ``model`` runs its experts through transformers' pluggable kernels."""
    can = getattr(type(model), "_can_set_experts_implementation", None)
    return callable(can) and bool(can()) and callable(getattr(model, "set_experts_implementation", None))


def _kernel(model: nn.Module) -> object:
    return getattr(getattr(model, "config", None), "_experts_implementation", None)


def _describe(kernel: object) -> str:
    return repr(kernel) if kernel else "the default (grouped_mm)"


def fused_kernel(model: nn.Module) -> str | None:
    """The fused experts kernel the first transformers model inside ``model`` runs on (``None``:
    no pluggable experts, or eager already): what :func:`eager_experts_on` would switch."""
    for module in model.modules():
        if _switchable(module) and _kernel(module) != EAGER:
            return str(_kernel(module) or "grouped_mm")
    return None


def kernel_words(was: str | None) -> str:
    """How a report says the float64 copy's experts kernel (empty when nothing was switched)."""
    if was is None:
        return ""
    return (
        f"its experts on transformers' eager kernel instead of the model's {was!r} (the fused "
        "kernels take no float64; the same function)"
    )


def eager_experts_on(
    model: nn.Module,
    *,
    what: str = "the float64 reference",
    fix: str = EAGER_FIX,
    error: type[GradAccumError] = WorkloadError,
) -> str | None:
    """Switch every transformers model inside ``model`` whose experts run on a fused kernel to the
    eager one, in place: call it on a copy. Returns the kernel they ran on before (``None`` when
    nothing was switched: no pluggable experts, or eager already). A model that cannot be switched
    is refused with ``error``, naming ``experts_implementation``, ``what`` needs it, and ``fix``."""
    was: object = None
    for module in model.modules():  # the outermost first: set_experts_implementation reaches the rest
        if not _switchable(module) or _kernel(module) == EAGER:
            continue
        before = _kernel(module)
        try:
            module.set_experts_implementation(EAGER)  # type: ignore[operator]
        except Exception as exc:
            raise error(
                f"{what} needs the experts on transformers' eager kernel (the fused kernels take no "
                f"float64), but experts_implementation {_describe(before)} of {type(module).__name__} "
                f"could not be switched ({type(exc).__name__}: {exc}); {fix}"
            ) from None
        was = was or before or "grouped_mm"
    return None if was is None else str(was)


def eager_experts(
    workload: Workload,
    *,
    flag: str = "--check-precision",
    what: str = "the float64 check",
    fix: str | None = None,
) -> tuple[Workload, str | None]:
    """``workload`` whose models run their experts on the eager kernel, and a line that says so;
    ``workload`` itself and ``None`` for a model without pluggable experts or already eager. A
    model that cannot be switched is refused with a :class:`WorkloadError` naming
    ``experts_implementation`` and ``flag float32`` (or ``fix``, for a command that runs in float64
    only). ``what``: what runs in float64, for the words."""
    model = workload.build_model()
    if fused_kernel(model) is None:
        return workload, None
    was = next(_kernel(m) for m in model.modules() if _switchable(m)) or "the default (grouped_mm)"
    build = workload.build_model
    fix = fix or (
        f"save the folder with experts_implementation='eager' in its config, or run in float32 "
        f"({flag} float32)"
    )

    def build_model() -> nn.Module:
        built = build()
        eager_experts_on(built, what=f"workload {workload.name}: {what}", fix=fix)
        return built

    build_model()  # refused now, before any check starts
    note = (
        f"experts: {what} runs {workload.name}'s experts on transformers' eager kernel "
        f"(experts_implementation 'eager' instead of {was}: the fused kernels take no float64; "
        "the same function)"
    )
    return dataclasses.replace(workload, build_model=build_model), note
