"""``ExactTrainer.verify_accumulation``: the trainer's own window against one full batch, in float64.

From two copies of the model (dropout off), :func:`gradaccum.check.equivalence.verify` runs the
full batch once through ``compute_loss`` (``num_items_in_batch`` its count) and the window of
micro-batches through the trainer's own ``get_batch_samples`` count and ``training_step``, and
compares gradients before the update and parameters after one SGD step.

A routing (mixture-of-experts) model whose config asks for its balancing loss
(``output_router_logits=True``) trains with the window's exact term
(:mod:`gradaccum.integrations.trainer_balance`), so the check compares against the full batch's
objective with that term in it: the reference is the full batch's loss (the model's own
per-forward term off) plus ``coef * E * sum_i f_i P_i`` from the whole batch's routing statistics,
and the window runs the trainer's routing pass, agreed statistics and per-micro-batch terms on the
candidate copy (scaled for this one process, whatever the job's world size).

A transformers MoE whose experts run on a fused kernel (``grouped_mm``, the default) is checked
with its copies' experts on the eager kernel, which computes the same function in float64
(:func:`gradaccum.workloads.experts.eager_experts_on`); the trainer's model keeps its own.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from gradaccum.batch import to_device
from gradaccum.check.equivalence import verify
from gradaccum.check.report import EquivalenceReport
from gradaccum.errors import ConfigError
from gradaccum.integrations.trainer_balance import trainer_balance, whole_batch_term
from gradaccum.workloads.experts import EAGER_FIX, eager_experts_on

__all__ = ["verify_trainer"]

_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def verify_trainer(
    trainer: Any,  # an ExactTrainer (typed loosely: gradaccum.integrations.transformers imports this)
    examples: Sequence[Any] | None = None,
    *,
    optimizer_factory: Callable[[Any], torch.optim.Optimizer] | None = None,
    seed: int = 0,
) -> EquivalenceReport:
    """:meth:`ExactTrainer.verify_accumulation` (see there and the module docstring)."""
    if trainer.accelerator.scaler is not None:
        raise ConfigError(
            "verify_accumulation runs in float64, but this trainer's fp16 GradScaler would scale its "
            "gradients. Run the check from a trainer built with fp16=False (bf16 is fine)."
        )
    routing = trainer.balance is not None
    k, m = trainer.args.gradient_accumulation_steps, trainer.args.per_device_train_batch_size
    loader = trainer.get_train_dataloader()
    if examples is None:
        examples = _first_examples(loader.dataset, k * m)
    examples = list(examples)
    if not examples:
        raise ConfigError("verify_accumulation needs at least one example; the training set has none")
    batch = trainer._verification_layout(loader.collate_fn(examples))
    sizes = [m] * (len(examples) // m) + ([len(examples) % m] if len(examples) % m else [])
    initial = trainer._verification_copy()
    # the float64 copies run a transformers MoE's experts on the eager kernel (the fused ones take
    # no float64); the trainer's own model keeps its kernel
    eager_experts_on(initial, what="verify_accumulation's float64 copies", fix=EAGER_FIX, error=ConfigError)
    for module in initial.modules():
        if isinstance(module, _DROPOUTS):
            module.p = 0.0  # training_step calls model.train(), which would switch eval() back
    saved = (trainer.loss_form, trainer._window, trainer.loss_is_scaled_for_ga, trainer.balance)
    saved_steps = getattr(trainer, "current_gradient_accumulation_steps", None)
    device = trainer.args.device

    def loss_fn(model: nn.Module, micro_batch: Any) -> torch.Tensor:
        # the loss this trainer means on one batch, summed over its counted units; a routing model's
        # objective adds the balancing term of this batch's own routing (once, so times the count)
        micro_batch = trainer._training_layout(micro_batch)
        n = float(trainer.count(micro_batch))
        items = torch.tensor(max(n, 1.0), dtype=torch.float64, device=device)

        def forward() -> torch.Tensor:
            loss = trainer.compute_loss(model, dict(micro_batch), num_items_in_batch=items)
            return loss[0] if isinstance(loss, tuple) else loss

        if not routing:
            return forward() * items
        loss, term = whole_batch_term(model, micro_batch, forward)
        return (loss + term.to(loss.dtype)) * items

    def trainer_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro: list[Any]) -> None:
        micro = [trainer._training_layout(mb) for mb in micro]
        trainer.loss_form = None
        if routing:  # the window's exact term on this copy, scaled for this one process
            balance = trainer_balance(model, device, world=1)  # no DDP averaging to undo here
            if balance is None:
                raise ConfigError(
                    "verify_accumulation: the model copy no longer asks for its balancing loss "
                    "(output_router_logits); the check needs the model as the trainer trains it"
                )
            trainer.balance = balance
        trainer._window = trainer._count_window(micro, device, model, 1)  # this process alone
        optimizer.zero_grad(set_to_none=True)
        for mb in micro:
            trainer.training_step(model, mb, trainer._window.divisor)
        optimizer.step()

    trainer_step.__qualname__ = f"{type(trainer).__name__}.training_step"
    try:
        report = verify(
            lambda: copy.deepcopy(initial),
            to_device(batch, device),
            loss_fn,
            trainer._layout_count,
            sizes=sizes,
            optimizer_factory=optimizer_factory,
            device=device,
            candidate_step=trainer_step,
            seed=seed,
            name=type(trainer).__name__,
            unit="tokens" if trainer.exact.count_fn is None else "units",
        )
        form = trainer.loss_form
    finally:
        trainer.loss_form, trainer._window, trainer.loss_is_scaled_for_ga, trainer.balance = saved
        if saved_steps is not None:
            trainer.current_gradient_accumulation_steps = saved_steps
    if report.passed:
        return report
    return dataclasses.replace(
        report, likely_causes=(*_form_causes(trainer, form, report), *report.likely_causes)
    )


def _first_examples(dataset: Any, n: int) -> list[Any]:
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        return [dataset[i] for i in range(min(n, len(dataset)))]
    return list(itertools.islice(iter(dataset), n))


def _form_causes(trainer: Any, form: str | None, report: EquivalenceReport) -> list[str]:
    """What the loss-form measurement says about a failed check, as the first likely cause."""
    name = f"{type(trainer).__name__}.compute_loss"
    if form == "mean":
        return [
            f"{name} ignores num_items_in_batch (a per-micro-batch mean), so ExactTrainer multiplies "
            f"each value back by the micro-batch's count of {report.unit} ({list(report.counts)}). The "
            "check failing means that mean is not over those units (padding counted, or another "
            "count): return the loss summed over the counted units divided by num_items_in_batch, or "
            "pass exact=ExactConfig(count_fn=...) counting what the loss averages over."
        ]
    if form == "sum":
        return [
            f"{name} divides by num_items_in_batch, yet the micro-batches do not add up to the full "
            "batch: a term computed per micro-batch (a regularizer, an auxiliary loss, a mean inside "
            "the sum) enters once per micro-batch instead of once per update."
        ]
    return []
