"""Post-scaling (``AccumConfig(scaling="post")``): the window streamed, the count on the device.

Pre-scaling must know N before the first backward, so it holds the whole window. Post-scaling
uses the same algebra in the other order: each micro-batch backpropagates its summed loss times a
fixed constant c, so after the window the gradient is c * sum_j grad(sum_{t in B_j} l_t), and one
multiplication by F/(N c) (F: what the model's reductions divide by, W under DDP) gives exactly
pre-scaling's F/N * sum_j grad(...). The micro-batches are consumed one at a time, so the step
never holds more than the one it runs and (to know which is the last) the one after it, none when
the window's length is declared (``len(window)``, or ``step(..., length=k)``).

**The constant c.** Summed losses grow with the tokens; backpropagated as they are, fp16
activations would overflow (and a GradScaler back off) more often than under pre-scaling, whose
backward sees F/N times them. c = 2**-round(log2(N'/F)), with N' the previous window's N (agreed
by every rank), makes the backward see what pre-scaling's sees within a
factor of sqrt(2) while windows count alike (a list window on one process is counted before its
first backward, and N' is its own N); and a power of two multiplies every float exactly, so
c and 1/c cost no rounding: the only rounding post-scaling adds is the one multiplication by
F/(N c). c must be the same on every rank (the gradient reduction sums c * g over ranks, which no
later factor could undo per rank), so a rank's own counts cannot choose it. Before the first window
has been counted, one process takes k n_1 for N' (n_1: the first micro-batch's count, on the
device before its forward; k: the declared length, else 1); under torch.distributed c = 1 for
that one window (a GradScaler may back off once more there than under pre-scaling).

**Where c lives.** N' is on the host wherever the step read N there anyway: in the verdict's one
read (one process), in the ranks' meeting (torch.distributed), or from int counts. c is then a
Python float (:func:`host_post_constant`) whose tensor the step keeps from window to window, and
W/(N c) costs one device op fewer; only the decision on the device (below), which reads nothing,
keeps N' and c on the device, where they cost five small ops a window.

**The decision on the device.** With an optimizer whose step reads a ``found_inf`` tensor (torch's
fused Adam, AdamW, SGD and Adagrad, on CPU too), the skip on a non-finite loss or gradient (or a
zero-count window) is a device flag handed to the optimizer, and the step's code reads nothing on
the host: :class:`DeviceStepResult` reads its figures when asked.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from gradaccum.errors import CountError, WindowError
from gradaccum.step.config import StepResult

__all__ = [
    "DeviceStepResult",
    "declared_length",
    "host_post_constant",
    "post_constant",
    "reads_found_inf",
    "with_last",
]

_FOUND_INF_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad")


def declared_length(window: Iterable[Any], length: int | None) -> int | None:
    """The window's number of micro-batches when known without reading it: ``length`` as the
    caller declared it, else ``len(window)`` for a sequence; ``None`` for an iterator."""
    if length is not None:
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise WindowError(f"length must be a positive int (the window's micro-batches), got {length!r}")
        return length
    return len(window) if isinstance(window, Sequence) else None


def with_last(window: Iterable[Any], length: int | None) -> Iterator[tuple[int, Any, bool]]:
    """(index, micro-batch, is_last), pulling each micro-batch when it is needed: one ahead of the
    one running when ``length`` is None, else exactly ``length`` (an iterator shared by several
    windows is left where the window ends)."""
    if isinstance(window, Sequence) and length == len(window):  # a list: nothing to read ahead
        last = length - 1
        return ((i, mb, i == last) for i, mb in enumerate(window))
    return _pulled(window, length)


def _pulled(window: Iterable[Any], length: int | None) -> Iterator[tuple[int, Any, bool]]:
    it = iter(window)
    if length is not None:
        for i in range(length):
            try:
                item = (i, next(it), i == length - 1)
            except StopIteration:
                raise WindowError(
                    f"the window was declared to hold {length} micro-batches but ended after {i}; "
                    "pass the length it has, or none (the step then reads one micro-batch ahead)"
                ) from None
            yield item
            del item  # the caller is done with it: hold nothing while the next one is read
        return
    try:
        current = next(it)
    except StopIteration:
        return
    i = 0
    for upcoming in it:
        yield i, current, False
        current, i = upcoming, i + 1
    yield i, current, True


def host_post_constant(units: float) -> float:
    """c = 2**-round(log2(N')) (N' at least 1) as a Python float: :func:`post_constant`'s value
    when N' is known on the host (one process, int counts), with no device op."""
    return 2.0 ** -round(math.log2(max(1.0, units)))


def post_constant(
    first_count: int | torch.Tensor,
    length: int | None,
    device: torch.device,
    *,
    expected: torch.Tensor | None = None,
    distributed: bool = False,
) -> torch.Tensor:
    """c = 2**-round(log2(N')) (N' at least 1), float64 on ``device``: N' = ``expected`` (the
    previous window's N/F) when known, else k n_1 on one process, else c = 1; see the module doc."""
    if expected is not None:
        return torch.exp2(-torch.round(torch.log2(expected.clamp(min=1))))
    if distributed:
        return torch.ones((), dtype=torch.float64, device=device)
    k = 1 if length is None else length
    if isinstance(first_count, int):
        return torch.tensor(host_post_constant(k * first_count), dtype=torch.float64, device=device)
    units = first_count.to(device=device, dtype=torch.float64, non_blocking=True).reshape(()) * k
    return torch.exp2(-torch.round(torch.log2(units.clamp(min=1))))


def reads_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` skips itself on a device ``found_inf`` flag: torch's fused
    Adam/AdamW/SGD/Adagrad (``fused=True``), which GradScaler drives the same way."""
    fused = bool(optimizer.defaults.get("fused"))
    return (
        fused
        and any(type(optimizer).__name__ == name for name in _FOUND_INF_OPTIMIZERS)
        and (type(optimizer).__module__.startswith("torch.optim"))
    )


class DeviceStepResult(StepResult):
    """A :class:`StepResult` whose figures are still on the device: the first field read copies
    them to the host in one read (a synchronization point), later reads are free.

    ``values`` are 0-dim tensors ``(summed loss, N, local count, applied, applied so far, norm or
    None, negative)``, stacked only when read (an update builds nothing it does not need).
    """

    __slots__ = ("_host", "_step_base", "_values", "_wants_norm")
    _host: list[float] | None
    _step_base: int
    _values: Sequence[torch.Tensor | None]
    _wants_norm: bool

    def __init__(
        self,
        values: Sequence[torch.Tensor | None],
        *,
        micro_batches: int,
        step_base: int,
        wants_norm: bool,
        recompiles: int = 0,
    ) -> None:
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_host", None)
        object.__setattr__(self, "_step_base", step_base)
        object.__setattr__(self, "_wants_norm", wants_norm)
        object.__setattr__(self, "micro_batches", micro_batches)
        object.__setattr__(self, "recompiles", recompiles)

    def resolved(self) -> StepResult:
        """A plain :class:`StepResult` with the figures read (what a copy or a pickle holds)."""
        return StepResult(
            loss=self.loss,
            local_count=self.local_count,
            global_count=self.global_count,
            micro_batches=self.micro_batches,
            grad_norm=self.grad_norm,
            applied=self.applied,
            skip_reason=self.skip_reason,
            step=self.step,
            recompiles=self.recompiles,
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.resolved().__reduce_ex__(protocol)

    def _read(self) -> list[float]:
        host: list[float] | None = object.__getattribute__(self, "_host")
        if host is None:
            first = next(v for v in self._values if v is not None)
            missing = torch.full((), math.nan, dtype=torch.float64, device=first.device)
            parts = [missing if v is None else v.to(torch.float64).reshape(()) for v in self._values]
            host = torch.stack(parts).tolist()
            object.__setattr__(self, "_host", host)
            if host[6]:
                raise CountError("count_fn returned a negative count; no update was applied")
        return host

    @property
    def loss(self) -> float | None:
        total, n = self._read()[:2]
        return total / n if n else None

    @property
    def global_count(self) -> int:
        return int(self._read()[1])

    @property
    def local_count(self) -> int:
        return int(self._read()[2])

    @property
    def applied(self) -> bool:
        return bool(self._read()[3])

    @property
    def step(self) -> int:
        return self._step_base + int(self._read()[4])

    @property
    def grad_norm(self) -> float | None:
        return self._read()[5] if self._wants_norm and self.applied else None

    @property
    def skip_reason(self) -> str | None:
        if self.applied:
            return None
        host = self._read()
        if not host[1]:
            return "the window holds zero valid units on every rank"
        return f"non-finite loss or gradient (loss {host[0]}, gradient norm or flag {host[5]})"
