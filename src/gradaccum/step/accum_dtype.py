"""Accumulate the gradients of bfloat16/float16 parameters in float32 (``AccumConfig.accum_dtype``).

A bf16 ``.grad`` rounds every micro-batch's sum to 8 significant bits: after k micro-batches the
accumulated gradient carries up to k roundings of a growing sum, and its error grows with k (a GPT-2
in bf16: 1.83x the k = 1 error at k = 64). Here the sum is held in ``accum_dtype`` and rounded into
the parameter's dtype *once*, just before the optimizer step, so the error no longer depends on k.

The mechanism, per wrapper (torch 2.13):

- one process: ``param.grad_dtype = float32``. Autograd then casts each incoming bf16 gradient to
  float32 and adds it into a float32 ``.grad``; clipping, the non-finite check and a GradScaler's
  unscale read that sum. The fused, foreach and for-loop Adam/AdamW refuse a float32 gradient on a
  bf16 parameter (SGD takes it), so :meth:`WideGradients.narrow` rounds ``.grad`` into the
  parameter's dtype right before ``optimizer.step()``, and the optimizer sees what it always saw,
  rounded once.
- DDP: its reducer copies ``.grad`` into buckets of the parameter's dtype and refuses a float32
  ``.grad`` ("Expected BFloat16, got Float"). So before each synchronizing backward the float32
  sum is moved aside and that backward fills the bf16 bucket with the last micro-batch's gradient
  alone; a communication hook adds the float32 sum back, divides by the W ranks (as DDP's own
  reduction does) and all-reduces in float32: the ranks exchange the float32 *sum* (4 bytes per
  parameter instead of 2). After the backward ``.grad`` is the reduced float32 sum again, the same
  on every rank. A model with another communication hook is refused (DDP takes one hook). Under
  ``find_unused_parameters=True`` a parameter whose sum is set aside holds a zero ``.grad`` of its
  own dtype during that backward instead of none: DDP records the parameters a no-sync
  micro-batch used, and one that the synchronizing backward does not reach is marked ready with
  its ``.grad`` as it is; an undefined one there stops DDP ("a bug in DDP implementation") on that
  rank while the others wait in the all-reduce. The zero goes into the bucket, the hook adds the
  float32 sum to it (0 + g = g: the sum is the same bits), and a parameter the backward reaches
  accumulates into the zero exactly as into nothing.
- FSDP2 accumulates the unsharded gradient in ``MixedPrecisionPolicy.reduce_dtype`` when it differs
  from the compute dtype (``FSDPParam.to_accumulated_grad_if_needed``), reduce-scatters it in that
  dtype and rounds the shard once into the parameter's dtype. So FSDP2 needs no hook: the policy
  must say ``reduce_dtype=accum_dtype``, and without it ``accum_dtype`` is refused, naming it.
- FSDP1, a mesh without FSDP2, a pipeline: refused (their reductions and schedules hold gradients
  where a float32 ``.grad`` cannot reach unchanged).

Parameters already as wide as ``accum_dtype`` (float32 LayerNorms of a bf16 model) are left alone;
a parameter wider than it (float64) is refused: accumulating it in float32 would lose precision.

Only while a window is open. The engine arms the wide sums when a window's accumulation starts,
for the parameters trainable then (however ``loss_fn`` reaches them: ``model.body`` and
``model.head`` called apart get float32 sums as a call of ``model`` does; a layer unfrozen later
joins the next window), and every window ends by rounding ``.grad`` into the parameter's dtype and
giving each ``grad_dtype`` back. No hook on the model: between windows, and after the accumulator
is closed or dropped, the user's own backward accumulates as torch does. DDP's communication hook
cannot be unregistered (torch 2.13): it holds the accumulator weakly and is DDP's plain average
(all-reduce / W) outside an open window, and a later accumulator on the same model takes it over
once the earlier one is closed or dropped.
"""

# No ``from __future__ import annotations``: DDP reads the communication hook's annotations
# (``bucket: GradBucket``) at registration and refuses strings.
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed import GradBucket

from gradaccum.distributed import dist
from gradaccum.distributed.sync import sync_module
from gradaccum.errors import ConfigError
from gradaccum.precision import accum_dtype_name, accum_dtype_of, dtype_name

__all__ = ["WideGradients", "check_fsdp2_reduce_dtype", "wide_gradients"]


def _narrow(params: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The trainable floating parameters narrower than ``dtype``; refuses a wider one."""
    trainable = [p for p in params if p.requires_grad and p.is_floating_point()]
    wider = sorted({dtype_name(p.dtype) for p in trainable if p.dtype.itemsize > dtype.itemsize})
    if wider:
        raise ConfigError(
            f"AccumConfig.accum_dtype={dtype_name(dtype)!r} is narrower than the parameters' dtype "
            f"{', '.join(wider)}: their gradients would lose precision. Leave accum_dtype=None for a "
            f"{wider[0]} model (its gradients already accumulate in {wider[0]}), or use "
            f"accum_dtype='{wider[0]}'."
        )
    return [p for p in trainable if p.dtype.itemsize < dtype.itemsize]


def check_fsdp2_reduce_dtype(module: nn.Module, dtype: torch.dtype, policy: str) -> None:
    """Refuse FSDP2 parameter groups that would accumulate narrower than ``dtype``.

    FSDP2 has no public getter for the policy (torch 2.13): each FSDP module's state lists its
    parameter groups, each holding the ``mp_policy`` it was built with and its parameters.
    """
    for sub in module.modules():
        get_state = getattr(sub, "_get_fsdp_state", None)
        groups = getattr(get_state(), "_fsdp_param_groups", None) if callable(get_state) else None
        for group in groups or ():
            mp = group.mp_policy
            for fsdp_param in group.fsdp_params:
                stored = fsdp_param.sharded_param.dtype
                compute = mp.param_dtype or stored
                if compute.itemsize >= dtype.itemsize:
                    continue
                if mp.reduce_dtype != dtype:
                    raise ConfigError(
                        f"AccumConfig.accum_dtype={dtype_name(dtype)!r} under FSDP2 needs "
                        f"MixedPrecisionPolicy(reduce_dtype=torch.{dtype_name(dtype)}): this model computes "
                        f"gradients in {dtype_name(compute)} with reduce_dtype={mp.reduce_dtype}, so FSDP2 "
                        f"accumulates them in {dtype_name(compute)}. Build fully_shard(..., mp_policy="
                        f"MixedPrecisionPolicy(param_dtype=..., reduce_dtype=torch.{dtype_name(dtype)})); "
                        "FSDP2 then accumulates and reduce-scatters in that dtype."
                    )
                if policy != "defer" and stored.itemsize < dtype.itemsize:
                    raise ConfigError(
                        f"AccumConfig.accum_dtype={dtype_name(dtype)!r} with sync_policy={policy!r} under "
                        f"FSDP2: the gradient is reduce-scattered every micro-batch and the shards add up "
                        f"in the parameters' {dtype_name(stored)}. Use sync_policy='defer' (the unsharded "
                        "gradient accumulates in reduce_dtype), or keep float32 parameters."
                    )


class _HookState:
    """What DDP holds for the communication hook, for good (torch has no way to unregister one):
    the process group and the :class:`WideGradients` it serves, held weakly and replaceable."""

    __slots__ = ("__weakref__", "group", "owner")

    def __init__(self, group: Any) -> None:
        self.group = group
        self.owner: Callable[[], WideGradients | None] = lambda: None


_HOOKED: weakref.WeakKeyDictionary[nn.Module, _HookState] = weakref.WeakKeyDictionary()
"""The DDP modules that hold this module's hook: a later accumulator on the same model takes the
hook over from a closed or dropped one (DDP accepts ``register_comm_hook`` once)."""


def _wide_hook(state: _HookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook: the wide sums' reduction while a window of a live accumulator is
    open, else DDP's own average (all-reduce / W), so a model whose accumulator was closed or
    dropped reduces as if the hook were not there."""
    owner = state.owner()
    if owner is not None and owner.armed:
        return owner.reduce(state.group, bucket)
    buffer: torch.Tensor = bucket.buffer()
    buffer.div_(dist.world_size(state.group))
    return dist.all_reduce_sum_future(buffer, state.group).then(lambda fut: fut.value()[0])


def _hook_state(ddp: nn.Module) -> _HookState:
    """The hook's state on ``ddp``: registered here the first time, taken over afterwards."""
    state = _HOOKED.get(ddp)
    if state is not None:
        owner = state.owner()
        if owner is not None and not owner.closed:
            raise ConfigError(
                "AccumConfig.accum_dtype under DDP: another accumulator with accum_dtype still holds this "
                "model's communication hook (DDP takes one, for good). close() that accumulator (or "
                "build it in a with-block) before building this one, or step with that one."
            )
        return state
    state = _HookState(getattr(ddp, "process_group", None))
    try:
        ddp.register_comm_hook(state, _wide_hook)  # type: ignore[operator]
    except RuntimeError as exc:
        raise ConfigError(
            "AccumConfig.accum_dtype under DDP reduces the float32 sum with its own "
            f"communication hook, and DDP takes one: {exc}. Drop the model's hook "
            "(bf16/fp16 compression hooks round what accum_dtype keeps) or accum_dtype."
        ) from exc
    _HOOKED[ddp] = state
    return state


class WideGradients:
    """``accum_dtype`` for the parameters narrower than it (one process and DDP), one window at a time.

    The engine opens each window with :meth:`start` (a part of its window, beside the noise meter
    and BatchNorm's moments): the parameters trainable *then* (``requires_grad`` is read again every
    window, so a layer unfrozen later is widened too) receive their gradients in ``accum_dtype``.
    The window ends with :meth:`narrow` (the optimizer update, right before the optimizer step) or
    :meth:`discard` (a skip or a failure, from ``zero_grad``): ``.grad`` rounded once into the
    parameter's dtype and every ``grad_dtype`` set back to what it was. So nothing is left on the
    model between windows: a backward of the user's own between steps, or after the accumulator is
    closed or dropped, accumulates as torch does. Under DDP :meth:`around_sync` wraps the
    synchronizing backward and the communication hook reduces the wide sums.
    """

    def __init__(self, model: nn.Module | None, dtype: torch.dtype, ddp: nn.Module | None) -> None:
        self._model = model  # None: nothing to widen (unset, no narrower parameter, FSDP2's policy)
        self.dtype = dtype
        self._live: list[torch.Tensor] = []  # the parameters widened in the open window
        self._saved: list[torch.dtype | None] = []  # their grad_dtype before it
        self._managed: set[int] = set()  # ids of _live: what the communication hook reduces wide
        self._stashed: dict[int, torch.Tensor] = {}  # a parameter's float32 sum, set aside for a sync
        self._reduced: dict[int, torch.Tensor] = {}  # its reduced float32 sum, from the hook
        self._ddp = ddp is not None
        # DDP that finds unused parameters refuses an undefined .grad on a parameter a no-sync
        # micro-batch used, when the synchronizing backward does not reach it (see around_sync)
        self._zero_aside = bool(getattr(ddp, "find_unused_parameters", False))
        self.closed = False
        self.reduced_bytes = 0  # what the communication hook has all-reduced, payload bytes
        if ddp is not None:
            state = _hook_state(ddp)
            state.owner = weakref.ref(self)  # DDP keeps the state for good; it keeps this weakly

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters a window opened now would widen: trainable, floating, narrower than
        ``accum_dtype``. Refuses a trainable one wider than it (as construction does)."""
        if self._model is None or self.closed:
            return []
        return _narrow(list(self._model.parameters()), self.dtype)

    @property
    def active(self) -> bool:
        """Whether a window may widen anything (else the engine leaves this part out)."""
        return self._model is not None

    @property
    def armed(self) -> bool:
        """Whether a window is open with gradients arriving wide."""
        return bool(self._live)

    @property
    def buffer_bytes(self) -> int:
        """The bytes of the wide sums while a window accumulates (what replaces the narrow ``.grad``)."""
        return sum(p.numel() for p in self.params) * self.dtype.itemsize

    def start(self) -> None:
        """Open a window: gradients of the parameters trainable now arrive in ``accum_dtype`` (a
        gradient already there, such as a loss parameter's from gradient caching, is widened)."""
        if self._live:
            self.discard()  # an exit the step did not see left the last window open
        self._live = self.params
        self._managed = {id(p) for p in self._live}
        self._saved = [p.grad_dtype for p in self._live]
        self._widen()

    def _widen(self) -> None:
        dtype = self.dtype
        for p in self._live:
            grad = p.grad
            p.grad = None
            p.grad_dtype = dtype
            if grad is not None:
                p.grad = grad.to(dtype)

    def narrow(self) -> None:
        """End the window: round each wide sum once into its parameter's dtype (what every
        optimizer accepts) and give each parameter its ``grad_dtype`` back."""
        if not (self._live or self._stashed or self._reduced):
            return  # nothing was widened (accum_dtype unset, or nothing narrower than it)
        for p, saved in zip(self._live, self._saved, strict=True):
            grad = p.grad
            p.grad = None
            p.grad_dtype = saved
            if grad is not None:
                p.grad = grad.to(p.dtype)
        self._live, self._saved, self._managed = [], [], set()
        self._stashed.clear()
        self._reduced.clear()

    def discard(self) -> None:
        """A skipped or abandoned window ends like an applied one (``zero_grad`` has cleared the
        gradients it clears; any other is kept, in its parameter's dtype)."""
        self.narrow()

    def close(self) -> None:
        """The accumulator is closed: a window still open ends, and the communication hook
        reduces as DDP does from now on."""
        self.narrow()
        self.closed = True

    def around_sync(self, backward: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
        """``backward`` for DDP's synchronizing backward: the wide sums set aside before it (the
        reducer takes the parameter's dtype only), and ``.grad`` = the reduced wide sum after.
        ``backward`` itself on one process, where no reduction intervenes."""
        if not self._ddp:
            return backward

        def synchronizing_backward(contribution: torch.Tensor) -> Any:
            zero_aside = self._zero_aside
            for p in self._live:
                grad = p.grad
                p.grad = None
                p.grad_dtype = p.dtype
                if grad is not None:
                    self._stashed[id(p)] = grad
                    if zero_aside:  # DDP copies the zero into its bucket; the hook adds the sum
                        p.grad = torch.zeros_like(p)
            try:
                return backward(contribution)
            finally:
                self._settle()

        return synchronizing_backward

    def _settle(self) -> None:
        """Each parameter's ``.grad``: its reduced wide sum (or, where the backward failed before
        the reduction, its sum as it was, for the engine to clear)."""
        for p in self._live:
            key = id(p)
            wide = self._reduced.pop(key, None)
            stashed = self._stashed.pop(key, None)
            p.grad = None
            p.grad_dtype = self.dtype
            if wide is not None:
                p.grad = wide
            elif stashed is not None:
                p.grad = stashed

    def reduce(self, group: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The communication hook in an open window: all-reduce (the wide sums + this backward's
        gradients) / W."""
        buffer: torch.Tensor = bucket.buffer()
        params: list[torch.Tensor] = bucket.parameters()
        world = dist.world_size(group)
        if not any(id(p) in self._managed for p in params):  # a float32 bucket: DDP's own reduction
            buffer.div_(world)
            self.reduced_bytes += buffer.numel() * buffer.element_size()
            return dist.all_reduce_sum_future(buffer, group).then(lambda fut: fut.value()[0])
        wide = buffer.to(self.dtype)
        offset = 0
        for p in params:  # the bucket holds its parameters' gradients flat, in this order
            stashed = self._stashed.pop(id(p), None)
            if stashed is not None:
                wide[offset : offset + p.numel()].add_(stashed.reshape(-1))
            offset += p.numel()
        wide.div_(world)
        self.reduced_bytes += wide.numel() * wide.element_size()

        def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
            reduced: torch.Tensor = fut.value()[0]
            start = 0
            for p in params:
                self._reduced[id(p)] = reduced[start : start + p.numel()].view_as(p)
                start += p.numel()
            buffer.copy_(reduced)  # what DDP writes into .grad, replaced by the wide sum after
            return buffer

        return dist.all_reduce_sum_future(wide, group).then(done)


def wide_gradients(
    accum_dtype: str | torch.dtype | None,
    model: nn.Module,
    kind: str,
    policy: str,
    layout: Any,
    pipeline: bool,
) -> WideGradients:
    """What the engine needs for ``accum_dtype`` (narrow gradients summed wide, rounded once before
    the step): one with no parameters, whose calls do nothing, when nothing is to widen (unset, no
    narrower parameter, or FSDP2 doing it by its policy); refuses what it cannot do exactly.
    ``kind``/``policy``/``layout``: the engine's."""
    name = accum_dtype_name(accum_dtype)  # AccumConfig stores the name; a dtype is named here too
    if name is None:
        return WideGradients(None, torch.float32, None)
    dtype = accum_dtype_of(name)
    synced = sync_module(model)  # the DDP/FSDP module, also inside a forward wrapper
    if kind == "fsdp2":
        check_fsdp2_reduce_dtype(synced, dtype, policy)
        return WideGradients(None, dtype, None)
    params = list(model.parameters())
    narrow = _narrow(params, dtype)  # refuses a trainable parameter wider than accum_dtype
    if not any(p.is_floating_point() and p.dtype.itemsize < dtype.itemsize for p in params):
        return WideGradients(None, dtype, None)
    where = (
        "a pipeline schedule (its stages' backwards and reductions run inside the schedule)"
        if pipeline
        else "a device mesh without FSDP2 (its parameters are DTensors spread over the mesh)"
        if layout is not None
        else "FSDP1 (its flat parameters reduce in their own dtype)"
        if kind == "fsdp"
        else None
    )
    if where is not None and not narrow:  # frozen narrower parameters only: nothing to widen there
        return WideGradients(None, dtype, None)
    if where is not None:
        raise ConfigError(
            f"AccumConfig.accum_dtype={name!r} is not supported with {where}: the float32 "
            "sum could not reach the optimizer unchanged. Use one process, DDP, or FSDP2 with "
            "MixedPrecisionPolicy(reduce_dtype=torch.float32), or leave accum_dtype=None."
        )
    # every window widens the parameters trainable then: a frozen one may be unfrozen later
    return WideGradients(model, dtype, synced if kind == "ddp" else None)
