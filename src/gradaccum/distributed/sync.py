"""Deferring gradient synchronization for plain, DDP, FSDP and FSDP2 modules.

Only public switches are used: ``DistributedDataParallel.no_sync`` and
``FullyShardedDataParallel.no_sync`` (both restore the previous flag on exit themselves), and FSDP2's
``FSDPModule.set_requires_gradient_sync`` / ``set_requires_all_reduce``, whose previous state is
restored on exit too (read through :func:`fsdp2_sync_flags`, since FSDP2 has no public getter).
DDP reads its flag in ``forward``, so the context must
wrap the forward *and* the backward of a micro-batch, never the backward alone.

A training framework may put a thin forward wrapper around the data-parallel module: Lightning
Fabric's ``fabric.setup`` returns a ``_FabricModule`` that casts inputs and runs autocast, then
forwards through the DDP or FSDP module it holds; ``torch.compile(DDP(m))`` returns an
``OptimizedModule`` holding the DDP. :func:`sync_module` finds that module, so the step forwards
through the wrapper and switches sync on the module that owns it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal, TypeVar

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from gradaccum.errors import ConfigError, SyncError

__all__ = [
    "SyncKind",
    "broadcasts_buffers",
    "check_sync_on",
    "ddp_forward_checked",
    "forward_called",
    "fsdp2_sync_flags",
    "needs_every_parameter",
    "no_grad_sync",
    "sync_deferred",
    "sync_kind",
    "sync_module",
]

SyncKind = Literal["local", "ddp", "fsdp", "fsdp2"]
"""How a module's gradients are synchronized: not at all (``local``), or by which wrapper."""


def _is_fsdp1(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(module, FullyShardedDataParallel)


def _is_fsdp2(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6 keeps it under _composable
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return False
    return isinstance(module, FSDPModule)


def _own_kind(module: nn.Module) -> SyncKind:
    if isinstance(module, DistributedDataParallel):
        return "ddp"
    if _is_fsdp1(module):
        return "fsdp"
    if _is_fsdp2(module):
        return "fsdp2"
    return "local"


_FORWARD_WRAPPERS = (
    ("lightning.fabric.wrappers", "_FabricModule"),
    ("lightning_fabric.wrappers", "_FabricModule"),
    ("torch._dynamo.eval_frame", "OptimizedModule"),
)
"""Classes that forward through a data-parallel module they hold as a child: Fabric's wrapper, and
what ``torch.compile(DDP(m))`` returns (an ``OptimizedModule`` whose child ``_orig_mod`` is the DDP;
DDP's forward still runs eagerly and reads its sync flag, so ``no_sync`` on it defers as usual).
Looked up in ``sys.modules`` only: an object of such a class exists only once its module was
imported, and ``import torch`` alone does not import dynamo."""


def _is_forward_wrapper(module: nn.Module) -> bool:
    for module_name, class_name in _FORWARD_WRAPPERS:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(cls, type) and isinstance(module, cls):
            return True
    return False


def sync_module(module: nn.Module) -> nn.Module:
    """The module whose gradient sync the step switches: ``module`` itself, or the DDP/FSDP module
    inside a forward wrapper (Lightning Fabric's ``_FabricModule``, torch.compile's ``OptimizedModule``).

    Neither offers a public accessor for the module it forwards through; it is a registered child
    of the wrapper, so the public ``children()`` finds it.
    """
    if isinstance(module, DistributedDataParallel) or not _is_forward_wrapper(module):
        return module
    for child in module.children():
        if _own_kind(child) != "local":
            return child
    return module


def sync_kind(module: nn.Module) -> SyncKind:
    """Which synchronization wrapper ``module`` is (its outermost one), seen through a framework's
    forward wrapper (see :func:`sync_module`)."""
    return _own_kind(sync_module(module))


def fsdp2_sync_flags(module: nn.Module) -> tuple[bool, bool]:
    """(reduce-scatter on, all-reduce on): the flags FSDP2's public setters last wrote.

    FSDP2 has no public getter for them (torch 2.4-2.13): ``set_requires_gradient_sync`` and
    ``set_requires_all_reduce`` write ``reduce_grads``/``all_reduce_grads`` on each FSDP parameter
    group, read here from the first FSDP module that holds one; where those attributes do not
    exist, FSDP2's default (both on) is assumed.
    """
    for sub in module.modules():
        get_state = getattr(sub, "_get_fsdp_state", None)
        groups = getattr(get_state(), "_fsdp_param_groups", None) if callable(get_state) else None
        if groups:
            group = groups[0]
            return bool(getattr(group, "reduce_grads", True)), bool(getattr(group, "all_reduce_grads", True))
    return True, True


class _Fsdp2SyncOff:
    """FSDP2's sync switch as a context: off inside, the previous state restored after.

    ``replicate_only``: keep the reduce-scatter over the shards and defer only HSDP's all-reduce
    over the replicas (``set_requires_all_reduce(False)``), the ``defer_replicate`` policy.
    """

    __slots__ = ("_module", "_previous", "_replicate_only")

    def __init__(self, module: nn.Module, replicate_only: bool = False) -> None:
        self._module = module
        self._replicate_only = replicate_only
        self._previous = (True, True)

    def __enter__(self) -> None:
        self._previous = fsdp2_sync_flags(self._module)
        if self._replicate_only:
            self._module.set_requires_all_reduce(False)  # type: ignore[operator]
        else:
            self._module.set_requires_gradient_sync(False)  # type: ignore[operator]

    def __exit__(self, *exc: object) -> None:
        reduce, all_reduce = self._previous
        self._module.set_requires_gradient_sync(reduce)  # type: ignore[operator]  # writes both flags
        if reduce and not all_reduce:
            self._module.set_requires_all_reduce(False)  # type: ignore[operator]


_NOTHING_TO_DEFER = contextlib.nullcontext()


def sync_deferred(
    module: nn.Module, kind: SyncKind, enabled: bool = True, *, replicate_only: bool = False
) -> AbstractContextManager[Any]:
    """The context that defers ``module``'s gradient sync (``kind`` = :func:`sync_kind` of it).

    The step calls this once per micro-batch with the kind it computed when it was built, so the
    hot path does no type checks and, for a plain module, builds no context at all.
    ``replicate_only`` (FSDP2 on a replicate x shard mesh): defer only the all-reduce over replicas.
    """
    if not enabled or kind == "local":
        return _NOTHING_TO_DEFER
    owner = module if isinstance(module, DistributedDataParallel) else sync_module(module)
    if kind == "fsdp2":
        return _Fsdp2SyncOff(owner, replicate_only)
    return owner.no_sync()  # type: ignore[operator]


def no_grad_sync(module: nn.Module, enabled: bool = True) -> AbstractContextManager[Any]:
    """Within this context, backward passes accumulate locally without synchronizing gradients.

    Wrap forward and backward of every micro-batch but the last. ``enabled=False`` is a no-op, so
    the caller's loop stays one shape. A plain module has nothing to defer.
    """
    return sync_deferred(module, sync_kind(module), enabled)


def check_sync_on(module: nn.Module) -> None:
    """Refuse to start a window inside the caller's own ``no_sync``: the final backward would not sync."""
    module = sync_module(module)
    if sync_kind(module) == "ddp" and not getattr(module, "require_backward_grad_sync", True):
        raise SyncError(
            "Accumulator.step was called inside DistributedDataParallel.no_sync(): the window's "
            "final backward would not synchronize gradients, and ranks would step on different "
            "gradients. Call step outside no_sync; it defers synchronization itself."
        )


def needs_every_parameter(module: nn.Module) -> bool:
    """Whether a synchronizing backward must reach every trainable parameter of ``module``.

    DDP built with ``find_unused_parameters=False`` (and no ``static_graph``) waits for a gradient
    from each of them: one that a window's last micro-batch does not use leaves its bucket
    unreduced, which hangs the ranks or steps on unaveraged gradients.
    """
    module = sync_module(module)
    if sync_kind(module) != "ddp":
        return False
    return not getattr(module, "find_unused_parameters", False) and not getattr(module, "static_graph", False)


def broadcasts_buffers(synced: Any, kind: str) -> bool:
    """Whether a DDP module broadcasts its buffers in a window's first forward (a collective the
    step's own must not cross); ``forward_sync_buffers`` from torch 2.13 on, ``broadcast_buffers``
    (its deprecated alias) before."""
    if kind != "ddp":
        return False
    flag = getattr(synced, "forward_sync_buffers", getattr(synced, "broadcast_buffers", False))
    return bool(flag) and any(True for _ in synced.buffers())


_Piece = TypeVar("_Piece")


def forward_called(module: nn.Module, call: Callable[[], _Piece]) -> tuple[_Piece, bool]:
    """``call()``'s result, and whether it ran ``module``'s forward: a wrapper (DDP, a DeepSpeed
    engine) prepares a micro-batch's reduction there, which a call of its submodules skips. A
    forward pre-hook, registered for this call only, tells."""
    ran: list[bool] = []
    handle = module.register_forward_pre_hook(lambda _module, _args: ran.append(True))
    try:
        result = call()
    finally:
        handle.remove()
    return result, bool(ran)


def ddp_forward_checked(
    model: nn.Module, kind: SyncKind, contribute: Callable[..., _Piece]
) -> Callable[..., _Piece]:
    """``contribute`` refusing a synchronizing micro-batch whose ``loss_fn`` never ran DDP's forward.

    DDP prepares its reducer in its forward: a ``loss_fn`` that calls ``model.module``'s submodules
    runs none, the synchronizing backward all-reduces nothing, and each rank would step on its own
    gradient, silently. A forward pre-hook on the DDP module, only around the micro-batches that
    synchronize (``require_backward_grad_sync``), tells; the error is raised inside the micro-batch,
    so the step's failure agreement tells every rank. A compiled wrapper is left unchecked (a hook
    added after dynamo traced the module may never be called).
    """
    if kind != "ddp" or hasattr(model, "_orig_mod"):
        return contribute
    ddp = model if isinstance(model, DistributedDataParallel) else sync_module(model)

    def checked(index: int, micro_batch: Any, *rest: Any) -> _Piece:
        if not getattr(ddp, "require_backward_grad_sync", True):  # deferred: nothing to prepare
            return contribute(index, micro_batch, *rest)
        piece, ran = forward_called(ddp, lambda: contribute(index, micro_batch, *rest))
        if not ran:
            raise ConfigError(
                f"micro-batch {index} synchronizes gradients, but loss_fn never called the "
                "DistributedDataParallel model: calling model.module or its submodules skips DDP's "
                "forward, so nothing would be all-reduced and each rank would step on its own "
                "gradient. Call the wrapped model (model(...)) in loss_fn."
            )
        return piece

    return checked
