"""The audit's ``transformers-trainer`` row: ``transformers.Trainer``'s own gradient accumulation on
an ``hf:`` workload's model and window.

A plain ``Trainer(gradient_accumulation_steps=k)`` is built on the audit's float64 copy of the model
(CPU, SGD-free: nothing steps), and the audit's micro-batches run through its own
``get_batch_samples`` (its count ``num_items_in_batch``) and ``training_step`` (its
``compute_loss``: the model's own causal-LM loss), as Trainer's loop calls them:
:func:`gradaccum.audit.trainer.audit_window`, what ``audit_trainer`` runs on a trainer's first
window, with its measured causes. The row's figure is the gradient the optimizer would receive
against the audit's reference, the same as every row's; for a model whose config asks for its
balancing loss (``output_router_logits``) the Trainer trains on that term too, which the
workload's ``loss_fn`` leaves out, so its figure is against ``audit_trainer``'s objective with the
window's balancing term instead (the row says so).

Run only where Trainer's objective is the workload's: an ``hf:`` workload's padded rows under
``token`` normalization. Packed rows (Trainer hands the model ``position_ids`` but no document mask)
and ``sequence``/``document`` normalization (Trainer's loss is a token mean) are reported as not
run, with the reason.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from gradaccum.audit.deepspeed import NotRun
from gradaccum.audit.measure import accelerate_state_kept
from gradaccum.audit.report import AuditReport
from gradaccum.batch import Batch, batch_size
from gradaccum.loss import CausalLMLoss

__all__ = ["TrainerRun", "run_trainer"]


@dataclass(frozen=True, slots=True)
class TrainerRun:
    """What the Trainer's window gave."""

    grads: list[torch.Tensor]
    """The accumulated gradient its optimizer would receive, float64, in parameter order."""
    report: AuditReport
    """``audit_trainer``'s report on the same window: its error, objective and measured causes."""
    balanced: bool
    """Whether the model's config asks for its balancing loss (the report's objective holds it)."""


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' log at errors only, and DeepSpeed's logger (which Trainer's set-up imports:
    "Setting accelerator to CPU" on its stdout) off, both given back as found."""
    import logging

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    deepspeed = logging.getLogger("DeepSpeed")  # the very logger DeepSpeed configures at import
    disabled = deepspeed.disabled
    deepspeed.disabled = True
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        deepspeed.disabled = disabled


def _stack(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([e[key] for e in examples]) for key in examples[0]}


def _refusal(model: nn.Module, micro: Sequence[Batch], loss: CausalLMLoss | None) -> str | None:
    from transformers import PreTrainedModel

    if loss is None or not isinstance(model, PreTrainedModel):
        return (
            "runs on hf: workloads only (a transformers model trained on its own causal-LM loss, which "
            "is the workload's CausalLMLoss there); this workload's loss_fn is its own"
        )
    if loss.normalization != "token":
        return (
            f"Trainer's loss is the mean over the window's tokens (num_items_in_batch); the workload's "
            f"{loss.normalization!r} normalization is another objective (audit with --normalization token)"
        )
    if not loss.shift:
        return "Trainer's causal-LM loss shifts the labels; this workload's are already aligned"
    if any(isinstance(mb, dict) and "position_ids" in mb for mb in micro):
        return (
            "packed rows: Trainer hands the model position_ids without the workload's document mask, "
            "so attention crosses the documents of a row (audit padded rows: leave out --pack)"
        )
    return None


def run_trainer(
    model: nn.Module, micro: Sequence[Batch], *, micro_batch: int, loss: CausalLMLoss | None
) -> TrainerRun:
    """A plain ``transformers.Trainer``'s accumulation of ``micro`` on ``model`` (the audit's float64
    copy; copied again inside), or :class:`NotRun` with the reason (module docstring)."""
    why = _refusal(model, micro, loss)
    if why is not None:
        raise NotRun(why)
    from transformers import Trainer, TrainingArguments

    from gradaccum.audit.trainer import audit_window
    from gradaccum.integrations.trainer_balance import trainer_balance

    rows: list[Any] = [
        {key: value[i] for key, value in mb.items()} for mb in micro for i in range(batch_size(mb))
    ]
    with (
        tempfile.TemporaryDirectory() as out,
        accelerate_state_kept(),
        _quiet_transformers(),
        contextlib.ExitStack() as stack,
    ):
        args = TrainingArguments(
            output_dir=out,
            report_to=[],
            use_cpu=True,
            per_device_train_batch_size=micro_batch,
            gradient_accumulation_steps=len(micro),
            max_steps=1,
            max_grad_norm=0.0,
            save_strategy="no",
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=_stack)
        report, grads = audit_window(
            trainer, micro, stack, where="the audit's window (the micro-batches every row runs)"
        )
        balanced = trainer_balance(model, args.device) is not None
    if report.error is None:
        raise NotRun(report.unaudited)
    return TrainerRun(grads=grads, report=report, balanced=balanced)
