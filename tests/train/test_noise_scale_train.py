"""``gradaccum train --noise-scale``: the estimate in each step record, the summary and the run card."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gradaccum.cli.main import main
from gradaccum.errors import TrainError
from gradaccum.step.config import AccumConfig
from gradaccum.train import train
from tests.train.common import config, one_thread


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


def _steps(run_dir: Path) -> list[dict[str, object]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "step"]


def test_train_logs_the_noise_scale_and_the_card_records_it(tmp_path: Path) -> None:
    accum = AccumConfig(max_grad_norm=1.0, track_grad_norm=True, noise_scale=True)
    result = train(config(tmp_path, accum=accum))
    noise = result.noise_scale
    assert noise is not None and noise.samples == 8 and noise.b_simple is not None
    b_simple = [s["b_simple"] for s in _steps(tmp_path)]
    assert len(b_simple) == 8 and all(isinstance(b, float) and b > 0 for b in b_simple)
    assert b_simple[-1] == pytest.approx(noise.b_simple, rel=1e-12)
    units = result.progress.tokens_seen / result.progress.windows
    assert result.critical_batch == noise.describe(units, "tokens")
    assert result.critical_batch.startswith(f"global batch {units:,.0f} tokens is ")
    card = json.loads((tmp_path / "runcard.json").read_text())
    assert card["accum"]["noise_scale"] is True
    recorded = card["extra"]["noise_scale"]
    assert recorded["samples"] == 8 and recorded["b_simple"] == pytest.approx(noise.b_simple, rel=1e-12)
    assert recorded["critical_batch"] == result.critical_batch


def test_without_the_flag_nothing_is_measured(tmp_path: Path) -> None:
    result = train(config(tmp_path, steps=2))
    assert result.noise_scale is None and result.critical_batch is None
    assert all(s["b_simple"] is None for s in _steps(tmp_path))
    assert "noise_scale" not in json.loads((tmp_path / "runcard.json").read_text())["extra"]


def test_fsdp_and_the_noise_scale_are_refused_together(tmp_path: Path) -> None:
    with pytest.raises(TrainError, match="not under FSDP2"):
        dataclasses.replace(config(tmp_path), fsdp=True, accum=AccumConfig(noise_scale=True))


def test_the_cli_flag_prints_where_the_global_batch_stands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--steps", "6", "--noise-scale", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "x B_simple ~ " in out and "critical batch" in out, out
    assert json.loads((tmp_path / "runcard.json").read_text())["accum"]["noise_scale"] is True
