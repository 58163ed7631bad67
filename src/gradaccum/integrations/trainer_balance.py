"""The MoE balancing term of a routing transformers model, made exact inside ``ExactTrainer``.

A model whose config has ``output_router_logits=True`` adds ``router_aux_loss_coef * aux_loss`` to
its ``.loss``, with ``aux_loss`` computed on each micro-batch alone: under accumulation the update
then follows another objective than the full batch's (5e-2 relative L2 on a tiny Mixtral, exactly
as far as plain ``Trainer``). ``ExactTrainer`` instead:

1. turns the model's own term off around its training forwards (``output_router_logits=False`` on
   the config for the duration, restored afterwards; evaluation keeps the model's own loss);
2. at the window's prefetch (``get_batch_samples``), before the first backward, runs the routing
   pass of :class:`gradaccum.moe.WindowBalance` (no-grad forwards of the unwrapped model in training
   mode, RNG replayed) and sums the routing statistics ``(c, R)`` on all ranks in the window's one
   count all-reduce;
3. adds micro-batch ``m``'s part of the window's term (times W, which DDP's averaging divides out)
   to the loss ``compute_loss`` returns, inside ``training_step`` only.

A training forward that routes differently from its routing pass (randomness the pass cannot
replay) raises :class:`~gradaccum.errors.EquivalenceError` before the window's update, on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from gradaccum.distributed import dist
from gradaccum.errors import ConfigError
from gradaccum.moe.balancer import BalanceWindow, WindowBalance
from gradaccum.moe.capture import RouterCapture
from gradaccum.moe.spec import LoadBalance, attention_mask
from gradaccum.moe.stats import balance_term, route

__all__ = ["TrainerBalance", "own_term_off", "trainer_balance", "whole_batch_term"]


def _mask(micro_batch: Any) -> torch.Tensor | None:
    """The attention mask of a Trainer micro-batch (a dict or a ``BatchEncoding``)."""
    return attention_mask(micro_batch)


def own_term_off(balance: TrainerBalance | None) -> contextlib.AbstractContextManager[None]:
    """The model's own balancing term off (nothing to do without a balance)."""
    return contextlib.nullcontext() if balance is None else balance.own_term_off()


def trainer_balance(
    core: nn.Module, device: torch.device, *, world: int | None = None
) -> TrainerBalance | None:
    """The exact balance of a routing model whose forward adds its own balancing loss, else ``None``
    (a dense model, or a model with ``output_router_logits`` off or a zero coefficient: its loss holds
    no balancing term, so there is nothing to make exact). ``world``: the data-parallel size the term
    is scaled by (DDP divides it out again); ``None``: the trainer's ``world_size``."""
    config = getattr(core, "config", None)
    if getattr(config, "output_router_logits", None) is not True:
        return None
    try:
        spec = LoadBalance.from_model(core)
    except ConfigError:
        return None  # no routers found: the model's loss holds no balancing term gradaccum knows
    if spec.coef == 0:
        return None
    return TrainerBalance(core, dataclasses.replace(spec, mask_fn=_mask), device, world=world)


def whole_batch_term(
    core: nn.Module, batch: Any, forward: Callable[[], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``forward()`` (the loss of ``core`` on ``batch``) with the model's own per-forward term off,
    and the balancing term of ``batch``'s own routing, ``coef * E * sum_i f_i P_i`` over its unpadded
    rows: over a whole batch, the term of the full batch's objective. The routers' hooks are taken
    off again, and the config restored, however the forward ends."""
    spec = LoadBalance.from_model(core)
    config: Any = core.config
    before = config.output_router_logits
    capture = RouterCapture(spec.routers, spec.logits_index)
    config.output_router_logits = False
    try:
        with capture.recording(graph=True) as records:
            loss = forward()
        device = loss.device
        routed = route(
            records, _mask(batch), layers=spec.layers, num_experts=spec.num_experts, top_k=spec.top_k,
            device=device,
        )  # fmt: skip
    finally:
        config.output_router_logits = before
        capture.remove()
    term = balance_term(
        routed.probs, routed.counts, routed.rows, num_experts=spec.num_experts, coef=spec.coef,
        pooled=spec.pooled,
    )  # fmt: skip
    return loss, term


class TrainerBalance:
    """One trainer's load balance: the routing pass, the window's agreed statistics, each term."""

    def __init__(
        self, core: nn.Module, spec: LoadBalance, device: torch.device, *, world: int | None = None
    ) -> None:
        self.core = core
        self.world = world
        """The data-parallel size the term is scaled by; ``None``: the trainer's ``world_size``."""
        self.balance = WindowBalance(spec, device, model=core)
        self._window: BalanceWindow | None = None
        self._index: dict[int, int] = {}
        self._current = 0
        self._active = False
        self._rejected = 0.0

    @property
    def size(self) -> int:
        """Length of the statistics vector riding in the count all-reduce."""
        return self.balance.size

    @contextlib.contextmanager
    def own_term_off(self) -> Iterator[None]:
        """The model's config with ``output_router_logits=False``: its forward adds no term of its own."""
        config: Any = self.core.config
        before = config.output_router_logits
        config.output_router_logits = False
        try:
            yield
        finally:
            config.output_router_logits = before

    def count(self, micro_batches: Sequence[Any], trainer: Any) -> torch.Tensor:
        """This rank's ``(c, R, M)`` vector from the routing pass over the window: the model in
        training mode as ``training_step`` puts it, inputs prepared and autocast as the trainer's."""
        core, was = self.core, self.core.training

        def forward(mb: Any) -> Any:
            inputs = trainer._prepare_inputs(dict(mb) if isinstance(mb, Mapping) else mb)
            with trainer.compute_loss_context_manager():
                return core(**inputs) if isinstance(inputs, Mapping) else core(inputs)

        core.train()
        try:
            with self.own_term_off():
                self.balance.use(forward)
                self.balance.count(micro_batches)
                return self.balance.local()
        finally:
            core.train(was)

    def agree(self, vector: torch.Tensor, micro_batches: Sequence[Any]) -> None:
        """The window's statistics from the summed vector; each micro-batch's place in the window."""
        self._window = self.balance.agree(vector)
        self._index = {id(mb): i for i, mb in enumerate(micro_batches)}
        self._rejected = 0.0

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[tuple[int, torch.Tensor]]]:
        """Capture the routers' logits of one training forward (the model's own term off)."""
        with self.own_term_off(), self.balance.capture.recording(graph=True) as records:
            yield records

    @contextlib.contextmanager
    def running(self, micro_batch: Any) -> Iterator[None]:
        """``training_step`` runs ``micro_batch`` (as prefetched) inside: its place in the window."""
        index = self._index.get(id(micro_batch))
        if self._window is None or index is None:
            raise ConfigError(
                "ExactTrainer balances a routing model over the window its get_batch_samples counted, "
                "but training_step was given a micro-batch that is not in that window. Call "
                "trainer.train(), which hands training_step the prefetched micro-batches."
            )
        self._current, self._active = index, True
        try:
            yield
        finally:
            self._active = False

    def add_term(self, loss: Callable[[], Any], inputs: Any, trainer: Any) -> Any:
        """``loss()`` (``compute_loss``'s result), plus this micro-batch's part of the window's term
        inside ``training_step``; a per-micro-batch-mean loss, which Trainer divides by ``D / n_j``
        (``current_gradient_accumulation_steps``), gets the term times that divisor."""
        if not self._active:
            return loss()
        with self.recording() as records:
            out = loss()
        world = self.world if self.world is not None else max(int(trainer.args.world_size), 1)
        term = self.term(inputs, records, world)
        if trainer.loss_form == "mean":
            term = term * trainer.current_gradient_accumulation_steps
        if isinstance(out, tuple):
            return (out[0] + term.to(out[0].dtype), *out[1:])
        return out + term.to(out.dtype)

    def term(self, inputs: Any, records: Sequence[tuple[int, torch.Tensor]], world: int) -> torch.Tensor:
        """The current micro-batch's part of the window's term; a routing that differs from its pass
        is refused before the window's update (under DDP, every rank meets at the last micro-batch)."""
        window, index = self._window, self._current
        assert window is not None  # running() checked
        term, rejected = self.balance.term(window, index, inputs, records)
        if rejected is not None:
            self._rejected += float(rejected)
        if world > 1 and index == len(self._index) - 1:
            # before the last (synchronizing) backward: every rank learns of any rank's veto
            flag = torch.tensor([self._rejected], dtype=torch.float64, device=self.balance.device)
            self._rejected = float(dist.all_reduce_sum_(flag, what="the routing-pass verdict").item())
        if self._rejected and (world == 1 or index == len(self._index) - 1):
            raise self.balance.rejection(int(self._rejected))
        return term * world
