"""What ``count_fn`` and ``loss_fn`` must return, and which windows ranks can step together, checked
with a message that says what arrived and what to do instead.

The checks run on every micro-batch of every step, so the happy path is a few ``isinstance`` tests;
messages are built only when a check fails.
"""

from __future__ import annotations

import torch

from gradaccum.distributed import comm
from gradaccum.errors import CountError, LossError, TooManySkipsError, WindowError

__all__ = [
    "as_count",
    "check_loss",
    "check_not_empty",
    "check_skips",
    "check_window_shapes",
    "counts_on_host",
    "sum_counts",
    "unmean",
]

_INTEGER_DTYPES = frozenset(
    d for d in vars(torch).values() if isinstance(d, torch.dtype) and not d.is_floating_point
) - {torch.bool, torch.complex32, torch.complex64, torch.complex128}
"""The tensor dtypes a count may have: one set lookup per micro-batch instead of three tests."""


def as_count(value: object, index: int) -> int | torch.Tensor:
    """Validate one ``count_fn`` result: a non-negative int, or a one-element integer tensor.

    A tensor's sign is not read here (that would cost a device sync per micro-batch); the step
    reduces the smallest count with the window's other numbers and refuses a negative one there.
    """
    if isinstance(value, torch.Tensor):
        if value.dtype in _INTEGER_DTYPES and value.numel() == 1:
            return value
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise CountError(_count_problem(value, index))


def _count_problem(value: object, index: int) -> str:
    # built only on failure: formatting a tensor costs more than the whole check
    where = f"count_fn returned {value!r} for micro-batch {index}"
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return f"{where}: a count must be a single number, got shape {tuple(value.shape)}"
        return f"{where}: a count must be an integer tensor, got dtype {value.dtype}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{where}: a count cannot be negative"
    return (
        f"{where}: a count must be a non-negative int or integer tensor "
        f"(valid tokens or examples), got {type(value).__name__}"
    )


def check_loss(loss: object, index: int) -> torch.Tensor:
    """Validate one ``loss_fn`` result: a scalar tensor that can be backpropagated."""
    if isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.requires_grad:
        return loss  # the path every micro-batch takes: one test
    if not isinstance(loss, torch.Tensor):
        raise LossError(
            f"loss_fn returned {type(loss).__name__} for micro-batch {index}; it must return a Tensor"
        )
    if loss.ndim != 0:
        raise LossError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)} for micro-batch {index}; it must "
            "return a scalar: the loss summed over the counted units (reduction='sum')"
        )
    raise LossError(  # what is left: a scalar tensor that does not require grad
        f"loss_fn returned a scalar that does not require grad for micro-batch {index}; was it "
        "computed under torch.no_grad() or detached?"
    )


def unmean(loss: torch.Tensor, count: int | torch.Tensor, index: int) -> torch.Tensor:
    """``loss_reduction="mean"``: the mean over n_j units times n_j is the sum.

    A mean over zero units has no defined gradient (0/0), so refuse it rather than backpropagate
    a NaN.
    """
    n = int(count)
    if n == 0:
        raise CountError(
            f"micro-batch {index} counts zero units, and loss_reduction='mean' cannot express its "
            "zero contribution (a mean over nothing is NaN). Return summed losses "
            "(loss_reduction='sum'), which handle all-padding micro-batches exactly."
        )
    return loss * n


def check_not_empty(micro_batches: int) -> None:
    """One process: a window must hold a micro-batch (under torch.distributed the ranks refuse
    empty windows together, in the counts all-reduce)."""
    if not micro_batches:
        raise WindowError("the window is empty: step needs at least one micro-batch")


def check_window_shapes(
    world: int, k: int, empty_ranks: int, k_sum: int, k_sq: int, *, defer_sync: bool, kind: str
) -> None:
    """Refuse, on every rank alike, windows whose micro-batch counts would hang the ranks.

    ``empty_ranks``, ``k_sum`` and ``k_sq`` are summed over ranks, so every rank decides the same;
    all ranks hold the same k iff W * sum(k^2) == sum(k)^2.
    """
    if empty_ranks:
        raise WindowError(
            f"{empty_ranks} of {world} data-parallel ranks have an empty window (no "
            f"micro-batches) and this rank has {k}: every rank must run at least one "
            "micro-batch, or the synchronizing backward would hang. Give each rank at least one "
            "micro-batch (an all-padding one contributes zero)."
        )
    fsdp = kind in ("fsdp", "fsdp2")
    if world * k_sq != k_sum * k_sum and (not defer_sync or fsdp):
        why = (
            f"{kind} gathers parameters in every forward"
            if fsdp
            else "defer_sync=False synchronizes on every backward"
        )
        raise WindowError(
            f"ranks hold different numbers of micro-batches ({k_sum} in all over {world} ranks, "
            f"{k} here) and {why}, so the ranks would wait on each other forever. Give every rank "
            "the same number of micro-batches (uneven token counts are fine)"
            + ("." if kind != "ddp" else ", or keep defer_sync=True.")
        )


def sum_counts(
    counts: list[int | torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's count (float64 on ``device``) and the smallest tensor count (or None; in the
    counts' own integer dtype), read nowhere: the step reduces both with the window's figures."""
    device_counts = [c for c in counts if not isinstance(c, int)]
    host_counts = 0 if len(device_counts) == len(counts) else sum(c for c in counts if isinstance(c, int))
    if not device_counts:
        return torch.full((), float(host_counts), dtype=torch.float64, device=device), None  # 3 us < tensor()
    stacked = torch.stack(device_counts)
    if stacked.device != device:
        stacked = stacked.to(device=device, non_blocking=True)
    total = stacked.sum(dtype=torch.float64)  # exact below 2**53, as the counts are integers
    return (total + host_counts if host_counts else total), stacked.min()


def counts_on_host(counts: list[int | torch.Tensor]) -> int | None:
    """The window's count when every count is an int or a CPU tensor (reading a CPU tensor waits
    for no device), else ``None``; a negative count is refused here, before any forward.

    One stack and one read for the tensors, instead of the device sum, smallest and W/N a device's
    counts take (:func:`sum_counts`): four small ops a window fewer.
    """
    tensors = [c for c in counts if isinstance(c, torch.Tensor)]
    # as_count refused negative ints
    ints = 0 if len(tensors) == len(counts) else sum([c for c in counts if isinstance(c, int)])
    if not tensors:
        return ints
    if not tensors[0].is_cpu:
        return None
    stacked = torch.stack(tensors)  # one device (stack refuses two); as_count: one element each
    read = comm.read_cpu(stacked if stacked.ndim == 1 else stacked.flatten())
    if min(read) < 0:
        raise CountError("count_fn returned a negative count; no update was applied")
    return sum(read) + ints


def check_skips(consecutive: int, limit: int | None, reason: str) -> None:
    """Stop a run whose updates keep being skipped (``max_consecutive_skips``): a diverging run
    would otherwise go on without ever stepping."""
    if limit is not None and consecutive > limit:
        raise TooManySkipsError(
            f"{consecutive} consecutive updates were skipped (limit "
            f"max_consecutive_skips={limit}); last reason: {reason}. Check the data for windows "
            "without valid units, the loss for overflow, or lower the learning rate."
        )
