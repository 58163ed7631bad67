"""Exact accumulation through DeepSpeed's engine, at every ZeRO stage: ``prepare_accumulator(engine)``.

DeepSpeed's own accumulation divides every micro-batch's loss by ``gradient_accumulation_steps``
inside ``engine.backward`` (``scale_wrt_gas=True``): a mean of per-micro-batch means when token
counts are uneven, and a short window divided by the configured count. Exact instead::

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    acc = prepare_accumulator(engine)
    for window in gradaccum.windows(loader, accum_steps=8):
        result = acc.step(window, loss_fn, count_fn)   # loss_fn(engine, mb): the summed loss

The step is gradaccum's window engine (:mod:`gradaccum.step.engine`) with DeepSpeed's engine as
the model and as the owner of the optimizer step (:class:`gradaccum.step.external.ExternalStep`):

1. every micro-batch is counted and N summed over the ranks in the engine's counts all-reduce,
   before the first forward;
2. micro-batch j backpropagates ``loss_j x F/N`` through ``engine.backward(..., scale_wrt_gas=False)``,
   with ``set_gradient_accumulation_boundary(j == last)`` before its forward, so the reduction
   (all-reduce at stages 0-1, reduce-scatter into ZeRO's partitions at 2-3) completes on the last;
3. ``engine.step()`` once: clipping by DeepSpeed's ``gradient_clipping``, the optimizer, and the
   engine's LR scheduler once (``engine.global_steps`` advances by exactly one).

**The factor F.** Every reduction DeepSpeed 0.19.8 runs on fp32 gradients averages over the
data-parallel group, whatever ``gradient_predivide_factor`` and ``postscale_gradients`` say: stage 0
(``allreduce_bucket``) multiplies by 1/p, all-reduces, multiplies by p/W; stages 1-2
(``gradient_reduction_w_predivide``, ``average_tensor``) divide by W/sp; stage 3
(``__avg_scatter_contiguous_grads``) divides by W/sp and multiplies the predivision back. With
sequence parallelism off (sp = 1, refused otherwise) that is F = W = ``engine.dp_world_size``, the
same W/N as under DDP.

**Clipping** is DeepSpeed's (``gradient_clipping`` in its config; 0 turns it off): at stages 1-3
only its optimizer sees the partitioned gradients and their global norm. ``AccumConfig.max_grad_norm``
is refused, so a window is never clipped twice.

**Non-finite windows.** At stage 0 the synchronized gradients are in ``p.grad``: the window engine
checks them and the loss, and clears them on every rank. At stages 1-3 they live in ZeRO's
partitions, which only its step can discard: ``engine.step()`` computes their global norm, and a
non-finite one discards them on every rank without stepping the optimizer or the scheduler (counted
in ``engine.skipped_steps``); the step reports that window as skipped. A window whose loss is not
finite while every gradient is (a non-finite term cut from the graph) is applied there: its
gradient is the exact one.

Refused, with the reason: pipeline-parallel engines (``PipelineEngine.train_batch`` runs its own
schedule of micro-batches and divides by the configured count inside it), ``fp16`` (DeepSpeed's
``FP16_Optimizer`` and dynamic loss scaler), ``BF16_Optimizer`` (DeepSpeed PR #7985: the last
micro-batch's gradients leak under ZeRO-1), sequence or model parallelism and MoE layers (ranks
that share tokens or experts with their own reduction groups),
``managed_gradient_accumulation=false`` (the boundary cannot be set), a DistributedDataParallel
module inside the engine (reduced twice), ``accum_dtype`` at ZeRO stages 2-3 (the sum lives in
ZeRO's buffers, in DeepSpeed's ``grad_accum_dtype``), a ``loss_fn`` that never calls the engine at
stage 3 (refused at that micro-batch), and gradaccum's post-scaling, noise scale and ``max_grad_norm``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from gradaccum.distributed import dist
from gradaccum.distributed.sync import forward_called
from gradaccum.errors import ConfigError, SyncError
from gradaccum.step.checks import check_loss, unmean
from gradaccum.step.config import AccumConfig, StepResult
from gradaccum.step.engine import WindowEngine
from gradaccum.step.external import ExternalOutcome
from gradaccum.step.face import EngineFace
from gradaccum.step.reduction import ReductionCheck
from gradaccum.step.window import ZERO_COUNT, CastScale, Contribution, CountFn

__all__ = ["DeepSpeedAccumulator", "DeepSpeedStep", "prepare_accumulator"]


def prepare_accumulator(engine: Any, *, config: AccumConfig | None = None) -> DeepSpeedAccumulator:
    """An accumulator whose ``.step(window, loss_fn, count_fn)`` is exact through ``engine``.

    ``engine``: what ``deepspeed.initialize`` returned first (with an optimizer); ``config``: the
    window's settings (default ``AccumConfig()``), without ``max_grad_norm``: set DeepSpeed's
    ``gradient_clipping`` instead. ``loss_fn(engine, micro_batch)`` returns the micro-batch's loss
    summed over the ``count_fn(micro_batch)`` units it counts.
    """
    return DeepSpeedAccumulator(engine, config=config)


class DeepSpeedStep:
    """The end of a window, taken by DeepSpeed's engine (:class:`~gradaccum.step.external.ExternalStep`)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.stage = int(engine.zero_optimization_stage())

    @property
    def factor(self) -> float:
        """W: every DeepSpeed reduction of fp32 gradients averages over the data-parallel group."""
        return float(self.engine.dp_world_size)

    @property
    def holds_gradients(self) -> bool:
        """Stage 0 leaves the all-reduced gradient in ``p.grad``; stages 1-3 move it into ZeRO's
        partitions (``p.grad`` is ``None`` after the boundary backward)."""
        return self.stage == 0

    def apply(self) -> ExternalOutcome:
        engine = self.engine
        before = int(engine.global_steps)
        engine.step()
        if int(engine.global_steps) != before + 1:
            raise SyncError(
                f"DeepSpeed's engine.step() advanced global_steps from {before} to {engine.global_steps}, "
                "not by one: the accumulation boundary was not set on the window's last micro-batch. "
                "Do not call set_gradient_accumulation_boundary or engine.step() between windows."
            )
        norm = engine.get_global_grad_norm()
        return ExternalOutcome(bool(engine.was_step_applied()), None if norm is None else float(norm))


class DeepSpeedAccumulator(EngineFace):
    """Exact windows through a DeepSpeed engine; build it with :func:`prepare_accumulator`."""

    def __init__(self, engine: Any, *, config: AccumConfig | None = None) -> None:
        config = AccumConfig() if config is None else config
        if not isinstance(config, AccumConfig):
            raise ConfigError(f"config must be a gradaccum.AccumConfig, got {type(config).__name__}")
        refuse_unsupported(engine, config)
        self.ds_engine = engine
        """The DeepSpeed engine: forwards, backwards and steps go through it."""
        step = DeepSpeedStep(engine)
        # ZeRO-2 and -3 reduce-scatter gradients in every backward (ZeRO-3 also gathers parameters
        # in every forward), and DeepSpeed's boundary bookkeeping assumes one window length on all
        # ranks: every rank must run the same number of micro-batches, which the counts
        # all-reduce checks under defer_sync=False (the engine defers nothing itself here; the
        # boundary does)
        config = dataclasses.replace(config, defer_sync=False)
        self._engine = WindowEngine(
            engine,
            engine.optimizer,
            config,
            backward=lambda loss: engine.backward(loss, scale_wrt_gas=False),
            external=step,
        )
        # the first window's losses are read for a mean passed as a sum (step/reduction.py)
        self._reduction = ReductionCheck(config.loss_reduction, config.check_loss_reduction)

    @property
    def stage(self) -> int:
        """The engine's ZeRO stage (0-3)."""
        return int(self.ds_engine.zero_optimization_stage())

    def step(self, window: Iterable[Any], loss_fn: Any, count_fn: CountFn) -> StepResult:
        """Accumulate the window's gradients exactly and take one ``engine.step()``.

        ``loss_fn(engine, micro_batch)``: the micro-batch's loss summed over its counted units (a
        mean over them with ``AccumConfig(loss_reduction="mean")``). The window may hold any number
        of micro-batches, whatever ``gradient_accumulation_steps`` says: the boundary is set on its
        last one and every loss is divided by the window's own count.
        """
        engine = self._engine
        ds = self.ds_engine
        micro_batches, failure = engine.open(window)
        counted = engine.count(micro_batches, count_fn, failure)
        engine.zero_grad()
        if counted.global_host == 0:  # known on every rank before any forward
            return engine.skip(0, 0, len(micro_batches), None, ZERO_COUNT)
        mean = engine.config.loss_reduction == "mean"
        # each micro-batch adds sum_t l_t / N; DeepSpeed then averages over W ranks: scale by W / N
        scale = CastScale(counted.scale())
        counts = counted.counts
        last = len(micro_batches) - 1
        reduction = self._reduction
        judging = reduction.pending

        def contribute(i: int, mb: Any) -> Contribution:
            # before the forward: ZeRO-3's hooks read the boundary in forward and backward
            ds.set_gradient_accumulation_boundary(i == last)
            loss = check_loss(engine_forward_checked(ds, self.stage, loss_fn, mb, i), i)
            if judging:  # before the backward: every rank refuses a mean passed as a sum
                reduction.judge(loss, counts[i], i)
            if mean:
                loss = unmean(loss, counts[i], i)
            # a new tensor, never the forward's output itself: at stage 0 DeepSpeed divides an output
            # by gradient_accumulation_steps in a hook unless engine.backward's hook ran first
            return Contribution(loss * scale.to(loss.dtype), loss.detach())

        accumulated = engine.accumulate(micro_batches, contribute)
        reduction.pending = False
        return engine.conclude(counted, accumulated)


def engine_forward_checked(engine: Any, stage: int, loss_fn: Any, micro_batch: Any, index: int) -> Any:
    """``loss_fn(engine, micro_batch)``, refusing at ZeRO stage 3 one that never ran the engine's forward.

    DeepSpeed's forward resets the ZeRO optimizer's per-pass gradient bookkeeping
    (``clear_backward_seen_flag``) before it calls the module. A ``loss_fn`` that calls
    ``engine.module`` or its submodules skips it; at stages 0-2 the window is still exact, at stage 3
    the reduced gradient is wrong on every rank alike (0.88 relL2 off the full batch's, no error).
    A forward pre-hook on the engine tells; the error is raised inside the micro-batch, before its
    backward, so the step's failure agreement tells every rank and nothing is updated.
    """
    if stage != 3:
        return loss_fn(engine, micro_batch)
    loss, ran = forward_called(engine, lambda: loss_fn(engine, micro_batch))
    if not ran:
        raise ConfigError(
            f"micro-batch {index}: loss_fn never called the DeepSpeed engine. At ZeRO stage 3 the "
            "engine's forward resets the optimizer's gradient bookkeeping; calling engine.module or its "
            "submodules skips it and the reduced gradient would be wrong on every rank. Call the engine "
            "(engine(...)) in loss_fn."
        )
    return loss


def refuse_unsupported(engine: Any, config: AccumConfig) -> None:
    """Refuse, before any window, what the exact step cannot drive (see the module docstring)."""
    try:
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.pipe.engine import PipelineEngine
    except ImportError as exc:  # pragma: no cover - the extra is not installed
        raise ConfigError(
            "gradaccum.integrations.deepspeed needs DeepSpeed: pip install 'gradaccum[deepspeed]'"
        ) from exc
    if not isinstance(engine, DeepSpeedEngine):
        raise ConfigError(
            f"engine must be the DeepSpeedEngine deepspeed.initialize returned, got {type(engine).__name__}"
        )
    name = type(engine).__name__
    if isinstance(engine, PipelineEngine):
        raise ConfigError(
            f"{name} is pipeline-parallel: its train_batch() runs its own schedule of micro-batches and "
            "divides every loss by gradient_accumulation_steps inside it, where the exact weights cannot "
            "be set. Build the engine without a PipelineModule, or use gradaccum.pipeline with torch's "
            "pipelining."
        )
    if engine.optimizer is None:
        raise ConfigError(f"the {name} has no optimizer: pass optimizer= or an 'optimizer' config section")
    if engine.fp16_enabled():
        raise ConfigError(
            "DeepSpeed's fp16 mode (FP16_Optimizer, or ZeRO with its dynamic loss scaler) is not "
            "supported: it scales, checks and skips float16 gradients in its own optimizer, and the "
            "exact window is verified here only in float32. Use fp32 (bf16 under ZeRO stage 2 or 3 runs "
            "the same reductions, checked only to bf16's rounding)."
        )
    if isinstance(engine.optimizer, BF16_Optimizer):
        raise ConfigError(
            "DeepSpeed's BF16_Optimizer (bf16 without ZeRO, or at stage 1 with fp32 gradient accumulation) "
            "is not supported: it accumulates "
            "micro-batch gradients into its own fp32 buffer in backward_epilogue, and under ZeRO-1 the "
            "last micro-batch's gradients leak into the next step (DeepSpeed PR #7985). Use fp32, or "
            "bf16 under ZeRO stage 2 or 3 (the same reductions as fp32, checked only to bf16's rounding)."
        )
    if not engine.managed_gradient_accumulation():
        raise ConfigError(
            "managed_gradient_accumulation=false: DeepSpeed then refuses "
            "set_gradient_accumulation_boundary, which the exact step needs on each window's last "
            "micro-batch. Leave managed_gradient_accumulation at its default (true)."
        )
    shared = int(getattr(engine, "sequence_parallel_size", 1) or 1)
    world = dist.world_size(None) if dist.is_distributed(None) else 1
    if shared > 1 or int(engine.dp_world_size) != world or getattr(engine, "has_moe_layers", False):
        raise ConfigError(
            f"the {name} runs with sequence parallelism {shared}, a data-parallel group of "
            f"{engine.dp_world_size} of {world} ranks, or MoE layers: ranks that share tokens or "
            "experts would count them more than once. Use pure data parallelism (ZeRO 0-3)."
        )
    if isinstance(engine.module, DistributedDataParallel):
        raise ConfigError(
            f"the {name} wraps a DistributedDataParallel module: DeepSpeed's engine is the data-parallel "
            "wrapper itself, so DDP would all-reduce every micro-batch's gradient and DeepSpeed reduce it "
            "again (at ZeRO stage 3 DeepSpeed fails inside the window). Pass the plain module to "
            "deepspeed.initialize."
        )
    stage = int(engine.zero_optimization_stage())
    if config.accum_dtype is not None and stage >= 2:
        raise ConfigError(
            f"AccumConfig(accum_dtype={config.accum_dtype!r}) at ZeRO stage {stage}: ZeRO moves each "
            "micro-batch's gradient out of p.grad into its own buffers, so the float32 sum in p.grad "
            "would never form and the setting would change nothing. Set DeepSpeed's "
            '"data_types": {"grad_accum_dtype": "fp32"} instead, or use stage 0-1.'
        )
    if config.max_grad_norm is not None:
        raise ConfigError(
            f"AccumConfig(max_grad_norm={config.max_grad_norm}) with DeepSpeed: clipping is DeepSpeed's "
            "own (only its optimizer holds ZeRO's partitioned gradients and their global norm). Set "
            f'"gradient_clipping": {config.max_grad_norm} in the DeepSpeed config and leave '
            "max_grad_norm unset."
        )
    if config.scaling != "pre" or config.noise_scale:
        what = "scaling='post'" if config.scaling != "pre" else "noise_scale=True"
        raise ConfigError(
            f"AccumConfig({what}) with DeepSpeed: both read or rescale p.grad, which ZeRO replaces by "
            "its own partitions. Use the default AccumConfig(scaling='pre', noise_scale=False)."
        )
