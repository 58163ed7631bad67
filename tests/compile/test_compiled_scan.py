"""scan names a division by a batch-derived Python number inside a compiled region, and only there.

``torch.compile`` is lazy: nothing here compiles (no forward runs), so these tests are fast.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradaccum import scan
from gradaccum.hazards.compiled import COMPILED_DENOMINATOR, compiled_regions
from tests.helpers import models


class MeanHead(nn.Module):
    """A block that averages over its rows with a Python count: fine eagerly, a constant when compiled."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum(dim=0) / len(x)


class ScaledAttention(nn.Module):
    """Divisions by the model's own sizes (not the batch's): nothing to name."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = 4

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        return scores / float(self.head_dim) ** 0.5 / q.shape[-1]


def per_micro_batch_mean(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(mb["input_ids"])
    total = F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), reduction="sum")
    return total / (mb["labels"] != -100).sum().item()


def _codes(findings: list) -> list[str]:
    return [f.code for f in findings]


def test_a_compiled_loss_dividing_by_an_item_is_named_with_its_line() -> None:
    model = models.gpt()
    found = [
        f
        for f in scan(model, 4, loss_fn=torch.compile(per_micro_batch_mean))
        if f.code == COMPILED_DENOMINATOR
    ]
    assert len(found) == 1
    assert found[0].kind == "loss" and found[0].severity == "warning"
    assert ".sum().item()" in found[0].explanation and "recompile" in found[0].explanation
    assert "summed" in found[0].fix
    # the same loss, not compiled: nothing compiled to break (the mean of means is verify's finding)
    assert COMPILED_DENOMINATOR not in _codes(scan(model, 4, loss_fn=per_micro_batch_mean))


def test_a_compiled_block_is_named_by_its_path_and_the_whole_model_through_torch_compile() -> None:
    model = nn.Sequential(nn.Linear(5, 5), MeanHead())
    assert COMPILED_DENOMINATOR not in _codes(scan(model, 4))
    model[1].compile()  # per-block compile, in place
    (finding,) = [f for f in scan(model, 4) if f.code == COMPILED_DENOMINATOR]
    assert finding.path == "1" and finding.kind == "MeanHead" and "len(x)" in finding.explanation
    whole = torch.compile(nn.Sequential(nn.Linear(5, 5), MeanHead()))
    (finding,) = [f for f in scan(whole, 4) if f.code == COMPILED_DENOMINATOR]
    assert finding.path == "_orig_mod.1"  # found in the block inside the compiled model's region
    kinds = [kind for _, kind, _ in compiled_regions(whole)]
    assert kinds == ["Sequential", "Linear", "MeanHead"]  # everything the compiled forward runs


def test_the_bundled_compiled_gpt_with_its_summed_loss_has_no_finding() -> None:
    findings = scan(torch.compile(models.gpt()), 4, loss_fn=torch.compile(models.gpt_loss))
    assert COMPILED_DENOMINATOR not in _codes(findings)


def test_divisions_by_the_models_own_sizes_are_not_named() -> None:
    assert COMPILED_DENOMINATOR not in _codes(scan(torch.compile(ScaledAttention()), 4))

    class RowMean(ScaledAttention):
        def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            return (q @ k.transpose(-2, -1)).sum() / q.shape[0] + q.sum() / int(k.ne(0).sum())

    found = [f for f in scan(torch.compile(RowMean()), 4) if f.code == COMPILED_DENOMINATOR]
    assert len(found) == 2 and "q.shape[0]" in found[0].explanation and "int(" in found[1].explanation
