"""The plain window: one process, a plain module, pre-scaling and no optional feature.

:class:`~gradaccum.step.engine.WindowEngine`'s phases 2-3 carry what only some steps use: the
counts all-reduce and the meetings of torch.distributed, the sync contexts of DDP and FSDP, a
load balance's routing pass, the noise meter's and BatchNorm's per-window parts, GradScaler. A
step that uses none of them still walked past each one, micro-batch after micro-batch: on the
bundled GPT at k=4 x 2x24 tokens that was ~1 % of the update (``benchmarks/step_cost.py``). So
the accumulator decides once, at construction, whether its steps are plain (:func:`plain_window`),
and a plain step counts and accumulates here with nothing else: the same checks on what
``count_fn`` and ``loss_fn`` return, the same float64 scale 1/N cast to the loss's dtype, the same
failure handling as the engine's on one process (gradients cleared, the error raised, an
out-of-memory error as :class:`~gradaccum.errors.WindowOutOfMemoryError`), the same observer
events; then the engine's own phase 4 (:meth:`WindowEngine.conclude`) decides and steps.

A process group that appears after construction sends that window down the engine's full path:
the check costs one call per window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from gradaccum.distributed import dist
from gradaccum.step.agreement import LocalFailure, raise_alone
from gradaccum.step.checks import (
    as_count,
    check_loss,
    check_not_empty,
    counts_on_host,
    sum_counts,
    unmean,
)
from gradaccum.step.config import StepResult
from gradaccum.step.reduction import ReductionCheck
from gradaccum.step.window import Accumulated, CastScale, CountFn, WindowCount

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from gradaccum.step.engine import WindowEngine

__all__ = ["PlainWindow", "plain_window"]


def plain_window(engine: WindowEngine) -> PlainWindow | None:
    """A :class:`PlainWindow` for ``engine`` when its steps can be plain, else ``None``.

    Plain: a module that no wrapper synchronizes, no mesh, no external engine, no GradScaler, no
    load balance, and none of the per-window features (noise scale, BatchNorm window statistics,
    float32 accumulation)."""
    config = engine.config
    plain = (
        engine.kind == "local"
        and engine.layout is None
        and engine.external is None
        and engine.scaler is None
        and engine.balance is None
        and config.scaling == "pre"
        and not config.noise_scale
        and config.batchnorm_stats != "window"
        and config.accum_dtype is None
    )
    return PlainWindow(engine) if plain else None


class PlainWindow:
    """Phases 1-3 of a plain window, then the engine's phase 4."""

    __slots__ = ("custom_backward", "engine", "mean", "observed")

    def __init__(self, engine: WindowEngine) -> None:
        self.engine = engine
        self.mean = engine.config.loss_reduction == "mean"
        self.observed = engine.observer is not None  # else no call per micro-batch to tell nobody
        # a backward of the caller's own (Lightning's manual_backward) receives loss * scale
        self.custom_backward = None if engine.backward is torch.Tensor.backward else engine.backward

    def applies(self) -> bool:
        """Whether this window is plain: no process group has appeared since construction."""
        return not dist.is_distributed(self.engine.dp_group)

    def step(
        self,
        window: Iterable[Any],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        count_fn: CountFn,
        reduction: ReductionCheck,
    ) -> StepResult:
        """One plain window; ``reduction`` reads the first window's losses (step/reduction.py)."""
        engine = self.engine
        micro_batches, _ = engine.open(window)  # one process: a failure is raised, not returned
        check_not_empty(len(micro_batches))
        counts = [as_count(count_fn(mb), i) for i, mb in enumerate(micro_batches)]
        # ints or CPU tensors: N is read on the host, and so is W/N; a device's counts stay there
        host_count = counts_on_host(counts)
        if host_count is None:
            local_count, min_count = sum_counts(counts, engine.device)
        else:  # float64, as the device's sum: exact below 2**53
            local_count = torch.full((), float(host_count), dtype=torch.float64, device=engine.device)
            min_count = None
        counted = WindowCount(counts, local_count, local_count, host_count, min_count, 1, engine.factor)
        engine.zero_grad()
        host_scale = counted.host_scale()
        # each micro-batch adds sum_t l_t / N
        scale = CastScale(counted.scale()) if host_scale is None else CastScale(host_scale, engine.device)
        model, custom, emit, mean, observed = (
            engine.model,
            self.custom_backward,
            engine.emit,
            self.mean,
            self.observed,
        )
        seed = torch.autograd.backward
        judging = reduction.pending
        losses: list[torch.Tensor] = []
        for i, mb in enumerate(micro_batches):
            if observed:
                emit("micro_start", i)
            phase = "forward"
            try:
                loss = check_loss(loss_fn(model, mb), i)
                if judging:
                    reduction.judge(loss, counts[i], i)
                if mean:
                    loss = unmean(loss, counts[i], i)
                losses.append(loss.detach())
                phase = "backward"
                # W/N seeds the backward as the loss's gradient: what loss * (W/N) would hand
                # the loss's graph (1.0 * W/N, exactly), without the multiply, its backward node
                # and the ones_like seed; a tensor subclass or a custom backward takes the product
                if custom is None and type(loss) is torch.Tensor:
                    seed(loss, scale.to(loss.dtype))
                elif custom is None:
                    (loss * scale.to(loss.dtype)).backward()
                else:
                    custom(loss * scale.to(loss.dtype))
            except Exception as exc:
                engine.zero_grad()
                raise_alone(LocalFailure(exc, phase, i), recoverable=True)
            if observed:
                emit("micro_end", i)
        reduction.pending = False
        accumulated = Accumulated(None, engine.settler.zero, False, len(micro_batches), tuple(losses))
        return engine.conclude(counted, accumulated)
