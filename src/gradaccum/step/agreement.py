"""Rank failures: every rank learns of a failure together, instead of hanging or stepping alone.

A data-parallel window goes wrong when one rank stops and the others carry on: they wait in the
next collective (the synchronizing backward) until the process-group timeout, or, where the
collectives happen to line up, step on gradients the stopped rank never sent. The
:class:`~gradaccum.Accumulator` therefore keeps two *agreement points* per window, small
all-reduces that every rank joins whatever happened to it before:

1. the counts all-reduce before the first forward (it exists anyway, for N), which also carries
   "I failed while reading or counting the window";
2. a flag all-reduce after the forward of each micro-batch whose backward synchronizes (the last
   one with ``defer_sync=True``, every one without), just before that backward. A rank that raised
   in any forward or deferred backward skips the rest of its window and comes straight here.
   Under DDP built with ``find_unused_parameters=False`` each rank also checks here that this
   backward reaches every parameter DDP reduces, since DDP would otherwise wait for the rest.

The counts all-reduce also refuses, on every rank, a window that is empty on some rank (an error,
not a silent zero-contribution participation: an empty shard is almost always a data bug, and a
rank whose window is all padding already participates with zero), and unequal micro-batch counts
where every backward or forward synchronizes (``defer_sync=False``, FSDP).

If any rank failed, every rank clears its gradients and raises: the failing rank its own exception,
the others :class:`RankFailedError`, which names the rank, the phase, the micro-batch and the error.
When every failure was an out-of-memory error, every rank raises :class:`WindowOutOfMemoryError`
(itself a ``torch.OutOfMemoryError``) and :func:`gradaccum.step.adaptive.step_adaptive` can retry the window
with smaller micro-batches. The process group and the DDP wrapper stay usable: DDP expects the
backward of a synchronizing forward that completed (even under ``no_sync`` later), so the window
after an agreed failure starts with a synchronizing micro-batch on every rank, which resets that
bookkeeping (one extra gradient all-reduce; the sum is the same, rounded differently).

Why agreement and not a side channel through the process group's store: the default store is
private API, a store of one's own needs an address every rank can reach, and rank 0 hosts either
one, so it dies with the rank that fails most often. The agreement needs none of that and answers
at once instead of at the timeout, for one all-reduce of three numbers and one host read per
window (about 0.2 ms on two gloo ranks on one host; ``benchmarks/fault_checks.py`` measures it).

Where ranks cannot agree, the others fail at the process-group timeout, or as soon as the failed
process exits, with :class:`~gradaccum.distributed.dist.CollectiveError`:

- a failure inside the synchronizing backward, the optimizer step, the scheduler or a hook;
- FSDP and FSDP2, whose forwards all-gather parameters: a rank that stops mid-window leaves the
  others inside a forward, so it raises at once rather than waiting for them at a later point;
- ``defer_sync=False`` with a failure in a backward (every backward synchronizes).

DDP with module buffers and ``broadcast_buffers=True`` broadcasts them in the first forward after
a synchronizing one; a forward that raised midway leaves that bookkeeping different across ranks.
The next window's counts all-reduce detects it and refuses the window on every rank
(:func:`check_buffer_broadcasts`) instead of letting the broadcast cross another collective.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.nn as nn

from gradaccum.distributed import dist
from gradaccum.errors import (
    ConfigMismatchError,
    RankFailedError,
    RankFailure,
    SyncError,
    UnusedParameterError,
    WindowOutOfMemoryError,
)
from gradaccum.step.norms import local_grads_finite, local_part

__all__ = [
    "LocalFailure",
    "RankFailedError",
    "RankFailure",
    "UnusedParameterError",
    "WindowOutOfMemoryError",
    "agree_before_backward",
    "back_off_scaler",
    "check_buffer_broadcasts",
    "fingerprint",
    "fingerprints_agree",
    "is_oom",
    "raise_agreed",
    "raise_alone",
    "raise_from_sync_backward",
    "raise_mismatch",
    "raise_unreached",
    "rank_settings",
    "settings_fingerprint",
    "unreached_parameters",
]

_MESSAGE_CHARS = 400
"""Longest error text carried per failing rank (CUDA OOM messages run to several lines)."""


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an accelerator out-of-memory error (``torch.OutOfMemoryError``)."""
    return isinstance(exc, torch.cuda.OutOfMemoryError)


@dataclass(frozen=True, slots=True)
class LocalFailure:
    """This rank's exception, held until the next agreement point."""

    error: Exception
    phase: str
    micro_batch: int | None

    @property
    def oom(self) -> bool:
        return is_oom(self.error)

    def report(self, rank: int) -> RankFailure:
        text = str(self.error).strip().replace("\n", " ")
        if len(text) > _MESSAGE_CHARS:
            text = text[: _MESSAGE_CHARS - 3] + "..."
        return RankFailure(
            rank=rank,
            phase=self.phase,
            micro_batch=self.micro_batch,
            error_type=type(self.error).__name__,
            message=text,
            oom=self.oom,
        )


def raise_agreed(local: LocalFailure | None, failed: int, oom: int, group: Any) -> NoReturn:
    """Raise on every rank after an agreement point counted ``failed`` failing ranks (``oom`` of them OOM).

    Every rank calls this together (they all read the same reduced counts), so the extra gather
    that collects the failing ranks' reports is matched on every rank.
    """
    me = dist.rank(group)
    reports = dist.all_gather_objects(
        None if local is None else local.report(me), group, what="the failing ranks' reports"
    )
    failures = [r for r in reports if r is not None]
    text = "; ".join(f.describe() for f in failures)
    if oom == failed:
        # No chained cause: the failed attempt's traceback holds its activations, and a retry needs
        # that memory back as soon as the caller leaves its except block.
        raise WindowOutOfMemoryError(
            f"out of memory in this window ({text}). Every rank discarded the window's gradients and "
            "applied no update; retry the same examples with smaller micro-batches "
            "(gradaccum.step.adaptive.step_adaptive does).",
            failures,
        ) from None
    if local is not None and not local.oom:
        raise local.error
    error = RankFailedError(
        f"{text}. Rank {me} stopped with it: every rank cleared the window's gradients before the "
        "synchronizing backward and applied no update. The failing rank's traceback shows the cause.",
        failures,
    )
    if local is not None:
        raise error from local.error
    raise error


def raise_alone(local: LocalFailure, *, recoverable: bool) -> NoReturn:
    """Raise a failure that no other rank waits for: one process, or ranks that cannot agree.

    ``recoverable``: no other rank depends on this one (a single process), so an out-of-memory
    error may be retried and becomes :class:`WindowOutOfMemoryError`.
    """
    if dist.looks_like_comm_failure(local.error):
        raise dist.collective_failed(f"the {local.phase} of micro-batch {local.micro_batch}", local.error)
    if recoverable and local.oom:
        raise WindowOutOfMemoryError(
            f"out of memory in this window ({local.report(0).describe()}); the window's gradients "
            "were discarded and no update applied. Retry with smaller micro-batches.",
            [local.report(0)],
        ) from None
    raise local.error


def agree_before_backward(
    failure: LocalFailure | None,
    contribution: torch.Tensor | None,
    index: int,
    kind: str,
    *,
    check_parameters: Sequence[tuple[str, torch.Tensor]],
    group: Any,
    tally: torch.Tensor,
    resynchronizing: bool = False,
) -> list[float] | None:
    """The agreement point before a synchronizing backward: returns on every rank, or raises on all.

    ``failure`` is this rank's exception in the window so far (it arrives here from the micro-batch
    it failed in); ``contribution`` the tensor about to be backpropagated. ``check_parameters``
    (named; DDP without ``find_unused_parameters``): each rank also checks that its backward
    reaches every one of them, since DDP would otherwise wait for their gradients. ``tally`` (a
    1-d float64 tensor: the window's summed loss so far, the replay rejections) travels in the same
    all-reduce, so the window's global loss costs no collective of its own.
    ``resynchronizing``: this is the synchronizing first micro-batch after an agreed failure.

    Returns the tally summed over ranks, as host floats, after a DDP agreement; ``None`` where no
    rank can be met (one process, FSDP): the caller reduces the tally itself.
    """
    if failure is not None and dist.looks_like_comm_failure(failure.error):
        raise_alone(failure, recoverable=False)  # a peer is gone: agreeing would wait for the timeout
    distributed = dist.is_distributed(group)
    if not distributed or kind != "ddp":
        # One process: nobody waits. FSDP/FSDP2: the others may be inside a forward's parameter
        # all-gather, which no agreement can reach; they fail at the process-group timeout.
        if failure is not None:
            raise_alone(failure, recoverable=not distributed)
        return None
    missed: list[str] = []
    if failure is None and contribution is not None and check_parameters:
        unreached = unreached_parameters(contribution, [p for _, p in check_parameters])
        missed = [check_parameters[j][0] for j in unreached]
    flags = torch.tensor(
        [failure is not None, failure is not None and failure.oom, bool(missed)],
        dtype=torch.float64,
        device=tally.device,
    )
    payload = torch.cat([flags, tally.detach().to(torch.float64).reshape(-1)])
    dist.all_reduce_sum_(payload, group, what=f"the failure flags before micro-batch {index}'s backward")
    values = payload.tolist()
    failed, oom, missing = (int(v) for v in values[:3])
    if failed:
        raise_agreed(failure, failed, oom, group)
    if missing:
        raise_unreached(missed, index, group, resynchronizing=resynchronizing)
    return values[3:]


def check_buffer_broadcasts(broadcasting: int, world: int) -> None:
    """Refuse a window whose first forward would broadcast DDP module buffers on only some ranks.

    DDP broadcasts buffers in the first forward after a synchronizing one. A forward that raised
    midway on some rank leaves that bookkeeping different across ranks, and the next forward's
    broadcast would meet another collective (gloo aborts the process on the size mismatch).
    ``broadcasting`` is the number of ranks about to broadcast, summed with the window's counts.
    """
    if 0 < broadcasting < world:
        raise SyncError(
            f"{broadcasting} of {world} ranks would broadcast DistributedDataParallel's module buffers "
            "in this window's first forward and the others would not: a forward through the wrapper "
            "failed midway on some rank in an earlier window (see the error raised there), or ran on "
            "some ranks only (run one-rank evaluation through .module). DDP's buffer bookkeeping is "
            "out of step, so this wrapper cannot run another forward safely. Rebuild it from its "
            ".module, or build it with broadcast_buffers=False (constant buffers such as masks need "
            "no broadcast; BatchNorm statistics then stay per rank)."
        )


def raise_from_sync_backward(exc: Exception, index: int, group: Any) -> NoReturn:
    """A synchronizing backward failed: past the agreement point, so no other rank can be told."""
    if not dist.is_distributed(group):
        raise_alone(LocalFailure(exc, "backward", index), recoverable=True)
    if dist.looks_like_comm_failure(exc):
        raise dist.collective_failed(f"gradients in micro-batch {index}'s synchronizing backward", exc, group)
    raise exc


def back_off_scaler(scaler: Any, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
    """Make a GradScaler skip and back off exactly as on the ranks that saw the overflow.

    The scaler only sees this rank's gradients. When another rank (or a non-finite loss with
    finite gradients) caused the skip, one gradient element is set to inf so that the scaler's
    own unscale/step/update path runs: it skips the step and backs the scale off once, and the
    scale stays identical on every rank.
    """
    if scaler is None:
        return
    if local_grads_finite(params):
        for p in params:
            local = local_part(p.grad)
            if local is not None and local.numel():
                local.view(-1)[0] = float("inf")
                break
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()


def _graph_leaves(output: torch.Tensor) -> Iterator[torch.Tensor]:
    """The leaf tensors that ``output``'s autograd graph accumulates gradients into."""
    if output.grad_fn is None:
        return
    stack = [output.grad_fn]
    seen = {output.grad_fn}
    while stack:
        node = stack.pop()
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None:
            yield variable
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)


def unreached_parameters(output: torch.Tensor, params: Sequence[torch.Tensor]) -> list[int]:
    """Indices of ``params`` that backpropagating ``output`` would give no gradient.

    The same graph walk DDP's ``find_unused_parameters=True`` does, once per synchronizing backward;
    it stops as soon as every parameter has been reached.
    """
    waiting = {id(p): i for i, p in enumerate(params)}
    for leaf in _graph_leaves(output):
        waiting.pop(id(leaf), None)
        if not waiting:
            break
    return sorted(waiting.values())


def raise_unreached(names: list[str], index: int, group: Any, *, resynchronizing: bool = False) -> NoReturn:
    """Every rank: name the trainable parameters each rank's synchronizing backward would miss."""
    everyone = dist.all_gather_objects(names, group, what="the parameters each rank's backward misses")
    lines = [
        f"  rank {r}: {', '.join(n[:6]) + (' ...' if len(n) > 6 else '') or '(none)'} ({len(n)} missed)"
        for r, n in enumerate(everyone)
    ]
    why = (
        " (it synchronizes because the previous window stopped after DDP had prepared its "
        "reduction, and only a synchronizing forward on every rank resets that)"
        if resynchronizing
        else ""
    )
    raise UnusedParameterError(
        "DistributedDataParallel was built with find_unused_parameters=False, but the backward of "
        f"micro-batch {index}{why}, which synchronizes, does not reach these trainable parameters:\n"
        + "\n".join(lines)
        + "\nDDP would wait for their gradients (a hang) or step on gradients it never averaged. "
        "No gradient was exchanged and no update applied. Build DDP with find_unused_parameters=True "
        "(parameters used by only some micro-batches are then averaged correctly), or freeze "
        "parameters that never train (requires_grad=False) before wrapping the model in DDP."
    )


def _shape_table(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    return [
        (name, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in model.named_parameters()
    ]


FINGERPRINT_SLOTS = 6
"""Values the configuration fingerprint adds to the window's counts all-reduce."""
_CHUNK_BITS = 16


def rank_settings(settings: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """What every rank must have in common: the accumulator's settings and the model's parameters."""
    table = _shape_table(model)
    mine = dict(settings)
    mine["parameters"] = len(table)
    mine["parameter elements"] = sum(p.numel() for p in model.parameters())
    mine["parameter shapes"] = hashlib.sha1(repr(table).encode()).hexdigest()[:12]
    return mine


def settings_fingerprint(
    config: Any,
    kind: str,
    scaler: Any,
    model: nn.Module,
    *,
    distributed: bool,
    same_model: bool,
    balance: str | None = None,
) -> tuple[dict[str, Any], list[float]]:
    """The settings every rank must share (with the model's parameter table where the ranks hold
    the same model; a pipeline's stages do not; ``balance``: an MoE load balance's description),
    and their :func:`fingerprint` under
    torch.distributed (empty on one process)."""
    settings: dict[str, Any] = dataclasses.asdict(config)
    settings["sync"] = kind
    settings["scaler"] = type(scaler).__name__ if scaler is not None else None
    # a load balance adds a vector of its own size to the counts all-reduce: ranks must agree on it
    # before that vector's length could make the all-reduce itself fail
    settings["balance"] = balance
    if distributed and same_model:
        settings = rank_settings(settings, model)
    return settings, fingerprint(settings) if distributed else []


def fingerprint(mine: dict[str, Any]) -> list[float]:
    """Three 16-bit chunks of a digest of ``mine`` and their squares, to be summed over ranks.

    After the sum, every rank holds the same chunk c on all W ranks iff W * sum(c^2) == sum(c)^2
    (equality in Cauchy-Schwarz); exact in float64 for W < 2**21. So the check rides in the
    counts all-reduce that every window has anyway, instead of a gather of its own. Two different
    configurations agree by chance with probability 2**-48.
    """
    digest = int(hashlib.sha1(repr(sorted(mine.items())).encode()).hexdigest(), 16)
    mask = (1 << _CHUNK_BITS) - 1
    chunks = [float((digest >> (_CHUNK_BITS * i)) & mask) for i in range(FINGERPRINT_SLOTS // 2)]
    return chunks + [c * c for c in chunks]


def fingerprints_agree(summed: Sequence[float], world: int) -> bool:
    """Whether the summed :func:`fingerprint` values say every rank holds the same fingerprint."""
    half = FINGERPRINT_SLOTS // 2
    return all(world * summed[half + i] == summed[i] * summed[i] for i in range(half))


def raise_mismatch(mine: dict[str, Any], model: nn.Module, group: Any) -> NoReturn:
    """Every rank, after the fingerprints disagreed: gather what each rank has, name the difference.

    One all-gather of a few values per rank; a second one, of every parameter's name, shape and
    dtype, only when the parameter digests differ, to say where.
    """
    everyone = dist.all_gather_objects(mine, group, what="the rank configuration fingerprint")
    differing = [key for key in mine if len({repr(r.get(key)) for r in everyone}) > 1]
    lines = [
        f"  {key}: " + ", ".join(f"rank {r}={v.get(key)!r}" for r, v in enumerate(everyone))
        for key in differing
    ]
    if "parameter shapes" in differing:
        tables = dist.all_gather_objects(_shape_table(model), group, what="the parameter shapes")
        lines.append("  " + _first_difference(tables))
    raise ConfigMismatchError(
        "data-parallel ranks disagree before the first step; no gradient was exchanged:\n"
        + "\n".join(lines or ["  (the settings differ in a way the summary does not show)"])
        + "\nEvery rank must build the same model and the same Accumulator settings."
    )


def _first_difference(tables: list[list[tuple[str, tuple[int, ...], str]]]) -> str:
    longest = max(len(t) for t in tables)
    for i in range(longest):
        entries = [t[i] if i < len(t) else None for t in tables]
        if len({repr(e) for e in entries}) > 1:
            shown = ", ".join(
                f"rank {r}=" + ("(none)" if e is None else f"{e[0]} {e[1]} {e[2]}")
                for r, e in enumerate(entries)
            )
            return f"first differing parameter is #{i}: {shown}"
    return "the parameter lists differ"  # pragma: no cover - digests differ only if a table does
