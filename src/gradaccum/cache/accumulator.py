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

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn

from gradaccum.cache.replay import (
    CacheError,
    RngState,
    ShapeMeta,
    as_reps,
    capture_rng,
    check_ranks_reps,
    check_rep_loss,
    gather_reps,
    replay_contribution,
    replay_error,
    replaying,
)
from gradaccum.check.workload import Workload
from gradaccum.distributed import dist
from gradaccum.distributed.sync import no_grad_sync
from gradaccum.errors import WorkloadError
from gradaccum.loss import count_examples
from gradaccum.step.accumulator import ZERO_COUNT, Accumulator, CountFn, Observer, WindowCount
from gradaccum.step.agreement import LocalFailure
from gradaccum.step.config import LossReduction, StepResult

__all__ = [
    "CacheError",
    "CachedAccumulator",
    "CandidateStep",
    "EncodeFn",
    "RepLossFn",
    "cached_candidate",
    "cached_candidate_for",
]

EncodeFn = Callable[[nn.Module, Any], "torch.Tensor | tuple[torch.Tensor, ...]"]
"""``encode_fn(model, micro_batch)``: that micro-batch's representations, one tensor per tower."""
RepLossFn = Callable[[Any], torch.Tensor]
"""``loss_fn(reps)``: the window's objective over all representations (a tensor, or a tuple with
one tensor per tower), each concatenated along dim 0 in window order, all ranks' in rank order."""
CandidateStep = Callable[[nn.Module, torch.optim.Optimizer, list[Any]], None]
"""``candidate_step(model, optimizer, micro_batches)``: one accumulated update, for ``verify``
(the same shape as :data:`gradaccum.check.equivalence.CandidateStep`)."""

DEFAULT_REPLAY_RTOL = 1e-2


class CachedAccumulator(Accumulator):
    """One exact optimizer step for an objective over the whole window's representations.

    >>> acc = CachedAccumulator(model, optimizer, max_grad_norm=None)
    >>> result = acc.step(window, encode_fn, loss_fn)

    zero_grad, deferred sync, GradScaler unscale, clipping, the optimizer and scheduler step, the
    skip on non-finite values, the rank checks and the agreement points that stop every rank
    together after a failure are :class:`Accumulator`'s own. Call the encoder on the ``model``
    it is given (the DDP-wrapped module), so that its hooks run. Under data parallelism every
    rank evaluates ``loss_fn`` on all ranks' representations, identically.

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
        loss_reduction: LossReduction = "sum",
        defer_sync: bool = True,
        track_grad_norm: bool = False,
        skip_nonfinite: bool = True,
        max_consecutive_skips: int | None = None,
        dp_group: Any = None,
        on_step: Sequence[Callable[[StepResult], None]] = (),
        observer: Observer | None = None,
        replay_rtol: float | None = DEFAULT_REPLAY_RTOL,
    ) -> None:
        """``replay_rtol``: the largest relative L2 difference allowed between a micro-batch's
        representations in the first and the second pass (``None``: shapes only). The default
        tolerates kernels that round differently with and without a graph, and catches an encoder
        that does not repeat itself, such as dropout drawn from a generator other than torch's."""
        if loss_reduction != "sum":
            raise CacheError(
                f"loss_reduction={loss_reduction!r} has no meaning for CachedAccumulator: loss_fn(reps) "
                "is already the whole window's objective. Leave loss_reduction at 'sum'."
            )
        if replay_rtol is not None and not (
            isinstance(replay_rtol, (int, float)) and not isinstance(replay_rtol, bool) and replay_rtol >= 0
        ):
            raise CacheError(f"replay_rtol must be a non-negative number or None, got {replay_rtol!r}")
        super().__init__(
            model,
            optimizer,
            scheduler,
            max_grad_norm,
            scaler,
            loss_reduction=loss_reduction,
            defer_sync=defer_sync,
            track_grad_norm=track_grad_norm,
            skip_nonfinite=skip_nonfinite,
            max_consecutive_skips=max_consecutive_skips,
            dp_group=dp_group,
            on_step=on_step,
            observer=observer,
        )
        self.replay_rtol = replay_rtol
        self._cuda_devices = sorted({p.device.index or 0 for p in self._params if p.device.type == "cuda"})

    # Not a drop-in Accumulator.step: the objective is one loss over representations, not a sum of
    # per-micro-batch losses, so the callables differ.
    def step(  # type: ignore[override]
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
        micro_batches = self._begin(window)
        counted = self._count(micro_batches, count_fn)
        self._zero_grad()
        k = len(micro_batches)
        if _window_is_empty(counted):
            return self._skip(0, 0, k, None, ZERO_COUNT)
        cached, rng_states, single = self._encode(micro_batches, encode_fn)
        loss, grads = self._objective(cached, single, loss_fn, counted.world)
        self._replay(micro_batches, encode_fn, cached, rng_states, grads)
        return self._conclude(loss, counted, k, loss_is_global=True)

    # -- the three passes ---------------------------------------------------------------------

    def _encode(
        self, micro_batches: list[Any], encode_fn: EncodeFn
    ) -> tuple[list[tuple[torch.Tensor, ...]], list[RngState], bool]:
        """(1) Every micro-batch's representations without a graph, and the RNG state it began from.

        A failure is held in ``self._failure`` (the rest of the window is skipped) for the shape
        exchange, where every rank learns of it.
        """
        cached: list[tuple[torch.Tensor, ...]] = []
        rng_states: list[RngState] = []
        single = True
        with torch.no_grad():
            for i, mb in enumerate(micro_batches):
                self._emit("encode_start", i)
                try:
                    rng_states.append(capture_rng(self._cuda_devices))
                    reps, single_i = as_reps(encode_fn(self.model, mb), i)
                    if cached and (len(reps) != len(cached[0]) or single_i != single):
                        raise CacheError(
                            f"encode_fn returned {len(reps)} tower(s) for micro-batch {i} but "
                            f"{len(cached[0])} for micro-batch 0; every micro-batch needs the same towers"
                        )
                except Exception as exc:
                    self._failure = LocalFailure(exc, "encode_fn (first pass)", i)
                    break
                single = single_i
                cached.append(tuple(r.detach() for r in reps))
                self._emit("encode_end", i)
        return cached, rng_states, single

    def _objective(
        self, cached: list[tuple[torch.Tensor, ...]], single: bool, loss_fn: RepLossFn, world: int
    ) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """(2) L over all ranks' representations as leaves, and this rank's rows of W * dL/dR.

        Every rank computes the same L and G. This rank backpropagates only its own rows and DDP
        then averages over W ranks, so its rows carry W * G (W = 1 on one process).
        """
        self._emit("loss_start", 0)
        local, metas = self._exchange_shapes(cached)
        grads: list[list[torch.Tensor]] = [[] for _ in cached]
        loss = self._zero
        try:
            everyone, starts = gather_reps(local, metas, self.dp_group)
            leaves = [rep.detach().requires_grad_(True) for rep in everyone]
            with torch.enable_grad():
                objective = check_rep_loss(loss_fn(leaves[0] if single else tuple(leaves)))
                (self.scaler.scale(objective) if self.scaler is not None else objective).backward()
            loss = objective.detach().to(torch.float64)
            if self.kind != "local":
                self._refuse_loss_parameters()
            for t, leaf in enumerate(leaves):
                g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                g = g * world if world != 1 else g
                row = starts[t]
                for i, reps in enumerate(cached):
                    grads[i].append(g.narrow(0, row, reps[t].shape[0]))
                    row += reps[t].shape[0]
        except Exception as exc:
            # held for the first agreement point of the replay, which every rank reaches
            self._failure = LocalFailure(exc, "loss_fn(reps)", None)
        self._emit("loss_end", 0)
        return loss, grads

    def _exchange_shapes(
        self, cached: list[tuple[torch.Tensor, ...]]
    ) -> tuple[list[torch.Tensor], list[ShapeMeta]]:
        """This rank's representations per tower, and every rank's shapes: an agreement point.

        A rank that failed in its first pass sends ``None`` instead of shapes; then every rank
        stops here, through the Accumulator's agreement (the failing rank raises its own error).
        """
        local: list[torch.Tensor] = []
        if self._failure is None:
            try:
                local = [torch.cat([c[t] for c in cached]) for t in range(len(cached[0]))]
            except Exception as exc:
                self._failure = LocalFailure(exc, "concatenating the representations", None)
        if not dist.is_distributed(self.dp_group):
            if self._failure is not None:
                self._agree(0, None)  # one process: raises this rank's error
            return local, []
        mine = None if self._failure is not None else [(tuple(t.shape), str(t.dtype)) for t in local]
        metas = dist.all_gather_objects(mine, self.dp_group, what="the representations' shapes")
        failed = [r for r, meta in enumerate(metas) if meta is None]
        if failed:
            self._agree(0, None)
            # only reached where the wrapper cannot agree (FSDP): the healthy ranks stop here
            self._zero_grad()
            raise CacheError(f"rank(s) {failed} failed in their first pass; no update was applied")
        check_ranks_reps(metas)
        return local, metas

    def _replay(
        self,
        micro_batches: list[Any],
        encode_fn: EncodeFn,
        cached: list[tuple[torch.Tensor, ...]],
        rng_states: list[RngState],
        grads: list[list[torch.Tensor]],
    ) -> None:
        """(3) Re-encode each micro-batch with a graph from its first pass's RNG state and
        backpropagate its cached G; only the last backward synchronizes (as in Accumulator.step,
        whose agreement point and synchronizing backward these are)."""
        worst = torch.zeros((), dtype=torch.float64, device=self._device)
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            self._emit("micro_start", i)
            # after an agreed failure under DDP the first micro-batch synchronizes too (see
            # Accumulator._agree): it resets the reducer that the abandoned window left armed
            syncs = i == last or not self.config.defer_sync or (i == 0 and self._resync)
            contribution: torch.Tensor | None = None
            with no_grad_sync(self.model, enabled=not syncs):
                if syncs and self._failure is None and self.kind == "ddp":
                    # agree before the synchronizing forward as well: DDP readies its reducer for a
                    # backward in that forward, and a window abandoned after it leaves the reducer
                    # expecting one, so the next window's first local backward would all-reduce
                    self._agree(i, None)
                phase = "forward (second pass)"
                if self._failure is None:
                    try:
                        with replaying(rng_states[i]), torch.enable_grad():
                            reps, _ = as_reps(encode_fn(self.model, mb), i)
                            contribution = replay_contribution(reps, cached[i], grads[i], i)
                            if self.replay_rtol is not None:
                                worst = torch.maximum(worst, replay_error(reps, cached[i]).to(worst.device))
                            if not syncs:
                                phase = "backward (second pass)"
                                contribution.backward()
                    except Exception as exc:
                        self._failure = LocalFailure(exc, phase, i)
                        contribution = None
                if syncs or self._failure is not None:
                    # every rank meets here before a synchronizing backward (and checks that it
                    # reaches every parameter); a rank that failed comes straight here
                    self._agree(i, contribution)
                if syncs and contribution is not None:
                    self._sync_backward(contribution, i)
            cached[i] = ()  # the first-pass copy is no longer needed
            self._emit("micro_end", i)
        if self.replay_rtol is not None:
            self._check_replay(worst)

    # -- checks -------------------------------------------------------------------------------

    def _refuse_loss_parameters(self) -> None:
        """Under DDP, a parameter whose gradient came from loss_fn itself would never be reduced."""
        used = [name for name, p in self.model.named_parameters() if p.grad is not None]
        if used:
            raise CacheError(
                f"loss_fn(reps) uses parameters of the {self.kind}-wrapped model directly ({used[:4]}"
                f"{'...' if len(used) > 4 else ''}); DDP reduces only gradients that flow through "
                "its forward, i.e. through encode_fn. Apply them inside encode_fn, or keep them "
                "outside the wrapped module (every rank computes the same loss, so their gradient "
                "needs no reduction)."
            )

    def _check_replay(self, worst: torch.Tensor) -> None:
        """Refuse the update, on every rank alike, when a replay did not reproduce its first pass."""
        tol = self.replay_rtol if self.replay_rtol is not None else math.inf
        flag = (worst > tol).to(torch.float64).reshape(1)
        dist.all_reduce_sum_(flag, self.dp_group, what="the replay check")
        bad, worst_host = torch.cat([flag, worst.reshape(1)]).tolist()
        if bad:
            self._zero_grad()
            raise CacheError(
                f"the second pass did not reproduce the first on {int(bad)} rank(s): the largest "
                f"relative difference of a micro-batch's representations here is {worst_host:.3g} > "
                f"replay_rtol={self.replay_rtol}; no update was applied. encode_fn must be "
                "deterministic given torch's RNG state: draw randomness (dropout, augmentation) "
                "from torch's global generator, not Python's or NumPy's."
            )


def _window_is_empty(counted: WindowCount) -> bool:
    """Zero examples on every rank; known on the host without a device read for int counts."""
    if counted.global_host is not None:
        return counted.global_host == 0
    return all(isinstance(c, int) for c in counted.counts) and sum(int(c) for c in counted.counts) == 0


def cached_candidate(
    encode_fn: EncodeFn, loss_fn: RepLossFn, *, count_fn: CountFn | None = None
) -> CandidateStep:
    """A ``candidate_step`` for :func:`gradaccum.verify` that updates through a CachedAccumulator.

    ``loss_fn(reps)`` is the objective; with ``count_fn`` it is instead summed over the units
    ``count_fn`` counts (a Workload's convention) and the objective is it divided by the window's
    count. The window is one process's, as in ``verify``.
    """

    def candidate_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[Any]) -> None:
        objective = loss_fn
        if count_fn is not None:
            n = sum(int(count_fn(mb)) for mb in micro_batches)

            def objective(reps: Any) -> torch.Tensor:
                return loss_fn(reps) / n

        CachedAccumulator(model, optimizer).step(
            micro_batches, encode_fn, objective, count_fn=count_fn or count_examples
        )

    candidate_step.__qualname__ = f"CachedAccumulator.step({_name(encode_fn)}, {_name(loss_fn)})"
    return candidate_step


def cached_candidate_for(workload: Workload) -> CandidateStep:
    """The cached candidate of a workload whose ``extras`` hold ``encode_fn`` and ``rep_loss_fn``.

    ``rep_loss_fn`` follows the workload's ``loss_fn``: summed over the units ``count_fn`` counts.
    """
    missing = [key for key in ("encode_fn", "rep_loss_fn") if not callable(workload.extras.get(key))]
    if missing:
        raise WorkloadError(
            f"workload {workload.name!r} cannot run through a gradient cache: its extras lack "
            f"{' and '.join(missing)}. Add extras={{'encode_fn': encode_fn(model, micro_batch) -> reps, "
            "'rep_loss_fn': rep_loss_fn(reps) -> loss summed over the counted units}."
        )
    return cached_candidate(
        workload.extras["encode_fn"], workload.extras["rep_loss_fn"], count_fn=workload.count_fn
    )


def _name(fn: object) -> str:
    return str(getattr(fn, "__qualname__", None) or type(fn).__name__)
