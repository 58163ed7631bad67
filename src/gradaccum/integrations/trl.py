"""Exact accumulation in TRL: ``exact_trainer(trl.GRPOTrainer)`` and ``exact_trainer(trl.DPOTrainer)``.

What TRL 1.16's ``GRPOTrainer._compute_loss`` computes per micro-batch j of an update of k
micro-batches on W ranks, with the generation batch spread over M = steps_per_generation / k
updates (per-token losses l_t, rows B_j, response tokens n_j):

* ``grpo``/``sapo``: (1/B_j) sum_s mean_s / k: exact only when every micro-batch on every rank
  holds as many rows;
* ``bnpo``: sum l_t / n_j / k, a mean of per-micro-batch token means (by its own definition);
* ``dr_grpo``: sum l_t / (B_j L) / k; ``luspo``: sum_s sum_t l_t / B_j / k (same caveat as grpo);
* ``dapo``/``cispo``/``vespo``: sum l_t / (N_gen / W x k / steps_per_generation): every update is
  divided by the *average* count of the updates in its generation batch, N_gen / M, not its own.

Each is the micro-batch's weighted sum of per-token losses over a denominator, and the exact
aggregation (:mod:`gradaccum.rl.aggregation`) has the same weighted sum over another denominator,
so the exact loss is TRL's times a scalar: ``ExactGRPOTrainer`` counts the update's units (tokens
or sequences with a response token) over its micro-batches on all ranks before its first backward
(the generation batch is already generated and split, so every micro-batch of the update is known),
counted as TRL counts them: its sequence means divide by every row, a row whose completion is
masked out entirely (``mask_truncated_completions``, a tool mask) included (``empty_rows="counted"``
of :class:`gradaccum.rl.PolicyLoss`), so the update is TRL's own objective over the update's rows;
and multiplies TRL's loss by (TRL's denominator) x W / (the update's count). The aggregation is
picked from the ``loss_type``: token-mean for bnpo, dapo, cispo, vespo; seq-mean-token-mean for grpo,
sapo; seq-mean-token-sum-norm for dr_grpo (L = max_completion_length); seq-mean-token-sum for luspo.
``ExactGRPOConfig(normalize="generation")`` divides by N_gen / M instead (TRL's dapo already does).

``DPOTrainer`` averages each micro-batch's pairs and lets Trainer divide by k; ``ExactDPOTrainer``
is :class:`~gradaccum.integrations.transformers.ExactTrainer` counting pairs, so the update is the
mean over all its pairs on all ranks. The logged loss of both is the update's exact mean.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn as nn
from transformers import Trainer
from trl import DPOTrainer, GRPOTrainer
from trl.trainer.utils import FusedCausalLMOutput

from gradaccum.batch import fields
from gradaccum.check.equivalence import verify
from gradaccum.check.report import EquivalenceReport
from gradaccum.distributed import dist
from gradaccum.errors import ConfigError
from gradaccum.integrations import transformers as hf
from gradaccum.integrations.transformers import ExactConfig, ExactTrainer
from gradaccum.rl.aggregation import EmptyRows, unit_count, unit_name
from gradaccum.rl.rollout import ROLLOUT_NORMALIZATIONS, RolloutNormalization
from gradaccum.values import require_choice, settings_or_default

__all__ = [
    "EXACT_AGGREGATIONS",
    "TRL_EMPTY_ROWS",
    "ExactDPOTrainer",
    "ExactGRPOConfig",
    "ExactGRPOTrainer",
    "count_pairs",
    "exact_trainer",
    "policy_batch",
]

EXACT_AGGREGATIONS: dict[str, str] = {
    "grpo": "seq-mean-token-mean",
    "sapo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "cispo": "token-mean",
    "vespo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "luspo": "seq-mean-token-sum",
}
"""The exact aggregation ``ExactGRPOTrainer`` trains for each TRL ``loss_type``."""

_PER_ROW = ("grpo", "sapo", "dr_grpo", "luspo")  # TRL divides by the micro-batch's rows
TRL_EMPTY_ROWS: EmptyRows = "counted"
"""TRL 1.16's convention for a row without a completion token: its sequence means count it."""
_TRL_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
_TRL_OPTIONAL = ("old_per_token_logps", "ref_per_token_logps", "tool_mask")


@dataclass(frozen=True, kw_only=True, slots=True)
class ExactGRPOConfig:
    """How ``ExactGRPOTrainer`` normalizes each optimizer update."""

    normalize: RolloutNormalization = "update"
    """``update``: each update is the mean over its own units (what the papers define);
    ``generation``: over the generation batch's units per update, N_gen / M (TRL's dapo)."""

    def __post_init__(self) -> None:
        require_choice("ExactGRPOConfig.normalize", self.normalize, ROLLOUT_NORMALIZATIONS)


class ExactGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose every update follows the exact aggregation of its ``loss_type``
    (see the module docstring). Takes GRPOTrainer's arguments plus ``exact=ExactGRPOConfig(...)``;
    reward functions, generation and advantages are TRL's, untouched.

    Refused, with the reason: ``steps_per_generation`` not a multiple of
    ``gradient_accumulation_steps`` (an update spanning two generation batches cannot be counted
    before its first backward), the entropy bonus and a MoE auxiliary loss (per-micro-batch means
    added to the policy loss, which one scalar cannot correct), DeepSpeed.
    """

    def __init__(self, *args: Any, exact: ExactGRPOConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exact = settings_or_default("exact", exact, ExactGRPOConfig)
        self.exact_aggregation = _aggregation_of(self)
        """The aggregation trained (``EXACT_AGGREGATIONS[loss_type]``)."""
        _refuse_unsupported_grpo(self)
        self._exact_divisor: torch.Tensor | None = None

    @property
    def _generation_steps(self) -> int:
        """TRL's ``steps_per_generation``: micro-batch steps per generation batch (k x M)."""
        return int(cast(Any, self.args).steps_per_generation)

    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        loss = super()._compute_loss(model, inputs)
        if not cast(Any, self.model).training:
            return loss  # evaluation: TRL's own mean over the batch, no accumulation
        k = int(self.args.gradient_accumulation_steps)
        if int(self.current_gradient_accumulation_steps) != k:
            raise ConfigError(
                f"{type(self).__name__}: this update holds {self.current_gradient_accumulation_steps} "
                f"micro-batches, not gradient_accumulation_steps={k} (a short last window of an epoch), "
                "so it does not cover whole slices of a generation batch. Set max_steps, or a dataset "
                "size that fills every update."
            )
        if self._step % k == 0 or self._exact_divisor is None:
            self._exact_divisor = self._update_divisor(_loss_mask(inputs).device)
        world = int(self.accelerator.num_processes)
        # TRL's loss is (weighted sum) / (its denominator); the exact one is (weighted sum) x W / D
        return loss * self._trl_denominator(inputs, world) * world / self._exact_divisor

    def _trl_denominator(self, inputs: Mapping[str, Any], world: int) -> torch.Tensor:
        """What TRL divides this micro-batch's weighted sum of per-token losses by (module docstring)."""
        mask = _loss_mask(inputs)
        k = int(self.current_gradient_accumulation_steps)
        if self.loss_type in _PER_ROW:
            return torch.tensor(float(mask.shape[0] * k), dtype=torch.float64, device=mask.device)
        if self.loss_type == "bnpo":
            return mask.sum().to(torch.float64).clamp(min=1.0) * k
        # dapo, cispo, vespo: the generation batch's count rescaled to one update
        n_gen = torch.as_tensor(inputs["num_items_in_batch"], device=mask.device).to(torch.float64)
        return n_gen.clamp(min=1.0) / world * k / self._generation_steps

    def _update_divisor(self, device: torch.device) -> torch.Tensor:
        """The update's count of units on all ranks (``update``), or the generation batch's count
        over M (``generation``); one all-reduce, at the update's first micro-batch."""
        k = int(self.args.gradient_accumulation_steps)
        slices = self._buffered_inputs
        if slices is None:
            raise ConfigError(f"{type(self).__name__}: no generation batch is buffered for this update")
        position = int(self._step) % self._generation_steps
        start = position - position % k
        aggregation = self.exact_aggregation
        counts = [unit_count(_loss_mask(s), aggregation, TRL_EMPTY_ROWS).to(device) for s in slices]
        local = torch.stack([torch.stack(counts[start : start + k]).sum(), torch.stack(counts).sum()])
        total = dist.all_reduce_sum_(local.to(torch.float64), what="the update's unit counts")
        if self.exact.normalize == "generation":
            return (total[1] / (self._generation_steps // k)).clamp(min=1.0)
        # an update without any unit has nothing to average: its loss is zero, never NaN
        return total[0].clamp(min=1.0)

    def verify_accumulation(self, *, seed: int = 0) -> EquivalenceReport:
        """Does this trainer's accumulated update equal one pass over the same rollout?

        On the first update's slices of a generation batch (the buffered one, or one generated
        now), from float64 copies of the model: the reference runs TRL's per-token loss over the
        update's rows in one batch, summed with the exact aggregation's weights and divided by the
        update's units; the candidate is this trainer's own ``_compute_loss``, micro-batch by
        micro-batch. Gradients and one SGD step are compared (:func:`gradaccum.verify`). On this
        process alone, normalized per update; the trainer is left as it was.
        """
        k = int(self.args.gradient_accumulation_steps)
        trained: Any = self.model
        saved = (
            self._exact_divisor,
            self._step,
            self._buffered_inputs,
            self.exact,
            trained.training,
            getattr(self, "current_gradient_accumulation_steps", None),
        )
        trained.train()
        self.current_gradient_accumulation_steps = k
        if self._buffered_inputs is None:
            self._prepare_inputs(next(iter(self.get_train_dataloader())))

        slices: list[dict[str, Any]] = list(self._buffered_inputs or [])[:k]
        batch = {key: torch.cat([s[key] for s in slices]) for key in _keys(slices[0])}
        sizes = [int(s["completion_ids"].shape[0]) for s in slices]
        temperature = float(cast(Any, self.args).temperature)
        start = _Float64Head(copy.deepcopy(self.accelerator.unwrap_model(trained)), temperature)
        self.exact = ExactGRPOConfig()  # the check compares one update with its own full batch

        def loss_fn(model: nn.Module, micro_batch: Any) -> torch.Tensor:
            # TRL's loss on these rows as one micro-batch, times its denominator: the weighted sum
            inputs = {**micro_batch, "num_items_in_batch": _loss_mask(micro_batch).sum()}
            return GRPOTrainer._compute_loss(self, model, inputs) * self._trl_denominator(inputs, 1)

        def count_fn(micro_batch: Any) -> torch.Tensor:
            return unit_count(_loss_mask(micro_batch), self.exact_aggregation, TRL_EMPTY_ROWS)

        def trainer_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro: list[Any]) -> None:
            self._buffered_inputs = list(micro)  # type: ignore[assignment]
            self._exact_divisor = None
            items = torch.stack([_loss_mask(mb).sum() for mb in micro]).sum()  # what TRL hands dapo
            optimizer.zero_grad(set_to_none=True)
            for step, mb in enumerate(micro):
                self._step = step
                self._compute_loss(model, {**mb, "num_items_in_batch": items}).backward()
            optimizer.step()

        trainer_step.__qualname__ = f"{type(self).__name__}._compute_loss"
        try:
            return verify(
                lambda: copy.deepcopy(start),
                batch,
                loss_fn,
                count_fn,
                sizes=sizes,
                device=self.args.device,
                candidate_step=trainer_step,
                seed=seed,
                name=type(self).__name__,
                unit=unit_name(self.exact_aggregation),
                audit=False,  # TRL's fused head returns log-probs, not logits: no positions to read
            )
        finally:
            self._exact_divisor, self._step, self._buffered_inputs, self.exact, training, steps = saved
            trained.train(training)
            if steps is not None:
                self.current_gradient_accumulation_steps = steps


class _Float64Head(nn.Module):
    """A copy of a model TRL gave its fused LM head, for the float64 checks.

    TRL's fused head computes log-probs in float32 whatever the model's dtype, which alone moves a
    float64 gradient by ~1e-8 between a micro-batch and the full batch; here a ``fused_lm_head=True``
    call returns them from the logits in the model's dtype (with the entropies GRPO logs). A plain
    call runs the class's forward on the copy: TRL's patched ``forward`` of a deep copy still calls
    the original model's forward for plain calls (its closure holds it).
    """

    def __init__(self, model: nn.Module, temperature: float = 1.0) -> None:
        super().__init__()
        self.model = model.to(torch.float64)
        self.temperature = temperature

    def forward(
        self,
        *args: Any,
        fused_lm_head: bool = False,
        labels: torch.Tensor | None = None,
        num_items_in_batch: Any = None,
        **kwargs: Any,
    ) -> Any:
        inner = self.model
        if not fused_lm_head:
            if labels is not None:
                kwargs["labels"] = labels
            return type(inner).forward(inner, *args, **kwargs)
        if labels is None:
            raise ConfigError("a fused_lm_head=True call needs labels (the tokens to score)")
        kwargs.pop("output_router_logits", None)
        kwargs["use_cache"] = False
        logits = type(inner).forward(inner, *args, **kwargs).logits[:, :-1] / self.temperature
        targets = labels[:, 1:]
        mask = targets != -100
        logp = torch.log_softmax(logits, dim=-1)
        taken = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~mask, 0.0)
        entropy = -(logp.exp() * logp).sum(-1).masked_fill(~mask, 0.0)
        with torch.no_grad():  # what the trainers log
            mean_logits = logits.mean(-1).masked_fill(~mask, 0.0)
            squares = torch.logsumexp(2.0 * logp, dim=-1).masked_fill(~mask, 0.0)
            top1 = (logits.argmax(-1) == targets) & mask
        return FusedCausalLMOutput(
            loss=-taken.sum() / mask.sum().clamp(min=1),
            log_probs=taken,
            entropy=entropy,
            log_sum_sq_probs=squares,
            mean_logits=mean_logits,
            is_top1=top1,
            label_mask=mask,
        )


class _ExactDPO(ExactTrainer):
    """ExactTrainer counting pairs, its check run through :class:`_Float64Head`."""

    def __init__(self, *args: Any, exact: ExactConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, exact=_pair_config(exact), **kwargs)
        self._paired_keys: frozenset[str] = frozenset()

    def _verification_copy(self) -> nn.Module:
        return _Float64Head(super()._verification_copy())

    def _verification_layout(self, batch: Any) -> Any:
        """TRL collates a pair's chosen row into the first half and its rejected row into the second:
        pair-major here ((pairs, 2, ...)), so the check splits whole pairs."""
        pairs = int(batch["input_ids"].shape[0]) // 2
        self._paired_keys = frozenset(
            key
            for key, v in batch.items()
            if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == 2 * pairs
        )
        return {
            key: v.reshape(2, pairs, *v.shape[1:]).transpose(0, 1) if key in self._paired_keys else v
            for key, v in batch.items()
        }

    def _training_layout(self, micro_batch: Any) -> Any:
        return {
            key: v.transpose(0, 1).reshape(-1, *v.shape[2:]) if key in self._paired_keys else v
            for key, v in micro_batch.items()
        }


def count_pairs(micro_batch: Any) -> torch.Tensor:
    """A DPO micro-batch's pairs: TRL collates the chosen rows, then the rejected rows."""
    named = fields(micro_batch)
    if named is None or "input_ids" not in named:
        got = sorted(map(str, named)) if named is not None else type(micro_batch).__name__
        raise ConfigError(f"count_pairs needs TRL's DPO micro-batch with 'input_ids', got {got}")
    ids = named["input_ids"]
    return torch.tensor(int(ids.shape[0]) // 2, dtype=torch.int64, device=ids.device)


class ExactDPOTrainer(_ExactDPO, DPOTrainer):
    """``trl.DPOTrainer`` whose update is the mean over all the window's pairs on all ranks.

    :class:`~gradaccum.integrations.transformers.ExactTrainer` counting pairs (:func:`count_pairs`)
    and keeping DPO's own loss; ``verify_accumulation()`` is ExactTrainer's, with log-probs in
    float64 (pass ``precompute_ref_log_probs=True`` for it: reference log-probs computed per
    micro-batch by TRL's float32 head differ from the full batch's by ~1e-8).
    """


def _pair_config(exact: ExactConfig | None) -> ExactConfig:
    exact = settings_or_default("exact", exact, ExactConfig)
    if exact.count_fn is None:
        return dataclasses.replace(exact, count_fn=count_pairs, loss_from_logits=False)
    return exact


def exact_trainer(trainer_class: type[Trainer]) -> type[Trainer]:
    """An exact subclass of a TRL trainer (``GRPOTrainer``, ``DPOTrainer`` or a subclass of either);
    any other ``transformers.Trainer`` subclass (``SFTTrainer``) goes to the transformers
    integration's :func:`~gradaccum.integrations.transformers.exact_trainer`."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise ConfigError(f"exact_trainer takes a transformers.Trainer subclass, got {trainer_class!r}")
    if issubclass(trainer_class, (ExactGRPOTrainer, ExactTrainer)):
        return trainer_class
    for base, exact in ((GRPOTrainer, ExactGRPOTrainer), (DPOTrainer, ExactDPOTrainer)):
        if issubclass(trainer_class, base):
            if trainer_class is base:
                return exact
            name = f"Exact{trainer_class.__name__}"
            attrs = {
                "__module__": trainer_class.__module__,
                "__qualname__": name,
                "__doc__": trainer_class.__doc__,
            }
            return type(name, (exact, trainer_class), attrs)
    return hf.exact_trainer(trainer_class)


def policy_batch(inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """GRPOTrainer's micro-batch (prompt and completion tensors) in :class:`gradaccum.rl.PolicyLoss`'s
    contract: ``input_ids``, ``attention_mask``, ``response_mask``, ``advantages`` and, where TRL
    has them, ``old_logprobs`` and ``ref_logprobs``, aligned with ``input_ids``."""
    missing = [key for key in _TRL_KEYS if key not in inputs]
    if missing:
        raise ConfigError(f"policy_batch: GRPOTrainer's micro-batch has no {missing}; got {sorted(inputs)}")
    prompt_mask = inputs["prompt_mask"]
    mask = _loss_mask(inputs)
    out = {
        "input_ids": torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
        "attention_mask": torch.cat([prompt_mask, inputs["completion_mask"]], dim=1),
        "response_mask": torch.cat([torch.zeros_like(prompt_mask), mask.to(prompt_mask.dtype)], dim=1),
        "advantages": inputs["advantages"],
    }
    for key, name in (("old_per_token_logps", "old_logprobs"), ("ref_per_token_logps", "ref_logprobs")):
        if inputs.get(key) is not None:
            values = inputs[key]
            out[name] = torch.cat([values.new_zeros(prompt_mask.shape), values], dim=1)
    return out


def _loss_mask(inputs: Mapping[str, Any]) -> torch.Tensor:
    mask = inputs["completion_mask"]
    return mask if inputs.get("tool_mask") is None else mask * inputs["tool_mask"]


def _aggregation_of(trainer: GRPOTrainer) -> str:
    loss_type = trainer.loss_type
    if loss_type not in EXACT_AGGREGATIONS:
        raise ConfigError(
            f"{type(trainer).__name__} knows TRL's loss_type {sorted(EXACT_AGGREGATIONS)}, not {loss_type!r}"
        )
    return EXACT_AGGREGATIONS[loss_type]


def _refuse_unsupported_grpo(trainer: ExactGRPOTrainer) -> None:
    name, args = type(trainer).__name__, cast(Any, trainer.args)
    k, spg = int(args.gradient_accumulation_steps), int(args.steps_per_generation)
    if spg % k:
        raise ConfigError(
            f"{name} needs steps_per_generation ({spg}) to be a multiple of gradient_accumulation_steps "
            f"({k}): an update that spans two generation batches cannot be counted before its first "
            "backward. Set steps_per_generation to k x the updates per generation."
        )
    if getattr(trainer, "_entropy_bonus_enabled", False):
        raise ConfigError(
            f"{name} does not take the entropy bonus (entropy_coef): TRL adds it as a per-micro-batch "
            "token mean over k, which the exact scaling of the policy loss would rescale too"
        )
    if getattr(trainer, "aux_loss_enabled", False):
        raise ConfigError(
            f"{name} does not train an MoE policy with its balancing loss (router_aux_loss_coef="
            f"{getattr(trainer, 'router_aux_loss_coef', None)}): TRL computes it inside each micro-batch's "
            "forward from that micro-batch's routed tokens, and this trainer does not count the update's "
            "routing statistics (tokens per expert, routed rows) before its first backward, so the term "
            "would not be the update's. Pass GRPOConfig(router_aux_loss_coef=0.0) (the update is then "
            "exact, without balancing), or train the policy with gradaccum.Accumulator(..., "
            "balance=gradaccum.moe.LoadBalance.from_model(policy)), whose term is exact over the window."
        )
    if trainer.is_deepspeed_enabled:
        raise ConfigError(f"{name} does not run under DeepSpeed, which scales the loss by k itself")


def _keys(inputs: Mapping[str, Any]) -> list[str]:
    return [k for k in (*_TRL_KEYS, *_TRL_OPTIONAL) if isinstance(inputs.get(k), torch.Tensor)]
