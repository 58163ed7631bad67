"""``gradaccum.guard``: a sanitizer that watches a hand-written accumulation loop and names its mistakes.

The user's loop runs unchanged inside ``with guard(model, optimizer, accum_steps=k): ...``. The guard
only observes, through public hooks and attribute patches that it removes on exit:

* backward passes: a post-accumulate-grad hook on every parameter. A window's length is the largest
  number of times any parameter's ``.grad`` was accumulated into since the last optimizer step, so
  backwards that reach only part of the model (frozen layers, unused experts) count correctly. One
  backward per micro-batch is assumed; a loop with several backward calls per micro-batch declares
  ``accum_steps`` in backward calls.
* ``optimizer.step``: ``Optimizer.register_step_pre_hook``; ``zero_grad`` of the optimizer and the model,
  ``scheduler.step`` and ``GradScaler.scale/unscale_/step/update``: instance attributes that call the
  originals; ``clip_grad_norm_``, ``clip_grad_norm``, ``clip_grad_value_`` and ``clip_grads_with_norm_``
  in ``torch.nn.utils`` (and ``torch.nn.utils.clip_grad``); ``torch.autograd.backward`` (which
  ``Tensor.backward`` calls), to read the loss graph and the caller's line before the engine runs.
* DDP synchronization, inferred from DDP's public ``require_backward_grad_sync`` flag: DDP decides in
  its *forward* whether the next backward all-reduces, so the flag is read by a forward pre-hook and
  again when the backward reaches the parameters. No comm hook is registered: DDP accepts one per
  model, for good, and it may be the user's.

What cannot be seen: a function imported by name before the guard was entered (``from torch.nn.utils
import clip_grad_norm_``) or gradients cleared by hand (``p.grad = None``); the mean-of-means rule reads
only losses of the form ``constant * reduction(...)`` (cross-entropy/NLL, ``mean()``, the reduced
``*_loss`` functions, ``sum()``, each optionally scaled by 0-dim constants), skips windows with any
other loss (sums of terms, label smoothing, non-scalar roots), compares micro-batches on one rank only
(unequal counts *across* ranks would need a collective in the user's loop) and reads the scale factors
on the host once per window. The graph is read through the ``grad_fn._saved_*`` attributes that
PyTorch's autograd notes document. Synchronization rules cover DDP, not FSDP.

Framework wrappers are seen through: the DDP inside Lightning Fabric's ``_FabricModule`` (the sync
flag is read there), the optimizer inside Accelerate's ``AcceleratedOptimizer`` or Fabric's
``_FabricOptimizer`` (the real update is observed, not a wrapper call that Accelerate skips inside
``accumulate()``), and the scheduler inside Accelerate's ``AcceleratedScheduler`` (its real steps are
counted: under N processes it steps N times per update unless built with ``split_batches``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from gradaccum.distributed.sync import sync_kind, sync_module
from gradaccum.hazards.lossform import WEIGHT_RTOL, LossForm, listed, read_loss
from gradaccum.hazards.rules import (
    GUARD_RULES,
    RULE_TEXT,
    GuardConfig,
    GuardError,
    GuardFinding,
    GuardMode,
    GuardSetupError,
    GuardWarning,
)

__all__ = [
    "GUARD_RULES",
    "Guard",
    "GuardConfig",
    "GuardError",
    "GuardFinding",
    "GuardMode",
    "GuardSetupError",
    "GuardWarning",
    "guard",
]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_CLIP_NAMES = ("clip_grad_norm_", "clip_grad_norm", "clip_grad_value_", "clip_grads_with_norm_")


_FRAMEWORKS = ("accelerate", "lightning", "lightning_fabric", "pytorch_lightning", "transformers")
"""Training libraries whose wrappers call backward, step or the scheduler on the user's behalf: a
finding names the user's line that called them, not theirs (only those already imported count)."""


def _library_dirs() -> tuple[str, ...]:
    dirs = [_TORCH_DIR, _OWN_DIR]
    for name in _FRAMEWORKS:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def _user_site() -> tuple[str, int]:
    """File and line of the innermost caller outside gradaccum, torch and the training libraries."""
    libraries = _library_dirs()
    frame = inspect.currentframe()
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(libraries):
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return "<unknown>", 0


class _Bound:
    """A method stand-in in an object's ``__dict__``: calls ``call``; copies and pickles as the method.

    ``copy.deepcopy(model)`` (an EMA or best-model snapshot) or ``torch.save(model)`` inside the guard
    would otherwise copy a closure bound to the original object, or fail to pickle it.
    """

    __slots__ = ("_call", "_name", "_owner")

    def __init__(self, owner: object, name: str, call: Callable[..., Any]) -> None:
        self._owner, self._name, self._call = owner, name, call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        # rebuilt as getattr(copy, name) while the copy's __dict__ is still empty: the class's method
        return (getattr, (self._owner, self._name))


def guard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    accum_steps: int = 4,
    scheduler: Any = None,
    scaler: Any = None,
    mode: GuardMode = "raise",
    *,
    micro_batches_per_epoch: int | None = None,
    ignore: Iterable[str] = (),
    inspect_loss: bool = True,
) -> Guard:
    """Watch the user's own accumulation loop: ``with guard(model, optimizer, accum_steps=4) as g:``.

    Pass the DDP wrapper (not its ``.module``) as ``model`` for the synchronization rules. A short last
    window is allowed only when declared: ``micro_batches_per_epoch`` when the loop's length is known
    (the loop stays unchanged), or ``g.final_window()`` inside the loop when it is not.
    """
    config = GuardConfig(
        accum_steps=accum_steps,
        mode=mode,
        micro_batches_per_epoch=micro_batches_per_epoch,
        ignore=frozenset(ignore),
        inspect_loss=inspect_loss,
    )
    return Guard(model, optimizer, config, scheduler=scheduler, scaler=scaler)


class Guard:
    """The context manager :func:`guard` returns; ``findings`` holds every misuse seen."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: GuardConfig,
        *,
        scheduler: Any = None,
        scaler: Any = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise GuardSetupError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise GuardSetupError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        for obj, label, methods in ((scheduler, "scheduler", ("step",)), (scaler, "scaler", _SCALER)):
            if obj is not None and not all(callable(getattr(obj, m, None)) for m in methods):
                raise GuardSetupError(f"{label} must have methods {list(methods)}; got {type(obj).__name__}")
        self.model, self.optimizer, self.config = model, optimizer, config
        self.scheduler, self.scaler = scheduler, scaler
        self._ddp = sync_kind(model) == "ddp"
        self._synced = sync_module(model)  # the DDP itself, also inside Fabric's _FabricModule
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._param_ids = {id(p) for p in self._params}
        self._active = False
        self._stack: contextlib.ExitStack | None = None
        self._findings: list[GuardFinding] = []
        self._pending: list[GuardFinding] = []
        self._warned: set[tuple[str, str, int, int]] = set()
        self.windows = 0
        """Optimizer steps (windows) completed inside the guard."""
        self._total = self._synced_total = 0
        self._final_marked = False
        # window state (since the last optimizer step), reset by _reset_window
        self._counts: list[int] = []
        self._n = self._syncs = self._sched_steps = 0
        self._last_synced = self._scaled = self._unscaled = self._scale_changed = False
        self._forms: list[LossForm | None] = []
        self._scaled_outputs: list[weakref.ref[torch.Tensor]] = []
        # call state (which patched call is in progress; DDP's flag at the last forward)
        self._fwd_sync: bool | None = None
        self._in_scaler_step = False
        self._clip_depth = self._bw_depth = 0
        self._bw_site: tuple[str, int] | None = None
        self._bw_form: LossForm | None = None
        self._reset_window()

    # -- public ------------------------------------------------------------------------------

    @property
    def findings(self) -> list[GuardFinding]:
        """Every misuse seen so far, in order (a copy)."""
        return list(self._findings)

    @property
    def backward_passes(self) -> int:
        """Backward passes that reached the model inside the guard (see the module docstring)."""
        return self._total

    @property
    def synced_backward_passes(self) -> int:
        """Of those, the ones DDP all-reduced (inferred from ``require_backward_grad_sync``)."""
        return self._synced_total

    def final_window(self) -> None:
        """Declare the window in progress (or the next one) the last of the data: it may be short."""
        self._final_marked = True

    def __enter__(self) -> Guard:
        if self._active:
            raise GuardSetupError("this guard is already active; enter a Guard once at a time")
        self._findings, self._pending, self.windows, self._total, self._synced_total = [], [], 0, 0, 0
        self._final_marked, self._fwd_sync = False, None
        self._reset_window()
        with contextlib.ExitStack() as stack:
            self._install(stack)
            self._stack = stack.pop_all()
        self._active = True
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._active = False
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        if exc_type is None:
            self._flush()

    # -- installing and removing the observers -------------------------------------------------

    def _install(self, stack: contextlib.ExitStack) -> None:
        for i, p in enumerate(self._params):
            stack.callback(p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i)).remove)
        chain = _optimizer_chain(self.optimizer)
        real = chain[-1]  # the optimizer whose step changes the weights
        stack.callback(real.register_step_pre_hook(self._on_optimizer_step).remove)
        if self._ddp:
            stack.callback(self._synced.register_forward_pre_hook(self._on_forward).remove)
        for level in chain:
            # a wrapper that inherits the real optimizer's zero_grad clears the gradients itself; one
            # that defines its own (Accelerate's, a no-op inside accumulate()) is seen through
            if level is real or type(level).zero_grad is type(real).zero_grad:
                self._patch(stack, level, "zero_grad", self._on_zero_grad)
        for module in (self.model, getattr(self.model, "module", None) if self._ddp else None):
            if isinstance(module, nn.Module):
                self._patch(stack, module, "zero_grad", self._on_zero_grad)
        if self.scheduler is not None:
            self._patch(stack, _real_scheduler(self.scheduler), "step", self._on_scheduler_step)
        if self.scaler is not None:
            self._patch(stack, self.scaler, "unscale_", self._on_unscale)
            self._patch(stack, self.scaler, "update", self._on_update)
            self._wrap_scaler_io(stack)
        for module in (torch.nn.utils, torch.nn.utils.clip_grad):
            for name in _CLIP_NAMES:
                if hasattr(module, name):
                    self._patch_clip(stack, module, name)
        self._wrap_backward(stack)

    def _put(self, stack: contextlib.ExitStack, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        """Set ``owner.name = wrapper`` and, on exit, put back exactly what ``owner`` held itself.

        If something else replaced the wrapper meanwhile, it stays; the wrapper passes through once
        the guard is inactive, so it is inert wherever it is still referenced. On an object (not a
        module) the wrapper is a :class:`_Bound`, so the object still copies and pickles.
        """
        if not isinstance(owner, types.ModuleType):
            wrapper = _Bound(owner, name, wrapper)
        had = name in vars(owner)
        previous = vars(owner).get(name)
        setattr(owner, name, wrapper)

        def restore() -> None:
            if vars(owner).get(name) is wrapper:
                if had:
                    setattr(owner, name, previous)
                else:
                    delattr(owner, name)

        stack.callback(restore)

    def _patch(
        self, stack: contextlib.ExitStack, owner: Any, name: str, before: Callable[[str], None]
    ) -> None:
        original = getattr(owner, name)
        label = f"{type(owner).__name__}.{name}"

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._active:
                before(label)
            return original(*args, **kwargs)

        self._put(stack, owner, name, wrapper)

    def _wrap_scaler_io(self, stack: contextlib.ExitStack) -> None:
        scale, step = self.scaler.scale, self.scaler.step

        @functools.wraps(scale)
        def scale_wrapper(outputs: Any) -> Any:
            out = scale(outputs)
            if self._active and self.scaler.is_enabled():
                self._scaled = True
                tensors = (
                    [out] if isinstance(out, torch.Tensor) else out if isinstance(out, list | tuple) else []
                )
                self._scaled_outputs += [weakref.ref(t) for t in tensors if isinstance(t, torch.Tensor)]
            return out

        @functools.wraps(step)
        def step_wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self._active:
                return step(*args, **kwargs)
            self._end_window("GradScaler.step")
            self._in_scaler_step = True
            try:
                return step(*args, **kwargs)
            finally:
                self._in_scaler_step = False

        self._put(stack, self.scaler, "scale", scale_wrapper)
        self._put(stack, self.scaler, "step", step_wrapper)

    def _patch_clip(self, stack: contextlib.ExitStack, module: types.ModuleType, name: str) -> None:
        original = getattr(module, name)
        label = f"torch.nn.utils.{name}"

        @functools.wraps(original)
        def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._active or self._clip_depth:
                return original(parameters, *args, **kwargs)
            if not isinstance(parameters, torch.Tensor):
                listed = list(parameters)
                # a fresh generator keeps torch's handling (and warning) of generator arguments
                is_gen = isinstance(parameters, types.GeneratorType)
                parameters = (p for p in listed) if is_gen else listed
            else:
                listed = [parameters]
            if any(id(p) in self._param_ids for p in listed):
                self._on_clip(label)
            self._clip_depth += 1
            try:
                return original(parameters, *args, **kwargs)
            finally:
                self._clip_depth -= 1

        self._put(stack, module, name, clip)

    def _wrap_backward(self, stack: contextlib.ExitStack) -> None:
        original = torch.autograd.backward

        @functools.wraps(original)
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._active or self._bw_depth:  # reentrant (checkpointing) backwards pass through
                return original(tensors, *args, **kwargs)
            self._flush()
            site = _user_site()
            self._bw_site = site
            if self.config.inspect_loss:
                root = tensors[0] if isinstance(tensors, list | tuple) and len(tensors) == 1 else tensors
                scaled = any(ref() is root for ref in self._scaled_outputs)
                try:
                    self._bw_form = read_loss(root, site, skip_top_mul=scaled)
                except (AttributeError, RuntimeError, TypeError, ValueError):
                    self._bw_form = None  # an unexpected graph: the window is not judged, never broken
            self._bw_depth += 1
            try:
                result = original(tensors, *args, **kwargs)
            finally:
                self._bw_depth, self._bw_site, self._bw_form = self._bw_depth - 1, None, None
            self._flush()
            return result

        self._put(stack, torch.autograd, "backward", backward)

    # -- observations ------------------------------------------------------------------------

    def _on_grad(self, index: int, _param: torch.Tensor) -> None:
        """A parameter's .grad was accumulated into. Runs inside autograd: records, never raises."""
        if not self._active:
            return
        count = self._counts[index] = self._counts[index] + 1
        if count <= self._n:
            return
        self._n, self._total = count, self._total + 1  # the window's next backward pass
        self._forms.append(self._bw_form if self._bw_depth else None)
        if self._ddp:
            site = self._bw_site or _user_site()
            now = bool(getattr(self._synced, "require_backward_grad_sync", True))
            synced = now if self._fwd_sync is None else self._fwd_sync
            if synced and not now:
                self._report("no-sync-backward-only", site, deferred=True)
            self._last_synced = synced
            self._syncs += synced
            self._synced_total += synced
            if synced and self._syncs == 2:
                self._report("sync-per-micro-batch", site, deferred=True)

    def _on_forward(self, module: nn.Module, _args: Any) -> None:
        if self._active and torch.is_grad_enabled():
            self._fwd_sync = bool(getattr(module, "require_backward_grad_sync", True))

    def _on_optimizer_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self._active and not self._in_scaler_step:
            self._end_window(f"{type(self.optimizer).__name__}.step")

    def _mid_window(self, code: str | None = None, label: str = "") -> bool:
        """Whether the window is partly accumulated (and not a declared short end); report ``code``."""
        self._flush()
        mid = 0 < self._n < self.config.accum_steps and not self._short_ok()
        if mid and code is not None:
            self._report(code, _user_site(), label=label)
        return mid

    def _on_zero_grad(self, label: str) -> None:
        if not self._mid_window("zero-grad-mid-window", label) and self._n:
            self._reset_window()  # a complete window discarded (a skipped update): start over

    def _on_scheduler_step(self, label: str) -> None:
        if self._mid_window() or self._sched_steps:
            where = f"after {self._n} of accum_steps={self.config.accum_steps} backward passes"
            where = "a second time since the last optimizer step" if self._sched_steps else where
            self._report("scheduler-mid-window", _user_site(), label=label, where=where)
        self._sched_steps += 1

    def _on_clip(self, label: str) -> None:
        self._mid_window("clip-mid-window", label)
        if self._scaled and not self._unscaled:
            self._report("clip-before-unscale", _user_site(), label=label)

    def _on_unscale(self, label: str) -> None:
        if not self._in_scaler_step:  # GradScaler.step unscales itself after the window ended
            self._mid_window("unscale-mid-window", label)
            self._unscaled = True

    def _on_update(self, label: str) -> None:
        self._scale_changed |= self._mid_window("scaler-update-mid-window", label)

    # -- the window ----------------------------------------------------------------------------

    def _short_ok(self) -> bool:
        per_epoch = self.config.micro_batches_per_epoch
        at_end = per_epoch is not None and self._total > 0 and self._total % per_epoch == 0
        return self._final_marked or at_end

    def _end_window(self, label: str) -> None:
        """The optimizer steps: judge the window, start the next one, then report."""
        self._flush()
        n, k, site = self._n, self.config.accum_steps, _user_site()
        if n < k and not (n and self._short_ok()):
            self._report("step-mid-window", site, deferred=True, label=label)
        elif n > k:
            self._report("window-overrun", site, deferred=True, label=label)
        if self._ddp and n and not self._last_synced:
            self._report("unsynced-step", site, deferred=True, label=label, syncs=self._syncs)
        if self.config.inspect_loss and not self._scale_changed:
            self._judge_losses(n, k)
        self.windows += 1
        self._final_marked = False
        self._reset_window()
        self._flush()

    def _judge_losses(self, n: int, k: int) -> None:
        """Each counted unit should enter the gradient with the same weight: compare the forms."""
        known = [f for f in self._forms if f is not None]
        if not known or len(known) != len(self._forms) or len({f.count is None for f in known}) != 1:
            return  # a backward whose loss could not be read: the window is not judged
        weights = [f.weight() for f in known]
        if not all(math.isfinite(w) and w != 0 for w in weights):
            return
        means = known[0].count is not None
        spread = max(abs(w - weights[0]) for w in weights)
        if spread > WEIGHT_RTOL * max(abs(w) for w in weights):
            odd = next(f for f, w in zip(known, weights, strict=True) if abs(w - weights[0]) > spread / 2)
            counts = [float(f.count) for f in known if f.count is not None]
            what = (
                f"are means over {listed(counts)} units, scaled by {listed([f.scale() for f in known])}, "
                f"so one unit weighs {listed(weights)}, not one common weight (1/{sum(counts):.0f} here)"
                if means
                else f"are sums scaled by different factors {listed(weights)}, each by its own count"
            )
            self._report("mean-of-means", odd.site, deferred=True, m=len(known), what=what)
        if means and n < k and self._short_ok() and all(math.isclose(f.scale(), 1 / k) for f in known):
            self._report("short-window-scale", known[0].site, deferred=True)

    def _reset_window(self) -> None:
        self._counts = [0] * len(self._params)
        self._n = self._syncs = self._sched_steps = 0
        self._last_synced, self._forms, self._scaled_outputs = True, [], []
        self._scaled = self._unscaled = self._scale_changed = False

    # -- reporting -----------------------------------------------------------------------------

    def _report(self, code: str, site: tuple[str, int], *, deferred: bool = False, **figures: Any) -> None:
        if code in self.config.ignore:
            return
        _, template, fix = RULE_TEXT[code]
        message = template.format(n=self._n, k=self.config.accum_steps, **figures)
        finding = GuardFinding(
            code=code, message=message, fix=fix, filename=site[0], lineno=site[1], window=self.windows
        )
        self._findings.append(finding)
        self._pending.append(finding)
        if not deferred:
            self._flush()

    def _flush(self) -> None:
        """Emit what was recorded where raising is unsafe (inside autograd) or premature.

        In warn mode one line of the user's loop that repeats a mistake at every micro-batch warns
        once per window, not once per micro-batch; ``findings`` still records every occurrence.
        """
        pending, self._pending = self._pending, []
        for finding in pending:
            if self.config.mode == "raise":
                raise GuardError(finding)
            key = (finding.code, finding.filename, finding.lineno, finding.window)
            if key in self._warned:
                continue
            if len(self._warned) > 1024:  # a long loop: only this window's keys can match again
                self._warned = {k for k in self._warned if k[3] == finding.window}
            self._warned.add(key)
            warnings.warn_explicit(str(finding), GuardWarning, finding.filename, finding.lineno)


_SCALER = ("scale", "unscale_", "step", "update")


def _optimizer_chain(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """``optimizer`` and the optimizers it wraps, outermost first: Accelerate's and Fabric's wrappers
    hold the real optimizer as their public ``optimizer`` attribute."""
    chain = [optimizer]
    inner = getattr(optimizer, "optimizer", None)
    while isinstance(inner, torch.optim.Optimizer) and all(inner is not level for level in chain):
        chain.append(inner)
        inner = getattr(inner, "optimizer", None)
    return chain


def _real_scheduler(scheduler: Any) -> Any:
    """The scheduler whose ``step`` changes the learning rate: Accelerate's ``AcceleratedScheduler``
    holds it as its public ``scheduler`` attribute and calls its ``step`` (or skips it)."""
    seen = [scheduler]
    inner = getattr(scheduler, "scheduler", None)
    while callable(getattr(inner, "step", None)) and all(inner is not s for s in seen):
        seen.append(inner)
        inner = getattr(inner, "scheduler", None)
    return seen[-1]
