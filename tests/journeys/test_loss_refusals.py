"""User journey: the loss a new user writes first, ``F.cross_entropy`` with its default reduction
(a mean), handed to ``Accumulator.step``, which takes each loss for a *sum* by default.

Before, the step used the mean as if summed: every micro-batch's tokens weighed 1/(n_j N) instead
of 1/N, the update off in scale by the micro-batch's token count (relL2 0.895 against the exact
update here, with 10 and 9 tokens a micro-batch; 1.000 at a language model's counts), and nothing
said so. Now the first window is refused, naming the reduction and the two
fixes, with the parameters as they were; both fixes then step exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gradaccum
from gradaccum.errors import LossError

VOCAB, ROWS, LENGTH = 11, 4, 6


class TokenTagger(nn.Module):
    """A tiny per-token classifier: embedding, then a linear head over the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.embed(input_ids))
        return out


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=gen)
    labels = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=gen)
    labels[0, 4:] = -100  # padding: rows hold 4, 6, 6 and 3 tokens
    labels[3, 3:] = -100
    return {"input_ids": input_ids, "labels": labels}


def loss_fn(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """What a new user writes: cross_entropy with its default reduction."""
    logits = model(mb["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten())


def summed_loss_fn(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(mb["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), reduction="sum")


count_fn = gradaccum.count_tokens("labels", shift=False)

REFUSAL = (
    "loss_fn returned a mean-reduced loss for micro-batch 0 (count_fn counts 10 units in it): its "
    "graph ends in cross_entropy/nll_loss with reduction='mean' (their default), a mean over 10 "
    "units. With loss_reduction='sum' (the default) the step takes each loss for the *summed* loss "
    "over count_fn's units and divides by the window's count once, so a mean would be divided "
    "twice: every unit would weigh 1/(n_j N) instead of 1/N and the update would be wrong in scale "
    "by the micro-batch's count. The window's gradients were discarded and no update was applied. "
    "Fix: return the sum over the units count_fn counts (reduction='sum'), or declare the mean with "
    "loss_reduction='mean' (the step multiplies it back by count_fn's count, which must count the "
    "same units). A loss that is not a sum over count_fn's units on purpose (a per-micro-batch loss "
    "with count_fn returning 1) is declared with check_loss_reduction=False."
)


def _exact_update(lr: float) -> list[torch.Tensor]:
    """One SGD step on the full batch's mean token loss, in float64: the independent reference."""
    model = TokenTagger().double()
    batch = _batch()
    logits = model(batch["input_ids"])
    loss = F.cross_entropy(logits.flatten(0, 1).double(), batch["labels"].flatten())  # mean over 19
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return [(p - lr * g).detach() for p, g in zip(model.parameters(), grads, strict=True)]


def test_cross_entropy_default_into_step_is_refused_by_name() -> None:
    model = TokenTagger().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = gradaccum.Accumulator(model, optimizer, max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    window = gradaccum.split(_batch(), micro_batch=2)  # 10 and 9 tokens
    with pytest.raises(LossError) as raised:
        acc.step(window, loss_fn, count_fn)
    assert str(raised.value) == REFUSAL
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "settings", "fn"),
    [
        ("reduction='sum'", {}, summed_loss_fn),
        ("loss_reduction='mean' declared", {"loss_reduction": "mean"}, loss_fn),
    ],
)
def test_both_fixes_step_exactly(name: str, settings: dict[str, str], fn: object) -> None:
    model = TokenTagger().double()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), **settings)
    result = acc.step(gradaccum.split(_batch(), micro_batch=2), fn, count_fn)  # type: ignore[arg-type]
    assert result.applied and result.global_count == 19
    # float64: the step's sum over two micro-batches times 1/19 and the reference's one mean differ
    # by a few roundings of values near 1 (~1e-16 each); 1e-12 catches any weight off by a token
    for got, want in zip(model.parameters(), _exact_update(0.5), strict=True):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-14), name
