"""``accum_dtype``'s float32 sums in bench's persistent memory term and in the advisor's sentence."""

from __future__ import annotations

import dataclasses

import torch

from gradaccum.bench.advisor import advise
from gradaccum.bench.memory import MemoryFigures, accum_buffer_bytes
from tests.bench.test_advisor import GIB, row
from tests.helpers import models


def test_the_buffers_are_four_bytes_per_narrower_parameter() -> None:
    mixed = torch.nn.Sequential(torch.nn.Linear(5, 4).to(torch.bfloat16), torch.nn.Linear(4, 3))
    assert accum_buffer_bytes(mixed, torch.float32) == (5 * 4 + 4) * 4  # the float32 layer needs none
    assert accum_buffer_bytes(mixed, None) == 0
    assert accum_buffer_bytes(models.mlp(), "float32") == 0  # float64 parameters: nothing narrower


def test_the_persistent_term_and_the_peak_count_the_buffers() -> None:
    plain = MemoryFigures(
        parameter_bytes=200, gradient_bytes=200, optimizer_state_bytes=400, activation_bytes=50
    )
    wide = dataclasses.replace(plain, accum_buffer_bytes=400)
    assert wide.persistent_bytes == plain.persistent_bytes + 400
    assert wide.tensor_peak_bytes == plain.tensor_peak_bytes + 400
    assert MemoryFigures.from_dict(wide.to_dict()) == wide
    # a record written before the field existed reads as 0
    old = {k: v for k, v in plain.to_dict().items() if k != "accum_buffer_bytes"}
    assert MemoryFigures.from_dict(old).accum_buffer_bytes == 0


def test_the_advisor_names_the_buffers_when_the_persistent_term_is_the_wall() -> None:
    heavy = dataclasses.replace(row(2, 8, 1000.0, 9.0, persistent_gib=8.0), accum_buffer_bytes=2.0 * GIB)
    advice = advise([heavy], 6 * GIB, global_batch=16)
    assert advice.outcome == "persistent"
    assert "2.0 GiB are the float32 sums of accum_dtype: accum_dtype=None frees them" in advice.sentence
    plain = advise([row(2, 8, 1000.0, 9.0, persistent_gib=8.0)], 6 * GIB, global_batch=16)
    assert "accum_dtype" not in plain.sentence
