"""Exact accumulation in the Hugging Face ``Trainer``: ``ExactTrainer`` and ``exact_trainer(SomeTrainer)``.

Trainer's loop already does most of the exact step: it prefetches each window of
``gradient_accumulation_steps`` micro-batches (``get_batch_samples``), defers DDP sync to the last
one (``accelerator.no_sync`` around forward and backward), and clips, steps, schedules and zeroes
once per window, a short final window of an epoch included. What goes wrong is the weight of each
micro-batch: a per-micro-batch mean divided by k for models that take no loss kwargs and for custom
losses (transformers #37766, #44342), a count one too large per row for a causal LM whose loss type
is unset (#46204), a rank-local count for custom losses under DDP.

The exact rule (:mod:`gradaccum.step.engine`): micro-batch j backpropagates its loss *summed* over
its n_j counted units times W/N, with N the window's count on all W data-parallel ranks (DDP then
averages over W). ``ExactTrainer`` gets there through Trainer's own hooks:

1. ``get_batch_samples`` counts every micro-batch of the window (label tokens that count, shifted
   by one per row for a causal LM), sums on all ranks in one small all-reduce that stays on the
   device, and hands every ``training_step`` ``num_items_in_batch = D = N / W``;
2. a loss that divides by ``num_items_in_batch`` (transformers' contract for models that take loss
   kwargs and for ``compute_loss_func``) is then sum_j * W / N exactly, and
   ``loss_is_scaled_for_ga = True`` stops Trainer from dividing it by k;
3. a loss that ignores ``num_items_in_batch`` is a per-micro-batch mean. Which kind the trainer's
   ``compute_loss`` returns is measured once, at the first window: the same micro-batch with the
   same random draws, given D and 2D (a sum over D halves, a mean stays). A mean over n_j units
   becomes sum_j * W / N through Trainer's own division by ``current_gradient_accumulation_steps``,
   which ``ExactTrainer`` sets to D / n_j for that micro-batch;
4. a model that takes no loss kwargs is trained on token cross-entropy computed from its logits
   (installed as ``compute_loss_func``, summed in the logits' own dtype), unless
   ``ExactConfig(loss_from_logits=False)``: then its own mean is multiplied back as in 3.

Trainer's ``average_tokens_across_devices`` multiplies the loss by the world size inside
``compute_loss``; ``ExactTrainer`` keeps W in the divisor instead (so a custom ``compute_loss`` that
never calls Trainer's gets it too) and turns that flag off on its own copy of the arguments. The
logged loss is then the window's global mean (Trainer sums ``sum_j * W / N`` over the window and
averages over ranks), and the logged grad norm is the norm of the exact, synchronized gradient,
before clipping.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PreTrainedModel, Trainer
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from gradaccum.batch import fields
from gradaccum.check.report import EquivalenceReport
from gradaccum.distributed import dist
from gradaccum.errors import ConfigError, CountError, EquivalenceError, LossError
from gradaccum.integrations.trainer_balance import own_term_off, trainer_balance
from gradaccum.integrations.trainer_verify import verify_trainer
from gradaccum.lazy import lazy_exports
from gradaccum.loss import IGNORE_INDEX, valid_tokens
from gradaccum.values import settings_or_default

__all__ = ["ExactConfig", "ExactTrainer", "audit_trainer", "exact_trainer"]  # noqa: F822 (lazy, below)
# audit_trainer (gradaccum.audit.trainer, which imports this module) is loaded on first access
__getattr__, __dir__ = lazy_exports(
    __name__, {"audit_trainer": "gradaccum.audit.trainer"}, globals(), __all__
)

LossForm = Literal["sum", "mean"]
"""What ``compute_loss`` returns: a sum divided by ``num_items_in_batch``, or a mean that ignores it."""

FORM_RTOL = 0.05
"""Relative tolerance of the loss-form probe. The two hypotheses differ by a factor of 2 (a loss over
``num_items_in_batch`` halves when it doubles, a mean stays); both calls run the same forward with
the same random draws, so they differ only in the final division's rounding (one bfloat16 ulp is
0.8 %). 5 % separates them with a wide margin either way."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ExactConfig:
    """How ``ExactTrainer`` counts and which loss it trains on; every field has a safe default."""

    count_fn: Callable[[Any], int | torch.Tensor] | None = None
    """How many units one micro-batch's loss is over. ``None``: the label tokens that count (labels
    ``!= ignore_index``) under ``shift_labels`` when the collator provides them, else under
    ``labels``, dropping each row's first label when ``label_shift``."""
    label_shift: bool | None = None
    """Whether the loss drops each row's first label (a causal LM predicts label t+1 at position t).
    ``None``: decided from the model: a decoder-only transformers causal LM shifts, anything else
    (encoder-decoder models, plain modules) does not."""
    loss_from_logits: bool | None = None
    """Train on token cross-entropy computed from the model's logits instead of the model's own loss.
    ``None``: only for a model that takes no loss kwargs when no ``compute_loss_func`` was given."""
    ignore_index: int = IGNORE_INDEX
    """Label value of positions that do not count."""
    verify_at_start: bool = False
    """Before the first update, run :meth:`ExactTrainer.verify_accumulation` and, if it fails, raise
    :class:`~gradaccum.errors.EquivalenceError` on every rank instead of training."""

    def __post_init__(self) -> None:
        if self.count_fn is not None and not callable(self.count_fn):
            raise ConfigError(
                f"ExactConfig.count_fn must be callable or None, got {type(self.count_fn).__name__}"
            )
        for name in ("label_shift", "loss_from_logits"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"ExactConfig.{name} must be True, False or None (decide), got {value!r}")
        if not isinstance(self.verify_at_start, bool):
            raise ConfigError(
                f"ExactConfig.verify_at_start must be True or False, got {self.verify_at_start!r}"
            )
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise ConfigError(f"ExactConfig.ignore_index must be an int, got {self.ignore_index!r}")


@dataclass(frozen=True, slots=True)
class _Window:
    """The window in progress: the divisor every micro-batch gets, and each micro-batch's count."""

    divisor: torch.Tensor
    """D = N / W, float64 on the device: the ``num_items_in_batch`` handed to ``training_step``."""
    counts: dict[int, torch.Tensor]
    """id(micro-batch) -> its count, for the mean form's per-micro-batch factor."""


class ExactTrainer(Trainer):
    """A drop-in ``transformers.Trainer`` whose gradient accumulation is exact (see the module docstring).

    Takes Trainer's arguments plus ``exact=ExactConfig(...)``. Supported: one process and DDP (one
    process per device, ``torchrun``/``accelerate launch``), any mixed precision Trainer offers;
    DeepSpeed at ZeRO stages 1-3 (see :func:`_refuse_deepspeed`); refused with an error that says
    why: DeepSpeed at stage 0 or in fp16,
    ``DataParallel`` over several GPUs in one process, and tensor, context or sequence parallelism
    (ranks that share a batch). Use :func:`exact_trainer` for a Trainer subclass (TRL's and your own).
    """

    def __init__(self, *args: Any, exact: ExactConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exact = exact = settings_or_default("exact", exact, ExactConfig)
        _refuse_unsupported(self)
        if self.args.average_tokens_across_devices:
            # compute_loss would multiply by the world size; the W of W/N lives in the divisor here
            copied: Any = copy.copy(self.args)  # shallow: the caller's arguments stay as they were
            copied.average_tokens_across_devices = False
            self.args = copied
        core = self.accelerator.unwrap_model(self.model)
        self.label_shift = _shifts_labels(core) if exact.label_shift is None else exact.label_shift
        """Whether the default count drops each row's first label (see ``ExactConfig.label_shift``)."""
        from_logits = exact.loss_from_logits
        if from_logits is None:
            from_logits = self.compute_loss_func is None and not self.model_accepts_loss_kwargs
        if from_logits:
            if self.compute_loss_func is not None:
                raise ConfigError(
                    "ExactConfig(loss_from_logits=True) and a compute_loss_func were both given; the "
                    "compute_loss_func already defines the loss. Drop one of them."
                )
            self.compute_loss_func = token_cross_entropy(
                shift=self.label_shift,
                ignore_index=exact.ignore_index,
                label_smoothing=float(self.args.label_smoothing_factor),
            )
        self.loss_form: LossForm | None = None
        """What ``compute_loss`` returns, measured at the first window (``None`` until then)."""
        self.loss_is_scaled_for_ga = True
        self._window: _Window | None = None
        self.balance = trainer_balance(core, self.args.device)
        """A routing model's exact balancing term (:mod:`gradaccum.integrations.trainer_balance`)."""

    # -- the window: counted once, before its first backward -------------------------------------

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[Any], torch.Tensor | None]:
        """Trainer's prefetch of one window, with ``num_items_in_batch = N / W`` counted exactly."""
        batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batch_samples:
            return batch_samples, None
        world = max(int(self.args.world_size), 1)
        self._window = self._count_window(batch_samples, device, self.model_wrapped, world)
        return batch_samples, self._window.divisor

    def _count_window(
        self, micro_batches: list[Any], device: torch.device, model: nn.Module, world: int
    ) -> _Window:
        """Count the window on this rank, agree on N across ``world`` ranks, measure the loss form
        at the first window."""
        counts = [torch.as_tensor(self.count(mb), device=device) for mb in micro_batches]
        local = torch.stack(counts).to(torch.float64).sum()
        first = self.loss_form is None
        balance = self.balance
        if first:
            with own_term_off(balance):
                self.loss_form = self._loss_form_of(model, micro_batches, counts)
        routing = None if balance is None else balance.count(micro_batches, self)
        if world > 1:
            # [N, ranks that measured, form, form^2] summed over the ranks, in the counts' one small
            # all-reduce: the M ranks that measured agree iff M * sum(f^2) == sum(f)^2, and a rank
            # whose micro-batches held no unit takes their form
            code = float(_FORM_CODES[self.loss_form]) if first else 0.0
            flags = [float(code > 0), code, code * code]
            # a routing model's (c, R, M) rides in the same all-reduce
            vector = [local.reshape(1), local.new_tensor(flags)] + ([] if routing is None else [routing])
            meta = dist.all_reduce_sum_(torch.cat(vector), what="the window's token counts")
            routing, meta = (None if routing is None else meta[4:]), meta[:4]
            if first:
                measured, total, squares = meta[1:].tolist()
                if measured * squares != total * total:
                    raise LossError(
                        f"the ranks disagree on what compute_loss returns (codes summed {total:g}, "
                        f"squares {squares:g} over {measured:g} ranks; 1 = divides by "
                        "num_items_in_batch, 2 = a per-micro-batch mean): every rank must run the "
                        "same compute_loss"
                    )
                self.loss_form = _FORMS[round(total / measured)] if measured else None
            local = meta[0]
        if self.loss_form == "mean" and bool(torch.stack(counts).eq(0).any()):
            raise CountError(
                f"a micro-batch of this window counts zero units ({[int(c) for c in counts]}), and "
                f"{type(self).__name__}.compute_loss returns a per-micro-batch mean, which is undefined "
                "over zero units. Return the loss summed over the counted units divided by "
                "num_items_in_batch (an empty micro-batch then adds zero), or filter empty examples."
            )
        # an all-padding window has nothing to average: N clamped to 1 gives zero gradients (Trainer
        # still steps: weight decay and momentum move), never NaN
        divisor = local.clamp(min=1) / world
        if balance is not None and routing is not None:
            balance.agree(routing, micro_batches)
        return _Window(divisor, {id(mb): c for mb, c in zip(micro_batches, counts, strict=True)})

    def count(self, micro_batch: Any) -> int | torch.Tensor:
        """The units one micro-batch's loss is over (see ``ExactConfig.count_fn``)."""
        exact = self.exact
        if exact.count_fn is not None:
            return exact.count_fn(micro_batch)
        named = fields(micro_batch)
        if named is None or not ({"labels", "shift_labels"} & set(named)):
            keys = sorted(map(str, named)) if named is not None else type(micro_batch).__name__
            raise CountError(
                f"ExactTrainer counts label tokens under 'labels' (or 'shift_labels'), but a micro-batch "
                f"holds {keys}. Pass exact=ExactConfig(count_fn=...) returning how many units the "
                "micro-batch's loss is over."
            )
        if "shift_labels" in named:
            return valid_tokens(named["shift_labels"], ignore_index=exact.ignore_index, shift=False)
        return valid_tokens(named["labels"], ignore_index=exact.ignore_index, shift=self.label_shift)

    # -- the loss each micro-batch backpropagates ------------------------------------------------

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """Trainer's training step, with the micro-batch weighted by its share of the window."""
        window = self._window
        if num_items_in_batch is None or window is None:
            raise ConfigError(
                "ExactTrainer.training_step needs the window's divisor that its get_batch_samples "
                "hands Trainer's loop; it was called without one. Call trainer.train(), or "
                "verify_accumulation() for a check outside training."
            )
        if self.loss_form == "mean":
            count = window.counts.get(id(inputs))
            if count is None:
                count = torch.as_tensor(self.count(inputs), device=window.divisor.device)
            # Trainer divides a loss not scaled for accumulation by current_gradient_accumulation_steps:
            # a mean over this micro-batch's n_j units divided by D / n_j is its sum over D = N / W
            self.loss_is_scaled_for_ga = False
            self.current_gradient_accumulation_steps = window.divisor / count
        else:
            self.loss_is_scaled_for_ga = True
        with contextlib.nullcontext() if self.balance is None else self.balance.running(inputs):
            return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """Trainer's; in a routing model's ``training_step``, plus its part of the window's term."""
        loss = functools.partial(super().compute_loss, model, inputs, *args, **kwargs)
        return loss() if self.balance is None else self.balance.add_term(loss, inputs, self)

    def _loss_form_of(
        self, model: nn.Module, micro_batches: Sequence[Any], counts: Sequence[Any]
    ) -> LossForm | None:
        """Sum over ``num_items_in_batch`` or per-micro-batch mean: the first micro-batch with units,
        run twice with the same random draws and ``num_items_in_batch`` D and 2D, tells (``None``:
        no micro-batch here holds a unit)."""
        core = self.accelerator.unwrap_model(model)  # its forward issues no collective
        for mb, count in zip(micro_batches, counts, strict=True):
            n = float(count)
            if n <= 0:
                continue
            once, twice = (self._loss_at(core, mb, n * scale) for scale in (1.0, 2.0))
            if not (math.isfinite(once) and math.isfinite(twice)) or once == 0:
                raise LossError(
                    f"{type(self).__name__}.compute_loss returned {once!r} on a micro-batch with {n:g} "
                    "counted units: a finite, non-zero loss is needed to tell how it is normalized"
                )
            if abs(once - 2 * twice) <= FORM_RTOL * abs(once):
                return "sum"
            if abs(once - twice) <= FORM_RTOL * abs(once):
                return "mean"
            raise LossError(
                f"{type(self).__name__}.compute_loss neither divides by num_items_in_batch nor ignores "
                f"it: the same micro-batch gave {once:.6g} with num_items_in_batch={n:g} and "
                f"{twice:.6g} with {2 * n:g} (a sum over it would halve, a mean would stay). Return "
                "the loss summed over the micro-batch's counted units divided by num_items_in_batch, "
                "with any per-batch term (a regularizer) divided by it too, or a mean over exactly "
                "the counted units."
            )
        return None  # no units in this window: a later window decides

    def _loss_at(self, model: nn.Module, micro_batch: Any, divisor: float) -> float:
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        inputs = dict(micro_batch) if isinstance(micro_batch, Mapping) else micro_batch  # compute_loss pops
        with torch.random.fork_rng(devices=devices), torch.no_grad(), self.compute_loss_context_manager():
            torch.manual_seed(0)  # both calls draw the same dropout masks
            items = torch.tensor(divisor, dtype=torch.float64, device=self.args.device)
            loss = self.compute_loss(model, inputs, num_items_in_batch=items)
        if isinstance(loss, tuple):
            loss = loss[0]
        return float(loss.detach().float().mean())

    # -- the check -------------------------------------------------------------------------------

    def verify_accumulation(
        self,
        examples: Sequence[Any] | None = None,
        *,
        optimizer_factory: Callable[[Any], torch.optim.Optimizer] | None = None,
        seed: int = 0,
    ) -> EquivalenceReport:
        """Does this trainer's accumulated update equal the update of one full batch?

        ``examples`` (default: the first ``per_device_train_batch_size x gradient_accumulation_steps``
        examples of the training set) are collated by the training collator into one batch. From
        two copies of the model (float64, dropout off) the check runs the full batch once through
        ``compute_loss`` (with ``num_items_in_batch`` its count: the update of one batch of all of
        them) and the window of micro-batches through this trainer's own ``training_step``, and
        compares gradients before the update and parameters after one SGD step (lr 0.1, or
        ``optimizer_factory``). On this process alone; the model and the trainer are left as they were.

        A routing (mixture-of-experts) model whose config asks for its balancing loss is checked with
        it: the reference is the full batch's objective, its loss plus the balancing term of the
        whole batch's routing, and the window runs the trainer's exact term
        (:mod:`gradaccum.integrations.trainer_verify`).
        """
        return verify_trainer(self, examples, optimizer_factory=optimizer_factory, seed=seed)

    def _verification_layout(self, batch: Any) -> Any:
        """The collated check batch in a layout whose tensors share dim 0 (examples), so that it
        splits into micro-batches; a subclass whose collator stacks rows otherwise maps it here."""
        return batch

    def _training_layout(self, micro_batch: Any) -> Any:
        """The inverse of :meth:`_verification_layout`, for one micro-batch of the check."""
        return micro_batch

    def _layout_count(self, micro_batch: Any) -> int | torch.Tensor:
        return self.count(self._training_layout(micro_batch))

    def _verification_copy(self) -> nn.Module:
        """The model ``verify_accumulation`` builds its copies from (a subclass may wrap it)."""
        return copy.deepcopy(self.accelerator.unwrap_model(self.model))

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's ``train``; with ``ExactConfig(verify_at_start=True)`` the check runs first."""
        if self.exact.verify_at_start:
            report = self.verify_accumulation()
            failed = torch.tensor([float(not report.passed)], dtype=torch.float64, device=self.args.device)
            if int(self.args.world_size) > 1:
                dist.all_reduce_sum_(failed, what="the verification verdict")
            if failed.item():
                causes = "; ".join(report.likely_causes) or "see this rank's report"
                raise EquivalenceError(
                    f"verify_accumulation failed on {int(failed.item())} rank(s) before training: "
                    f"{report.summary()}. Likely causes: {causes}"
                )
        return super().train(*args, **kwargs)


_FORM_CODES: dict[LossForm | None, int] = {None: 0, "sum": 1, "mean": 2}
_FORMS: dict[int, LossForm] = {1: "sum", 2: "mean"}


def exact_trainer(trainer_class: type[Trainer]) -> type[ExactTrainer]:
    """An exact subclass of any ``transformers.Trainer`` subclass (TRL's ``SFTTrainer``, your own).

    The user's overrides (samplers, ``compute_loss``, ``training_step``) stay: the exact hooks come
    first in the method order and call theirs through ``super()``. Takes ``exact=ExactConfig(...)``
    besides the class's own arguments.
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise ConfigError(f"exact_trainer takes a transformers.Trainer subclass, got {trainer_class!r}")
    if issubclass(trainer_class, ExactTrainer):
        return trainer_class
    name = f"Exact{trainer_class.__name__}"
    attrs = {"__module__": trainer_class.__module__, "__qualname__": name, "__doc__": trainer_class.__doc__}
    return type(name, (ExactTrainer, trainer_class), attrs)


def token_cross_entropy(
    *, shift: bool, ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0
) -> Callable[..., torch.Tensor]:
    """A ``compute_loss_func``: token cross-entropy from the logits, summed, over ``num_items_in_batch``.

    In the logits' dtype (half precisions upcast to float32), so a float64 model's loss stays
    float64; with ``num_items_in_batch=None`` (evaluation) a mean over this batch's counted tokens.
    """

    def compute_loss_func(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        logits = _logits(outputs)
        if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point:
            got = type(labels).__name__ if not isinstance(labels, torch.Tensor) else str(labels.dtype)
            raise ConfigError(
                f"ExactTrainer trains a model that takes no loss kwargs on token cross-entropy from its "
                f"logits, but its labels are {got}, not class ids. Pass a compute_loss_func, or "
                "exact=ExactConfig(loss_from_logits=False) to keep the model's own loss."
            )
        if shift:
            logits, labels = logits[..., :-1, :], labels[..., 1:]
        flat = logits.reshape(-1, logits.shape[-1])
        if flat.dtype in (torch.float16, torch.bfloat16):
            flat = flat.float()
        targets = labels.reshape(-1).to(flat.device)
        total = F.cross_entropy(
            flat, targets, ignore_index=ignore_index, reduction="sum", label_smoothing=label_smoothing
        )
        if num_items_in_batch is None:
            num_items_in_batch = (targets != ignore_index).sum().clamp(min=1)
        return total / num_items_in_batch

    compute_loss_func.__qualname__ = f"token_cross_entropy(shift={shift})"
    return compute_loss_func


def _logits(outputs: Any) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping) and "logits" in outputs:
        return outputs["logits"]
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    raise LossError(
        f"the model returned {type(outputs).__name__}; token cross-entropy needs its logits (a tensor, "
        "a tuple starting with them, or an output with a 'logits' field)"
    )


def _shifts_labels(model: nn.Module) -> bool:
    """Whether ``model``'s own loss drops each row's first label: a decoder-only transformers causal LM.

    Trainer decides this from ``loss_type``, which a model built from a config may leave unset
    (GPT-2: its loss then falls back to ``ForCausalLMLoss``, which shifts); the class is asked too.
    """
    if not isinstance(model, PreTrainedModel):
        return False
    if getattr(model.config, "is_encoder_decoder", False):
        return False
    causal = type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return causal or LOSS_MAPPING.get(getattr(model, "loss_type", None) or "") is ForCausalLMLoss


def _refuse_unsupported(trainer: Trainer) -> None:
    name = type(trainer).__name__
    if trainer.is_deepspeed_enabled:
        _refuse_deepspeed(trainer)
    if trainer.args.n_gpu > 1:
        raise ConfigError(
            f"{name} does not run under DataParallel (n_gpu={trainer.args.n_gpu} in one process), which "
            "splits every micro-batch across GPUs after it was counted. Launch one process per GPU "
            "(torchrun --nproc-per-node N) instead."
        )
    shared = trainer.get_tp_size() * trainer.get_cp_size() * trainer.get_sp_size()
    if shared > 1:
        raise ConfigError(
            f"{name} does not run with tensor, context or sequence parallelism (tp x cp x sp = {shared}): "
            "ranks that share a batch would each count it. Use data parallelism only."
        )


def _refuse_deepspeed(trainer: Trainer) -> None:
    """DeepSpeed through Trainer: exact at ZeRO stages 1-3 in fp32 and bf16, refused elsewhere.

    Trainer passes ``scale_wrt_gas=False`` to ``engine.backward`` for a loss it does not divide by
    k (transformers #35808), and Accelerate sets the engine's accumulation boundary on the window's
    last micro-batch and calls ``engine.step()`` there; every DeepSpeed reduction averages over the
    W data-parallel ranks. So the loss sum_j * W / N that ``ExactTrainer`` hands Trainer is exact
    there as under DDP (measured on two ranks at stages 1-3: the full batch's update, loss and grad
    norm). At ZeRO stage 0 DeepSpeed 0.19.8 hooks every tensor its forward returns to divide its
    gradient by k, unless ``engine.backward``'s own hook on the loss ran first; when ``compute_loss``
    returns the model's loss tensor itself (``ExactTrainer`` keeps it as it is, with
    ``average_tokens_across_devices`` off), the output's hook runs first and the update is 1/k of
    the full batch's (measured). A ``compute_loss`` override could return that tensor too, so stage
    0 is refused rather than patched here; gradaccum's own step backpropagates ``loss * W/N``, a new
    tensor, and is exact there.
    """
    name = type(trainer).__name__
    config = getattr(trainer.args, "hf_deepspeed_config", None)
    settings: dict[str, Any] = getattr(config, "config", None) or {}
    stage = int((settings.get("zero_optimization") or {}).get("stage", 0) or 0)
    fp16 = bool((settings.get("fp16") or {}).get("enabled", False)) or bool(trainer.args.fp16)
    if stage == 0 or fp16:
        what = "ZeRO stage 0" if stage == 0 else "fp16 (DeepSpeed's loss scaler and FP16_Optimizer)"
        raise ConfigError(
            f"{name} runs under DeepSpeed with ZeRO stages 1-3 in fp32 or bf16; this config uses {what}, "
            "where the accumulated update is not exact (at stage 0 DeepSpeed divides the model's own "
            "loss tensor by gradient_accumulation_steps in a hook on the forward's output: 1/k of the "
            "full batch's update, measured). Set zero_optimization.stage to 1, 2 or 3 and leave fp16 "
            "off, or drive the engine with gradaccum.integrations.deepspeed.prepare_accumulator."
        )
