"""``gradaccum.CausalLMLoss``: the unit each normalization counts, what it refuses, how it calls the model."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import gradaccum
from gradaccum.errors import ConfigError, CountError, CountTypeError, LossError
from tests.helpers import lm


def test_counts_per_normalization_on_padded_and_packed_rows() -> None:
    docs = lm.documents()
    layouts = lm.layouts(docs)
    packed, padded = layouts["packed"], layouts["padded"]
    # the 1-token document has no target; the long document is two documents of the rows
    documents_with_targets = len(docs) + 1 - 1
    targets = sum(len(d) - 1 for d in docs) - 1  # cutting the long document drops one more target
    for layout in (packed, padded):
        assert int(gradaccum.CausalLMLoss("token").count_fn(layout.batch)) == targets == layout.targets
        assert int(gradaccum.CausalLMLoss("document").count_fn(layout.batch)) == documents_with_targets
    assert int(gradaccum.CausalLMLoss("sequence").count_fn(padded.batch)) == documents_with_targets
    assert int(gradaccum.CausalLMLoss("sequence").count_fn(packed.batch)) == packed.rows
    assert gradaccum.CausalLMLoss("document").unit == "documents"


def test_document_ids_mark_documents_like_position_restarts() -> None:
    packed = lm.layouts()["packed"]
    from gradaccum.packing import document_segments

    segments = document_segments(packed.input_ids.shape, position_ids=packed.position_ids)
    by_ids = {"input_ids": packed.input_ids, "labels": packed.labels, "document_ids": segments * 5 + 1}
    loss = gradaccum.CausalLMLoss("document")
    assert int(loss.count_fn(by_ids)) == int(loss.count_fn(packed.batch))
    # without position_ids the model sees positions 0..T-1: compare the weighting with a model
    # that ignores positions, which then gives the same loss either way
    model = lm.PositionWise()
    with torch.no_grad():
        model.pos.weight.zero_()
    assert torch.allclose(loss.loss_fn(model, by_ids), loss.loss_fn(model, packed.batch), rtol=1e-14, atol=0)


def test_unshifted_labels_give_the_same_loss() -> None:
    docs = lm.documents()
    shifted = gradaccum.pack(docs, lm.SEQ_LEN)
    unshifted = gradaccum.pack(docs, lm.SEQ_LEN, shift=False)
    model = lm.PositionWise()
    for normalization in ("token", "sequence", "document"):
        a = gradaccum.CausalLMLoss(normalization)
        b = gradaccum.CausalLMLoss(normalization, shift=False)
        assert int(a.count_fn(shifted.batch)) == int(b.count_fn(unshifted.batch))
        # shift=False scores the logits at every position (the last one has no target): same sum
        got, want = b.loss_fn(model, unshifted.batch), a.loss_fn(model, shifted.batch)
        assert torch.allclose(got, want, rtol=1e-13, atol=0), normalization


def test_a_row_continuing_a_document_is_refused_under_document_and_sequence() -> None:
    # one 20-token document cut into two rows by hand, the second row's positions continuing
    ids = torch.arange(1, 21).reshape(2, 10) % lm.VOCAB
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(20).reshape(2, 10)}
    for normalization in ("document", "sequence"):
        with pytest.raises(
            CountError, match=r"row\(s\) \[1\] of this micro-batch start at position_ids \[10\]"
        ):
            gradaccum.CausalLMLoss(normalization).count_fn(batch)
    assert int(gradaccum.CausalLMLoss("token").count_fn(batch)) == 18  # any split is exact for tokens
    # and through the step: refused before any backward, the weights untouched
    model = lm.PositionWise()
    before = [p.detach().clone() for p in model.parameters()]
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loss = gradaccum.CausalLMLoss("document")
    with pytest.raises(CountError, match="normalization='token', which any split leaves exact"):
        acc.step(gradaccum.split(batch, sizes=[1, 1]), loss.loss_fn, loss.count_fn)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_left_padding_with_transformers_positions_is_not_refused() -> None:
    # transformers gives left padding position 1 and the first real token 0
    batch = {
        "input_ids": torch.tensor([[0, 0, 4, 5, 6], [7, 8, 9, 10, 11]]),
        "labels": torch.tensor([[-100, -100, 4, 5, 6], [7, 8, 9, 10, 11]]),
        "position_ids": torch.tensor([[1, 1, 0, 1, 2], [0, 1, 2, 3, 4]]),
    }
    assert int(gradaccum.CausalLMLoss("sequence").count_fn(batch)) == 2
    assert int(gradaccum.CausalLMLoss("document").count_fn(batch)) == 2
    assert int(gradaccum.CausalLMLoss("token").count_fn(batch)) == 2 + 4


def test_rows_without_targets_are_not_units_and_sum_to_an_exact_zero() -> None:
    batch = {"input_ids": torch.ones(2, 6, dtype=torch.long), "labels": torch.full((2, 6), -100)}
    model = lm.PositionWise()
    for normalization in ("token", "sequence", "document"):
        loss = gradaccum.CausalLMLoss(normalization)
        assert int(loss.count_fn(batch)) == 0
        value = loss.loss_fn(model, batch)
        value.backward()
        assert float(value.detach()) == 0.0
        assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())


class _Recorder(torch.nn.Module):
    def __init__(self, output: str = "tensor") -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1, lm.VOCAB).double()
        self.output = output
        self.calls: list[dict[str, torch.Tensor]] = []

    def forward(self, **inputs: torch.Tensor) -> object:
        self.calls.append(inputs)
        logits = self.linear(inputs["input_ids"].unsqueeze(-1).double())
        if self.output == "tensor":
            return logits
        if self.output == "logits":
            return type("Out", (), {"logits": logits})()
        return {"no": "logits"}


def test_the_model_gets_only_the_keys_present_and_a_block_mask_when_asked() -> None:
    packed = gradaccum.pack([[1, 2, 3], [4, 5]], 6)
    batch = dict(packed.batch, document_ids=torch.zeros(1, 6, dtype=torch.long))
    model = _Recorder("logits")
    gradaccum.CausalLMLoss().loss_fn(model, batch)
    assert set(model.calls[-1]) == {"input_ids", "position_ids"}  # no labels, no document_ids
    gradaccum.CausalLMLoss(mask_documents=True).loss_fn(model, packed.batch)
    mask = model.calls[-1]["attention_mask"]
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.float64  # the model's dtype
    assert bool(mask[0, 0, 3, 2] < 0) and bool(mask[0, 0, 4, 3] == 0)  # doc 2 does not see doc 1
    padded = gradaccum.packing.pad([[1, 2, 3], [4, 5]], 6)
    gradaccum.CausalLMLoss(mask_documents=True).loss_fn(model, padded.batch)
    assert model.calls[-1]["attention_mask"].ndim == 2  # no documents marked: passed as given


def test_errors_name_the_setting_and_the_fix() -> None:
    with pytest.raises(
        ConfigError, match=r"normalization must be one of \['token', 'sequence', 'document'\]"
    ):
        gradaccum.CausalLMLoss("tokens")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="shift must be True or False"):
        gradaccum.CausalLMLoss(shift=1)  # type: ignore[arg-type]
    with pytest.raises(LossError, match="needs a micro-batch mapping with 'input_ids' and 'labels'"):
        gradaccum.CausalLMLoss().count_fn({"input_ids": torch.ones(1, 3, dtype=torch.long)})
    with pytest.raises(CountTypeError, match="integer tensor of class ids"):
        gradaccum.CausalLMLoss().count_fn({"input_ids": torch.ones(1, 3), "labels": torch.ones(1, 3)})
    batch = {"input_ids": torch.ones(1, 3, dtype=torch.long), "labels": torch.ones(1, 3, dtype=torch.long)}
    with pytest.raises(LossError, match="it must return the logits or an output with .logits"):
        gradaccum.CausalLMLoss().loss_fn(_Recorder("dict"), batch)


def test_import_gradaccum_and_the_new_names_import_no_transformers() -> None:
    code = (
        "import sys, gradaccum\n"
        "gradaccum.CausalLMLoss, gradaccum.pack, gradaccum.verify_packed\n"
        "import gradaccum.workloads\n"
        "from gradaccum.cli.main import build_parser\n"
        "build_parser().format_help()\n"
        "print([m for m in ('transformers', 'tokenizers') if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
