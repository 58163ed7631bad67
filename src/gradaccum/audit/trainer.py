"""``audit_trainer(trainer)``: how far a ``transformers.Trainer``'s own accumulation is from the full batch.

The trainer's first window (its own sampler and collator, ``gradient_accumulation_steps``
micro-batches) runs through the trainer's own ``get_batch_samples`` and ``training_step`` (so its
``compute_loss`` and its count ``num_items_in_batch``), on a float64 copy of its model with every
random source off. What is compared is the accumulated gradient, the one the optimizer receives at
the end of the window (before clipping: an SGD-like view of the first update's direction), against
the gradient of the same examples' full-batch objective (:mod:`gradaccum.audit.objective`). The same
window then runs through ``exact_trainer(type(trainer))`` built from the trainer's own arguments,
collator, data and loss function on another float64 copy: ``exact_error``.

Causes are measured, not guessed: the trainer's path is recomputed with one fix at a time, in order,
each on top of the ones before:

1. the denominator: each micro-batch weighted by its share of the window's N targets
   (``num_items_in_batch = N`` for a loss divided by it; ``current_gradient_accumulation_steps =
   N / n_j`` for a per-micro-batch mean, which Trainer divides by it);
2. the balancing term (a routing model): the model's own per-micro-batch term off, the window's
   term added.

A cause's share is the error its fix removes, over the error before any fix. The user's trainer and
model are left as they were: the trainer's path runs on a shallow copy of the trainer whose model
is the float64 copy, the random states are restored, and the data loader the audit opened is closed.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from transformers import Trainer

from gradaccum.audit.measure import float64_copy, gradients, norm, preserved_rng, rel_l2
from gradaccum.audit.objective import FullBatch, Routing, full_batch
from gradaccum.audit.report import AuditReport, Cause
from gradaccum.errors import ConfigError
from gradaccum.integrations.trainer_balance import trainer_balance
from gradaccum.integrations.transformers import ExactTrainer, exact_trainer
from gradaccum.loss import valid_tokens
from gradaccum.workloads.experts import fused_kernel, kernel_words

__all__ = ["EXACT_BOUND", "audit_trainer", "audit_window"]

EXACT_BOUND = 1e-6
"""An error at or below this is reported with no cause: transformers' causal-LM loss computes in
float32 (``logits.float()``) even for a float64 model, one ulp (6e-8) per token; gradaccum's exact
path measures 4e-8 there. Anything a cause explains is orders of magnitude above."""

_CONSTRUCTOR = ("args", "data_collator", "train_dataset", "processing_class", "compute_loss_func")
"""The trainer attributes ``exact_trainer(type(trainer))`` is rebuilt from, besides the model."""


def audit_trainer(trainer: Trainer) -> AuditReport:
    """Audit ``trainer``'s gradient accumulation for one optimizer update (see the module docstring)."""
    if not isinstance(trainer, Trainer):
        raise ConfigError(f"audit_trainer takes a transformers.Trainer, got {type(trainer).__name__}")
    name = type(trainer).__name__
    k = int(trainer.args.gradient_accumulation_steps)
    with preserved_rng(), contextlib.ExitStack() as stack:
        micro = _first_window(trainer, k)
        if not micro:
            raise ConfigError(f"audit_trainer needs training data; {name}'s train dataloader is empty")
        first = micro[0]
        if not hasattr(first, "keys") or not ({"labels", "shift_labels"} & set(first.keys())):
            keys = sorted(first.keys()) if hasattr(first, "keys") else type(first).__name__
            return AuditReport(
                recipe=name,
                error=None,
                exact_error=None,
                unaudited=(
                    f"{name}'s micro-batches hold {keys}, no 'labels': its objective is not a token "
                    "loss over labels (TRL's DPO and GRPO trainers compute their own from preference "
                    f"pairs or rollouts). Check it with exact_trainer({name}).verify_accumulation(), "
                    "which compares its update with one full batch of its own objective."
                ),
            )
        examples = k * int(trainer.args.per_device_train_batch_size)
        where = (
            "the first window the trainer's own train dataloader draws (its sampler's order and its "
            f"collator; verify_accumulation checks the training set's first {examples} examples in "
            "dataset order, another window)"
        )
        report, _ = audit_window(trainer, micro, stack, where=where)
        return report


def audit_window(
    trainer: Trainer, micro: Sequence[Any], stack: contextlib.ExitStack, *, where: str
) -> tuple[AuditReport, list[torch.Tensor]]:
    """``trainer``'s own accumulation over the micro-batches ``micro`` on float64 copies of its model
    (the copies live while ``stack`` is open), against the full batch's objective: the report, and
    the gradient the trainer's optimizer would receive. ``where`` says which window ``micro`` is."""
    name = type(trainer).__name__
    device = trainer.args.device
    core = trainer.accelerator.unwrap_model(trainer.model)
    kernel = kernel_words(fused_kernel(core))
    model = float64_copy(core, stack)
    exact, why_not = _exact_twin(trainer, float64_copy(core, stack))
    if exact is None:
        return AuditReport(recipe=name, error=None, exact_error=None, unaudited=why_not), []
    counts = [int(exact.count(mb)) for mb in micro]
    balance = trainer_balance(model, device)
    config: Any = getattr(model, "config", None)
    routing = None
    if balance is not None:
        routing = Routing(coef=float(config.router_aux_loss_coef), top_k=int(config.num_experts_per_tok))
    reference = full_batch(
        model,
        micro,
        trainer._prepare_inputs,
        shift=exact.label_shift,
        ignore_index=exact.exact.ignore_index,
        smoothing=float(trainer.args.label_smoothing_factor),
        routing=routing,
    )
    twin = _twin(trainer, model, device)
    own = _run(twin, model, micro)
    error = rel_l2(own.grads, reference.grads)
    exact_error = rel_l2(_exact_run(exact, micro), reference.grads)
    units = sum(counts)
    targets = (
        "target tokens (labels != -100 that a position predicts, after the causal shift)"
        if exact.label_shift
        else "target tokens (labels != -100)"
    )
    window = (
        f"{where}: {len(micro)} micro-batches, {sum(_rows(mb) for mb in micro)} examples, {units} "
        f"{targets}, per micro-batch {counts}"
    )
    objective = "token cross-entropy summed over the window's targets / N" + (
        f" + {routing.coef:g} x the balancing loss over the whole window" if routing else ""
    )
    copy_words = "a float64 deep copy of the model, dropout off" + (f", {kernel}" if kernel else "")
    reference_words = (
        f"the objective written out in float64 on {copy_words}, apart from the trainer's compute_loss "
        "(gradaccum.audit.objective): each micro-batch's summed cross-entropy divided once by the "
        "window's N" + (", the balancing term from the whole window's routing statistics" if routing else "")
    )
    causes: list[Cause] = []
    residual = None
    if error > EXACT_BOUND:
        causes, residual = _causes(twin, model, micro, own, reference, counts, balance, error)
    report = AuditReport(
        recipe=name,
        error=error,
        exact_error=exact_error,
        causes=tuple(causes),
        objective=objective,
        window=window,
        residual=residual,
        reference=reference_words,
    )
    return report, own.grads


# -- the window, the copies ----------------------------------------------------------------------


def _first_window(trainer: Trainer, k: int) -> list[Any]:
    """The first ``k`` micro-batches of the trainer's own train dataloader (sampler and collator);
    the loader is closed again and taken off the accelerator's list."""
    accelerator = trainer.accelerator
    registered = getattr(accelerator, "_dataloaders", None)
    before = None if registered is None else len(registered)
    loader = trainer.get_train_dataloader()
    try:
        return list(itertools.islice(iter(loader), k))
    finally:
        end = getattr(loader, "end", None)
        if callable(end):
            end()  # Accelerate's shard registers itself with the gradient state while it iterates
        if registered is not None and before is not None:
            del registered[before:]


def _twin(trainer: Trainer, model: nn.Module, device: torch.device) -> Trainer:
    """A shallow copy of ``trainer`` that trains ``model``: the user's trainer keeps its attributes."""
    twin = copy.copy(trainer)
    twin.model = twin.model_wrapped = model
    if isinstance(twin, ExactTrainer):  # its routing pass and window belong to the model it trains
        twin.balance = trainer_balance(model, device)
        twin._window = None
    return twin


def _exact_twin(trainer: Trainer, model: nn.Module) -> tuple[ExactTrainer | None, str]:
    """``exact_trainer(type(trainer))`` built on ``model`` from the trainer's own arguments."""
    cls = exact_trainer(type(trainer))
    params = inspect.signature(cls.__init__).parameters
    kwargs: dict[str, Any] = {"model": model}
    kwargs.update({n: getattr(trainer, n) for n in _CONSTRUCTOR if n in params and hasattr(trainer, n)})
    if isinstance(trainer, ExactTrainer):
        kwargs["exact"] = trainer.exact
    try:
        return cls(**kwargs), ""
    except Exception as exc:  # a subclass whose constructor needs more than Trainer's arguments
        return None, (
            f"exact_trainer({type(trainer).__name__}) could not be built from the trainer's "
            f"{', '.join(sorted(kwargs))} ({type(exc).__name__}: {exc}); without it the targets "
            "the loss predicts are not counted"
        )


def _rows(mb: Any) -> int:
    labels = mb["shift_labels"] if "shift_labels" in mb else mb["labels"]
    return int(labels.shape[0])


# -- the runs --------------------------------------------------------------------------------------


class _Run:
    """One pass of the trainer's path over the window: its gradient and the count it used."""

    def __init__(self, grads: list[torch.Tensor], items: Any) -> None:
        self.grads = grads
        self.items = items


def _run(
    twin: Trainer,
    model: nn.Module,
    micro: Sequence[Any],
    *,
    items: float | None = None,
    divisors: Sequence[float] | None = None,
    term_off: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
) -> _Run:
    """The trainer's own window: ``get_batch_samples`` (its count), then ``training_step`` per
    micro-batch, as Trainer's loop calls them; a fix replaces the count or the per-micro-batch
    divisor, or turns the model's own balancing term off."""
    model.zero_grad(set_to_none=True)
    batch, counted = twin.get_batch_samples(iter(micro), len(micro), twin.args.device)
    if items is not None:
        counted = torch.tensor(items, dtype=torch.float64, device=twin.args.device)
    twin.current_gradient_accumulation_steps = len(batch)
    with term_off() if term_off is not None else contextlib.nullcontext():
        for j, mb in enumerate(batch):
            if divisors is not None:
                twin.current_gradient_accumulation_steps = divisors[j]
            twin.training_step(model, mb, counted)
    grads = gradients(model)
    model.zero_grad(set_to_none=True)
    return _Run(grads, counted)


def _exact_run(exact: ExactTrainer, micro: Sequence[Any]) -> list[torch.Tensor]:
    model = exact.model
    assert isinstance(model, nn.Module)  # audit_trainer built it on a float64 copy
    return _run(exact, model, micro).grads


# -- the causes ------------------------------------------------------------------------------------


def _causes(
    twin: Trainer,
    model: nn.Module,
    micro: Sequence[Any],
    own: _Run,
    reference: FullBatch,
    counts: Sequence[int],
    balance: Any,
    error: float,
) -> tuple[list[Cause], float]:
    k, units = len(micro), reference.units
    causes: list[Cause] = []
    fix: dict[str, Any] = {}
    if own.items is not None:  # the loss is divided by the trainer's count, once per window
        fix["items"] = float(units)
    else:  # a per-micro-batch mean, which Trainer divides by k
        fix["divisors"] = [units / max(n, 1) for n in counts]
    fixed = _run(twin, model, micro, **fix)
    e_count = rel_l2(fixed.grads, reference.grads)
    if e_count < error:
        causes.append(
            Cause(sentence=_count_sentence(own, micro, counts, units, k), share=(error - e_count) / error)
        )
    else:
        fix, e_count = {}, error
    left = e_count
    if balance is not None and reference.balance_grads is not None:
        without = _run(twin, model, micro, term_off=balance.own_term_off, **fix)
        with_own = fixed if fix else own
        own_term = [a - b for a, b in zip(with_own.grads, without.grads, strict=True)]
        balanced = [a + b for a, b in zip(without.grads, reference.balance_grads, strict=True)]
        e_balance = rel_l2(balanced, reference.grads)
        ratio = norm(own_term) / max(norm(reference.balance_grads), 1e-300)
        config: Any = model.config
        coef = float(config.router_aux_loss_coef)
        causes.append(
            Cause(
                sentence=(
                    f"the router balancing loss (router_aux_loss_coef {coef:g}) is computed from each "
                    f"micro-batch's own routing statistics (expert fractions f and mean probabilities P "
                    f"over its tokens) and enters once per micro-batch, {k} terms, where the full batch "
                    "has one term over the window's statistics; the gradient it adds is "
                    f"{ratio:.2f}x the window term's in norm"
                ),
                share=(left - e_balance) / error,
            )
        )
        left = e_balance
    if left > EXACT_BOUND:
        causes.append(
            Cause(
                sentence=(
                    "a remainder no count or balancing fix removes: a term the trainer's compute_loss "
                    "computes per micro-batch, per-micro-batch statistics (normalization), or a lower "
                    "precision under the trainer's autocast"
                ),
                share=left / error,
            )
        )
    return causes, left


def _count_sentence(own: _Run, micro: Sequence[Any], counts: Sequence[int], units: int, k: int) -> str:
    if own.items is None:
        weights = [k * n / units for n in counts]
        return (
            f"compute_loss returns each micro-batch's mean over its own tokens and Trainer divides it "
            f"by gradient_accumulation_steps = {k}: micro-batch j weighs 1/{k} instead of n_j/N "
            f"(n_j = {list(counts)}, N = {units}), so the micro-batches' weights are off by factors "
            f"{min(weights):.2f} to {max(weights):.2f}"
        )
    items = float(own.items)
    unshifted = sum(int(valid_tokens(_labels(mb), shift=False)) for mb in micro)
    rows = sum(int(_labels(mb).ne(-100).any(dim=-1).sum()) for mb in micro)
    what = (
        f"its count of labels != -100 without the causal shift, which counts each of the {rows} "
        "rows' first label though no position predicts it"
        if round(items) == unshifted and unshifted != units
        else "its count of the window's labels"
    )
    return (
        f"Trainer divides the window's summed loss by num_items_in_batch = {items:g} ({what}); the "
        f"loss predicts N = {units} targets, so every token's gradient is {units}/{items:g} = "
        f"{units / items:.3f} of the full batch's"
    )


def _labels(mb: Any) -> torch.Tensor:
    return mb["shift_labels"] if "shift_labels" in mb else mb["labels"]
