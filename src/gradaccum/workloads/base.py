"""The :class:`Workload` type: everything gradaccum needs to check, measure or train one model on one
loss, and the contract a workload's functions meet.

It lives here, below both :mod:`gradaccum.check.workload` (which loads a workload a spec names) and
the ``hf:`` builder (:mod:`gradaccum.workloads.hf`, which returns one), so neither imports the other
to name the type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from gradaccum.batch import Batch
from gradaccum.errors import WorkloadError
from gradaccum.fielddocs import document_fields
from gradaccum.step.accumulator import CountFn, LossFn
from gradaccum.values import require_int

__all__ = ["OptimizerFactory", "Workload", "sgd"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Plain SGD, lr 0.1: an update that shows gradient differences one-to-one."""
    return torch.optim.SGD(params, lr=0.1)


@document_fields
@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model factory, a source of examples, and the loss and count that define the objective.

    Every command takes one (``--workload MODULE:FUNCTION``, a function of no arguments returning
    a Workload; or ``--workload hf:MODEL_DIR --data FILE``). The contract:

    * ``make_batch(n_examples, seed)`` returns ``n_examples`` examples: a tensor, or a tuple, list or
      mapping of tensors that share dim 0, the same for the same seed. gradaccum cuts it into
      micro-batches along dim 0 (``gradaccum.split``), so each example must stand alone: a sequence
      or document must not continue in another example.
    * ``loss_fn(model, micro_batch)`` returns the loss **summed** over the micro-batch's counted
      units (``reduction="sum"``), not their mean. The step divides once by N, the window's count
      over every micro-batch and rank, agreed before the first backward: the full-batch mean is
      (1/N) sum_j sum_{t in B_j} l_t, so each micro-batch must hand over its sum. A mean divided
      by k weighs a micro-batch of few units like one of many (a mean of means), and the mean of
      an all-padding micro-batch is NaN where its sum is an exact 0.
    * ``count_fn(micro_batch)`` returns how many units that sum covers (an int or an integer tensor);
      counts add up over micro-batches to the whole batch's count.
    * The shift: transformers' causal LMs take ``labels`` equal to ``input_ids`` and predict
      token t+1 from position t, so a row of L tokens has L - 1 targets. Count and sum with
      ``shift=True`` (``count_tokens("labels", shift=True)``, ``summed_cross_entropy(..., shift=True)``,
      or ``gradaccum.CausalLMLoss``); counting the unshifted labels counts one target too many per row.

    >>> def my_workload() -> gradaccum.Workload:
    ...     loss = gradaccum.CausalLMLoss("token")
    ...     return gradaccum.Workload(
    ...         name="my-lm", build_model=build, make_batch=batches,
    ...         loss_fn=loss.loss_fn, count_fn=loss.count_fn, unit=loss.unit)

    docs/workloads.md ("Your own") has a complete, runnable example.
    """

    name: str
    """Short name shown in reports."""
    build_model: Callable[[], nn.Module]
    """Returns a fresh model with the same initial weights on every call (seed inside, e.g.
    torch.manual_seed in a torch.random.fork_rng block); the checks compare two of them."""
    make_batch: Callable[[int, int], Batch]
    """make_batch(n_examples, seed): n_examples examples sharing dim 0, deterministic in seed.
    Seed 0 is the verification batch; training and benchmarks draw further seeds."""
    loss_fn: LossFn
    """loss_fn(model, micro_batch): the loss SUMMED over the micro-batch's counted units (a 0-dim
    tensor that requires grad); the step divides by the window's global count."""
    count_fn: CountFn
    """count_fn(micro_batch): how many units loss_fn sums over (int or integer tensor)."""
    optimizer_factory: OptimizerFactory = sgd
    """Builds the optimizer from the model's parameters (default SGD, lr 0.1)."""
    batch_size: int = 8
    """Examples in the verification batch."""
    micro_batch: int = 2
    """Default micro-batch for verification."""
    unit: str = "tokens"
    """What count_fn counts, for reports ("tokens", "sequences", "documents", "examples")."""
    description: str = ""
    """One line on what the workload is and what it should show."""
    declared_hazards: tuple[str, ...] = ()
    """Batch couplings the scan cannot see in the modules, e.g. ("in-batch-negatives",)."""
    parallelize: Callable[[nn.Module, Any], nn.Module] | None = None
    """parallelize(model, mesh): tensor-parallelize and shard the model on a DeviceMesh (as the
    training job does), returning the module to step; what ``verify --mesh`` checks under torchrun."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Workload-specific objects other front ends may use: encode_fn and rep_loss_fn for
    verify --cached; documents (token-id sequences), seq_len and pad_id for verify --packed."""

    def __post_init__(self) -> None:
        for name in ("build_model", "make_batch", "loss_fn", "count_fn", "optimizer_factory"):
            if not callable(getattr(self, name)):
                raise WorkloadError(f"Workload {self.name!r}: {name} must be callable")
        for name in ("batch_size", "micro_batch"):
            require_int(f"Workload {self.name!r}: {name}", getattr(self, name), error=WorkloadError)

    def batch(self, seed: int = 0) -> Batch:
        """The verification batch (``batch_size`` examples drawn with ``seed``)."""
        return self.make_batch(self.batch_size, seed)
