"""Exact accumulation for losses that couple the whole batch (gradient caching).

In-batch-negative losses (CLIP, SimCLR, dense retrieval) are a function of *all* the window's
representations R = [R_1; ...; R_k] (every rank's, under data parallelism), so the per-micro-batch
sum that :class:`~gradaccum.Accumulator` relies on does not exist. The chain rule still splits:

    dL/dθ = sum_j (∂R_j/∂θ)^T G_j      with   G_j = ∂L/∂R_j,

and G needs only R, which is small. Gradient caching (Gao, Zhang, Han and Callan, RepL4NLP 2021)
therefore (1) encodes every micro-batch without a graph, keeping R_j; (2) evaluates L on all of R
as leaf tensors and backpropagates once to get every G_j; (3) re-encodes each micro-batch with a
graph and backpropagates G_j through it, holding one micro-batch's activations at a time. The
result is the full-batch gradient up to summation order, provided the second pass reproduces R_j:
the weights do not change in between, and each micro-batch's RNG state is restored so that its
dropout masks repeat. The cost is one extra forward per example.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from gradaccum.cache.replay import (
    ShapeMeta,
    as_reps,
    check_ranks_reps,
    check_rep_loss,
    gather_reps,
    replay_contribution,
    replay_error,
)
from gradaccum.distributed import dist
from gradaccum.errors import CacheError
from gradaccum.loss import count_examples
from gradaccum.moe.runner import refuse_balance
from gradaccum.rng import RngState, capture_rng, replaying
from gradaccum.step.agreement import LocalFailure
from gradaccum.step.config import AccumConfig, StepResult
from gradaccum.step.engine import WindowEngine
from gradaccum.step.face import EngineFace
from gradaccum.step.window import ZERO_COUNT, Contribute, Contribution, CountFn, Observer

__all__ = ["DEFAULT_REPLAY_RTOL", "CachedAccumulator", "EncodeFn", "RepLossFn"]

EncodeFn = Callable[[nn.Module, Any], "torch.Tensor | tuple[torch.Tensor, ...]"]
"""``encode_fn(model, micro_batch)``: that micro-batch's representations, one tensor per tower."""
RepLossFn = Callable[[Any], torch.Tensor]
"""``loss_fn(reps)``: the window's objective over all representations (a tensor, or a tuple with
one tensor per tower), each concatenated along dim 0 in window order, all ranks' in rank order."""

DEFAULT_REPLAY_RTOL = 1e-2


class CachedAccumulator(EngineFace):
    """One exact optimizer step for an objective over the whole window's representations.

    >>> acc = CachedAccumulator(model, optimizer, max_grad_norm=None)
    >>> result = acc.step(window, encode_fn, loss_fn)

    It composes the same :class:`~gradaccum.step.engine.WindowEngine` as
    :class:`~gradaccum.Accumulator`: zero_grad, deferred sync, GradScaler unscale, clipping, the
    optimizer and scheduler step, the skip on non-finite values, the rank checks and the agreement
    points that stop every rank together after a failure are the engine's. Call the encoder on the
    ``model`` it is given (the DDP-wrapped module), so that its hooks run. Under data parallelism
    every rank evaluates ``loss_fn`` on all ranks' representations, identically.

    Parameters the loss uses directly (a learned temperature) get their gradient from ``loss_fn``
    on one process; under DDP they must be applied in ``encode_fn`` or live outside the wrapped
    module, because DDP reduces only gradients that flow through its forward.
    BatchNorm in training mode sees each micro-batch twice and updates its running statistics
    twice; the representations themselves are unaffected.

    The observer sees ``encode_start``/``encode_end`` per micro-batch (first pass),
    ``loss_start``/``loss_end`` once, then ``micro_start``/``micro_end`` per replay.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        scaler: Any = None,
        *,
        config: AccumConfig | None = None,
        dp_group: Any = None,
        on_step: Sequence[Callable[[StepResult], None]] = (),
        observer: Observer | None = None,
        replay_rtol: float | None = DEFAULT_REPLAY_RTOL,
        **settings: Any,
    ) -> None:
        """``replay_rtol``: the largest relative L2 difference allowed between a micro-batch's
        representations in the first and the second pass (``None``: shapes only). The default
        tolerates kernels that round differently with and without a graph, and catches an encoder
        that does not repeat itself, such as dropout drawn from a generator other than torch's.
        ``settings``: :class:`AccumConfig`'s fields as keywords, when no ``config`` is given."""
        refuse_balance(
            settings.pop("balance", None),
            "CachedAccumulator",
            "it replays each micro-batch to backpropagate cached gradients into its representations, "
            "and the balancing term of the routers is no part of those representations' objective",
        )
        if max_grad_norm is not None:  # the one setting also taken positionally; None = not given
            settings["max_grad_norm"] = max_grad_norm
        config = AccumConfig.resolve(config, settings)
        if config.noise_scale:
            raise CacheError(
                "noise_scale=True is not supported by CachedAccumulator: an objective over the whole "
                "window's representations has no per-micro-batch gradient of its own (each replay "
                "backpropagates its share of one coupled loss), so there are no small batches to "
                "measure. Leave noise_scale off here; estimate it on a per-example loss instead."
            )
        if config.scaling != "pre":
            raise CacheError(
                f"scaling={config.scaling!r} is not supported by CachedAccumulator: its replays "
                "backpropagate the cached gradient of one objective over the whole window, which "
                "needs every representation (and so every micro-batch) before the first backward; "
                "there is no summed per-micro-batch loss to scale afterwards. Leave scaling at 'pre'."
            )
        if config.batchnorm_stats != "micro-batch":
            raise CacheError(
                f"batchnorm_stats={config.batchnorm_stats!r} is not supported by CachedAccumulator: "
                "each micro-batch runs through BatchNorm twice (the representations, then the replay), "
                "so its rows would count twice. Leave batchnorm_stats at 'micro-batch'."
            )
        if config.loss_reduction != "sum":
            raise CacheError(
                f"loss_reduction={config.loss_reduction!r} has no meaning for CachedAccumulator: "
                "loss_fn(reps) is already the whole window's objective. Leave loss_reduction at 'sum'."
            )
        if replay_rtol is not None and not (
            isinstance(replay_rtol, (int, float)) and not isinstance(replay_rtol, bool) and replay_rtol >= 0
        ):
            raise CacheError(f"replay_rtol must be a non-negative number or None, got {replay_rtol!r}")
        self._engine = WindowEngine(
            model,
            optimizer,
            config,
            scheduler=scheduler,
            scaler=scaler,
            dp_group=dp_group,
            on_step=on_step,
            observer=observer,
        )
        self.replay_rtol = replay_rtol
        self._cuda_devices = sorted(
            {p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"}
        )

    def step(
        self,
        window: Iterable[Any],
        encode_fn: EncodeFn,
        loss_fn: RepLossFn,
        *,
        count_fn: CountFn = count_examples,
    ) -> StepResult:
        """Cache the window's representations, take the loss over all of them, replay, step once.

        ``count_fn`` counts each micro-batch's examples (override it for micro-batches that are
        not tensors); the counts feed the result and the empty-window checks, not the loss.
        """
        engine = self._engine
        micro_batches, failure = engine.open(window)
        counted = engine.count(micro_batches, count_fn, failure)
        engine.zero_grad()
        k = len(micro_batches)
        if counted.empty:
            return engine.skip(0, 0, k, None, ZERO_COUNT)
        first = self._encode(micro_batches, encode_fn)
        objective, grads, failure = self._objective(first, loss_fn, counted.world)
        if failure is not None:  # the others learn of it at the replay's agreement point
            engine.agree_outside(failure)
        worst: list[torch.Tensor] = []
        contribute = self._replayer(encode_fn, first, grads, worst)
        accumulated = engine.accumulate(
            micro_batches, contribute, phases=("forward (second pass)", "backward (second pass)")
        )

        def rejection(count: int) -> Exception:
            here = float(torch.stack(worst).max()) if worst else 0.0
            return CacheError(
                f"the second pass did not reproduce the first in {count} micro-batch(es) over all ranks: "
                f"the largest relative difference of a micro-batch's representations here is "
                f"{here:.3g} > replay_rtol={self.replay_rtol}; no update was applied. encode_fn must be "
                "deterministic given torch's RNG state: draw randomness (dropout, augmentation) "
                "from torch's global generator, not Python's or NumPy's."
            )

        return engine.conclude(counted, accumulated, objective=objective, rejection=rejection)

    # -- the three passes ---------------------------------------------------------------------

    def _encode(self, micro_batches: list[Any], encode_fn: EncodeFn) -> _FirstPass:
        """(1) Every micro-batch's representations without a graph, and the RNG state it began from.

        A failure ends the pass (the rest of the window is skipped) and is returned, for the shape
        exchange, where every rank learns of it.
        """
        engine = self._engine
        cached: list[tuple[torch.Tensor, ...]] = []
        rng_states: list[RngState] = []
        single = True
        failure: LocalFailure | None = None
        with torch.no_grad():
            for i, mb in enumerate(micro_batches):
                engine.emit("encode_start", i)
                try:
                    rng_states.append(capture_rng(self._cuda_devices))
                    reps, single_i = as_reps(encode_fn(engine.model, mb), i)
                    if cached and (len(reps) != len(cached[0]) or single_i != single):
                        raise CacheError(
                            f"encode_fn returned {len(reps)} tower(s) for micro-batch {i} but "
                            f"{len(cached[0])} for micro-batch 0; every micro-batch needs the same towers"
                        )
                except Exception as exc:
                    failure = LocalFailure(exc, "encode_fn (first pass)", i)
                    break
                single = single_i
                cached.append(tuple(r.detach() for r in reps))
                engine.emit("encode_end", i)
        return _FirstPass(cached, rng_states, single, failure)

    def _objective(
        self, first: _FirstPass, loss_fn: RepLossFn, world: int
    ) -> tuple[torch.Tensor, list[list[torch.Tensor]], LocalFailure | None]:
        """(2) L over all ranks' representations as leaves, and this rank's rows of W * dL/dR.

        Every rank computes the same L and G. This rank backpropagates only its own rows and DDP
        then averages over W ranks, so its rows carry W * G (W = 1 on one process). A failure in
        the loss is returned, for the replay's first agreement point, which every rank reaches.
        """
        engine = self._engine
        engine.emit("loss_start", 0)
        local, metas = self._exchange_shapes(first)
        cached = first.cached
        grads: list[list[torch.Tensor]] = [[] for _ in cached]
        loss = torch.zeros((), dtype=torch.float64, device=engine.device)
        failure: LocalFailure | None = None
        try:
            everyone, starts = gather_reps(local, metas, engine.dp_group)
            leaves = [rep.detach().requires_grad_(True) for rep in everyone]
            with torch.enable_grad():
                objective = check_rep_loss(loss_fn(leaves[0] if first.single else tuple(leaves)))
                scaler = engine.scaler
                (scaler.scale(objective) if scaler is not None else objective).backward()
            loss = objective.detach().to(torch.float64)
            if engine.kind != "local":
                self._refuse_loss_parameters()
            for t, leaf in enumerate(leaves):
                g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                g = g * world if world != 1 else g
                row = starts[t]
                for i, reps in enumerate(cached):
                    grads[i].append(g.narrow(0, row, reps[t].shape[0]))
                    row += reps[t].shape[0]
        except Exception as exc:
            failure = LocalFailure(exc, "loss_fn(reps)", None)
        engine.emit("loss_end", 0)
        return loss, grads, failure

    def _exchange_shapes(self, first: _FirstPass) -> tuple[list[torch.Tensor], list[ShapeMeta]]:
        """This rank's representations per tower, and every rank's shapes: an agreement point.

        A rank that failed in its first pass sends ``None`` instead of shapes; then every rank
        stops here, through the engine's agreement (the failing rank raises its own error).
        """
        engine = self._engine
        failure = first.failure
        local: list[torch.Tensor] = []
        if failure is None:
            try:
                cached = first.cached
                local = [torch.cat([c[t] for c in cached]) for t in range(len(cached[0]))]
            except Exception as exc:
                failure = LocalFailure(exc, "concatenating the representations", None)
        if not dist.is_distributed(engine.dp_group):
            engine.agree_outside(failure)  # one process: raises this rank's error, if any
            return local, []
        mine = None if failure is not None else [(tuple(t.shape), str(t.dtype)) for t in local]
        metas = dist.all_gather_objects(mine, engine.dp_group, what="the representations' shapes")
        failed = [r for r, meta in enumerate(metas) if meta is None]
        if failed:
            engine.agree_outside(failure)
            # only reached where the wrapper cannot agree (FSDP): the healthy ranks stop here
            engine.zero_grad()
            raise CacheError(f"rank(s) {failed} failed in their first pass; no update was applied")
        check_ranks_reps(metas)
        return local, metas

    def _replayer(
        self,
        encode_fn: EncodeFn,
        first: _FirstPass,
        grads: list[list[torch.Tensor]],
        worst: list[torch.Tensor],
    ) -> Contribute:
        """(3) Re-encode micro-batch i with a graph from its first pass's RNG state; its contribution
        sum_t <R_t, G_t> sends the cached G into the replay (the engine runs the backward, deferring
        sync to the last micro-batch as in Accumulator.step)."""
        engine, rtol = self._engine, self.replay_rtol
        cached, rng_states = first.cached, first.rng_states

        def contribute(i: int, mb: Any) -> Contribution:
            with replaying(rng_states[i]), torch.enable_grad():
                reps, _ = as_reps(encode_fn(engine.model, mb), i)
                contribution = replay_contribution(reps, cached[i], grads[i], i)
            rejected = None
            if rtol is not None:
                err = replay_error(reps, cached[i]).to(engine.device)
                worst.append(err)
                rejected = (err > rtol).to(torch.float64)
            cached[i] = ()  # the first-pass copy is no longer needed
            return Contribution(contribution, None, rejected)

        return contribute

    # -- checks -------------------------------------------------------------------------------

    def _refuse_loss_parameters(self) -> None:
        """Under DDP, a parameter whose gradient came from loss_fn itself would never be reduced."""
        engine = self._engine
        used = [name for name, p in engine.model.named_parameters() if p.grad is not None]
        if used:
            raise CacheError(
                f"loss_fn(reps) uses parameters of the {engine.kind}-wrapped model directly ({used[:4]}"
                f"{'...' if len(used) > 4 else ''}); DDP reduces only gradients that flow through "
                "its forward, i.e. through encode_fn. Apply them inside encode_fn, or keep them "
                "outside the wrapped module (every rank computes the same loss, so their gradient "
                "needs no reduction)."
            )


@dataclass(frozen=True, slots=True)
class _FirstPass:
    """What the first pass leaves: the representations, the RNG states, and a failure if any."""

    cached: list[tuple[torch.Tensor, ...]]
    rng_states: list[RngState]
    single: bool
    """Whether encode_fn returned one tensor (not a tuple of towers)."""
    failure: LocalFailure | None
