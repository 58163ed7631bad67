"""``gradaccum.pack`` and its padded counterpart: rows, positions, labels, and what they report."""

from __future__ import annotations

import pytest
import torch

import gradaccum
from gradaccum.errors import PlanError
from gradaccum.packing import block_causal_mask, document_segments, pad
from tests.helpers import lm


def _row_documents(packed: gradaccum.packing.Packed, r: int) -> list[list[int]]:
    """A packed row read back from its position_ids alone: a document starts where they are 0."""
    ids, pos = packed.input_ids[r].tolist(), packed.position_ids[r].tolist()
    docs: list[list[int]] = []
    for token, p in zip(ids, pos, strict=True):
        if p == 0:
            docs.append([])
        docs[-1].append(token)
    return docs[: len(packed.row_lengths[r])]  # the rest is the padding's pseudo-document


def test_packed_rows_hold_every_document_once_with_positions_restarting() -> None:
    docs = lm.documents()
    packed = gradaccum.pack(docs, lm.SEQ_LEN)
    # the long document is cut into a row-sized document and its rest; the 1-token one stays
    long = docs[5]
    expected = [d for i, d in enumerate(docs) if i != 5] + [long[: lm.SEQ_LEN], long[lm.SEQ_LEN :]]
    found = [d for r in range(packed.rows) for d in _row_documents(packed, r)]
    assert sorted(found) == sorted(expected)
    assert [len(d) for r in range(packed.rows) for d in _row_documents(packed, r)] == [
        n for lengths in packed.row_lengths for n in lengths
    ]
    assert packed.split_documents == 1 and packed.documents == len(docs) + 1
    assert packed.tokens == sum(len(d) for d in docs)
    assert packed.padding_tokens == packed.rows * lm.SEQ_LEN - packed.tokens
    assert packed.rows < len(docs)  # several documents per row
    assert set(packed.batch) == {"input_ids", "labels", "position_ids"}


def test_no_target_crosses_a_document_boundary() -> None:
    packed = gradaccum.pack(lm.documents(), lm.SEQ_LEN)
    starts = packed.position_ids == 0
    # shift=True: the label at a document's first token (predicted from the previous one) is ignored
    assert (packed.labels[starts] == -100).all()
    inside = ~starts & (packed.labels != -100)
    assert torch.equal(packed.labels[inside], packed.input_ids[inside])


def test_off_by_one_a_row_of_three_documents_counts_its_real_targets() -> None:
    packed = gradaccum.pack([[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]], 16)
    assert packed.rows == 1 and packed.row_lengths == ((4, 3, 5),)
    # 12 tokens, 3 documents: 3 + 2 + 4 = 9 targets, not 12 - 1 = 11
    assert packed.targets == 9
    assert int((packed.labels != -100).sum()) == 9
    for normalization, units in (("token", 9), ("document", 3), ("sequence", 1)):
        assert int(gradaccum.CausalLMLoss(normalization).count_fn(packed.batch)) == units
    # the same row with naive labels (the inputs, padding ignored): the loss still counts 9
    naive_labels = packed.input_ids.clone()
    naive_labels[:, 12:] = -100
    naive = dict(packed.batch, labels=naive_labels)
    assert int(gradaccum.CausalLMLoss("token").count_fn(naive)) == 9
    assert (
        int(gradaccum.count_tokens("labels", shift=True)(naive)) == 11
    )  # what ignoring the documents counts


def test_padded_rows_give_the_same_targets_as_packed_rows() -> None:
    docs = lm.documents()
    packed, padded = gradaccum.pack(docs, lm.SEQ_LEN), pad(docs, lm.SEQ_LEN)
    assert padded.rows == packed.documents and padded.targets == packed.targets
    assert int((padded.labels != -100).sum()) == packed.targets
    assert torch.equal(padded.attention_mask.sum(1), torch.tensor([n for (n,) in padded.row_lengths]))
    assert set(padded.batch) == {"input_ids", "labels", "attention_mask"}


def test_unshifted_labels_are_the_next_tokens_within_documents() -> None:
    packed = gradaccum.pack([[1, 2, 3], [4, 5]], 8, shift=False)
    assert packed.labels[0].tolist() == [2, 3, -100, 5, -100, -100, -100, -100]


def test_first_fit_pads_less_than_in_order() -> None:
    docs = [[1] * 9, [2] * 9, [3] * 6, [4] * 6]
    first_fit = gradaccum.pack(docs, 15)
    in_order = gradaccum.pack(docs, 15, order="in_order")
    assert first_fit.rows == 2 and first_fit.row_lengths == ((9, 6), (9, 6))
    assert in_order.rows == 3 and in_order.padding_tokens > first_fit.padding_tokens
    assert "2 rows of 15 tokens" in first_fit.summary() and "0 padding (0.0%)" in first_fit.summary()
    assert "15 padding (33.3%)" in in_order.summary()


def test_overflow_truncate_and_error() -> None:
    truncated = gradaccum.pack([list(range(1, 21))], 8, overflow="truncate")
    assert truncated.row_lengths == ((8,),) and truncated.truncated_tokens == 12
    with pytest.raises(PlanError, match="document 0 holds 20 tokens, more than seq_len=8"):
        gradaccum.pack([list(range(1, 21))], 8, overflow="error")
    with pytest.raises(
        PlanError, match=r"overflow must be one of \['split', 'truncate', 'error'\], got 'wrap'"
    ):
        pad([[1, 2]], 8, overflow="wrap")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("documents", "seq_len", "message"),
    [
        ([[1, 2]], 1, "seq_len must be an integer >= 2"),
        (["some text"], 8, "documents are tokenized"),
        ([[1, -3]], 8, "negative token id"),
        ([[1.5]], 8, "token ids are integers"),
        ([[True, 2]], 8, "not booleans"),
        ([[]], 8, "the one document holds no token"),
        ([torch.ones(2, 2, dtype=torch.long)], 8, "a 1-D integer tensor"),
    ],
)
def test_bad_documents_are_refused_naming_the_value(documents: list, seq_len: int, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        gradaccum.pack(documents, seq_len)


def test_segments_from_positions_and_from_document_ids_agree() -> None:
    packed = gradaccum.pack(lm.documents(), lm.SEQ_LEN)
    from_positions = document_segments(packed.input_ids.shape, position_ids=packed.position_ids)
    ids = from_positions * 7 + 3  # any labels that change where the documents change
    from_ids = document_segments(packed.input_ids.shape, document_ids=ids)
    assert from_positions is not None and torch.equal(from_positions, from_ids)
    assert document_segments(packed.input_ids.shape) is None


def test_block_causal_mask_attends_within_documents_only() -> None:
    segments = torch.tensor([[0, 0, 1, 1, 1]])
    mask = block_causal_mask(segments, dtype=torch.float64)
    allowed = (mask == 0)[0, 0]
    assert mask.shape == (1, 1, 5, 5)
    assert allowed.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [False, False, True, False, False],
        [False, False, True, True, False],
        [False, False, True, True, True],
    ]
    assert mask.min() == torch.finfo(torch.float64).min  # finite: a fully masked row is no NaN
    padded = block_causal_mask(segments, torch.tensor([[1, 1, 1, 1, 0]]), dtype=torch.float32)
    assert not (padded == 0)[0, 0, :, 4].any()
