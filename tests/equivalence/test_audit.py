"""Evidence that cannot be fooled: the denominator audit, randomness switched off for real, and a
mean loss diagnosed as a mean, on transformers' GPT-2 and on plain modules.

Tolerances: the float64 check's own (1e-10, argued in gradaccum.check.tolerances); a wrong count
moves every gradient by N/(N + rows), about 8 % here, which the audit names without needing one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from gradaccum import count_examples, count_tokens, scan, summed_cross_entropy, verify
from gradaccum.check.audit import audit_count
from gradaccum.check.controls import randomness_off
from tests.integrations import common

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 40, 12


def gpt2(dropout: float = 0.1) -> nn.Module:
    """A tiny transformers GPT-2 with the library's default dropout of 0.1 unless told otherwise."""
    torch.manual_seed(0)  # the tests' dropout draws start from here
    return common.gpt2(0, dropout, layers=2, vocab=VOCAB, positions=SEQ)


def batch(n: int = 8, seed: int = 3) -> dict[str, torch.Tensor]:
    """Padded rows of uneven length: labels are the inputs (transformers' convention), -100 at pads."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=gen)
    lengths = torch.randint(3, SEQ + 1, (n,), generator=gen)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def shifted_sum(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
    return summed_cross_entropy(logits, mb["labels"], shift=True)


def model_mean(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """The most common first attempt: the model's own loss, a mean over the micro-batch's targets."""
    return model(**mb).loss


def test_an_unshifted_count_under_a_shifted_loss_fails_naming_the_shift() -> None:
    data = batch()
    wrong = verify(gpt2, data, shifted_sum, count_tokens("labels", shift=False), micro_batch=2)
    assert not wrong.passed
    counted = int(count_tokens("labels", shift=False)(data))
    used = int(count_tokens("labels", shift=True)(data))
    assert counted - used == 8  # one per row: the 8.3 % of the example
    cause = wrong.likely_causes[0]
    assert cause.startswith("the denominator is wrong (micro-batch 0): count_fn counts")
    assert "one fewer per row" in cause and "count_tokens(..., shift=True)" in cause
    assert [a.status for a in wrong.audit] == ["mismatch"] * 4
    assert (
        sum(a.counted or 0 for a in wrong.audit) == counted and sum(a.used or 0 for a in wrong.audit) == used
    )
    # the gradients alone agree (both sides used the same wrong count): only the audit sees it
    assert wrong.grad_max_rel_err < 1e-10
    # so the verdict's line names the denominator, with the window's figures, beside figures in tolerance
    denominator = (
        f"the denominator: count_fn counts {counted} units where the loss uses {used} output positions "
        "(4 of 4 micro-batches)"
    )
    assert wrong.failures == (denominator,)
    assert wrong.summary().startswith(f"FAIL: {denominator}; gradient max rel err ")

    right = verify(gpt2, data, shifted_sum, count_tokens("labels", shift=True), micro_batch=2)
    assert right.passed, right.likely_causes
    assert right.audit_summary == (
        f"consistent: count_fn counts exactly the {used} units the loss sums over in the 8 examples of "
        "the checked batch (the output positions that receive a gradient)"
    )


def test_an_example_level_loss_audits_as_examples() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x = torch.randn(6, 5, dtype=torch.float64)
    y = torch.tensor([0, 2, 1, 1, 0, 2])

    def classify(m: nn.Module, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(m(mb[0]), mb[1], reduction="sum")

    audit = audit_count(model, (x, y), classify, count_examples)
    assert audit.status == "consistent" and (audit.counted, audit.used, audit.rows) == (6, 6, 6)
    assert audit.output_shape == (6, 3)
    # counting tokens where the loss gives each example one term is named as such
    audit = audit_count(model, (x, y), classify, lambda mb: 18)
    assert audit.status == "mismatch" and "the loss gives each of the 6 examples one term" in audit.reason
    assert all(p.grad is None for p in model.parameters())  # the audit touches no parameter gradient


class TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def _contrast(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    q, k = model(mb["q"]), model(mb["k"])
    return ((q - k) ** 2).sum()


def test_a_loss_the_audit_cannot_read_is_reported_as_not_audited() -> None:
    data = {"q": torch.randn(4, 4, dtype=torch.float64), "k": torch.randn(4, 4, dtype=torch.float64)}
    audit = audit_count(TwoTower(), data, _contrast, count_examples)
    assert audit.status == "not audited" and audit.passed is None
    assert "called the model 2 times" in audit.reason
    report = verify(TwoTower, data, _contrast, count_examples, micro_batch=2)
    assert report.passed  # neither passed nor failed by the audit
    assert report.audit_summary.startswith("not audited: loss_fn called the model 2 times")


def test_gpt2_with_its_default_dropout_passes_and_its_probabilities_are_restored() -> None:
    built: list[nn.Module] = []

    def build() -> nn.Module:
        model = gpt2(dropout=0.1)
        built.append(model)
        return model

    report = verify(build, batch(), shifted_sum, count_tokens("labels", shift=True), micro_batch=2)
    assert report.passed, report.likely_causes
    assert report.grad_max_rel_err < 1e-10
    # what verify switched off is what the scan reports as random, one for one
    found = [f.path for f in scan(gpt2(), 4) if f.code == "random-layer"]
    assert sorted(d.split("=")[0].rsplit(".", 1)[0] for d in report.disabled) == sorted(found)
    assert "transformer.h.0.attn.attn_dropout.p=0.1" in report.disabled
    # every model verify built has its probabilities back
    assert built and all(m.p == 0.1 for model in built for m in model.modules() if isinstance(m, nn.Dropout))


def test_randomness_off_covers_probabilities_read_by_a_parent_and_restores_them() -> None:
    class Attention(nn.Module):
        """Reads a float attribute in training mode, as transformers' Llama-style attention does."""

        def __init__(self) -> None:
            super().__init__()
            self.attention_dropout = 0.25
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.dropout(self.proj(x), self.attention_dropout if self.training else 0.0)

    model = nn.Sequential(Attention(), nn.Dropout(0.5), nn.RReLU())
    x = torch.randn(64, 4)
    with randomness_off(model) as sources:
        assert [s.describe() for s in sources] == [
            "0.attention_dropout=0.25",
            "1.p=0.5",
            "2 (RReLU, training off)",
        ]
        assert torch.equal(model(x), model(x))  # deterministic inside
    assert model[0].attention_dropout == 0.25 and model[1].p == 0.5 and model[2].training
    assert not torch.equal(model(x), model(x))  # random again after


def test_a_mean_loss_is_diagnosed_as_a_mean_with_the_fix() -> None:
    report = verify(gpt2, batch(), model_mean, count_tokens("labels", shift=True), micro_batch=2)
    assert not report.passed
    # the model's mean divides by the shifted token count, so the audit agrees with the count...
    assert all(a.status == "consistent" for a in report.audit)
    # ... and the probe names the mean, with the figures and the fix
    cause = report.likely_causes[0]
    assert cause.startswith("loss_fn returns a mean over the micro-batch, not a sum")
    assert "x the whole (a sum would equal it)" in cause
    assert "reduction='sum'" in cause and "summed_cross_entropy" in cause
    assert not any("not additive" in c for c in report.likely_causes)
