"""A run card with ``batchnorm_stats="window"`` records the setting, and ``train`` replays it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gradaccum.plan import BatchPlan
from gradaccum.runcard import read_runcard
from gradaccum.step.config import AccumConfig
from tests.train.common import one_thread, train_from_accum_card


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


def test_train_replays_window_batchnorm_statistics_from_the_run_card(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = BatchPlan(micro_batch=2, accum_steps=2, dp=1)
    accum = AccumConfig(batchnorm_stats="window")
    card, built, trained = train_from_accum_card(
        tmp_path, monkeypatch, "gradaccum.examples:bn_cnn", plan, accum
    )
    assert json.loads(card.read_text())["accum"]["batchnorm_stats"] == "window"
    assert read_runcard(card).accum == accum
    assert [acc.config.batchnorm_stats for acc in built] == ["window"]
    assert trained["batchnorm_stats"] == "window"
