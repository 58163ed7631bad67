"""The advisor: among measured rows that fit a memory budget, the fastest, and why, in one sentence.

A pure function of the rows (:func:`advise`), so it is tested on synthetic figures. Each row is
one measured configuration of a sweep at one global batch: a (micro-batch, accumulation)
factorization, with or without activation checkpointing, replicated (DDP) or sharded (FSDP2), with
sync deferred or not. The figure compared with the budget is the one that best says what the
configuration needs on this device: CUDA's ``max_memory_reserved`` over an update where there is a
GPU (the allocator's pool: what the device actually gives up), else the peak from the tensors
(:attr:`gradaccum.bench.memory.MemoryFigures.tensor_peak_bytes`: parameters, optimizer state,
gradients held, one micro-batch's activations), which leaves out the runtime and kernels' workspace.

When nothing fits, the sentence says which term is in the way. If even the smallest persistent
term (parameters, gradients, optimizer state; per rank under FSDP2) exceeds the budget, no
micro-batch, accumulation or checkpointing can help (:func:`gradaccum.bench.models.persistent_wall`
says so, for the plain rows' memory model too); otherwise it names what was not yet measured that
shrinks the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from gradaccum.bench.models import fmt_size, persistent_wall
from gradaccum.errors import BenchError
from gradaccum.plan import BatchPlan

if TYPE_CHECKING:
    from gradaccum.bench.stats import ConfigSummary

__all__ = ["Advice", "Outcome", "Row", "advise"]

Outcome = Literal["fits", "persistent", "activations", "nothing measured"]
"""``fits``: a row was chosen; ``persistent``: the persistent term alone exceeds the budget in
every row; ``activations``: the persistent term fits somewhere, but no measured row fits whole;
``nothing measured``: no row finished with its memory measured."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One measured configuration, as the advisor compares it."""

    label: str
    """The row's label (``8x2 ckpt``)."""
    plan: BatchPlan
    """Micro-batch, accumulation and data-parallel degree."""
    checkpointing: str
    """``none`` or ``full``."""
    fsdp: bool
    """Sharded with FSDP2 (else replicated, or one process)."""
    defer_sync: bool
    """Gradient sync deferred to the last micro-batch."""
    units_per_s: float
    """Median throughput over runs."""
    unit: str
    """What the throughput counts."""
    memory_bytes: float
    """The figure compared with the budget (per rank)."""
    memory_kind: str
    """Where it comes from: ``CUDA max reserved`` or ``from the tensors``."""
    persistent_bytes: float
    """Parameters + gradients + optimizer state, per rank."""
    accum_buffer_bytes: float = 0.0
    """Of ``persistent_bytes``: the float32 sums of ``AccumConfig.accum_dtype``."""
    max_tokens: int | None = None
    """A token-budget row's budget (its plan is the window's rows per rank, not a micro-batch it ran);
    ``None``: fixed micro-batches."""

    @classmethod
    def of(cls, summary: ConfigSummary) -> Row | None:
        """The row of a finished configuration with its memory measured; ``None`` otherwise."""
        m = summary.memory
        if not summary.ok or m is None or summary.units_per_s is None:
            return None
        cuda = m.max_reserved_bytes is not None
        return cls(
            label=summary.spec.row_label,
            plan=summary.plan,
            checkpointing=summary.spec.checkpointing,
            fsdp=summary.spec.fsdp,
            defer_sync=summary.spec.defer_sync,
            units_per_s=summary.units_per_s.median,
            unit=summary.unit,
            memory_bytes=float(
                m.max_reserved_bytes if m.max_reserved_bytes is not None else m.tensor_peak_bytes
            ),
            memory_kind="CUDA max reserved" if cuda else "from the tensors",
            persistent_bytes=float(m.persistent_bytes),
            accum_buffer_bytes=float(m.accum_buffer_bytes),
            max_tokens=summary.spec.max_tokens,
        )

    def words(self, contrast: Row | None = None) -> str:
        """``micro-batch 8 with checkpointing (8x2)``; what ``contrast`` has and this row lacks is
        said too (``without checkpointing``), so that a comparison names the difference."""
        if self.max_tokens is None:
            parts = [f"micro-batch {self.plan.micro_batch}"]
        else:  # named by its budget: the window is cut by lengths, no fixed micro-batch ran
            parts = [f"micro-batches of at most {self.max_tokens} tokens"]
        if self.checkpointing != "none":
            parts.append("with checkpointing")
        elif contrast is not None and contrast.checkpointing != "none":
            parts.append("without checkpointing")
        if self.fsdp and (contrast is None or not contrast.fsdp):
            parts.append("sharded with FSDP2")
        elif not self.fsdp and contrast is not None and contrast.fsdp:
            parts.append("replicated")
        if not self.defer_sync and (contrast is None or contrast.defer_sync):
            parts.append("syncing every micro-batch")
        elif self.defer_sync and contrast is not None and not contrast.defer_sync:
            parts.append("with sync deferred")
        name = self.plan.label() if self.max_tokens is None else f"tokens<={self.max_tokens}"
        return " ".join(parts) + f" ({name})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "micro_batch": self.plan.micro_batch if self.max_tokens is None else None,
            "accum_steps": self.plan.accum_steps if self.max_tokens is None else None,
            "dp": self.plan.dp,
            "checkpointing": self.checkpointing,
            "fsdp": self.fsdp,
            "defer_sync": self.defer_sync,
            "units_per_s": self.units_per_s,
            "unit": self.unit,
            "memory_bytes": self.memory_bytes,
            "memory_kind": self.memory_kind,
            "persistent_bytes": self.persistent_bytes,
            "accum_buffer_bytes": self.accum_buffer_bytes,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class Advice:
    """What the advisor chose for a budget, and the sentence that says why."""

    budget_bytes: float
    """The budget, per rank."""
    outcome: Outcome
    """Which case it is (see :data:`Outcome`)."""
    sentence: str
    """One sentence with the figures."""
    chosen: Row | None
    """The fastest row within the budget; ``None`` unless ``outcome`` is ``fits``."""
    compared: Row | None
    """The row the sentence compares it with, if any fits beside it."""
    fitting: tuple[str, ...]
    """Labels of the rows within the budget, fastest first."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "outcome": self.outcome,
            "sentence": self.sentence,
            "chosen": None if self.chosen is None else self.chosen.to_dict(),
            "compared": None if self.compared is None else self.compared.to_dict(),
            "fitting": list(self.fitting),
        }


def _differs(a: Row, b: Row) -> bool:
    """Whether ``b`` differs from ``a`` in more than the factorization."""
    return (a.checkpointing, a.fsdp, a.defer_sync) != (b.checkpointing, b.fsdp, b.defer_sync)


def _fastest_first(rows: Sequence[Row]) -> list[Row]:
    return sorted(rows, key=lambda r: (-r.units_per_s, r.memory_bytes))


def advise(rows: Sequence[Row], budget_bytes: float, *, global_batch: int) -> Advice:
    """The fastest of ``rows`` at ``global_batch`` whose memory fits ``budget_bytes``, and why.

    The comparison is with the fastest fitting row that differs in more than the factorization
    (checkpointing, sharding, deferral), so that the sentence says what the trade bought; with none,
    with the next fastest fitting row. Rows of another global batch are not compared: a different
    global batch is a different optimization, not a faster way to the same one.
    """
    if not budget_bytes > 0:
        raise BenchError(f"a memory budget must be a positive number of bytes, got {budget_bytes!r}")
    same = _fastest_first([r for r in rows if r.plan.global_batch == global_batch])
    budget = fmt_size(budget_bytes)
    if not same:
        return Advice(
            budget_bytes=budget_bytes,
            outcome="nothing measured",
            sentence=f"no configuration at global batch {global_batch} finished with its memory measured, "
            f"so none can be advised for {budget}",
            chosen=None,
            compared=None,
            fitting=(),
        )
    fits = [r for r in same if r.memory_bytes <= budget_bytes]
    if not fits:
        return _nothing_fits(same, budget_bytes)
    chosen = fits[0]
    others = fits[1:]
    compared = next((r for r in others if _differs(chosen, r)), others[0] if others else None)
    fastest = same[0]
    beyond = ""
    if fastest is not chosen:
        beyond = (
            f"; the fastest measured, {fastest.words(chosen)}, has "
            f"{fastest.units_per_s / chosen.units_per_s:.2f}x its {chosen.unit}/s but needs "
            f"{fmt_size(fastest.memory_bytes)}"
        )
    kind = chosen.memory_kind
    if compared is None:
        sentence = (
            f"{chosen.words()} is the only measured configuration within {budget} "
            f"({fmt_size(chosen.memory_bytes)}, {kind}){beyond}"
        )
    else:
        sentence = (
            f"{chosen.words(compared)}: {chosen.units_per_s / compared.units_per_s:.2f}x the {chosen.unit}/s "
            f"of {compared.words(chosen)}, both within {budget} ({fmt_size(chosen.memory_bytes)} and "
            f"{fmt_size(compared.memory_bytes)}, {kind}){beyond}"
        )
    return Advice(
        budget_bytes=budget_bytes,
        outcome="fits",
        sentence=sentence,
        chosen=chosen,
        compared=compared,
        fitting=tuple(r.label for r in fits),
    )


def _nothing_fits(rows: Sequence[Row], budget_bytes: float) -> Advice:
    lightest = min(rows, key=lambda r: (r.persistent_bytes, r.memory_bytes))
    wall = persistent_wall(
        lightest.persistent_bytes, budget_bytes, sharded_dp=lightest.plan.dp if lightest.fsdp else None
    )
    outcome: Outcome = "persistent"
    if wall is None:
        outcome, wall = "activations", _activations_over(rows, budget_bytes)
    elif lightest.accum_buffer_bytes:
        wall += (
            f" Of the persistent term, {fmt_size(lightest.accum_buffer_bytes)} are the float32 sums of "
            "accum_dtype: accum_dtype=None frees them, at the accumulation error gradaccum scan reports."
        )
    return Advice(
        budget_bytes=budget_bytes,
        outcome=outcome,
        sentence=wall,
        chosen=None,
        compared=None,
        fitting=(),
    )


def _activations_over(rows: Sequence[Row], budget_bytes: float) -> str:
    """The persistent state fits but no row's activations do: the smallest row, and what to measure."""
    smallest = min(rows, key=lambda r: r.memory_bytes)
    remedies = []
    if all(r.checkpointing == "none" for r in rows):
        remedies.append("activation checkpointing (--checkpointing full)")
    if min(r.plan.micro_batch for r in rows) > 1:
        remedies.append("a smaller micro-batch with more accumulation")
    if smallest.plan.dp > 1 and not any(r.fsdp for r in rows):
        remedies.append("sharding the state (--sharding fsdp2)")
    if not remedies:
        remedies.append("sharding over more ranks, or a lighter optimizer")
    activations = smallest.memory_bytes - smallest.persistent_bytes
    return (
        f"no measured configuration fits {fmt_size(budget_bytes)}: the smallest, {smallest.words()}, needs "
        f"{fmt_size(smallest.memory_bytes)} ({smallest.memory_kind}; {fmt_size(smallest.persistent_bytes)} "
        f"persistent, {fmt_size(activations)} besides); measure " + " or ".join(remedies)
    )
