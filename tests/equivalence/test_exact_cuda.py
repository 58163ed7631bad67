"""The float64 equivalence test on a CUDA device (skipped where none is present).

Same tolerance and argument as tests/equivalence/test_exact_step.py: only summation order differs.
On CUDA the count stays on the device until the end-of-step check; this also exercises that path.
"""

from __future__ import annotations

import pytest
import torch

from gradaccum import Accumulator, split
from gradaccum.batch import to_device
from tests.helpers import models
from tests.helpers.reference import full_batch_grads, grads_of, max_rel_err

pytestmark = pytest.mark.cuda


def test_gpt_padded_sequences_match_full_batch_on_cuda() -> None:
    batch = to_device(models.gpt_batch(8, seed=3), "cuda")
    want = full_batch_grads(models.gpt().cuda(), batch, models.gpt_loss, models.tokens)
    model = models.gpt().cuda()
    result = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0)).step(
        split(batch, sizes=[1, 3, 4]), models.gpt_loss, models.tokens
    )
    assert result.applied
    assert max_rel_err(grads_of(model), want) < 1e-12
