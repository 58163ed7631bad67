"""Each normalization, on padded and on packed rows: the accumulated update is the full batch's.

The reference is computed independently (tests/helpers/lm.py: one forward of the whole batch, the
normalization's mean taken document by document in Python). Tolerance 1e-12 relative in float64:
both sides add the same few hundred terms in another order, which moves results by ~1e-15
(float64 rounds at 1.1e-16); a mean of means is off by more than 1e-2 on these uneven rows.
"""

from __future__ import annotations

import pytest
import torch

import gradaccum
from tests.helpers import lm
from tests.helpers.reference import grads_of, max_rel_err

TOL = 1e-12
NORMALIZATIONS = ("token", "sequence", "document")
# uneven micro-batches of rows, per layout (packed: 9 rows, padded: 15 rows)
SIZES = {"packed": [1, 3, 5], "padded": [2, 1, 5, 7]}


@pytest.fixture(scope="module")
def layouts() -> dict[str, gradaccum.packing.Packed]:
    found = lm.layouts()
    assert found["packed"].rows == sum(SIZES["packed"]) and found["padded"].rows == sum(SIZES["padded"])
    return found


def _accumulated(layout: gradaccum.packing.Packed, sizes: list[int], normalization: str) -> dict:
    model = lm.PositionWise()
    loss = gradaccum.CausalLMLoss(normalization)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    result = acc.step(gradaccum.split(layout.batch, sizes=sizes), loss.loss_fn, loss.count_fn)
    assert result.applied and result.global_count == int(loss.count_fn(layout.batch))
    return grads_of(model)


def _mean_of_means(layout: gradaccum.packing.Packed, sizes: list[int], normalization: str) -> dict:
    """The hand-written loop: each micro-batch's own mean, divided by the number of micro-batches."""
    model = lm.PositionWise()
    loss = gradaccum.CausalLMLoss(normalization)
    parts = gradaccum.split(layout.batch, sizes=sizes)
    for part in parts:
        (loss.loss_fn(model, part) / loss.count_fn(part) / len(parts)).backward()
    return grads_of(model)


@pytest.mark.parametrize("layout_name", ["padded", "packed"])
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_accumulated_update_equals_the_independent_reference(
    layouts: dict, layout_name: str, normalization: str
) -> None:
    layout = layouts[layout_name]
    want = lm.reference_grads(lm.PositionWise(), layout, normalization)
    got = _accumulated(layout, SIZES[layout_name], normalization)
    assert max_rel_err(got, want) < TOL
    control = _mean_of_means(layout, SIZES[layout_name], normalization)
    assert max_rel_err(control, want) > 1e-2, "the control must show the weighting error it guards against"


def test_the_loss_itself_matches_the_reference_mean(layouts: dict) -> None:
    model = lm.PositionWise()
    for name, layout in layouts.items():
        batch = layout.batch
        logits = model(**{k: v for k, v in batch.items() if k != "labels"})
        for normalization in NORMALIZATIONS:
            loss = gradaccum.CausalLMLoss(normalization)
            mean = loss.loss_fn(model, batch) / loss.count_fn(batch)
            want = lm.reference_loss(logits, layout, normalization)
            assert torch.allclose(mean, want, rtol=TOL, atol=0), (name, normalization)


def test_verify_passes_every_normalization_and_layout(layouts: dict) -> None:
    for name, layout in layouts.items():
        for normalization in NORMALIZATIONS:
            loss = gradaccum.CausalLMLoss(normalization)
            report = gradaccum.verify(
                lm.PositionWise, layout.batch, loss.loss_fn, loss.count_fn, sizes=SIZES[name], unit=loss.unit
            )
            assert report.passed, (name, normalization, report.summary())
            assert report.grad_max_rel_err < TOL
