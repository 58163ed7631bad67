"""One shift convention (``gradaccum.loss``'s docstring): ``CausalLMLoss`` shifts by default, and
``count_tokens``, ``summed_cross_entropy`` and ``valid_tokens`` refuse a call that omits ``shift``,
naming it and which value fits which labels. For a transformers causal LM, labels equal to the
inputs with ``ignore_index`` at padding (an all-padding row included),
``count_tokens("labels", shift=True)`` counts exactly the positions that
``summed_cross_entropy(..., shift=True)`` and ``CausalLMLoss`` put a loss on.

Exactness: counts are integers, compared with ``==``; the positions a loss sums over are those of
the logits whose gradient is not exactly zero (a position with a target has a softmax gradient
``p - onehot`` whose target entry is ``p_y - 1 < 0`` for any finite logits)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import gradaccum
from gradaccum.check.audit import audit_count
from gradaccum.errors import ConfigError
from gradaccum.loss import valid_tokens
from tests.integrations import common

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 40, 10


def gpt2() -> nn.Module:
    return common.gpt2(0, 0.0, layers=1, vocab=VOCAB, positions=SEQ)


def batch() -> dict[str, torch.Tensor]:
    """Rows of 10, 7, 1 and 0 real tokens (the last all padding), labels == inputs, -100 at pads."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (4, SEQ), generator=gen)
    lengths = torch.tensor([10, 7, 1, 0])
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 4] = -100  # a target ignored inside a row
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}


def _positions_of_the_summed_loss(mb: dict[str, torch.Tensor]) -> int:
    """Positions of a transformers model's logits that ``summed_cross_entropy(shift=True)`` reaches."""
    logits = gpt2()(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
    leaf = logits.detach().requires_grad_(True)
    gradaccum.summed_cross_entropy(leaf, mb["labels"], shift=True).backward()
    assert leaf.grad is not None
    return int((leaf.grad != 0).any(dim=-1).sum())


def test_the_causal_lm_count_equals_the_positions_both_losses_sum_over() -> None:
    mb = batch()
    count = int(gradaccum.count_tokens("labels", shift=True)(mb))
    # by hand: row 0 has 9 targets less the ignored one, row 1 has 6, rows 2 and 3 none
    assert count == 8 + 6 + 0 + 0
    assert _positions_of_the_summed_loss(mb) == count
    loss = gradaccum.CausalLMLoss("token")
    assert int(loss.count_fn(mb)) == int(loss.positions(mb)) == count
    audit = audit_count(gpt2(), mb, loss.loss_fn, gradaccum.count_tokens("labels", shift=True))
    assert (audit.status, audit.counted, audit.used) == ("consistent", count, count)
    # the count the unshifted default gave: one more target per row that has a label
    assert int(gradaccum.count_tokens("labels", shift=False)(mb)) == count + 3


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda: gradaccum.count_tokens("labels"), id="count_tokens"),
        pytest.param(lambda: gradaccum.count_tokens(), id="count_tokens-no-key"),
        pytest.param(
            lambda: gradaccum.summed_cross_entropy(torch.zeros(1, 3, 5), torch.zeros(1, 3, dtype=torch.long)),
            id="summed_cross_entropy",
        ),
        pytest.param(lambda: valid_tokens(torch.zeros(1, 3, dtype=torch.long)), id="valid_tokens"),
    ],
)
def test_omitting_shift_is_refused_at_the_call_naming_it(call: object) -> None:
    assert callable(call)
    with pytest.raises(ConfigError, match="give shift explicitly") as caught:
        call()
    message = str(caught.value)
    assert "shift=True for labels equal to the inputs, as Hugging Face causal LMs take them" in message
    assert "shift=False for labels already aligned with the logits" in message


def test_a_shift_that_is_not_a_bool_is_refused() -> None:
    with pytest.raises(ConfigError, match="shift must be True or False, got 1"):
        gradaccum.count_tokens("labels", shift=1)  # type: ignore[arg-type]


def test_causal_lm_loss_keeps_its_causal_default() -> None:
    assert gradaccum.CausalLMLoss().shift is True
    mb = batch()
    assert int(gradaccum.CausalLMLoss().count_fn(mb)) == int(gradaccum.count_tokens("labels", shift=True)(mb))


@pytest.mark.parametrize("container", ["tuple", "list", "dict", "tensor"])
@pytest.mark.parametrize("shift", [True, False])
def test_count_tokens_reads_labels_by_position_in_every_container(container: str, shift: bool) -> None:
    # labels of 2 rows x 5: row 0 has 4 valid labels, row 1 has 2; the shift drops each row's first
    labels = torch.tensor([[3, 4, 5, 6, -100], [7, 8, -100, -100, -100]])
    ids = labels.clamp(min=0)
    mb = {
        "tuple": (ids, labels),
        "list": [ids, labels],
        "dict": {0: ids, 1: labels},
        "tensor": labels,
    }[container]
    count = gradaccum.count_tokens(1, shift=shift)(mb)  # a bare tensor is the labels themselves
    assert int(count) == (4 if shift else 6) == int(valid_tokens(labels, shift=shift))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.bool, torch.complex64])
def test_labels_that_are_not_integers_are_refused_by_dtype(dtype: torch.dtype) -> None:
    from gradaccum.errors import CountTypeError

    labels = torch.ones(2, 4, dtype=dtype)
    with pytest.raises(CountTypeError, match=f"integer tensor of class ids .*got dtype {dtype}"):
        gradaccum.count_tokens(2, shift=True)((labels, labels, labels))
    for integer in (torch.int64, torch.int32, torch.int16, torch.uint8):
        assert int(valid_tokens(torch.ones(2, 4, dtype=integer), shift=True)) == 6
