"""The load balance a step runs: the routing pass, the agreed statistics, each micro-batch's term.

:class:`WindowBalance` is built by the accumulator from a :class:`~gradaccum.moe.spec.LoadBalance`
and driven by the window engine at two points:

* the count phase: :meth:`WindowBalance.count` computes this rank's statistics vector
  (:meth:`WindowBalance.local`), which rides in the count all-reduce beside N (one process reduces
  nothing), and :meth:`WindowBalance.agree` turns the summed vector into the window's
  :class:`BalanceWindow` (:attr:`WindowBalance.window`);
* the accumulate phase: :meth:`BalanceWindow.term` builds micro-batch ``m``'s term from the logits
  its forward recorded; the step adds it (times the DDP averaging factor W) to the scaled loss.

What the vector holds, by mode:

* ``exact``: this window's ``(c, R)``, from a no-grad routing pass over the window's micro-batches
  (:mod:`gradaccum.moe.routing`: the same weights, each forward stopped after its last router, the
  RNG state forked and restored so the training forwards replay the same dropout and router
  jitter, the model's buffers restored). Each training forward's counts are compared with its
  routing pass; a mismatch vetoes the update on every rank rather than apply a term that is not exact.
* ``lagged``: the counts of the last *applied* window, observed in its training forwards (one
  forward per micro-batch). A skipped window's counts are dropped, as its gradients are: the window
  after it uses the same counts the skipped one used. Until a window has been applied (nothing
  carried) each micro-batch uses its own statistics, as ``micro-batch`` mode does. The carried
  counts are this rank's, saved as the ``balance`` part of the accumulator's ``state_dict`` (each
  rank saves and loads its own).
* ``micro-batch``: only the window's micro-batch count M; micro-batch ``m`` uses its own ``(c, R)``
  and weighs ``1/M``: the mean over the window's micro-batches of the per-micro-batch term, which is
  what per-micro-batch balancing computes.

Aux-loss-free balancing (``bias_rate``) moves each router's bias once per *applied* optimizer step
(:meth:`WindowBalance.applied`, an ``on_step`` hook), from that window's agreed counts, identically
on every rank; a skipped window moves nothing. ``exact``: the counts are agreed before the window's
forwards, so the bias moves at once, with the update. ``lagged`` and ``micro-batch``: a window's
counts are summed over the ranks in the next window's count all-reduce, so the bias moves there,
before that window's first forward (and only once, however many skipped windows carry them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from gradaccum.errors import ConfigError, EquivalenceError
from gradaccum.moe.capture import RouterCapture
from gradaccum.moe.routing import RoutingPass
from gradaccum.moe.spec import LoadBalance
from gradaccum.moe.stats import WindowStats, balance_term, route, z_term

__all__ = ["BalanceWindow", "WindowBalance"]

Forward = Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class BalanceWindow:
    """One window's agreed statistics and how each micro-batch's term uses them."""

    stats: WindowStats | None
    """The ``(c, R)`` every micro-batch's term uses; ``None``: each micro-batch's own (weighted 1/M)."""
    micro_batches: torch.Tensor
    """M: micro-batches over the window and the data ranks."""
    expected: Sequence[torch.Tensor]
    """``exact``: each micro-batch's counts from the routing pass, which its forward must reproduce."""


class WindowBalance:
    """Capture, statistics and carried state of one accumulator's load balance (a ``StatePart``)."""

    def __init__(self, spec: LoadBalance, device: torch.device, *, model: nn.Module | None = None) -> None:
        """``model``: the module the routing pass runs, whose buffers it leaves as found (``None``:
        only the routers' buffers are kept)."""
        self.spec = spec
        self.device = device
        self.capture = RouterCapture(spec.routers, spec.logits_index)
        self._pass = RoutingPass(self.capture, device, [model] if model is not None else spec.routers)
        self._empty = WindowStats.zeros(spec.layers, spec.num_experts, device)
        # the last applied window's counts: lagged, this rank's seen in its forwards; exact, agreed
        self._carried: WindowStats | None = None
        self._pending: WindowStats | None = None  # this window's, carried once it is applied
        self._seen: list[torch.Tensor] = []  # this window's counts per micro-batch, from its forwards
        self._terms: list[torch.Tensor] = []
        self._expected: list[tuple[torch.Tensor, torch.Tensor]] = []  # exact: the routing pass's
        self._bias_due = False
        self._forward: Forward | None = None
        self._local: torch.Tensor | None = None
        self.window: BalanceWindow | None = None
        """The current window's agreed statistics, from the count phase on (``None`` before)."""

    @property
    def size(self) -> int:
        """Length of the statistics vector in the count all-reduce."""
        return self.spec.layers * self.spec.num_experts + self.spec.layers + 1

    # -- count phase ----------------------------------------------------------------------------

    def use(self, forward: Forward) -> None:
        """The routing pass's forward of a micro-batch (the front end's ``loss_fn`` on its model),
        set before each window's count phase."""
        self._forward = forward

    def local(self) -> torch.Tensor:
        """This rank's statistics vector for the count all-reduce: what :meth:`count` computed, or
        zeros of the same length where it did not run (a rank that failed before it), so that the
        ranks' slots line up."""
        return self._empty.pack() if self._local is None else self._local

    def count(self, micro_batches: Sequence[Any]) -> None:
        """This rank's statistics vector (see the module docstring for what it holds per mode)."""
        spec, k = self.spec, len(micro_batches)
        m = torch.tensor(float(k), dtype=torch.float64, device=self.device)
        if spec.mode != "exact":
            carried = self._carried or self._empty
            self._local = WindowStats(carried.counts, carried.rows, m).pack()
            return
        if self._forward is None:
            raise ConfigError(
                "LoadBalance(mode='exact') needs use(forward) before the count: its routing pass"
            )
        if self._bias_due and self._carried is not None:  # a checkpoint saved with the move pending
            self._apply_bias(self._carried.counts)
        per_batch = self._routing_pass(micro_batches, self._forward)
        self._expected = per_batch
        counts = torch.stack([c for c, _ in per_batch]).sum(0) if per_batch else self._empty.counts
        rows = torch.stack([r for _, r in per_batch]).sum(0) if per_batch else self._empty.rows
        self._local = WindowStats(counts, rows, m).pack()

    def _routing_pass(
        self, micro_batches: Sequence[Any], forward: Forward
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each micro-batch's ``(c, R)`` from its no-grad forward up to the last router
        (:class:`~gradaccum.moe.routing.RoutingPass`: RNG state and buffers left as found)."""
        out = []
        for records, mb in zip(self._pass.run(micro_batches, forward), micro_batches, strict=True):
            routed = self._route(records, mb, selection_only=True)
            out.append((routed.counts, routed.rows))
        return out

    def _route(
        self, records: Sequence[tuple[int, torch.Tensor]], mb: Any, *, selection_only: bool = False
    ) -> Any:
        spec = self.spec
        return route(
            records,
            spec.mask(mb),
            layers=spec.layers,
            num_experts=spec.num_experts,
            top_k=spec.top_k,
            device=self.device,
            biases=None if spec.bias_rate is None else [getattr(r, spec.bias_name) for r in spec.routers],
            selection_only=selection_only,
        )

    def agree(self, vector: torch.Tensor) -> BalanceWindow:
        """The window's statistics from the summed vector (on one process, this rank's), kept as
        :attr:`window` for the accumulate phase."""
        self._local = None
        self.window = self._agree(vector)
        return self.window

    def _agree(self, vector: torch.Tensor) -> BalanceWindow:
        spec = self.spec
        agreed = WindowStats.unpack(vector, spec.layers, spec.num_experts)
        self._seen, self._terms = [], []
        if spec.mode == "exact":
            expected = [c for c, _ in self._expected]
            self._expected = []
            self._pending = agreed  # carried, and the bias moved from it, once the window is applied
            return BalanceWindow(agreed, agreed.micro_batches, expected)
        self._pending = None  # this window's forwards fill it (finish)
        if self._carried is None:  # nothing applied yet: each micro-batch balances on its own
            return BalanceWindow(None, agreed.micro_batches, [])
        if self._bias_due:  # the last applied window's counts, summed over the ranks only now
            self._apply_bias(agreed.counts)
        stats = agreed if spec.mode == "lagged" else None
        return BalanceWindow(stats, agreed.micro_batches, [])

    def applied(self, result: Any = None) -> None:
        """An ``on_step`` hook (it runs once per applied optimizer step, never for a skipped one):
        this window's counts become the carried ones, and the bias moves once for them (``exact``
        now; ``lagged`` and ``micro-batch`` at the next window's agreement)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        self._carried = pending
        self._bias_due = self.spec.bias_rate is not None
        if self.spec.mode == "exact":
            self._apply_bias(pending.counts)

    def _apply_bias(self, counts: torch.Tensor) -> None:
        """DeepSeek-V3's update, once per applied step: ``b_i += rate * sign(mean load - load_i)``
        per router, from the window's agreed counts."""
        rate = self.spec.bias_rate
        self._bias_due = False
        if rate is None:
            return
        with torch.no_grad():
            for layer, router in enumerate(self.spec.routers):
                bias = getattr(router, self.spec.bias_name)
                load = counts[layer]
                bias.add_(torch.sign(load.mean() - load).to(device=bias.device, dtype=bias.dtype), alpha=rate)

    # -- accumulate phase -----------------------------------------------------------------------

    def term(
        self, window: BalanceWindow, index: int, mb: Any, records: Sequence[tuple[int, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Micro-batch ``index``'s balancing (and z-loss) term, and its veto (``exact``: 1 when its
        forward routed differently from its routing pass)."""
        spec = self.spec
        routed = self._route(records, mb)
        self._seen.append(routed.counts)
        if window.stats is not None:
            counts, rows, weight = window.stats.counts, window.stats.rows, None
        else:  # each micro-batch's own statistics, averaged over the window's M micro-batches
            counts, rows, weight = routed.counts, routed.rows, window.micro_batches.clamp(min=1)
        term = balance_term(
            routed.probs, counts, rows, num_experts=spec.num_experts, coef=spec.coef, pooled=spec.pooled
        )
        if spec.z_coef is not None:
            term = term + z_term(routed.z, rows, z_coef=spec.z_coef, pooled=spec.pooled)
        if weight is not None:
            term = term / weight
        self._terms.append(term.detach())
        rejected = None
        if index < len(window.expected):
            rejected = (routed.counts != window.expected[index]).any().to(torch.float64)
        return term, rejected

    def finish(self) -> None:
        """After the window's last forward: lagged and micro-batch modes keep its counts, carried
        once the window is applied (:meth:`applied`)."""
        if self.spec.mode != "exact" and self._seen:
            counts = torch.stack(self._seen).sum(0)
            rows = self._rows_of(self._seen)
            self._pending = WindowStats(counts, rows, self._empty.micro_batches)

    def _rows_of(self, seen: list[torch.Tensor]) -> torch.Tensor:
        """Rows from counts: every counted row fills top_k slots in each layer."""
        return torch.stack(seen).sum(0).sum(1) / self.spec.top_k

    @staticmethod
    def rejection(ranks: int) -> Exception:
        """The error every rank raises when a training forward routed differently from its routing pass."""
        return EquivalenceError(
            f"on {ranks} micro-batch(es) the training forward routed tokens to other experts than the "
            "routing pass did: the model's routing is not reproducible (an RNG the step cannot replay, a "
            "nondeterministic kernel), so the exact balancing term is unknown; no update was applied. "
            "Make the routing deterministic, or use LoadBalance(mode='lagged')."
        )

    # -- reporting and state --------------------------------------------------------------------

    def window_counts(self) -> torch.Tensor | None:
        """This rank's routed slots per layer and expert over the last window's training forwards."""
        return torch.stack(self._seen).sum(0) if self._seen else None

    def window_term(self) -> torch.Tensor | None:
        """This rank's part of the last window's balancing term (summed over ranks in exact mode it
        is the full-batch term's value)."""
        return torch.stack(self._terms).sum() if self._terms else None

    def state_dict(self) -> dict[str, Any]:
        """The carried counts (this rank's, of the last applied window), as float64 lists: exact
        integers, bitwise on reload; ``bias_due``: the bias has not moved for them yet (lagged)."""
        carried = self._carried
        return {
            "mode": self.spec.mode,
            "carried": None if carried is None else carried.pack().tolist(),
            "bias_due": self._bias_due,
        }

    def load_state_dict(self, state: Any) -> None:
        """Restore :meth:`state_dict`; a different mode or layout is refused before anything changes."""
        ok = isinstance(state, dict) and set(state) == {"mode", "carried", "bias_due"}
        carried = state.get("carried") if ok else None
        if not ok or (carried is not None and (not isinstance(carried, list) or len(carried) != self.size)):
            raise ConfigError(
                f"the accumulator state's 'balance' part must hold mode, carried ({self.size} numbers or "
                f"None) and bias_due for {self.spec.layers} routers x {self.spec.num_experts} experts, "
                f"got {state!r:.200}"
            )
        if state["mode"] != self.spec.mode:
            raise ConfigError(
                f"the checkpoint's load balance ran mode={state['mode']!r}, this one "
                f"mode={self.spec.mode!r}: rebuild LoadBalance with the checkpoint's mode"
            )
        vector = None if carried is None else torch.tensor(carried, dtype=torch.float64, device=self.device)
        self._carried = (
            None if vector is None else WindowStats.unpack(vector, self.spec.layers, self.spec.num_experts)
        )
        self._bias_due = bool(state["bias_due"])
