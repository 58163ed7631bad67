"""What flows between the window engine's phases: the counts, each micro-batch's contribution,
what the loop leaves for the optimizer step, and the figures the ranks reduce together.

Kept apart from :mod:`gradaccum.step.engine` so that the phases (pre-scaling's in the engine,
post-scaling's in :mod:`gradaccum.step.post_scaling`, gradient caching's and the pipeline's in
their own folders) share one vocabulary without importing each other. What is built every window
(:class:`WindowCount`, :class:`Accumulated`, :class:`WindowTotals`) is a slotted dataclass that
nothing changes once built, not a frozen one: a frozen dataclass's ``__init__`` sets each field
through ``object.__setattr__``, ~2-3 us more per object on the cache a window's backwards leave cold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

__all__ = [
    "ZERO_COUNT",
    "Accumulated",
    "Backward",
    "CastScale",
    "Contribute",
    "Contribution",
    "CountFn",
    "CountTotals",
    "Observer",
    "StreamContribute",
    "WindowCount",
    "WindowTotals",
]

CountFn = Callable[[Any], "int | torch.Tensor"]
"""``count_fn(micro_batch)``: how many units ``loss_fn`` sums over (valid tokens, examples)."""
Observer = Callable[[str, int], None]
"""Called with (event, micro-batch index) at phase boundaries; used by the benchmarks' timers."""
Backward = Callable[[torch.Tensor], None]
"""``backward(tensor)``: backpropagate one micro-batch's scaled loss. ``Tensor.backward`` by
default; a framework whose backward must run its own hooks passes its own (Lightning's
``LightningModule.manual_backward``)."""

ZERO_COUNT = "the window holds zero valid units on every rank"


@dataclass(slots=True)
class WindowCount:
    """The counts of one window: per micro-batch, this rank's, and all ranks' (the N of W/N)."""

    counts: list[int | torch.Tensor]
    """``count_fn`` of each micro-batch, as returned (ints or 0-dim integer tensors)."""
    local_count: torch.Tensor
    """This rank's units, float64 on the model's device."""
    global_count: torch.Tensor
    """Every rank's units, float64 on the model's device: the N of W/N."""
    global_host: int | None
    """N on the host: known before the first backward under torch.distributed, and on one
    process when every count was an int; else None."""
    min_count: torch.Tensor | None
    """The smallest tensor count (a negative one is refused where the step reads the device)."""
    world: int
    """Ranks that met in the counts all-reduce (1 on one process)."""
    factor: float
    """The W of W/N: what the model's gradient reductions divide by (1 for a plain module; see
    :func:`gradaccum.mesh.reduction.averaging_factor`)."""
    post: torch.Tensor | float | None = None
    """Post-scaling's constant c (0-dim float64, or a Python float when it was known on the host):
    the backward ran on c * summed loss, and the gradients still need W/(N c)
    (:mod:`gradaccum.step.stream`); ``None`` under pre-scaling."""

    @property
    def empty(self) -> bool:
        """Zero units on every rank, known on the host without reading the device."""
        if self.global_host is not None:
            return self.global_host == 0
        return all(isinstance(c, int) for c in self.counts) and not any(self.counts)

    def scale(self) -> torch.Tensor:
        """W / N (N at least 1): what each micro-batch's summed loss is multiplied by."""
        inverse = torch.reciprocal(self.global_count.clamp(min=1))
        return inverse if self.factor == 1 else inverse.mul_(self.factor)

    def host_scale(self) -> float | None:
        """:meth:`scale` as a Python float when N is known on the host (one process, int counts):
        the same float64 operations, so the same bits, and no device op; else ``None``."""
        if self.global_host is None:
            return None
        inverse = 1.0 / max(self.global_host, 1)
        return inverse if self.factor == 1 else inverse * self.factor

    def post_factor(self) -> torch.Tensor | float | None:
        """Post-scaling's W/(N c): what turns the gradients its backwards left into pre-scaling's;
        a Python float when N and c are both on the host (the same float64 operations as
        :meth:`scale`'s, so the same bits); ``None`` under pre-scaling."""
        if self.post is None:
            return None
        if isinstance(self.post, float):
            if self.global_host is not None:
                inverse = 1.0 / max(self.global_host, 1)
                return (inverse if self.factor == 1 else inverse * self.factor) / self.post
            # (1/N) * (W/c) is (1/N * W) / c to the bit: c is a power of two; one device op fewer
            return torch.reciprocal(self.global_count.clamp(min=1)).mul_(self.factor / self.post)
        return self.scale() / self.post


class CastScale:
    """W/N, computed in float64 once per window, cast once to each dtype a loss has (a window's
    losses usually share one): a float64 model multiplies by the full-precision scale.

    ``scale`` may be a Python float (:meth:`WindowCount.host_scale`); each dtype's 0-dim tensor is
    then filled from it on ``device``, rounded once from float64 as a tensor's cast rounds."""

    __slots__ = ("_casts", "_device", "_scale")

    def __init__(self, scale: torch.Tensor | float, device: torch.device | None = None) -> None:
        self._scale = scale
        self._device = device
        self._casts: dict[torch.dtype, torch.Tensor] = {}

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        cast = self._casts.get(dtype)
        return cast if cast is not None else self._cast(dtype)

    def _cast(self, dtype: torch.dtype) -> torch.Tensor:
        scale = self._scale
        if isinstance(scale, float):
            cast = torch.full((), scale, dtype=dtype, device=self._device)
        else:
            cast = scale.to(dtype)
        self._casts[dtype] = cast
        return cast


class Contribution(NamedTuple):
    """What one micro-batch hands the engine once its forward ran."""

    backprop: torch.Tensor
    """The scalar to backpropagate, already scaled by W/N (and by the GradScaler)."""
    loss: torch.Tensor | None = None
    """This micro-batch's summed loss, for the window's reported mean; ``None`` when the loss is
    the whole window's objective (gradient caching)."""
    rejected: torch.Tensor | None = None
    """0-dim; non-zero when this micro-batch must veto the update on every rank (a replay that did
    not reproduce its first pass)."""


Contribute = Callable[[int, Any], Contribution]
"""``contribute(index, micro_batch)``: run the forward of one micro-batch, return its contribution."""
StreamContribute = Callable[[int, Any, "int | torch.Tensor", "torch.Tensor | float"], Contribution]
"""``contribute(index, micro_batch, count, c)`` under post-scaling: the forward, backprop = c * sum."""


@dataclass(slots=True)
class Accumulated:
    """What the micro-batch loop leaves for :meth:`WindowEngine.conclude`."""

    loss: torch.Tensor | None
    """The window's summed loss (0-dim float64): global when the ranks met with it, else local;
    ``None`` while it is still the micro-batches' :attr:`losses`."""
    rejected: torch.Tensor
    """Micro-batches that vetoed the update (0-dim float64), global when ``loss_is_global``."""
    loss_is_global: bool
    """Whether the sums above already cover every rank."""
    micro_batches: int
    """Micro-batches in this rank's window."""
    losses: tuple[torch.Tensor, ...] = ()
    """Each micro-batch's summed loss, not yet added up (``loss`` is ``None``): one process reads
    them in the verdict's one stacked read and adds them on the host, two device ops fewer."""

    def loss_sum(self) -> torch.Tensor:
        """The window's summed loss, on the device (float64)."""
        if self.loss is not None:
            return self.loss
        return torch.stack(self.losses).sum(dtype=torch.float64)


@dataclass(frozen=True, slots=True)
class CountTotals:
    """The counts all-reduce, read on every rank: sums over the data-parallel ranks."""

    global_count: float
    """N: every rank's units."""
    empty_ranks: float
    """Ranks whose window holds no micro-batch."""
    negative_ranks: float
    """Ranks where ``count_fn`` returned a negative tensor count."""
    micro_batches: float
    """sum of k over ranks; with :attr:`micro_batches_squared`, all k are equal iff
    W * sum(k^2) == sum(k)^2."""
    micro_batches_squared: float
    failed_ranks: float
    """Ranks that failed while reading or counting their window."""
    oom_ranks: float
    """Of those, ranks whose failure was an out-of-memory error."""
    broadcasting_ranks: float
    """DDP ranks whose next forward broadcasts module buffers (all or none must)."""
    fingerprint: list[float]
    """The settings and model fingerprint (:func:`gradaccum.step.agreement.fingerprint`)."""
    missed_ranks: float = 0.0
    """Post-scaling under DDP: ranks whose synchronizing backward would miss a parameter."""


@dataclass(slots=True)
class WindowTotals:
    """The end-of-window summary, read once on every rank (the step's one host read on one process)."""

    loss: float
    """The window's summed loss over every rank (or the given objective)."""
    rejected: float
    """Micro-batches, over every rank, that vetoed the update."""
    gradient: float
    """The global pre-clip gradient norm, or the non-finite flag when no norm was computed."""
    global_count: float
    local_count: float
    smallest_count: float
    """The smallest tensor count (negative: refused); 0 when every count was an int."""
    noise: list[float] = field(default_factory=list)
    """[P, K, |grad|^2, sigma] with ``noise_scale=True`` (:mod:`gradaccum.step.noise`)."""
