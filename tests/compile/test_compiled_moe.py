"""An exact load balance through ``torch.compile`` (aot_eager: no C++ build on this machine).

The routers' forward hooks run inside the compiled graph's forward; the routing pass runs the same
compiled module without a graph (one more graph, for grad mode off). Tolerance 1e-10 as in
tests/equivalence/test_moe_balance.py: the same float64 sums in another order.
"""

from __future__ import annotations

import copy

import pytest
import torch

from gradaccum import Accumulator
from gradaccum.moe import LoadBalance
from tests.helpers import moe as h

pytestmark = pytest.mark.slow


def test_compiled_mixtral_is_exact() -> None:
    torch.compiler.reset()
    model = h.tiny_moe()
    seqs = h.sequences((5, 7, 3, 8, 6, 4, 7, 5), seed=1)
    reference = h.reference_update(model, seqs, coef=0.05)
    m = copy.deepcopy(model)
    before = [p.detach().clone() for p in m.parameters()]
    compiled = torch.compile(m, backend="aot_eager")
    acc = Accumulator(
        compiled, torch.optim.SGD(m.parameters(), lr=1.0), balance=LoadBalance.from_model(compiled)
    )
    window = [h.pad(seqs[i : i + 2], 8) for i in range(0, 8, 2)]  # one width: one graph per grad mode
    assert acc.step(window, h.ce_sum, h.tokens).applied
    assert h.rel_l2(h.update_of(m, before), reference) <= 1e-10
    torch.compiler.reset()
