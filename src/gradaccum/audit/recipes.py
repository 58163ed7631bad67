"""``audit_stack``: one window of a workload through each installed framework's documented
accumulation recipe and through gradaccum's ``Accumulator``, each against the float64 full batch.

The recipes, each on its own float64 copy of the model with every random source off (dropout
probabilities set to 0, train mode kept), all fed the same micro-batches:

* the hand-written loop: ``(loss_fn(mb) / count_fn(mb) / k).backward()`` per micro-batch, the
  mean loss per micro-batch divided by k;
* Accelerate's ``Accelerator(gradient_accumulation_steps=k)`` on CPU: ``with accelerator.accumulate
  (model)``, ``accelerator.backward(mean)``, ``optimizer.step()`` per micro-batch, as documented
  (Accelerate divides the loss by k and steps the optimizer on the k-th micro-batch);
* Lightning's ``Trainer(accumulate_grad_batches=k)`` on CPU, one optimizer step, a LightningModule
  whose ``training_step`` returns the mean loss of its micro-batch (Lightning divides it by k);
* DeepSpeed's engine with ``gradient_accumulation_steps=k``: the mean loss of each micro-batch
  through ``engine.backward`` (which divides it by k) and ``engine.step()``; and gradaccum's
  ``prepare_accumulator`` on the same engine;
* gradaccum's ``Accumulator.step``: each micro-batch's summed loss divided by the window's N;
* on an ``hf:`` workload, ``transformers.Trainer(gradient_accumulation_steps=k)``: its own count and
  ``training_step`` over the same micro-batches (:mod:`gradaccum.audit.hf_trainer`).

What is compared is the gradient the optimizer receives: a recording optimizer reads every
parameter's gradient when ``step`` is called and leaves the parameters as they are. The reference is
the gradient of the workload's objective over the whole window, ``loss_fn(whole window) / N`` with
``N = count_fn(whole window)``, in float64, computed as ``verify`` computes it: the whole window in
one forward and one backward on its own copy. It shares no code path with the rows' micro-batch
loops (a reference that summed the micro-batches in the order ``Accumulator.step`` does would give
gradaccum's row a bitwise 0 that says nothing), so the exact rows print their real rounding.
DeepSpeed's two rows (its engine's ``gradient_accumulation_steps``, and ``prepare_accumulator`` on
the same engine) run in float32 in a one-rank process group (:mod:`gradaccum.audit.deepspeed`).
``rows`` chooses rows by name (:mod:`gradaccum.audit.rows`).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import importlib.util
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

from gradaccum.audit.deepspeed import NotRun, deepspeed_gradients
from gradaccum.audit.hf_trainer import TrainerRun, run_trainer
from gradaccum.audit.measure import (
    RecordingOptimizer,
    accelerate_state_kept,
    float64_copy,
    gradients,
    preserved_rng,
    rel_l2,
)
from gradaccum.audit.rows import ROWS
from gradaccum.audit.stack import RecipeRow, StackAudit
from gradaccum.batch import Batch, batch_size
from gradaccum.check.runs import host_count
from gradaccum.loss import CausalLMLoss
from gradaccum.step.accumulator import Accumulator, CountFn, LossFn
from gradaccum.workloads.experts import fused_kernel, kernel_words

__all__ = ["REFERENCE", "audit_stack", "full_batch_gradient", "whole_batch_gradient"]

Progress = Callable[[str], None]

TRAINER_ROW = "transformers-trainer"

REFERENCE = (
    "the whole window in one forward and one backward on another float64 copy (loss_fn over all its "
    "examples / N, as verify computes it), independent of every row's micro-batch loop"
)
"""The reference every row is compared with, in the words the audit prints."""


def whole_batch_gradient(
    model: nn.Module, batch: Batch, loss_fn: LossFn, count_fn: CountFn
) -> list[torch.Tensor]:
    """Gradient of ``loss_fn(model, batch) / count_fn(batch)``: the whole window in one forward and
    one backward, as ``verify``'s reference computes it, independent of every row's micro-batch
    loop (the rows' own order of additions would give the exact rows a bitwise-equal figure)."""
    units = max(host_count(count_fn(batch), "the whole window"), 1)  # all padding: zero, never NaN
    model.zero_grad(set_to_none=True)
    (loss_fn(model, batch) / units).backward()
    grads = gradients(model)
    model.zero_grad(set_to_none=True)
    return grads


def full_batch_gradient(
    model: nn.Module, micro: Sequence[Batch], loss_fn: LossFn, count_fn: CountFn
) -> list[torch.Tensor]:
    """Gradient of ``sum_j loss_fn(model, mb_j) / N`` (``N = sum_j count_fn(mb_j)``), parameter order."""
    units = max(sum(host_count(count_fn(mb), f"micro-batch {j}") for j, mb in enumerate(micro)), 1)
    model.zero_grad(set_to_none=True)
    for mb in micro:
        (loss_fn(model, mb) / units).backward()
    grads = gradients(model)
    model.zero_grad(set_to_none=True)
    return grads


def _hand_loop(
    model: nn.Module, micro: Sequence[Batch], loss_fn: LossFn, count_fn: CountFn
) -> list[torch.Tensor]:
    optimizer = RecordingOptimizer(list(model.parameters()))
    k = len(micro)
    for mb in micro:
        (loss_fn(model, mb) / count_fn(mb) / k).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer.received[-1]


def _accelerate(
    model: nn.Module, micro: Sequence[Batch], loss_fn: LossFn, count_fn: CountFn
) -> list[torch.Tensor]:
    from accelerate import Accelerator

    recording = RecordingOptimizer(list(model.parameters()))
    with accelerate_state_kept():  # the state is process-wide: the recipe starts from none
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=len(micro))
        prepared, optimizer = accelerator.prepare(model, recording)
        for mb in micro:
            with accelerator.accumulate(prepared):
                accelerator.backward(loss_fn(prepared, mb) / count_fn(mb))
                optimizer.step()
                optimizer.zero_grad()
    if len(recording.received) != 1:
        raise RuntimeError(f"Accelerate stepped the optimizer {len(recording.received)} times in one window")
    return recording.received[0]


def _lightning_module() -> Any:
    import importlib

    with contextlib.suppress(ImportError):
        return importlib.import_module("lightning.pytorch")
    return importlib.import_module("pytorch_lightning")


def _lightning(
    model: nn.Module, micro: Sequence[Batch], loss_fn: LossFn, count_fn: CountFn
) -> list[torch.Tensor]:
    pl = _lightning_module()
    recording = RecordingOptimizer(list(model.parameters()))

    module: Any = pl.LightningModule

    class Wrapped(module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return loss_fn(self.model, batch) / count_fn(batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return recording

    loader: Any = torch.utils.data.DataLoader(list(micro), batch_size=None, shuffle=False)  # type: ignore[arg-type]
    quiet = [logging.getLogger(name) for name in ("lightning", "lightning.pytorch", "pytorch_lightning")]
    levels = [log.level for log in quiet]
    try:
        for log in quiet:
            log.setLevel(logging.ERROR)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=1,
            accumulate_grad_batches=len(micro),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            deterministic=False,
        )
        trainer.fit(Wrapped(), train_dataloaders=loader)
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)
    if len(recording.received) != 1:
        raise RuntimeError(f"Lightning stepped the optimizer {len(recording.received)} times in one window")
    return recording.received[0]


def _gradaccum(
    model: nn.Module, micro: Sequence[Batch], loss_fn: LossFn, count_fn: CountFn
) -> list[torch.Tensor]:
    recording = RecordingOptimizer(list(model.parameters()))
    Accumulator(model, recording).step(list(micro), loss_fn, count_fn)
    return recording.received[-1]


_Recipe = Callable[[nn.Module, Sequence[Batch], LossFn, CountFn], list[torch.Tensor]]


class _DeepSpeedRows:
    """DeepSpeed's two rows, run together in one child process the first time either is asked for
    (:mod:`gradaccum.audit.deepspeed`): one per audit."""

    def __init__(self) -> None:
        self._got: dict[str, list[torch.Tensor] | NotRun] | None = None

    def row(self, loop: str) -> _Recipe:
        def run(
            model: nn.Module, micro: Sequence[Batch], loss_fn: LossFn, count_fn: CountFn
        ) -> list[torch.Tensor]:
            if self._got is None:
                self._got = deepspeed_gradients(model, micro, loss_fn, count_fn)
            got = self._got[loop]
            if isinstance(got, NotRun):
                raise got
            return got

        return run


def _recipes() -> dict[str, tuple[_Recipe, str]]:
    """Each row's run and which loss it accumulates, by row name (:data:`gradaccum.audit.rows.ROWS`;
    ``transformers-trainer`` runs apart, :mod:`gradaccum.audit.hf_trainer`)."""
    deepspeed = _DeepSpeedRows()
    return {
        "hand-loop": (_hand_loop, "mean"),
        "accelerate": (_accelerate, "mean"),
        "lightning": (_lightning, "mean"),
        "deepspeed-engine": (deepspeed.row("loop"), "mean"),
        "deepspeed-gradaccum": (deepspeed.row("exact"), "exact float32"),
        "gradaccum": (_gradaccum, "exact"),
    }


def _installed(module: str) -> bool:
    if module == "lightning":
        return any(importlib.util.find_spec(m) is not None for m in ("lightning", "pytorch_lightning"))
    return importlib.util.find_spec(module) is not None


def _version(module: str) -> str:
    names = ("lightning", "pytorch-lightning") if module == "lightning" else (module,)
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return ""


def _mean_cause(counts: Sequence[int], unit: str, error: float) -> str:
    k, units = len(counts), sum(counts)
    if len(set(counts)) == 1:
        return (
            f"every micro-batch counts {counts[0]} {unit}: the mean of the {k} micro-batch means equals the "
            f"full batch's mean; what is left ({error:.1e}) is rounding"
        )
    weights = [k * n / units for n in counts]
    return (
        f"the mean loss per micro-batch divided by k = {k} weighs micro-batch {unit} unequally: "
        f"{' vs '.join(str(n) for n in counts)} {unit} (N = {units}) each weigh 1/{k} instead of n_j/N, "
        f"so a {unit[:-1] if unit.endswith('s') else unit}'s gradient is off by factors "
        f"{1 / max(weights):.2f} to {1 / min(weights):.2f}"
    )


def _exact_cause(
    counts: Sequence[int], unit: str, error: float, *, rounding: str = "float64 rounding"
) -> str:
    left = (
        "it is bitwise equal to the reference"
        if error == 0.0
        else f"what is left against the whole window's single forward and backward ({error:.1e}) is "
        f"{rounding}"
    )
    return (
        f"each micro-batch's summed loss is divided by the window's N = {sum(counts)} {unit}, counted "
        f"before the first backward: the full batch's objective; {left}"
    )


def _cause(kind: str, counts: Sequence[int], unit: str, error: float) -> str:
    if kind == "mean":
        return _mean_cause(counts, unit, error)
    if kind == "exact float32":  # DeepSpeed reduces no float64 gradient (gradaccum.audit.deepspeed)
        rounding = "float32 rounding: DeepSpeed's engine reduces float32 gradients"
        return _exact_cause(counts, unit, error, rounding=rounding)
    return _exact_cause(counts, unit, error)


@contextlib.contextmanager
def _framework_side_effects_undone() -> Iterator[None]:
    """The frameworks' warnings silenced, and the process environment given back as found (importing
    Lightning sets ``PYTORCH_NVML_BASED_CUDA_CHECK``; nothing here reads the variables)."""
    import os
    import warnings

    environ = dict(os.environ)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for name in set(os.environ) - set(environ):
            del os.environ[name]
        os.environ.update(environ)


def _trainer_cause(run: TrainerRun, error: float) -> str:
    report = run.report
    said = "; ".join(str(c) for c in report.causes) or (
        f"Trainer's count and its loss give the full batch's objective here; what is left "
        f"({error:.1e}) is float32 rounding: transformers' causal-LM loss computes in float32 "
        "(logits.float())"
    )
    if run.balanced:
        return (
            f"against the full batch's objective with the window's balancing term ({report.objective}: "
            f"the model's config asks for it, output_router_logits; loss_fn and the other rows leave it "
            f"out): {said}"
        )
    return said


def audit_stack(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    count_fn: CountFn,
    *,
    micro_batch: int,
    workload: str = "",
    unit: str = "units",
    progress: Progress | None = None,
    rows: Sequence[str] | None = None,
    causal_lm: CausalLMLoss | None = None,
) -> StackAudit:
    """Every installed framework's accumulation recipe on one window (``batch`` cut into micro-batches
    of ``micro_batch``) against the full batch's gradient, float64 (module docstring). ``model`` is
    copied; it, its gradients and the random state are left as they were. ``progress`` is called with
    one line per recipe. ``rows``: the names of the rows to run (:func:`gradaccum.audit.rows.select_rows`;
    ``None``: every row). ``causal_lm``: an ``hf:`` workload's loss, which the
    ``transformers-trainer`` row needs (without it that row is reported as not run)."""
    from gradaccum.batch import cast, split

    chosen = [row for row in ROWS if rows is None or row.name in rows]
    data = cast(batch, torch.float64)
    micro = split(data, micro_batch)
    counts = tuple(host_count(count_fn(mb), f"micro-batch {j}") for j, mb in enumerate(micro))
    out: list[RecipeRow] = []
    runs = _recipes()
    with preserved_rng(), contextlib.ExitStack() as stack:
        kernel = kernel_words(fused_kernel(model))
        base = float64_copy(model, stack)
        reference = whole_batch_gradient(copy.deepcopy(base), data, loss_fn, count_fn)
        for row in chosen:
            recipe, framework, module = row.recipe, row.framework, row.module
            if not _installed(module):
                out.append(
                    RecipeRow(
                        recipe=recipe,
                        framework=framework,
                        status="not installed",
                        error=None,
                        cause=f"not installed (importlib.util.find_spec({module!r}) is None)",
                        name=row.name,
                    )
                )
                if progress is not None:
                    progress(f"{recipe}: {framework} is not installed")
                continue
            if progress is not None:
                progress(f"{recipe} ({framework}) on {len(micro)} micro-batches ...")
            try:
                with _framework_side_effects_undone():
                    if row.name == TRAINER_ROW:
                        trained = run_trainer(
                            copy.deepcopy(base), micro, micro_batch=micro_batch, loss=causal_lm
                        )
                        got = trained.grads
                    else:
                        run, kind = runs[row.name]
                        got = run(copy.deepcopy(base), micro, loss_fn, count_fn)
            except NotRun as exc:
                out.append(
                    RecipeRow(
                        recipe=recipe,
                        framework=framework,
                        status="not run",
                        error=None,
                        cause=str(exc),
                        name=row.name,
                    )
                )
                if progress is not None:
                    progress(f"  not run: {exc}")
                continue
            if row.name == TRAINER_ROW:
                error = trained.report.error if trained.balanced else rel_l2(got, reference)
                assert error is not None  # run_trainer raises NotRun for an unmeasured window
                cause = _trainer_cause(trained, error)
            else:
                error = rel_l2(got, reference)
                cause = _cause(kind, counts, unit, error)
            out.append(
                RecipeRow(
                    recipe=recipe,
                    framework=framework,
                    status="measured",
                    error=error,
                    cause=cause,
                    version=_version(module),
                    name=row.name,
                )
            )
            if progress is not None:
                progress(f"  update error {error:.2e}")
    units = sum(counts)
    copy_words = "a float64 deep copy of the model, train mode kept, every dropout probability set to 0"
    return StackAudit(
        workload=workload,
        objective=f"loss_fn summed over every counted {unit[:-1] if unit.endswith('s') else unit} of the "
        f"window / N (N = {units}), float64",
        window=f"{len(micro)} micro-batches of {micro_batch}, {batch_size(batch)} examples, {units} {unit} "
        f"(what count_fn counts, the units the loss sums over; per micro-batch {list(counts)})",
        counts=counts,
        model=copy_words + (f", {kernel}" if kernel else ""),
        rows=tuple(out),
        reference=REFERENCE,
        skipped=tuple(row.name for row in ROWS if row not in chosen),
    )
