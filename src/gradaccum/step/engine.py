"""The window engine: one window of micro-batches, from counting to the optimizer step, written once.

For a window of micro-batches B_1..B_k on each of W data-parallel ranks, with n_j counted units in
B_j and N = sum over all ranks and micro-batches of n_j, the full-batch mean loss is

    L = (1/N) sum_j sum_{t in B_j} l_t    so    grad L = sum_j grad( sum_{t in B_j} l_t ) / N.

Each micro-batch therefore backpropagates its *summed* loss times 1/N. DDP and FSDP then *average*
the W ranks' gradients, which divides by W once more, so each rank scales by W/N instead.
Everything that belongs to the optimizer step (zero_grad, unscale, clip, step, scheduler, hooks)
runs once per window; nothing runs per micro-batch except forward and backward.

Every front end composes this engine: :class:`~gradaccum.step.accumulator.Accumulator` hands
it the loss of each micro-batch, :class:`~gradaccum.cache.accumulator.CachedAccumulator` the
replayed representations times their cached gradients, the pipeline its schedule's losses;
post-scaling (:mod:`gradaccum.step.post_scaling`) is this engine with phases 1-3 streamed and the
gradients scaled once before phase 4. What flows between the phases is :mod:`gradaccum.step.window`.
The phases are

1. :meth:`WindowEngine.open`: materialize the window (a failure here is *returned*, for 2);
2. :meth:`WindowEngine.count`: count every micro-batch and agree on N across ranks: collective 1,
   which also carries earlier failures, the window shapes and the configuration fingerprint;
3. :meth:`WindowEngine.accumulate`: forward and backward per micro-batch, sync deferred to the
   last; before a synchronizing backward every rank meets once more (collective 2, DDP), and the
   window's loss travels in that same all-reduce;
4. :meth:`WindowEngine.conclude`: one host read decides for every rank (finite? counted?), then
   unscale, clip, step, schedule and hooks, once.

So a DDP update costs two small all-reduces besides the gradients' own, and one process reads the
device once. ``noise_scale=True`` (:mod:`gradaccum.step.noise`) adds parameter hooks that read each
micro-batch's gradient and, under DDP with the agreement on, one small all-reduce of its sums in
phase 4; no host read. A failure on one rank stops every rank at an agreement point instead of leaving the
others in a collective: :mod:`gradaccum.step.agreement` says where, and what that cannot cover.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from gradaccum.distributed import dist
from gradaccum.distributed.sync import (
    SyncKind,
    check_sync_on,
    needs_every_parameter,
    sync_deferred,
    sync_kind,
    sync_module,
)
from gradaccum.errors import ConfigError, CountError, SyncError, TooManySkipsError, WindowError
from gradaccum.mesh.reduction import averaging_factor, clip_mesh_grads_, local_squares
from gradaccum.mesh.step import (
    check_sync_policy,
    layout_for_step,
    raise_replica_mismatch,
    replica_slots,
    replicas_agree,
)
from gradaccum.step.agreement import (
    LocalFailure,
    agree_before_backward,
    back_off_scaler,
    check_buffer_broadcasts,
    fingerprint,
    fingerprints_agree,
    raise_agreed,
    raise_alone,
    raise_from_sync_backward,
    raise_mismatch,
    raise_unreached,
    rank_settings,
    unreached_parameters,
)
from gradaccum.step.checks import as_count, check_window_shapes
from gradaccum.step.compiled import CompileCounter
from gradaccum.step.config import AccumConfig, StepResult
from gradaccum.step.ledger import Ledger
from gradaccum.step.noise import NoiseScale, NoiseScaleMeter
from gradaccum.step.norms import clip_grads_, nonfinite_flag, total_norm, uniform_plain
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
    WindowTotals,
)
from gradaccum.values import require_int

__all__ = ["WindowEngine"]

_STATE_KEYS = ("steps_applied", "steps_skipped", "consecutive_skips")
_NOISE_KEY = "noise"


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
    ) -> None:
        """``mesh``/``mesh_dims``: the DeviceMesh the model was parallelized with (see
        :mod:`gradaccum.mesh`); ``pipeline``: a pipeline schedule runs the micro-batches, and
        every stage counts the same window (:class:`gradaccum.pipeline.PipelineAccumulator`);
        ``synced``: the module whose wrapper synchronizes gradients, when ``model`` is not it
        (a pipeline's stage modules)."""
        if not isinstance(config, AccumConfig):
            raise ConfigError(f"config must be a gradaccum.AccumConfig, got {type(config).__name__}")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        from gradaccum.integrations.accelerate import refuse_accelerated_scheduler  # here: no import cycle

        refuse_accelerated_scheduler(scheduler)  # it steps W times per update; names prepare_accumulator
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
        # DDP expects the backward of a synchronizing forward that completed, even in no_sync later;
        # after an agreed failure the next window's first micro-batch synchronizes on every rank.
        # This is the wrapper's bookkeeping across windows, not a failure carried between phases.
        self._resync = False
        _refuse_static_graph(self._synced, self.kind, config.defer_sync)
        # DDP fixes the parameters it reduces when it is built; the accumulator is built right after
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._reduced_params = trainable if needs_every_parameter(model) else []
        self._params = list(model.parameters())
        self._uniform = uniform_plain(self._params)  # a gradient has its parameter's device and dtype
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self._params_outside_optimizer = [p for p in self._params if id(p) not in in_optimizer]
        self.device = self._params[0].device if self._params else torch.device("cpu")
        self._zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self._one = torch.ones(1, dtype=torch.float32, device=self.device)  # the check's unit scale
        self._distributed = dist.is_distributed(dp_group)
        self.layout = layout_for_step(
            mesh, mesh_dims, model=model, config=config, dp_group=dp_group, pipeline=pipeline
        )
        if self.layout is not None:
            self._distributed = dist.is_distributed()
        data_ranks = self.layout.data_size if self.layout else dist.world_size(dp_group)
        if data_ranks > 1 and self.kind == "local":
            raise SyncError(
                f"the data-parallel group has {data_ranks} ranks but the model is a plain "
                f"{type(model).__name__}: its gradients would never be averaged across ranks. Wrap it "
                "in DistributedDataParallel or fully_shard (FSDP2) before building the Accumulator."
            )
        # the W of W/N, and the ranks that hold the same tokens (whose sums count each unit once)
        self.factor = averaging_factor(self._synced, self.kind, data_ranks)
        self._count_replicas = self.layout.tp * self.layout.pp if self.layout else 1
        self._loss_replicas = self.layout.tp if self.layout else 1
        self._policy = check_sync_policy(config, self.kind, self.layout)
        self._norm_holders = self.layout.world // self.layout.pp if self.layout else 1
        settings: dict[str, Any] = dataclasses.asdict(config)
        settings["sync"] = self.kind
        settings["scaler"] = type(scaler).__name__ if scaler is not None else None
        # the ranks' models must match, but a pipeline's stages hold different parts of it
        same_model = self._distributed and not pipeline
        self._settings = rank_settings(settings, model) if same_model else settings
        self._fingerprint = fingerprint(self._settings) if self._distributed else []
        self._noise = self._noise_meter() if config.noise_scale else None
        self._compiles = CompileCounter()  # graphs torch.compile builds during a window
        # DDP that broadcasts buffers in a window's first forward (the same on every rank)
        self._broadcasts = (
            self.kind == "ddp"
            # forward_sync_buffers from torch 2.13 on (broadcast_buffers, deprecated, is its alias)
            and bool(
                getattr(
                    self._synced, "forward_sync_buffers", getattr(self._synced, "broadcast_buffers", False)
                )
            )
            and any(True for _ in self._synced.buffers())
        )

    def _noise_meter(self) -> NoiseScaleMeter:
        if self.kind in ("fsdp", "fsdp2"):
            raise ConfigError(
                f"noise_scale=True is not supported under {self.kind.upper()}: it reads each "
                "micro-batch's gradient through hooks on the parameters the accumulator holds, and "
                "under FSDP those are shards that FSDP fills in its own reduce-scatter (with sync "
                "deferred, only after the last micro-batch). Measure the noise scale under DDP or on "
                "one process (it does not depend on the sharding), or leave noise_scale off."
            )
        return NoiseScaleMeter(self.model, self._params, device=self.device, uniform=self._uniform)

    @property
    def noise_scale(self) -> NoiseScale:
        """The gradient noise scale so far (``noise_scale=True``); see :mod:`gradaccum.step.noise`."""
        if self._noise is None:
            raise ConfigError(
                "this accumulator does not measure the gradient noise scale; build it with "
                "noise_scale=True (AccumConfig(noise_scale=True))"
            )
        return self._noise.result()

    # -- counters -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The counters a resumed run needs: applied and skipped updates, consecutive skips; with
        ``noise_scale=True`` also the noise scale's moving averages (``noise``), so the estimate
        continues across a resume instead of restarting."""
        self.settle_counters()
        state: dict[str, Any] = {key: int(getattr(self, key)) for key in _STATE_KEYS}
        if self._noise is not None:
            state[_NOISE_KEY] = self._noise.state_dict()
        return state

    def settle_counters(self) -> None:
        """Bring counters kept on the device to the host: nothing to do here, where every verdict
        is read on the host (post-scaling's device verdict overrides it)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, refusing missing, unknown or negative values. A state without
        ``noise`` (an older checkpoint, or a run without the estimate) leaves the estimate empty; a
        ``noise`` entry is ignored by an accumulator that does not measure it (it never changes the
        update)."""
        got = set(state) if isinstance(state, dict) else None
        if got is None or not set(_STATE_KEYS) <= got <= {*_STATE_KEYS, _NOISE_KEY}:
            shown = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ConfigError(
                f"an accumulator state_dict holds exactly {list(_STATE_KEYS)} (and {_NOISE_KEY!r} with "
                f"noise_scale=True), got {shown}"
            )
        for key in _STATE_KEYS:
            value = state[key]
            require_int(f"accumulator state {key}", value, low=0, error=ConfigError)
        if state["consecutive_skips"] > state["steps_skipped"]:
            raise ConfigError(
                f"accumulator state has consecutive_skips={state['consecutive_skips']} > "
                f"steps_skipped={state['steps_skipped']}: not a state a run can reach"
            )
        if self._noise is not None and _NOISE_KEY in state:
            self._noise.load_state_dict(state[_NOISE_KEY])  # validates before changing anything
        for key in _STATE_KEYS:
            setattr(self, key, state[key])

    # -- phases ---------------------------------------------------------------------------------

    def open(self, window: Iterable[Any]) -> tuple[list[Any], LocalFailure | None]:
        """Materialize the window. Under torch.distributed a failure is returned, not raised, so
        that :meth:`count` carries it to the other ranks instead of leaving them waiting there."""
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
        """
        counts: list[int | torch.Tensor] = []
        if failure is None:
            try:
                for i, mb in enumerate(micro_batches):
                    counts.append(as_count(count_fn(mb), i))
            except Exception as exc:
                if not self._distributed:
                    raise
                failure = LocalFailure(exc, "count_fn", len(counts))
                counts = []
        local_count, min_count = self._sum_counts(counts)
        if not self._distributed:
            if not micro_batches:
                raise WindowError("the window is empty: step needs at least one micro-batch")
            return WindowCount(counts, local_count, local_count, None, min_count, 1, self.factor)
        return self._agree_on_counts(len(micro_batches), counts, local_count, min_count, failure)[0]

    def _sum_counts(self, counts: list[int | torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's count (float64 on the device) and the smallest tensor count (or None; in
        the counts' own integer dtype)."""
        device_counts = [c for c in counts if not isinstance(c, int)]
        host_counts = 0 if len(device_counts) == len(counts) else sum(c for c in counts if isinstance(c, int))
        if not device_counts:
            return torch.tensor(float(host_counts), dtype=torch.float64, device=self.device), None
        stacked = torch.stack(device_counts)
        if stacked.device != self.device:
            stacked = stacked.to(device=self.device, non_blocking=True)
        total = stacked.sum(dtype=torch.float64)  # exact below 2**53, as the counts are integers
        return (total + host_counts if host_counts else total), stacked.min()

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
        reduced = settled.value("tally") if post is not None else None
        counted = WindowCount(counts, local_count, global_count, n, min_count, world, self.factor, post)
        return counted, reduced  # type: ignore[return-value]

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
        meets = self._meets()
        defer = self._policy != "every"
        replicate_only = self._policy == "defer_replicate"
        losses: list[torch.Tensor] = []
        rejections: list[torch.Tensor] = []
        reduced: list[float] | None = None
        last = len(micro_batches) - 1
        resync = self._resync
        noise = self._noise
        if noise is not None:
            noise.start()
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
                    reduced = self._agree(failure, i, piece, self._tally(losses, rejections))
                elif failure is not None:
                    self._fail_alone(failure)
                if syncs and piece is not None:
                    self._sync_backward(piece.backprop, i)
            if noise is not None:
                noise.fold()  # this micro-batch's |Delta_j|^2, from the hooks its backward ran
            self.emit("micro_end", i)
        if reduced is not None:
            loss = torch.tensor(reduced[0], dtype=torch.float64, device=self.device)
            rejected = torch.tensor(reduced[1], dtype=torch.float64, device=self.device)
            return Accumulated(loss, rejected, True, len(micro_batches))
        loss = torch.stack(losses).sum(dtype=torch.float64) if losses else self._zero
        rejected = torch.stack(rejections).sum(dtype=torch.float64) if rejections else self._zero
        return Accumulated(loss, rejected, False, len(micro_batches))

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
        everything = self._params
        grads: list[torch.Tensor] = [g for p in everything if (g := p.grad) is not None]
        params = (
            everything if len(grads) == len(everything) else [p for p in everything if p.grad is not None]
        )
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
        norm, gradient = self._gradient_check(grads)
        totals, norm = self._settle(counted, accumulated, objective, gradient, norm)
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
        if self.config.skip_nonfinite and not (math.isfinite(totals.loss) and gradient_ok):
            back_off_scaler(self.scaler, self.optimizer, params)
            what = f"gradient norm {totals.gradient}" if norm is not None else "a gradient holds NaN or inf"
            reason = f"non-finite loss or gradient (loss {totals.loss}, {what})"
            return self.skip(local_n, n_global, k, mean_loss, reason)

        norm_host = self._apply_update(params, grads, norm, totals.gradient)
        self.steps_applied += 1
        self.consecutive_skips = 0
        if self._noise is not None:
            self._noise.update(totals.noise, n_global, counted.world)
        result = StepResult(
            loss=mean_loss,
            local_count=local_n,
            global_count=n_global,
            micro_batches=k,
            grad_norm=norm_host if (norm is not None and self.config.wants_norm) else None,
            applied=True,
            step=self.steps_applied,
            recompiles=self._compiles.since(),
        )
        for hook in self.on_step:
            hook(result)
        self.emit("optimizer_end", 0)
        return result

    def _gradient_check(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the global norm or None, what says whether the gradient is finite).

        Finiteness comes from the norm when clipping, the report or the noise scale need it anyway,
        else from a fused check that costs a third of it (replicated gradients only: a shard's
        check would be local to the shard). On a mesh the second value is this rank's share of
        the squared norm (:func:`gradaccum.mesh.reduction.local_squares`): it rides in the
        end-of-window all-reduce, and :meth:`_settle` returns the norm.
        """
        config = self.config
        needs_norm = config.wants_norm or config.skip_nonfinite or self._noise is not None
        if self.layout is not None:
            return None, local_squares(grads, self._norm_holders, self.device) if needs_norm else None
        fused = self._noise is None and self.kind in ("local", "ddp")
        if config.skip_nonfinite and not config.wants_norm and fused:
            flag = nonfinite_flag(grads, uniform=self._uniform, one=self._one)
            if flag is not None:
                return None, flag
        if needs_norm:
            norm = self._grad_norm(grads)
            return norm, norm
        return None, None

    def _settle(
        self,
        counted: WindowCount,
        accumulated: Accumulated,
        objective: torch.Tensor | None,
        gradient: torch.Tensor | None,
        norm: torch.Tensor | None,
    ) -> tuple[WindowTotals, torch.Tensor | None]:
        """The end-of-window summary, reduced over ranks where it is still local and read once;
        and the gradient norm (on a mesh, assembled here from every rank's squares).

        The count is global already (collective 1), and so is the norm off a mesh (gradients are
        synchronized; sharded norms are reduced by :meth:`_grad_norm`). The loss and the vetoes
        are global when the ranks met before the synchronizing backward; else they are summed
        here, in one small all-reduce, with the noise scale's per-rank sums and a mesh's squares.
        Ranks that hold the same tokens (TP) add the same loss: the sum is divided by them.
        """
        noise = self._noise
        if not self._distributed and noise is None and self.layout is None:
            alone = self._read_alone(counted, accumulated, objective, gradient)
            if alone is not None:
                return alone, norm
        still_local = self._distributed and not accumulated.loss_is_global
        squares = self.layout is not None and gradient is not None
        ledger = Ledger(self.device)
        if objective is None:
            ledger.add("loss", accumulated.loss, summed=still_local)
        else:  # the objective is computed identically on every rank: never summed
            ledger.add("loss", objective.detach(), summed=False)
        ledger.add("rejected", accumulated.rejected, summed=still_local)
        ledger.add("gradient", self._zero if gradient is None else gradient, summed=squares)
        if noise is not None:
            # every rank's micro-batches are small batches: P and K are summed over ranks
            small, batches, big, sigma = noise.window_sums(
                counted.counts, norm, self.scaler, rescale=counted.post_factor()
            )
            ledger.add("noise_small", small, summed=self._distributed)
            ledger.add("noise_batches", batches, summed=self._distributed)
            ledger.add("noise_global", torch.stack([big, sigma]), summed=False)
        ledger.add("global_count", counted.global_count, summed=False)
        ledger.add("local_count", counted.local_count, summed=False)
        smallest = self._zero if counted.min_count is None else counted.min_count
        ledger.add("smallest_count", smallest, summed=False)
        what = "the window's loss" if noise is None else "the window's loss and noise-scale sums"
        settled = ledger.settle(self.dp_group, what=what, distributed=self._distributed)
        totals = settled.unpack(WindowTotals)
        if noise is not None:
            big_sq, scale_sigma = settled.value("noise_global")  # type: ignore[misc]
            noisy = [settled.value("noise_small"), settled.value("noise_batches"), big_sq, scale_sigma]
            totals = dataclasses.replace(totals, noise=noisy)  # type: ignore[arg-type]
        if self._distributed and objective is None and self._loss_replicas > 1:
            totals = dataclasses.replace(totals, loss=totals.loss / self._loss_replicas)
        if squares:
            norm = settled.device("gradient").sqrt()
            totals = dataclasses.replace(totals, gradient=math.sqrt(max(totals.gradient, 0.0)))
        return totals, norm

    def _read_alone(
        self,
        counted: WindowCount,
        accumulated: Accumulated,
        objective: torch.Tensor | None,
        gradient: torch.Tensor | None,
    ) -> WindowTotals | None:
        """One process, nothing to reduce: the six figures in one stack and one read (the ledger
        packs them one by one, ~40 us more on every update); ``None`` when they are not all 0-dim
        on one device, for the ledger to pack."""
        figures = (
            accumulated.loss if objective is None else objective.detach(),
            accumulated.rejected,
            self._zero if gradient is None else gradient,
            counted.global_count,
            counted.local_count,
            self._zero if counted.min_count is None else counted.min_count,
        )
        try:  # one device and all 0-dim, or stack refuses them (cheaper than checking each)
            stacked = torch.stack(figures)
        except RuntimeError:
            return None
        if stacked.ndim != 1:
            return None
        return WindowTotals(*stacked.to(torch.float64).tolist())

    def _apply_update(
        self,
        params: Sequence[torch.Tensor],
        grads: list[torch.Tensor],
        norm: torch.Tensor | None,
        norm_host: float,
    ) -> float:
        """Unscale, clip by the global pre-clip norm, step the optimizer and the scheduler, once.

        Returns the pre-clip norm on the host (recomputed after unscaling under a GradScaler).
        """
        config = self.config
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
            if config.wants_norm:
                norm = self._grad_norm(grads)
                norm_host = float(norm.item()) if norm is not None else math.nan
        if config.max_grad_norm is not None and norm is not None:
            if self.layout is not None:  # shards on several meshes: each rank scales its own part
                clip_mesh_grads_(grads, config.max_grad_norm, norm)
            else:
                clip_grads_(params, config.max_grad_norm, norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return norm_host

    def skip(self, local_n: int, global_n: int, k: int, loss: float | None, reason: str) -> StepResult:
        """No update: gradients cleared, the skip counted, the same on every rank."""
        self.zero_grad()
        self.steps_skipped += 1
        self.consecutive_skips += 1
        limit = self.config.max_consecutive_skips
        if limit is not None and self.consecutive_skips > limit:
            raise TooManySkipsError(
                f"{self.consecutive_skips} consecutive updates were skipped (limit "
                f"max_consecutive_skips={limit}); last reason: {reason}. Check the data for windows "
                "without valid units, the loss for overflow, or lower the learning rate."
            )
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
        self.optimizer.zero_grad(set_to_none=True)
        if self._noise is not None:  # every abandoned or skipped window passes here
            self._noise.discard()
        if self._params_outside_optimizer:  # e.g. frozen or separately optimized parameters
            for p in self._params_outside_optimizer:
                p.grad = None

    def emit(self, event: str, index: int) -> None:
        if self.observer is not None:
            self.observer(event, index)

    def agree_outside(self, failure: LocalFailure | None) -> None:
        """An agreement point outside the micro-batch loop (gradient caching's phases): a failure
        raises on every rank (one flags all-reduce under DDP), or at once where no rank waits."""
        if self._meets():
            self._agree(failure, 0, None, self._tally([], []))
        elif failure is not None:
            self._fail_alone(failure)

    def _meets(self) -> bool:
        """Whether the ranks meet before synchronizing backwards (DDP with agreement on)."""
        return self._distributed and self.kind == "ddp" and self.config.agree_on_failure

    def _fail_alone(self, failure: LocalFailure) -> None:
        """A failure no other rank learns of here: one process, FSDP, or agreement turned off."""
        self.zero_grad()
        self._resync = self.kind == "ddp"
        raise_alone(failure, recoverable=not self._distributed)

    def _tally(self, losses: list[torch.Tensor], rejections: list[torch.Tensor]) -> torch.Tensor:
        loss = torch.stack(losses).sum(dtype=torch.float64) if losses else self._zero
        rejected = torch.stack(rejections).sum(dtype=torch.float64) if rejections else self._zero
        return torch.stack([loss, rejected])

    def _grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        """The global gradient norm: what every rank's clipping and skip decision must see."""
        if self.layout is not None:  # every rank takes part, gradients or not
            squares = local_squares(grads, self._norm_holders, self.device)
            return dist.all_reduce_sum_(squares, self.dp_group, what="the gradient norm").sqrt()
        if self.kind == "fsdp":
            # FSDP1 shards flat gradients; its own method reduces the norm across ranks. With an
            # infinite max_norm it multiplies by exactly 1 (the clip coefficient is clamped to 1).
            return self._synced.clip_grad_norm_(float("inf"))  # type: ignore[operator]
        return total_norm(grads, uniform=self._uniform) if grads else None

    def _agree(
        self, failure: LocalFailure | None, index: int, piece: Contribution | None, tally: torch.Tensor
    ) -> list[float] | None:
        """Before a synchronizing backward: all ranks go on, or all clear their gradients and raise."""
        try:
            return agree_before_backward(
                failure,
                None if piece is None else piece.backprop,
                index,
                self.kind,
                check_parameters=self._reduced_params,
                group=self.dp_group,
                tally=tally,
                resynchronizing=index == 0 and self._resync,
            )
        except BaseException:
            self.zero_grad()
            # DDP expects the backward of a synchronizing forward that completed, even in no_sync
            # later; a synchronizing first micro-batch on every rank resets that bookkeeping
            self._resync = self.kind == "ddp"
            raise

    def _sync_backward(self, contribution: torch.Tensor, index: int) -> None:
        try:
            self.backward(contribution)
        except Exception as exc:
            self.zero_grad()
            raise_from_sync_backward(exc, index, self.dp_group)
        self._resync = False


def _refuse_static_graph(model: nn.Module, kind: SyncKind, defer_sync: bool) -> None:
    """DDP built with ``static_graph=True`` cannot defer sync: refuse it before the first window.

    Its reducer records the first iteration's hooks and expects every later backward to fire
    them all; a backward inside ``no_sync`` then trips an internal assert in PyTorch's reducer
    (``expect_autograd_hooks_``) on torch 2.4-2.13, for a hand-written ``no_sync`` loop too.
    """
    if defer_sync and kind == "ddp" and bool(getattr(model, "static_graph", False)):
        raise SyncError(
            "DistributedDataParallel was built with static_graph=True, and PyTorch's reducer cannot "
            "defer gradient sync in that mode: a backward inside no_sync() fails with an internal "
            "assert (expect_autograd_hooks_). Either build DDP without static_graph (the usual "
            "default; find_unused_parameters=True covers parameters that only some micro-batches "
            "use), or build the accumulator with defer_sync=False, which all-reduces the gradients "
            "on every micro-batch (k all-reduces per update instead of one)."
        )
