"""Post-scaling's engine (``AccumConfig(scaling="post")``): the same phases, streamed.

:class:`PostScalingEngine` is the :class:`~gradaccum.step.engine.WindowEngine` with phases 1-3
fused into :meth:`PostScalingEngine.stream` (read, count, forward and backward each micro-batch as
it arrives; the counts add up on the device) and a phase 4 that first multiplies the gradients by
W/(N c) once. The algebra, the constant c and the device-side verdict are derived in
:mod:`gradaccum.step.stream`; the agreement points are the engine's own, met once: under
torch.distributed the ranks meet before the synchronizing backward, in one small all-reduce that
carries N, the loss, the failures, the window shapes and the fingerprint.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from gradaccum.distributed import dist
from gradaccum.distributed.sync import check_sync_on, sync_deferred
from gradaccum.errors import ConfigError, WindowError
from gradaccum.step.agreement import LocalFailure, check_buffer_broadcasts, raise_agreed
from gradaccum.step.checks import as_count, check_not_empty, check_window_shapes, sum_counts
from gradaccum.step.config import StepResult
from gradaccum.step.engine import WindowEngine
from gradaccum.step.ledger import Ledger
from gradaccum.step.lifetime import closed_error
from gradaccum.step.norms import clip_grads_, scale_grads_
from gradaccum.step.stream import (
    DeviceStepResult,
    host_post_constant,
    post_constant,
    reads_found_inf,
    with_last,
)
from gradaccum.step.window import Accumulated, Contribution, CountFn, StreamContribute, WindowCount

__all__ = ["PostBasis", "PostScalingEngine"]


class PostBasis:
    """What chooses the next window's c: the last window's N/F (None before the first window).

    A window carries it to the next, so it is the ``"post"`` part of the accumulator's
    ``state_dict``: a resumed run chooses the c an uninterrupted one does (with c = 1 again, a
    float16 backward under a GradScaler overflows where the uninterrupted run did not, and the
    run skips an update and backs the scaler off once more)."""

    def __init__(self) -> None:
        self.expected: torch.Tensor | float | None = None

    def state_dict(self) -> dict[str, float | None]:
        """N/F as a Python float (exact: a float64 count below 2**53 over F); one host read where
        the decision on the device kept it there."""
        expected = self.expected
        return {"expected": None if expected is None else float(expected)}

    def load_state_dict(self, state: Any) -> None:
        """Restore :meth:`state_dict`, refusing a state post-scaling could not have written."""
        value = state.get("expected", ...) if isinstance(state, dict) and set(state) == {"expected"} else ...
        if value is not None and not (isinstance(value, float) and math.isfinite(value) and value >= 0):
            raise ConfigError(
                "a post-scaling state holds exactly {'expected': the last window's N/F, a finite "
                f"float >= 0, or None before the first window}}, got {state!r}"
            )
        self.expected = value


class PostScalingEngine(WindowEngine):
    """The window engine for ``scaling="post"``: :meth:`stream` then :meth:`conclude`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._check_post()
        # with a found_inf optimizer the skip is decided on the device; the counters of the
        # updates it decided stay there too, [applied, skipped, consecutive], until read
        self._on_device = self._decides_on_device()
        self._device_counters: torch.Tensor | None = None
        self._counter_steps = _counter_steps(self.device) if self._on_device else None
        self._basis = PostBasis()  # the last window's N / F, which chooses c: saved in state_dict()
        self.parts["post"] = self._basis

    def _check_post(self) -> None:
        """Refuse what post-scaling cannot do, before the first window."""
        if self._distributed and self.kind != "local" and self._policy != "defer":
            raise ConfigError(
                f"scaling='post' under torch.distributed needs sync_policy='defer' and defer_sync=True "
                f"(got {self._policy!r}): a rank does not know its window's length before its last "
                "micro-batch, so only the last backward may synchronize."
            )

    def _decides_on_device(self) -> bool:
        """Whether the skip decision can stay on the device (see :mod:`gradaccum.step.stream`):
        the optimizer reads ``found_inf``, and nothing else needs the verdict on the host (a
        scheduler must not advance on a skipped update, ``max_consecutive_skips`` counts skips, a
        GradScaler keeps its own found_inf)."""
        return (
            reads_found_inf(self.optimizer)
            and self.scaler is None
            and self.scheduler is None
            and self.config.max_consecutive_skips is None
            and self.layout is None
            and self.kind in ("local", "ddp")
            and self._noise is None  # its figures are read with the verdict
            and self.config.batchnorm_stats == "micro-batch"  # its update waits for the host verdict
        )

    def stream(
        self, window: Iterable[Any], contribute: StreamContribute, count_fn: CountFn, *, length: int | None
    ) -> tuple[WindowCount, Accumulated]:
        """Post-scaling's phases 1-3 in one pass: read, count, forward and backward each micro-batch
        as it arrives (:mod:`gradaccum.step.stream`), sync deferred to the last.

        Counts add up on the device. Under torch.distributed the ranks meet once, before the
        synchronizing backward (a rank that failed, or whose window ended empty, comes straight
        there): that one small all-reduce carries N, the loss, the failures, the window shapes and
        the fingerprint, so every rank refuses together what would hang. ``length``: the window's
        declared number of micro-batches, or ``None`` to read one ahead.
        """
        if self.closed:
            raise closed_error("accumulator")
        self._distributed = distributed = dist.is_distributed(self.dp_group)
        self._compiles.start()
        model, kind = self.model, self.kind
        if kind == "ddp":
            check_sync_on(model)
        if distributed and kind in ("fsdp", "fsdp2"):
            self._agree_on_length(length)
        counts: list[int | torch.Tensor] = []  # 0-dim tensors or ints: a few bytes per micro-batch
        losses: list[torch.Tensor] = []
        # a list window on one process: its own N is known before the first backward, so c follows it
        counted_ahead = self._count_ahead(window, count_fn, length) if not distributed else None
        c = None if counted_ahead is None else self._constant_of(counted_ahead)
        failure: LocalFailure | None = None
        k = 0
        resync = self.meetings.resync
        noise = self._noise
        for part in self._windowed:  # the noise meter, BatchNorm's window moments
            part.start()
        observer, plain = self.observer, kind == "local"  # the loop's Python runs k times a window
        nothing_to_defer = sync_deferred(model, kind, enabled=False)
        pieces = with_last(window, length)
        self.emit("window_start", length or 0)
        ahead: list[tuple[int, Any, bool] | None] = []
        if distributed and self._broadcasts:
            ahead.append(self._read_first(pieces))
        while True:
            try:
                item = ahead.pop() if ahead else next(pieces, None)
            except Exception as exc:
                if not distributed:
                    self.zero_grad()
                    raise
                failure, item = LocalFailure(exc, "reading the window", k), None
            if item is None:
                break
            i, mb, last = item
            k = i + 1
            if observer is not None:
                observer("micro_start", i)
            syncs = last or (i == 0 and resync)
            piece: Contribution | None = None
            with nothing_to_defer if syncs or plain else sync_deferred(model, kind):
                phase = "count_fn"
                try:
                    count = as_count(count_fn(mb), i) if counted_ahead is None else counted_ahead[i]
                    counts.append(count)
                    if c is None:
                        c = self._constant(count, length, distributed)
                    phase = "forward"
                    piece = contribute(i, mb, count, c)
                    if piece.loss is not None:
                        losses.append(piece.loss)
                    if not syncs:
                        phase = "backward"
                        self.backward(piece.backprop)
                except Exception as exc:
                    failure = LocalFailure(exc, phase, i)
                if distributed and (last or failure is not None):
                    local, smallest = sum_counts(counts, self.device)
                    counted, reduced = self._meet_streamed(
                        k, counts, local, smallest, failure, post=c, piece=piece, index=i,
                        tally=self.meetings.tally(losses, []),
                    )  # fmt: skip
                    if syncs and piece is not None:
                        self.meetings.sync_backward(piece.backprop, i)
                    if noise is not None:
                        noise.fold()
                    self.emit("micro_end", i)
                    assert reduced is not None
                    assert counted.global_host is not None  # read in the meeting
                    self._basis.expected = counted.global_host / self.factor
                    tallied = torch.tensor(reduced, dtype=torch.float64, device=self.device)
                    return counted, Accumulated(tallied[0], tallied[1], True, k)
                if distributed and syncs:  # the resynchronizing first micro-batch of a longer window
                    self.meetings.agree(None, i, piece, self.meetings.tally([], []))
                elif failure is not None:
                    self.meetings.fail_alone(failure, distributed)
                if syncs and piece is not None:
                    self.meetings.sync_backward(piece.backprop, i)
            if noise is not None:
                noise.fold()  # this micro-batch's |c s_j|^2, from the hooks its backward ran
            if observer is not None:
                observer("micro_end", i)
            if last:
                break
            item = mb = piece = None  # hold no micro-batch while the next ones are read
        local, smallest = sum_counts(counts, self.device)
        if distributed:  # the window ended before a last micro-batch: empty, or a read failed
            if c is None:
                c = self._zero + 1
            self._meet_streamed(k, counts, local, smallest, failure, post=c, index=k)
            raise AssertionError("unreachable: an empty window or a failure raises on every rank")
        check_not_empty(k)
        assert c is not None
        on_host = all(isinstance(n, int) for n in counts)
        n_host = sum(int(n) for n in counts) if on_host else None  # ints: no read
        counted = WindowCount(counts, local, local, n_host, smallest, 1, self.factor, c)
        if n_host is not None:
            self._basis.expected = n_host / self.factor
        else:  # replaced by the host N where the verdict is read; a division only where it is not
            self._basis.expected = local if self.factor == 1 else local / self.factor
        loss = torch.stack(losses).sum(dtype=torch.float64) if losses else self._zero
        return counted, Accumulated(loss, self._zero, False, k)

    def _count_ahead(
        self, window: Iterable[Any], count_fn: CountFn, length: int | None
    ) -> list[int | torch.Tensor] | None:
        """Every micro-batch's count of a non-empty list window, before its first forward: c can
        then follow this window's N rather than the last one's, which differs as much as the data
        does (N from 1 to 2**20 between windows: c from the previous N would overflow fp16 where
        pre-scaling does not). None for an iterator (counted as it streams)."""
        if type(window) is not list or not window:
            return None
        return [as_count(count_fn(mb), i) for i, mb in enumerate(window[:length])]

    def _constant_of(self, counts: list[int | torch.Tensor]) -> torch.Tensor | float:
        """c for a window whose counts are all known: a Python float from int counts, else on the
        device (no host read)."""
        if all(isinstance(n, int) for n in counts):
            return host_post_constant(sum(int(n) for n in counts) / self.factor)
        local, _ = sum_counts(counts, self.device)
        return post_constant(0, None, self.device, expected=local / self.factor)

    def _constant(
        self, first: int | torch.Tensor, length: int | None, distributed: bool
    ) -> torch.Tensor | float:
        """This window's c (:mod:`gradaccum.step.stream`): a Python float whenever N' is known on
        the host (the last window's N was read there, or one process counts ints, or the first
        window under torch.distributed takes c = 1), so the window costs no device op for c nor
        for its part of W/(N c); else 0-dim float64 on the device (the decision on the device
        keeps N there)."""
        expected = self._basis.expected
        if isinstance(expected, float):
            return host_post_constant(expected)
        if expected is None and distributed:
            return 1.0
        if expected is None and isinstance(first, int):
            return host_post_constant((length or 1) * first)
        return post_constant(first, length, self.device, expected=expected, distributed=distributed)

    def _meet_streamed(self, *args: Any, **kwargs: Any) -> tuple[WindowCount, list[float] | None]:
        """The post-scaling meeting (:meth:`_agree_on_counts`); after a raise there, DDP expects the
        backward of the synchronizing forward some ranks completed, so the next window resyncs."""
        try:
            return self._agree_on_counts(*args, **kwargs)
        except BaseException:
            self.meetings.resync = self.kind == "ddp"
            raise

    def _read_first(self, pieces: Iterator[tuple[int, Any, bool]]) -> tuple[int, Any, bool] | None:
        """DDP with buffers to broadcast: the window's first forward broadcasts them, a collective
        that a rank whose window failed to read, or is empty, would never join. So the ranks read
        their first micro-batch and meet before that forward (one small all-reduce more, only for
        such models: ``broadcast_buffers=False`` avoids it where the buffers are constant)."""
        failure: LocalFailure | None = None
        first: tuple[int, Any, bool] | None = None
        try:
            first = next(pieces, None)
        except Exception as exc:
            failure = LocalFailure(exc, "reading the window", 0)
        world = dist.world_size(self.dp_group)
        ledger = Ledger(self.device)
        ledger.add("failed", failure is not None)
        ledger.add("oom", failure is not None and failure.oom)
        ledger.add("empty", first is None and failure is None)
        ledger.add("broadcasting", self._synced.will_sync_module_buffers())  # type: ignore[operator]
        settled = ledger.settle(self.dp_group, what="the first micro-batches, before DDP's buffer broadcast")
        names = ("failed", "oom", "empty", "broadcasting")
        failed, oom, empty, broadcasting = (int(settled.value(n)) for n in names)  # type: ignore[arg-type]
        if failed:
            self.zero_grad()
            raise_agreed(failure, failed, oom, self.dp_group)
        check_buffer_broadcasts(broadcasting, world)
        if empty:
            check_window_shapes(
                world, 0 if first is None else 1, empty, 0, 0, defer_sync=True, kind=self.kind
            )
        return first

    def _agree_on_length(self, length: int | None) -> None:
        """FSDP under post-scaling: every rank's forward all-gathers parameters, so a rank that ran
        out of micro-batches early could not meet the others later. The declared lengths are
        compared before the first forward, on every rank (one small all-reduce)."""
        ledger = Ledger(self.device)
        k = 0 if length is None else length
        ledger.add("unknown", length is None)
        ledger.add("k", k)
        ledger.add("k_squared", k * k)
        settled = ledger.settle(self.dp_group, what="the windows' declared lengths")
        unknown, k_sum, k_sq = (float(settled.value(name)) for name in ("unknown", "k", "k_squared"))  # type: ignore[arg-type]
        world = dist.world_size(self.dp_group)
        if unknown or world * k_sq != k_sum * k_sum:
            self.zero_grad()
            raise WindowError(
                f"scaling='post' under {self.kind.upper()} needs every rank to declare the same window "
                f"length ({int(unknown)} of {world} ranks did not declare one (a list, or "
                f"step(..., length=k)); this rank declared {length}, {int(k_sum)} in all): FSDP "
                "all-gathers parameters in every forward, so the ranks must run equally many."
            )

    def _conclude_on_device(
        self,
        counted: WindowCount,
        accumulated: Accumulated,
        params: Sequence[torch.Tensor],
        grads: list[torch.Tensor],
    ) -> StepResult:
        """Phase 4 without a host read: the skip is a device flag the fused optimizer reads
        (``found_inf``); the result and the counters are read when asked."""
        config = self.config
        norm, gradient = self.update.gradient_check(grads, noise=self._noise is not None)
        n = counted.global_count
        # zero exactly where the update may go ahead: loss * 0 (and norm * 0) is NaN for a
        # non-finite value, the fused flag is non-zero for a non-finite gradient; one vector, so
        # the verdict is a few small device ops, not one per condition
        negative = counted.min_count < 0 if counted.min_count is not None else None
        terms = [accumulated.loss_sum() * 0, n == 0]
        if negative is not None:
            terms.append(negative)
        if config.skip_nonfinite and gradient is not None:
            terms.append(gradient * 0 if norm is not None else gradient)
        bad = (torch.stack(terms) != 0).any()
        if config.max_grad_norm is not None and norm is not None:
            clip_grads_(params, config.max_grad_norm, norm)
        self.update.wide.narrow()  # accum_dtype: rounded once, the window ended (as update.apply does)
        optimizer: Any = self.optimizer
        optimizer.found_inf = bad.to(torch.float32)
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
        skipped = bad.to(torch.float64)
        counters = self._device_counters
        if counters is None:
            counters = self._zero.new_zeros(3)  # a fill, not a copy from the host
            if self.consecutive_skips:
                counters[2] = self.consecutive_skips
        # [applied, skipped, consecutive] + [1 - s, s, 1], times [1, 1, s]: a skip adds one to the
        # run of skips, an update ends it; a new tensor each window, so a result holds its own
        assert self._counter_steps is not None
        add, signs, keep, last = self._counter_steps
        change = torch.addcmul(add, signs, skipped)
        self._device_counters = (counters + change) * torch.addcmul(keep, last, skipped)
        applied = change[0]
        result = DeviceStepResult(
            (
                accumulated.loss_sum(),
                n,
                counted.local_count,
                applied,
                self._device_counters[0],
                norm,
                self._zero if negative is None else negative,
            ),
            micro_batches=accumulated.micro_batches,
            step_base=self.steps_applied,
            wants_norm=config.wants_norm,
            recompiles=self._compiles.since(),
        )
        for hook in self.on_step:
            hook(result)
        self.emit("optimizer_end", 0)
        return result

    def _decide(
        self,
        counted: WindowCount,
        accumulated: Accumulated,
        params: Sequence[torch.Tensor],
        grads: list[torch.Tensor],
        objective: torch.Tensor | None,
        rejection: Callable[[int], Exception] | None,
    ) -> StepResult:
        """The backward ran on c * summed loss: multiply the gradients by W/(N c) once (foreach),
        then decide as under pre-scaling, or on the device where the optimizer reads found_inf."""
        factor = counted.post_factor()
        assert factor is not None
        scale_grads_(grads, factor, uniform=self._uniform)
        if self._on_device and objective is None and rejection is None:
            return self._conclude_on_device(counted, accumulated, params, grads)
        result = super()._decide(counted, accumulated, params, grads, objective, rejection)
        # read with the verdict: the next c is a host float
        self._basis.expected = result.global_count / self.factor
        return result

    # -- counters decided on the device ---------------------------------------------------------

    def settle_counters(self) -> None:
        """Add the updates decided on the device to the host counters (one host read, if any)."""
        if self._device_counters is None:
            return
        applied, skipped, consecutive = (int(v) for v in self._device_counters.tolist())
        self._device_counters = None
        self.steps_applied += applied
        self.steps_skipped += skipped
        if applied or skipped:
            self.consecutive_skips = consecutive

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)  # validates first: a refused state changes nothing
        self._device_counters = None


def _counter_steps(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The constant vectors of the device counters' update, made once: [applied, skipped,
    consecutive] becomes (counters + [1, 0, 1] + s [-1, 1, 0]) * ([1, 1, 0] + s [0, 0, 1]) for a
    window skipped (s = 1) or applied (s = 0)."""
    rows = ([1.0, 0.0, 1.0], [-1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0])
    add, signs, keep, last = (torch.tensor(row, dtype=torch.float64, device=device) for row in rows)
    return add, signs, keep, last
