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
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from gradaccum.errors import WorkloadError
from gradaccum.workloads.base import Workload

__all__ = ["eager_experts"]

EAGER = "eager"


def _switchable(model: nn.Module) -> bool:
    """Whether ``model`` runs its experts through transformers' pluggable kernels."""
    can = getattr(type(model), "_can_set_experts_implementation", None)
    return callable(can) and bool(can()) and callable(getattr(model, "set_experts_implementation", None))


def _kernel(model: nn.Module) -> object:
    return getattr(getattr(model, "config", None), "_experts_implementation", None)


def eager_experts(
    workload: Workload, *, flag: str = "--check-precision", what: str = "the float64 check"
) -> tuple[Workload, str | None]:
    """``workload`` whose models run their experts on the eager kernel, and a line that says so;
    ``workload`` itself and ``None`` for a model without pluggable experts or already eager. A
    model that cannot be switched is refused with a :class:`WorkloadError` naming
    ``experts_implementation`` and ``flag float32``. ``what``: what runs in float64, for the words."""
    model = workload.build_model()
    if not _switchable(model) or _kernel(model) == EAGER:
        return workload, None
    was = _kernel(model) or "the default (grouped_mm)"
    build = workload.build_model

    def build_model() -> nn.Module:
        built = build()
        try:
            built.set_experts_implementation(EAGER)  # type: ignore[operator]
        except Exception as exc:
            raise WorkloadError(
                f"workload {workload.name}: {what} needs the experts on transformers' eager "
                f"kernel, but experts_implementation {was!r} could not be switched "
                f"({type(exc).__name__}: {exc}); save the folder with experts_implementation='eager' in "
                f"its config, or run in float32 ({flag} float32)"
            ) from None
        return built

    build_model()  # refused now, before any check starts
    note = (
        f"experts: {what} runs {workload.name}'s experts on transformers' eager kernel "
        f"(experts_implementation 'eager' instead of {was}: the fused kernels take no float64; "
        "the same function)"
    )
    return dataclasses.replace(workload, build_model=build_model), note
