"""The packed check: the same documents packed and padded give the same update under ``token`` and
``document`` normalization for a model that attends within documents, and differ under
``sequence``; a model that attends across documents (or ignores position restarts) fails it.

The attending model is a 2-layer transformers Llama given the block-diagonal 4D mask that
``CausalLMLoss(mask_documents=True)`` builds; the position-wise model attends to nothing.
Tolerances: the report's own (1e-10 float64, argued in gradaccum.check.packed); the differences
that must show are above 1e-2.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

import gradaccum
from tests.helpers import lm

transformers = pytest.importorskip("transformers")


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=lm.VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=lm.SEQ_LEN,
        use_cache=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return transformers.LlamaForCausalLM(config)


class _IgnoresMask(nn.Module):
    """A Llama handed a plain all-ones mask instead of the block mask: packed tokens attend across
    documents. (Given no mask at all, transformers 5 finds packed documents from position_ids
    itself when no key/value cache is in use.)"""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _llama()

    def forward(
        self, input_ids: torch.Tensor, attention_mask: object = None, position_ids: object = None
    ) -> object:
        return self.inner(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), position_ids=position_ids
        )


class _AbsolutePositions(lm.PositionWise):
    """Reads positions 0..T-1 of the row, not the restarting position_ids."""

    def forward(
        self, input_ids: torch.Tensor, attention_mask: object = None, position_ids: object = None
    ) -> torch.Tensor:
        return super().forward(input_ids)


MODELS: dict[str, Callable[[], nn.Module]] = {"llama": _llama, "position-wise": lm.PositionWise}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("normalization", ["token", "document"])
def test_packed_and_padded_agree_for_a_model_attending_within_documents(
    model: str, normalization: str
) -> None:
    report = gradaccum.verify_packed(
        MODELS[model], lm.documents(), seq_len=lm.SEQ_LEN, normalization=normalization
    )
    assert report.passed, report.summary()
    assert report.layouts_agree and report.layout_grad_max_rel_err < 1e-12
    assert report.packed.passed and report.padded.passed
    assert len(set(report.packed.sizes)) > 1 and len(set(report.padded.sizes)) > 1  # uneven
    assert report.packed_loss == pytest.approx(report.padded_loss, rel=1e-12)
    assert "packed and padded agree" in report.summary()


@pytest.mark.parametrize("model", sorted(MODELS))
def test_sequence_normalization_differs_between_layouts_as_it_must(model: str) -> None:
    report = gradaccum.verify_packed(
        MODELS[model], lm.documents(), seq_len=lm.SEQ_LEN, normalization="sequence"
    )
    assert not report.expect_same and not report.layouts_agree
    assert report.layout_grad_max_rel_err > 1e-2
    assert report.passed, report.summary()  # each layout still accumulates exactly
    assert "as sequence normalization must" in report.summary()


@pytest.mark.parametrize(
    "build", [_IgnoresMask, _AbsolutePositions], ids=["attends-across", "absolute-positions"]
)
def test_a_model_that_sees_across_documents_fails_with_the_reason(build: Callable[[], nn.Module]) -> None:
    report = gradaccum.verify_packed(build, lm.documents(), seq_len=lm.SEQ_LEN, normalization="document")
    assert not report.passed and not report.layouts_agree
    assert report.layout_grad_max_rel_err > 1e-2
    assert report.packed.passed  # the accumulation is still exact: the layouts compute different things
    assert any("attends across the documents of a packed row" in c for c in report.likely_causes)


def test_verify_packed_workload_needs_documents() -> None:
    from gradaccum.check.packed import verify_packed_workload
    from gradaccum.check.workload import load_workload

    with pytest.raises(gradaccum.WorkloadError, match=r"needs the workload's tokenized documents"):
        verify_packed_workload(load_workload("gradaccum.examples:tiny_gpt"))
