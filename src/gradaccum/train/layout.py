"""How a run is laid out on processes, and what a resume on another layout may change.

The training stream is layout-independent by construction (:mod:`gradaccum.train.data`): window
``w`` is the global batch ``make_batch(global_batch, train_seed(seed, w))`` whatever the number of
processes, the micro-batch or the token budget, and the exact accumulation gives the same update
for any cut of it. So a checkpoint resumes on another layout (another world size, ``--micro-batch``
or ``--max-tokens``, FSDP2 or DDP or one process); the accumulation steps follow from the global
batch. Its data position is global: the next window, and the rows of the global stream consumed.

What does change the trajectory is refused by name, saying what would change: another global batch,
seed, workload (model and data), or precision; and a layout change of a run with a batch-size
schedule, whose state is counted in accumulation steps of its starting plan.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gradaccum.errors import CheckpointError
from gradaccum.plan import BatchPlan

__all__ = ["Layout", "check_resume", "describe_layout", "moved_layout", "saved_layout"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """How one segment of a run cut its global batch: processes, micro-batch, steps, sharding."""

    world: int
    """Data-parallel processes."""
    micro_batch: int | None
    """Rows per micro-batch; None with a token budget (the micro-batches follow the lengths)."""
    accum_steps: int
    """Micro-batches per rank and window (1 with a token budget: the plan holds rows per rank)."""
    max_tokens: int | None
    """The token budget per micro-batch, or None."""
    fsdp: bool
    """Whether the parameters were sharded with FSDP2 (else DDP, or one process)."""

    @classmethod
    def of(cls, plan: BatchPlan, *, max_tokens: int | None, fsdp: bool) -> Layout:
        return cls(
            world=plan.dp,
            micro_batch=None if max_tokens is not None else plan.micro_batch,
            accum_steps=plan.accum_steps,
            max_tokens=max_tokens,
            fsdp=fsdp,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def resume_record(self, meta: dict[str, Any], progress: dict[str, Any]) -> dict[str, Any]:
        """What the run card records of a resume onto this layout: the checkpoint (``meta`` of
        :func:`~gradaccum.train.checkpoint.load_checkpoint`), its boundary, the global rows drawn
        before it, and the layouts it was written and resumed on."""
        return {
            "from": meta["path"],
            "window": progress["windows"],
            "step": progress["steps_applied"],
            "rows": progress["rows_seen"],
            "written_on": meta["layout"],
            "resumed_on": self.to_dict(),
        }


def describe_layout(layout: dict[str, Any]) -> str:
    """A recorded layout in words: ``2 processes (DDP), micro-batch 3 x 2 accumulation steps``."""
    world = int(layout["world"])
    kind = "FSDP2" if layout.get("fsdp") else ("DDP" if world > 1 else "no wrapper")
    cut = (
        f"token budget {layout['max_tokens']:,} per micro-batch"
        if layout.get("max_tokens") is not None
        else f"micro-batch {layout['micro_batch']} x {layout['accum_steps']} accumulation steps"
    )
    return f"{world} {'process' if world == 1 else 'processes'} ({kind}), {cut}"


def moved_layout(resumes: tuple[dict[str, Any], ...]) -> str | None:
    """The last resume in words when it changed the layout (None when it did not, or no resume)."""
    if not resumes or resumes[-1]["written_on"] == resumes[-1]["resumed_on"]:
        return None
    last = resumes[-1]
    return (
        f"written on {describe_layout(last['written_on'])}; now {describe_layout(last['resumed_on'])}; "
        f"the same global batch, so the same trajectory"
    )


def saved_layout(state: dict[str, Any]) -> dict[str, Any]:
    """The layout a checkpoint was written on (read from its plan for checkpoints without one)."""
    layout = state.get("layout")
    if isinstance(layout, dict):
        return layout
    plan = state["plan"]
    return Layout.of(BatchPlan(**plan), max_tokens=None, fsdp=False).to_dict()


def check_resume(
    folder: Path,
    state: dict[str, Any],
    *,
    plan: BatchPlan,
    layout: Layout,
    precision: str,
    seed: int | None,
    workload: str | None,
) -> bool:
    """Refuse to resume checkpoint ``folder`` (its loaded ``state``) where the trajectory would
    change; True when it continues on another layout than it was written on.

    ``seed`` and ``workload`` None: not compared (a caller that does not know them).
    """
    saved_plan = BatchPlan(**state["plan"])
    saved = saved_layout(state)
    meta = state.get("meta") or {}
    what = f"checkpoint {folder} was written"
    if saved_plan.global_batch != plan.global_batch:
        raise CheckpointError(
            f"{what} with global batch {saved_plan.global_batch} ({saved_plan.equation()}); this run "
            f"has global batch {plan.global_batch} ({plan.equation()}). Resuming would change the data "
            f"and the size of every update from here on. Resume with --global-batch "
            f"{saved_plan.global_batch} (any --micro-batch, --max-tokens or number of processes), or "
            "start a new run"
        )
    saved_precision = meta.get("precision")
    if saved_precision != precision:
        raise CheckpointError(
            f"{what} in precision {saved_precision}, this run uses {precision}; resume with "
            f"--precision {saved_precision}"
        )
    saved_seed = meta.get("seed")
    if seed is not None and saved_seed is not None and saved_seed != seed:
        raise CheckpointError(
            f"{what} with seed {saved_seed}, this run has seed {seed}: resuming would draw other "
            f"examples from here on. Resume with --seed {saved_seed}, or start a new run"
        )
    saved_workload = meta.get("workload")
    if workload is not None and saved_workload is not None and saved_workload != workload:
        raise CheckpointError(
            f"{what} for workload {saved_workload}, this run trains {workload}: the model and its data "
            f"would change. Resume with --workload {saved_workload}, or start a new run"
        )
    moved = saved != layout.to_dict()
    if moved and state.get("batch_schedule") is not None:
        raise CheckpointError(
            f"{what} with --batch-schedule critical on {describe_layout(saved)}; this run is laid "
            f"out as {describe_layout(layout.to_dict())}. A batch-size schedule's state counts "
            "accumulation steps of its starting plan, so it resumes on the same layout only: launch "
            f"{saved['world']} process(es) with the checkpoint's --micro-batch, or start a new run"
        )
    return moved
