"""Batch arithmetic: the batch equation, its inverse, cadence, and comparisons of plans.

    global_batch = micro_batch x dp x accum_steps

``dp`` is the number of data-parallel replicas. Tensor-, pipeline- and context-parallel ranks work on
the same samples, so they divide the world size but never multiply the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, overload

from gradaccum.errors import PlanError
from gradaccum.fielddocs import document_fields
from gradaccum.values import require_int

__all__ = [
    "BatchPlan",
    "FinalWindow",
    "PlanComparison",
    "PlanRow",
    "compare_plans",
    "factorizations",
    "windows",
]

T = TypeVar("T")

FinalWindow = Literal["keep", "drop"]
"""How a final partial window counts: ``keep`` steps on it (its own N), ``drop`` discards it."""


def _positive_int(name: str, value: object) -> int:
    return require_int(name, value, error=PlanError)


@document_fields
@dataclass(frozen=True, kw_only=True, slots=True)
class BatchPlan:
    """One data-parallel accumulation plan."""

    micro_batch: int
    """Examples (sequences, images) per forward pass on one replica."""
    accum_steps: int
    """Micro-batches accumulated per optimizer step on one replica."""
    dp: int = 1
    """Data-parallel replicas; TP/PP/CP ranks are not counted here."""

    def __post_init__(self) -> None:
        _positive_int("micro_batch", self.micro_batch)
        _positive_int("accum_steps", self.accum_steps)
        _positive_int("dp", self.dp)

    @property
    def global_batch(self) -> int:
        """Examples per optimizer step across all replicas."""
        return self.micro_batch * self.dp * self.accum_steps

    @property
    def local_batch(self) -> int:
        """Examples per optimizer step on one replica."""
        return self.micro_batch * self.accum_steps

    @classmethod
    def from_world(
        cls,
        *,
        world_size: int,
        micro_batch: int,
        accum_steps: int,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
    ) -> BatchPlan:
        """The plan of a job on ``world_size`` ranks, of which ``tp*pp*cp`` share each sample."""
        world_size = _positive_int("world_size", world_size)
        model_parallel = _positive_int("tp", tp) * _positive_int("pp", pp) * _positive_int("cp", cp)
        if world_size % model_parallel:
            raise PlanError(
                f"world_size={world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = "
                f"{model_parallel}; the data-parallel degree would not be a whole number. "
                f"Use a world size that is a multiple of {model_parallel}."
            )
        return cls(micro_batch=micro_batch, accum_steps=accum_steps, dp=world_size // model_parallel)

    @classmethod
    def from_mesh(
        cls,
        mesh: object,
        *,
        micro_batch: int,
        accum_steps: int,
        mesh_dims: Mapping[str, str] | None = None,
    ) -> BatchPlan:
        """The plan on a DeviceMesh (or ``{name: size}``): dp = dp_replicate x dp_shard.

        Context-parallel ranks split each sequence and tensor- and pipeline-parallel ranks split
        the model, so none of them multiplies the batch (see :mod:`gradaccum.mesh.layout`)."""
        from gradaccum.mesh.layout import role_sizes

        sizes = role_sizes(mesh, mesh_dims)
        return cls(
            micro_batch=micro_batch, accum_steps=accum_steps, dp=sizes["dp_replicate"] * sizes["dp_shard"]
        )

    @classmethod
    def solve(cls, *, global_batch: int, micro_batch: int, dp: int = 1) -> BatchPlan:
        """The plan that reaches ``global_batch`` with this micro-batch and replica count."""
        global_batch = _positive_int("global_batch", global_batch)
        per_pass = _positive_int("micro_batch", micro_batch) * _positive_int("dp", dp)
        if global_batch % per_pass:
            below = (global_batch // per_pass) * per_pass
            above = below + per_pass
            nearest = f"{below} or {above}" if below else f"{above}"
            raise PlanError(
                f"global_batch={global_batch} is not a multiple of micro_batch x dp = "
                f"{micro_batch} x {dp} = {per_pass}; the nearest reachable global batches are "
                f"{nearest}. Change global_batch, micro_batch or dp."
            )
        return cls(micro_batch=micro_batch, accum_steps=global_batch // per_pass, dp=dp)

    def tokens_per_step(self, seq_len: int) -> int:
        """Token positions per optimizer step at a fixed sequence length (padding included)."""
        return self.global_batch * _positive_int("seq_len", seq_len)

    def optimizer_updates(self, dataset_size: int, *, final_window: FinalWindow = "keep") -> int:
        """Optimizer updates in one pass over ``dataset_size`` examples.

        With ``final_window="keep"`` (the default, like ``drop_last=False``) a final partial window
        is one more update, normalized by its own count; with ``"drop"`` it is discarded.
        """
        require_int("dataset_size", dataset_size, low=0)
        if final_window == "keep":
            return math.ceil(dataset_size / self.global_batch)
        if final_window == "drop":
            return dataset_size // self.global_batch
        raise PlanError(f"final_window must be 'keep' or 'drop', got {final_window!r}")

    def equation(self) -> str:
        """The batch equation, written out."""
        return (
            f"global_batch = micro_batch {self.micro_batch} x dp {self.dp} x "
            f"accum_steps {self.accum_steps} = {self.global_batch}"
        )

    def label(self) -> str:
        """``MICROxACCUM`` on one replica, ``MICROxDPxACCUM`` under data parallelism: the form the
        commands take plans in, and the one label every report and run card uses."""
        if self.dp == 1:
            return f"{self.micro_batch}x{self.accum_steps}"
        return f"{self.micro_batch}x{self.dp}x{self.accum_steps}"


def factorizations(global_batch: int, *, dp: int = 1) -> list[BatchPlan]:
    """Every plan that reaches ``global_batch`` on ``dp`` replicas, largest micro-batch first."""
    global_batch = _positive_int("global_batch", global_batch)
    dp = _positive_int("dp", dp)
    if global_batch % dp:
        raise PlanError(f"global_batch={global_batch} is not divisible by dp={dp}")
    local = global_batch // dp
    return [
        BatchPlan(micro_batch=m, accum_steps=local // m, dp=dp) for m in range(local, 0, -1) if local % m == 0
    ]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanRow:
    """One plan measured against the baseline of a comparison."""

    name: str
    plan: BatchPlan
    tokens_per_step: int | None
    optimizer_updates: int | None
    same_global_batch: bool
    same_tokens: bool | None
    same_updates: bool | None

    @property
    def controlled(self) -> bool:
        """True when this plan changes only the accumulation mechanics, not the optimization."""
        return self.same_global_batch and self.same_tokens is not False and (self.same_updates is not False)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanComparison:
    """Plans side by side, each against the first (the baseline)."""

    rows: tuple[PlanRow, ...]
    seq_len: int | None
    dataset_size: int | None

    @property
    def baseline(self) -> PlanRow:
        return self.rows[0]

    def verdicts(self) -> list[str]:
        """One sentence per non-baseline plan saying what it holds fixed and what it changes."""
        lines = []
        base = self.baseline
        for row in self.rows[1:]:
            if row.controlled:
                lines.append(
                    f"{row.name} vs {base.name}: global batch, tokens and update cadence held fixed "
                    f"({row.plan.global_batch}); only the accumulation mechanics change."
                )
                continue
            changed = []
            if not row.same_global_batch:
                ratio = row.plan.global_batch / base.plan.global_batch
                changed.append(
                    f"global batch {base.plan.global_batch} -> {row.plan.global_batch} ({ratio:g}x)"
                )
            if row.same_tokens is False:
                changed.append(f"tokens/step {base.tokens_per_step} -> {row.tokens_per_step}")
            if row.same_updates is False:
                changed.append(f"updates {base.optimizer_updates} -> {row.optimizer_updates}")
            lines.append(
                f"{row.name} vs {base.name}: NOT a controlled comparison; it changes "
                + "; ".join(changed)
                + ". It is a different-batch experiment that needs its own tuning, "
                "not a test of accumulation."
            )
        return lines


def compare_plans(
    plans: Mapping[str, BatchPlan],
    *,
    seq_len: int | None = None,
    dataset_size: int | None = None,
    final_window: FinalWindow = "keep",
) -> PlanComparison:
    """Compare named plans against the first one (the baseline)."""
    if not plans:
        raise PlanError("compare_plans needs at least one plan")
    items = list(plans.items())
    base = items[0][1]
    base_tokens = base.tokens_per_step(seq_len) if seq_len is not None else None
    base_updates = (
        base.optimizer_updates(dataset_size, final_window=final_window) if dataset_size is not None else None
    )
    rows = []
    for name, plan in items:
        tokens = plan.tokens_per_step(seq_len) if seq_len is not None else None
        updates = (
            plan.optimizer_updates(dataset_size, final_window=final_window)
            if dataset_size is not None
            else None
        )
        rows.append(
            PlanRow(
                name=name,
                plan=plan,
                tokens_per_step=tokens,
                optimizer_updates=updates,
                same_global_batch=plan.global_batch == base.global_batch,
                same_tokens=None if tokens is None else tokens == base_tokens,
                same_updates=None if updates is None else updates == base_updates,
            )
        )
    return PlanComparison(rows=tuple(rows), seq_len=seq_len, dataset_size=dataset_size)


@overload
def windows(
    micro_batches: Iterable[T],
    accum_steps: int,
    *,
    pad_to_multiple: int | None = None,
    pad_values: Mapping[str | int, float] | None = None,
) -> Iterator[list[T]]: ...
@overload
def windows(
    micro_batches: Iterable[Any],
    accum_steps: None = None,
    *,
    max_tokens: int,
    global_batch: int,
    rank: int = 0,
    world: int = 1,
    equal_count: bool = False,
    layout: Literal["padded", "packed"] = "padded",
    cost: Callable[[Sequence[int]], float] | None = None,
) -> Iterator[list[Any]]: ...
def windows(
    micro_batches: Iterable[T],
    accum_steps: int | None = None,
    *,
    pad_to_multiple: int | None = None,
    pad_values: Mapping[str | int, float] | None = None,
    max_tokens: int | None = None,
    global_batch: int | None = None,
    rank: int = 0,
    world: int = 1,
    equal_count: bool = False,
    layout: Literal["padded", "packed"] = "padded",
    cost: Callable[[Sequence[int]], float] | None = None,
) -> Iterator[list[Any]]:
    """Group micro-batches into windows of ``accum_steps``; the final short window is yielded too.

    Each window is the list that :meth:`gradaccum.Accumulator.step` takes; the step normalizes a
    short final window by its own valid count, so nothing is lost or over-weighted.

    ``pad_to_multiple=N`` right-pads each micro-batch's sequence dimension (dim 1 of its tensors of
    2 or more dims) to a multiple of N, labels with the ignore index, so that a model compiled with
    static shapes meets at most max_len / N lengths instead of recompiling for every one (see
    :mod:`gradaccum.step.compiled`); ``pad_values`` overrides or adds a key's padding value
    (:func:`gradaccum.batch.pad_length` has the rules). Counts and gradients do not change.

    ``max_tokens=B`` (instead of ``accum_steps``) makes token-budget windows: the iterable holds
    tokenized documents (sequences of token ids), ``global_batch`` of them form a window, and each
    window is this rank's micro-batches of at most B computed tokens, balanced across ``world``
    ranks (:func:`gradaccum.split_by_tokens`); ``layout="packed"`` packs the documents into rows
    with ``position_ids`` instead of padding one per row (:mod:`gradaccum.tokens.loader`).
    ``cost`` balances the ranks' compute cost instead of their valid tokens
    (``gradaccum.tokens.transformer_cost(d_model, layers)``; see :func:`gradaccum.split_by_tokens`).
    """
    if max_tokens is not None:
        if accum_steps is not None or pad_to_multiple is not None or pad_values is not None:
            raise PlanError(
                "max_tokens sets each window's micro-batches by tokens: give global_batch (documents per "
                "window) with it, not accum_steps, pad_to_multiple or pad_values"
            )
        if global_batch is None:
            raise PlanError("max_tokens needs global_batch: how many documents form one window")
        from gradaccum.tokens.loader import token_windows  # torch only for token budgets

        return token_windows(
            micro_batches,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            global_batch=global_batch,
            rank=rank,
            world=world,
            equal_count=equal_count,
            layout=layout,
            cost=cost,
        )
    if global_batch is not None or (rank, world, equal_count, layout) != (0, 1, False, "padded"):
        raise PlanError(
            "global_batch, rank, world, equal_count and layout belong to token-budget windows: give "
            "max_tokens with them"
        )
    if cost is not None:
        raise PlanError(
            "cost balances the ranks of token-budget windows: give max_tokens (and global_batch) with it"
        )
    if accum_steps is None:
        raise PlanError("windows needs accum_steps (micro-batches per window) or max_tokens")
    accum_steps = _positive_int("accum_steps", accum_steps)
    if pad_to_multiple is not None:
        _positive_int("pad_to_multiple", pad_to_multiple)
    elif pad_values is not None:
        raise PlanError("pad_values is given but pad_to_multiple is not: say what to pad to")
    return _windows(micro_batches, accum_steps, pad_to_multiple, pad_values)


def _windows(
    micro_batches: Iterable[T],
    accum_steps: int,
    pad_to_multiple: int | None,
    pad_values: Mapping[str | int, float] | None,
) -> Iterator[list[T]]:
    if pad_to_multiple is not None:
        from gradaccum.batch import pad_length  # torch only when padding

        multiple = pad_to_multiple
        micro_batches = (pad_length(item, multiple, pad_values) for item in micro_batches)
    window: list[T] = []
    for item in micro_batches:
        window.append(item)
        if len(window) == accum_steps:
            yield window
            window = []
    if window:
        yield window
