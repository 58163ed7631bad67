"""The window engine: one window of micro-batches, from counting to the optimizer step, written once.

For a window of micro-batches B_1..B_k on each of W data-parallel ranks, with n_j counted units in B_j and
N = sum over all ranks and micro-batches of n_j, the full-batch mean loss is

    L = (1/N) sum_j sum_{t in B_j} l_t    so    grad L = sum_j grad( sum_{t in B_j} l_t ) / N.

Each micro-batch therefore backpropagates its *summed* loss times 1/N. DDP and FSDP then *average* the W
ranks' gradients, which divides by W once more, so each rank scales by W/N instead. Everything that
belongs to the optimizer step (zero_grad, unscale, clip, step, scheduler, hooks) runs once per window;
nothing runs per micro-batch except forward and backward.

Every front end composes this engine: ``Accumulator`` hands it each micro-batch's loss, ``CachedAccumulator``
replayed representations times their cached gradients, the pipeline its schedule's losses; post-scaling
(:mod:`~gradaccum.step.post_scaling`) streams phases 1-3 and scales the gradients once before phase 4; a
plain one-process step (:mod:`~gradaccum.step.plain`) runs phases 2-3 bare. Beside it in ``step/``:
``window`` (what flows between phases), ``settle`` and ``update`` (phase 4), ``objects``, ``state``. Phases:

1. :meth:`WindowEngine.open`: materialize the window (a failure here is *returned*, for 2);
2. :meth:`WindowEngine.count`: count every micro-batch and agree on N across ranks: collective 1,
   which also carries earlier failures, the window shapes and the configuration fingerprint;
3. :meth:`WindowEngine.accumulate`: forward and backward per micro-batch, sync deferred to the
   last; before a synchronizing backward every rank meets once more (collective 2, DDP), and the
   window's loss travels in that same all-reduce;
4. :meth:`WindowEngine.conclude`: one host read decides for every rank (finite? counted?), then
   unscale, clip, step, schedule and hooks, once.

So a DDP update costs two small all-reduces besides the gradients' own; one process reads the device once.
What a window leaves on the model, and ``close()``: :mod:`gradaccum.step.lifetime`. A failure on one rank
stops every rank at an agreement point (:mod:`gradaccum.step.agreement`: where, and what it cannot cover).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from gradaccum.distributed import dist
from gradaccum.distributed.sync import (
    SyncKind,
    broadcasts_buffers,
    check_sync_on,
    needs_every_parameter,
    sync_deferred,
    sync_kind,
    sync_module,
)
from gradaccum.errors import CountError
from gradaccum.mesh.reduction import DivideFactor
from gradaccum.mesh.step import (
    check_sync_policy,
    layout_for_step,
    raise_length_mismatch,
    raise_replica_mismatch,
    replica_slots,
    replicas_agree,
)
from gradaccum.moe.balancer import WindowBalance
from gradaccum.step.agreement import (
    LocalFailure,
    back_off_scaler,
    check_buffer_broadcasts,
    fingerprints_agree,
    raise_agreed,
    raise_alone,
    raise_mismatch,
    raise_unreached,
    settings_fingerprint,
    unreached_parameters,
)
from gradaccum.step.batchnorm import window_batchnorm
from gradaccum.step.checks import as_count, check_not_empty, check_skips, check_window_shapes, sum_counts
from gradaccum.step.compiled import CompileCounter
from gradaccum.step.config import AccumConfig, StepResult
from gradaccum.step.external import ExternalStep
from gradaccum.step.ledger import Ledger
from gradaccum.step.lifetime import closed_error
from gradaccum.step.meetings import Meetings
from gradaccum.step.noise import NoiseScale, noise_meter, noise_scale_of
from gradaccum.step.norms import present_grads, uniform_plain
from gradaccum.step.objects import check_objects, refuse_static_graph, refuse_unwrapped
from gradaccum.step.settle import WindowSettler
from gradaccum.step.state import COUNTER_KEYS, StatePart, check_state
from gradaccum.step.update import OptimizerUpdate
from gradaccum.step.window import (
    ZERO_COUNT,
    Accumulated,
    Backward,
    Contribute,
    Contribution,
    CountFn,
    CountTotals,
    Observer,
    WindowCount,
)
from gradaccum.step.zeroing import gradient_clearer

__all__ = ["WindowEngine"]


class WindowEngine:
    """The micro-batch loop, sync deferral, agreement points and the once-per-window optimizer step.

    Holds the objects a step touches, the :class:`AccumConfig`, and the counters that
    :meth:`state_dict` saves. Accumulators build one and drive its phases in order.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: AccumConfig,
        *,
        scheduler: Any = None,
        scaler: Any = None,
        dp_group: Any = None,
        mesh: Any = None,
        mesh_dims: Mapping[str, str] | None = None,
        on_step: Sequence[Callable[[StepResult], None]] = (),
        observer: Observer | None = None,
        backward: Backward | None = None,
        pipeline: bool = False,
        synced: nn.Module | None = None,
        external: ExternalStep | None = None,
        balance: WindowBalance | None = None,
    ) -> None:
        """``mesh``/``mesh_dims``: the DeviceMesh the model was parallelized with (see
        :mod:`gradaccum.mesh`); ``pipeline``: a pipeline schedule runs the micro-batches, and
        every stage counts the same window (:class:`gradaccum.pipeline.PipelineAccumulator`);
        ``synced``: the module whose wrapper synchronizes gradients, when ``model`` is not it
        (a pipeline's stage modules); ``external``: an engine that reduces, checks, clips and
        applies the gradients itself (DeepSpeed, :mod:`gradaccum.step.external`): its
        ``optimizer`` need not be a ``torch.optim.Optimizer``, and conclude hands it the update;
        ``balance``: an MoE load balance (:mod:`gradaccum.moe`)."""
        check_objects(model, optimizer, config, scheduler, external=external is not None)
        self.external = external
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.scheduler = scheduler
        self.scaler = scaler
        self.dp_group = dp_group
        self.on_step = list(on_step)
        self.observer = observer
        self.backward: Backward = torch.Tensor.backward if backward is None else backward
        self.kind: SyncKind = sync_kind(model if synced is None else synced)
        # the DDP/FSDP module itself, also inside Fabric's wrapper
        self._synced = sync_module(model if synced is None else synced)
        self.steps_applied = 0
        self.steps_skipped = 0
        self.consecutive_skips = 0
        refuse_static_graph(self._synced, self.kind, config.defer_sync)
        # DDP fixes the parameters it reduces when it is built; the accumulator is built right after
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._reduced_params = trainable if needs_every_parameter(model) else []
        self._params = list(model.parameters())
        self._uniform = uniform_plain(self._params)  # a gradient has its parameter's device and dtype
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        outside = [p for p in self._params if id(p) not in in_optimizer]
        self._clear_grads = gradient_clearer(optimizer, outside)  # optimizer.zero_grad's effect
        self.device = self._params[0].device if self._params else torch.device("cpu")
        self._zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self._distributed = dist.is_distributed(dp_group)
        self._pipeline = pipeline
        self.layout = layout_for_step(
            mesh, mesh_dims, model=model, config=config, dp_group=dp_group, pipeline=pipeline
        )
        if self.layout is not None:
            self._distributed = dist.is_distributed()
        data_ranks = self.layout.data_size if self.layout else dist.world_size(dp_group)
        # the W of W/N, and the ranks that hold the same tokens (whose sums count each unit once)
        if external is None:
            refuse_unwrapped(model, self.kind, data_ranks)
        divide = DivideFactor(self._synced, self.kind, data_ranks) if external is None else external
        self._divide: DivideFactor | ExternalStep = divide
        self._count_replicas = self.layout.tp * self.layout.pp if self.layout else 1
        self._policy = check_sync_policy(config, self.kind, self.layout)
        # the ranks' models must match, but a pipeline's stages hold different parts of it
        described = None if balance is None else balance.spec.describe()  # ranks agree on it too
        self._settings, self._fingerprint = settings_fingerprint(
            config,
            self.kind,
            scaler,
            model,
            distributed=self._distributed,
            same_model=not pipeline,
            balance=described,
        )
        self._noise = (
            noise_meter(self.model, self._params, self.kind, device=self.device, uniform=self._uniform)
            if config.noise_scale
            else None
        )
        # what a window carries to the next one, saved under its name in state_dict()
        self.parts: dict[str, StatePart] = {} if self._noise is None else {"noise": self._noise}
        self.balance = balance
        if balance is not None:
            self.parts["balance"] = balance
        self._compiles = CompileCounter()  # graphs torch.compile builds during a window
        self.settler = WindowSettler(
            self._zero, self.dp_group, layout=self.layout, noise=self._noise, scaler=scaler
        )
        self.update = OptimizerUpdate(
            optimizer,
            config,
            scheduler=scheduler,
            scaler=scaler,
            kind=self.kind,
            synced=self._synced,
            layout=self.layout,
            uniform=self._uniform,
            device=self.device,
        )
        self.meetings = Meetings(
            self.kind,
            agree_on_failure=config.agree_on_failure,
            group=dp_group,
            reduced_params=self._reduced_params,
            backward=self.update.wide.around_sync(self.backward),
            zero_grad=self.zero_grad,
            zero=self._zero,
        )
        # DDP that broadcasts buffers in a window's first forward (the same on every rank)
        self._broadcasts = broadcasts_buffers(self._synced, self.kind)
        wide = self.update.wide if self.update.wide.active else None  # per window: step/lifetime.py
        self._windowed = [p for p in (self._noise, window_batchnorm(self), wide) if p is not None]
        self.closed = False

    @property
    def factor(self) -> float:
        """F, the W of W/N, read where each window scales (FSDP2's may be set after construction)."""
        return self._divide.factor

    @property
    def noise_scale(self) -> NoiseScale:
        """The gradient noise scale so far (``noise_scale=True``); see :mod:`gradaccum.step.noise`."""
        return noise_scale_of(self._noise)

    # -- counters -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The counters a resumed run needs (applied and skipped updates, consecutive skips), and
        under its own name whatever a feature carries across windows (:mod:`gradaccum.step.state`):
        a resumed run continues where it stopped instead of restarting those figures."""
        self.settle_counters()
        state: dict[str, Any] = {key: int(getattr(self, key)) for key in COUNTER_KEYS}
        for name, part in self.parts.items():
            state[name] = part.state_dict()
        return state

    def settle_counters(self) -> None:
        """Bring device-kept counters to the host: none here (post-scaling's device verdict has some)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, refusing missing, unknown or negative values. A part this
        accumulator uses but the state lacks (an older checkpoint) starts empty; a part it does not
        use is ignored (it never changes the update)."""
        check_state(state)
        for name, part in self.parts.items():
            if name in state:
                part.load_state_dict(state[name])  # each part validates before changing anything
        for key in COUNTER_KEYS:
            setattr(self, key, state[key])

    # -- phases ---------------------------------------------------------------------------------

    def open(self, window: Iterable[Any]) -> tuple[list[Any], LocalFailure | None]:
        """Materialize the window. Under torch.distributed a failure is returned, not raised, so
        that :meth:`count` carries it to the other ranks instead of leaving them waiting there."""
        if self.closed:
            raise closed_error("accumulator")
        self._distributed = dist.is_distributed(self.dp_group)
        self._compiles.start()
        failure: LocalFailure | None = None
        try:
            micro_batches = window if type(window) is list else list(window)
            if self.kind == "ddp":
                check_sync_on(self.model)
        except Exception as exc:
            if not self._distributed:
                raise
            failure = LocalFailure(exc, "reading the window", None)
            micro_batches = []
        self.emit("window_start", len(micro_batches))
        return micro_batches, failure

    def count(self, micro_batches: list[Any], count_fn: CountFn, failure: LocalFailure | None) -> WindowCount:
        """Count the whole window before the first backward, and agree on N across ranks.

        Counts travel as float64 (exact below 2**53) so that the scale W/N is full precision. On
        one process nothing leaves the device here; under torch.distributed the counts all-reduce
        is read once, so that every rank takes the same branch (and raises a failure together).
        A load balance's routing statistics (:mod:`gradaccum.moe`) are counted here too, beside N.
        """
        counts: list[int | torch.Tensor] = []
        if failure is None:
            phase = "count_fn"
            try:
                for i, mb in enumerate(micro_batches):
                    counts.append(as_count(count_fn(mb), i))
                if self.balance is not None:
                    phase = "the routing pass"
                    self.balance.count(micro_batches)
            except Exception as exc:
                if not self._distributed:
                    raise
                failure = LocalFailure(exc, phase, len(counts))
                counts = []
        local_count, min_count = sum_counts(counts, self.device)
        if not self._distributed:
            check_not_empty(len(micro_batches))
            if self.balance is not None:
                self.balance.agree(self.balance.local())
            return WindowCount(counts, local_count, local_count, None, min_count, 1, self.factor)
        return self._agree_on_counts(len(micro_batches), counts, local_count, min_count, failure)[0]

    def _agree_on_counts(
        self,
        k: int,
        counts: list[int | torch.Tensor],
        local_count: torch.Tensor,
        min_count: torch.Tensor | None,
        failure: LocalFailure | None,
        *,
        post: torch.Tensor | None = None,
        tally: torch.Tensor | None = None,
        piece: Contribution | None = None,
        index: int = 0,
    ) -> tuple[WindowCount, list[float] | None]:
        """Collective 1: N, and everything every rank must know before its first forward.

        Under post-scaling the same all-reduce is the meeting before the synchronizing backward
        (``post``: the constant c): it also carries the window's loss ``tally`` (returned summed)
        and, under DDP, whether ``piece``'s backward would miss a parameter DDP waits for.

        On a mesh the sums run over every rank, and ranks that hold the same tokens (TP, and the
        stages of one pipeline) add the same count R times: N is the sum over R. That they agree
        is checked in the same all-reduce: each rank adds its count c and c^2 at its data index d,
        and the R ranks at d agree iff R * sum(c^2) == (sum c)^2.
        """
        world = dist.world_size(self.dp_group)
        replicas = self._count_replicas
        ledger = Ledger(self.device)
        ledger.add("global_count", local_count)
        ledger.add("empty_ranks", k == 0)
        ledger.add("negative_ranks", 0 if min_count is None else (min_count < 0))
        ledger.add("micro_batches", k)
        ledger.add("micro_batches_squared", k * k)
        ledger.add("failed_ranks", failure is not None)
        ledger.add("oom_ranks", failure is not None and failure.oom)
        ledger.add("broadcasting_ranks", self.kind == "ddp" and self._synced.will_sync_module_buffers())  # type: ignore[operator]
        ledger.add("fingerprint", self._fingerprint)
        if self.balance is not None:  # (c, R): window statistics like N (zeros from a failed rank)
            ledger.add("routing", self.balance.local())
        if replicas > 1:
            assert self.layout is not None
            ledger.add("replica_counts", replica_slots(self.layout, local_count, k))
        missed: list[str] = []
        if post is not None:
            if failure is not None and dist.looks_like_comm_failure(failure.error):
                raise_alone(failure, recoverable=False)  # a peer is gone: meeting would wait for the timeout
            if failure is None and piece is not None and self._reduced_params:
                unreached = unreached_parameters(piece.backprop, [p for _, p in self._reduced_params])
                missed = [self._reduced_params[j][0] for j in unreached]
            ledger.add("missed_ranks", bool(missed))
            ledger.add("tally", self._zero.new_zeros(2) if tally is None else tally)
        settled = ledger.settle(self.dp_group, what="the window's counts")
        totals = settled.unpack(CountTotals)
        if replicas > 1 and not replicas_agree(settled.value("replica_counts"), replicas):  # type: ignore[arg-type]
            self.zero_grad()
            assert self.layout is not None
            raise_replica_mismatch(self.layout, local_count, k, self.dp_group)
        if not fingerprints_agree(totals.fingerprint, world):
            self.zero_grad()
            raise_mismatch(self._settings, self.model, self.dp_group)
        if totals.failed_ranks:
            self.zero_grad()
            raise_agreed(failure, int(totals.failed_ranks), int(totals.oom_ranks), self.dp_group)
        if totals.missed_ranks:
            self.zero_grad()
            raise_unreached(missed, index, self.dp_group)
        check_buffer_broadcasts(int(totals.broadcasting_ranks), world)
        if self._pipeline and world * totals.micro_batches_squared != totals.micro_batches**2:
            raise_length_mismatch(k, self.dp_group)  # a schedule cannot run uneven windows: it would hang
        check_window_shapes(
            world,
            k,
            int(totals.empty_ranks),
            int(totals.micro_batches),
            int(totals.micro_batches_squared),
            defer_sync=self.config.defer_sync,
            kind=self.kind,
        )
        if totals.negative_ranks:
            raise CountError(f"count_fn returned a negative count on {int(totals.negative_ranks)} rank(s)")
        global_count = settled.device("global_count")
        if replicas > 1:  # exact: the R ranks at each data index agree, so the sum is R * N
            global_count = global_count / replicas
        n = int(totals.global_count) // replicas
        reduced = self.meetings.split(settled.value("tally")) if post is not None else None  # type: ignore[arg-type]
        if self.balance is not None:  # ranks that hold the same tokens (TP) add the same routing
            self.balance.agree(settled.device("routing") / replicas)
        counted = WindowCount(counts, local_count, global_count, n, min_count, world, self.factor, post)
        return counted, reduced

    def accumulate(
        self,
        micro_batches: list[Any],
        contribute: Contribute,
        *,
        phases: tuple[str, str] = ("forward", "backward"),
    ) -> Accumulated:
        """Forward and backward of every micro-batch, gradient sync deferred to the last one.

        ``no_sync`` wraps the forward *and* the backward of every micro-batch but the last (DDP
        decides in forward whether the backward synchronizes). Before each synchronizing backward
        the ranks meet (DDP): a rank that raised in an earlier micro-batch skips the rest of its
        window and comes straight to that meeting, where every rank learns of it. ``phases`` name
        the forward and the backward in a failing rank's report.
        """
        model, kind = self.model, self.kind
        meetings = self.meetings
        meets = meetings.meets(self._distributed)
        defer = self._policy != "every"
        replicate_only = self._policy == "defer_replicate"
        losses: list[torch.Tensor] = []
        rejections: list[torch.Tensor] = []
        reduced: list[float] | None = None
        last = len(micro_batches) - 1
        resync = meetings.resync
        noise = self._noise
        for part in self._windowed:  # the noise meter, BatchNorm's window moments
            part.start()
        for i, mb in enumerate(micro_batches):
            self.emit("micro_start", i)
            syncs = i == last or not defer or (i == 0 and resync)
            piece: Contribution | None = None
            failure: LocalFailure | None = None
            with sync_deferred(model, kind, enabled=not syncs, replicate_only=replicate_only):
                phase = phases[0]
                try:
                    piece = contribute(i, mb)
                    if piece.loss is not None:
                        losses.append(piece.loss)
                    if piece.rejected is not None:
                        rejections.append(piece.rejected)
                    if not syncs:
                        phase = phases[1]
                        self.backward(piece.backprop)
                except Exception as exc:
                    failure = LocalFailure(exc, phase, i)
                if meets and (syncs or failure is not None):
                    # every rank meets before a synchronizing backward; a failed rank skips ahead to it
                    reduced = meetings.agree(failure, i, piece, meetings.tally(losses, rejections))
                elif failure is not None:
                    meetings.fail_alone(failure, self._distributed)
                if syncs and piece is not None:
                    meetings.sync_backward(piece.backprop, i)
            if noise is not None:
                noise.fold()  # this micro-batch's |Delta_j|^2, from the hooks its backward ran
            self.emit("micro_end", i)
        if reduced is not None:
            loss = torch.tensor(reduced[0], dtype=torch.float64, device=self.device)
            rejected = torch.tensor(reduced[1], dtype=torch.float64, device=self.device)
            return Accumulated(loss, rejected, True, len(micro_batches))
        rejected = torch.stack(rejections).sum(dtype=torch.float64) if rejections else self._zero
        summed = None if losses else self._zero  # the losses are added up in settle, beside the verdict
        return Accumulated(summed, rejected, False, len(micro_batches), tuple(losses))

    def conclude(
        self,
        counted: WindowCount,
        accumulated: Accumulated,
        *,
        objective: torch.Tensor | None = None,
        rejection: Callable[[int], Exception] | None = None,
    ) -> StepResult:
        """One decision for all ranks (counted? finite? vetoed?), then unscale, clip and step once.

        ``objective``: the window's loss computed identically on every rank (gradient caching);
        by default the mean of the accumulated summed losses over N. ``rejection(ranks)`` builds
        the error raised, on every rank, when micro-batches vetoed the update.
        """
        self.emit("optimizer_start", 0)
        params, grads = present_grads(self._params)
        return self._decide(counted, accumulated, params, grads, objective, rejection)

    def _decide(
        self,
        counted: WindowCount,
        accumulated: Accumulated,
        params: Sequence[torch.Tensor],
        grads: list[torch.Tensor],
        objective: torch.Tensor | None,
        rejection: Callable[[int], Exception] | None,
    ) -> StepResult:
        """The verdict from the figures every rank reads alike, then the update or the skip."""
        # an external step that keeps its gradients out of p.grad checks them itself (only it can
        # discard them): it skips a window whose gradient is not finite, in its apply() below
        checks_here = self.external is None or self.external.holds_gradients
        norm, gradient = (
            self.update.gradient_check(grads, noise=self._noise is not None) if checks_here else (None, None)
        )
        totals, norm = self.settler.settle(
            counted, accumulated, objective, gradient, norm, distributed=self._distributed
        )
        n_global, local_n, k = int(totals.global_count), int(totals.local_count), accumulated.micro_batches

        # the verdict: every rank read the same reduced figures, so every rank takes the same branch
        if totals.smallest_count < 0:
            self.zero_grad()
            raise CountError("count_fn returned a negative count; no update was applied")
        if totals.rejected and rejection is not None:
            self.zero_grad()
            raise rejection(int(totals.rejected))
        mean_loss = totals.loss if objective is not None else (totals.loss / n_global if n_global else None)
        if n_global == 0:
            return self.skip(local_n, 0, k, None, ZERO_COUNT)
        # a NaN or inf on any rank made the reduced loss or the global norm non-finite
        gradient_ok = math.isfinite(totals.gradient) and (norm is not None or totals.gradient == 0)
        if checks_here and self.config.skip_nonfinite and not (math.isfinite(totals.loss) and gradient_ok):
            back_off_scaler(self.scaler, self.optimizer, params)
            what = f"gradient norm {totals.gradient}" if norm is not None else "a gradient holds NaN or inf"
            reason = f"non-finite loss or gradient (loss {totals.loss}, {what})"
            return self.skip(local_n, n_global, k, mean_loss, reason)

        if self.external is not None:
            outcome = self.external.apply()
            if not outcome.applied:
                owner = type(self.external).__name__
                reason = f"non-finite gradient (loss {totals.loss}): {owner} discarded it"
                return self.skip(local_n, n_global, k, mean_loss, reason)
            known = outcome.grad_norm is not None or norm is not None
            norm_host = totals.gradient if outcome.grad_norm is None else outcome.grad_norm
        else:
            known = norm is not None
            norm_host = self.update.apply(params, grads, norm, totals.gradient, self.dp_group)
        self.steps_applied += 1
        self.consecutive_skips = 0
        if self._noise is not None:
            self._noise.update(totals.noise, n_global, counted.world)
        result = StepResult(
            loss=mean_loss,
            local_count=local_n,
            global_count=n_global,
            micro_batches=k,
            grad_norm=norm_host if (known and self.config.wants_norm) else None,
            applied=True,
            step=self.steps_applied,
            recompiles=self._compiles.since(),
        )
        for hook in self.on_step:
            hook(result)
        self.emit("optimizer_end", 0)
        return result

    def skip(self, local_n: int, global_n: int, k: int, loss: float | None, reason: str) -> StepResult:
        """No update: gradients cleared, the skip counted, the same on every rank."""
        self.zero_grad()
        self.steps_skipped += 1
        self.consecutive_skips += 1
        check_skips(self.consecutive_skips, self.config.max_consecutive_skips, reason)
        self.emit("optimizer_end", 0)
        return StepResult(
            loss=loss,
            local_count=local_n,
            global_count=global_n,
            micro_batches=k,
            grad_norm=None,
            applied=False,
            skip_reason=reason,
            step=self.steps_applied,
            recompiles=self._compiles.since(),
        )

    # -- helpers --------------------------------------------------------------------------------

    def zero_grad(self) -> None:
        self._clear_grads()  # also of parameters outside the optimizer: frozen, optimized apart
        for part in self._windowed:  # every abandoned or skipped window passes here
            part.discard()

    def close(self) -> None:
        """Leave the model as found (:mod:`gradaccum.step.lifetime`); idempotent."""
        self.closed = True
        for part in self._windowed:
            part.close()

    def emit(self, event: str, index: int) -> None:
        if self.observer is not None:
            self.observer(event, index)

    def agree_outside(self, failure: LocalFailure | None) -> None:
        """An agreement point outside the micro-batch loop (gradient caching's phases)."""
        self.meetings.outside(failure, self._distributed)
