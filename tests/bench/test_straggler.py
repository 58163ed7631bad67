"""The straggler figure: under DDP, the slowest rank's window time over the ranks' mean.

Each rank's window is timed from the update's start to its last gradient bucket handed to the
all-reduce (the counting comm hook's clock): its own work, before it waits for the others. The
unit tests check the arithmetic and where the figure is absent; the two-rank sweep checks that
``bench`` measures it on real gloo ranks and prints it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gradaccum.bench.measure import _straggler, straggler_ratio
from gradaccum.bench.stats import ConfigSummary, Spread
from gradaccum.bench.tables import straggler_lines
from tests.cli.test_bench_cli import two_rank_sweep


def test_the_ratio_is_the_slowest_rank_over_the_mean() -> None:
    assert straggler_ratio([10.0, 30.0]) == pytest.approx(1.5, rel=1e-15)
    assert straggler_ratio([20.0, 20.0, 20.0]) == 1.0
    assert straggler_ratio([0.0, 0.0]) == 1.0


def test_per_update_over_ranks_and_none_where_a_rank_did_not_time() -> None:
    # two ranks, three updates: rank 1 the straggler in the first two, rank 0 in the third
    got = _straggler([[10.0, 10.0, 30.0], [30.0, 20.0, 10.0]])
    assert got == pytest.approx((1.5, 20 / 15, 1.5), rel=1e-15)
    assert _straggler([[10.0, 12.0]]) is None  # one rank: nobody waits
    assert _straggler([[10.0, None], [11.0, 12.0]]) is None  # not every update timed (no DDP hook)


class _Row:
    """What straggler_lines reads of a ConfigSummary."""

    def __init__(self, label: str, straggler: Spread | None) -> None:
        self.straggler = straggler
        self.spec = type("S", (), {"row_label": label})()


def test_the_lines_name_each_timed_row_and_nothing_without_ddp() -> None:
    rows = [_Row("2x2", None), _Row("tokens<=64", Spread.of([1.2, 1.1, 1.4]))]
    lines = straggler_lines(rows)  # type: ignore[arg-type]
    assert lines[0].startswith("Stragglers (DDP): the slowest rank's window time over the ranks' mean")
    assert lines[1:] == ["- tokens<=64: 1.200x (1.100..1.400)"]
    assert straggler_lines([_Row("2x2", None)]) == []  # type: ignore[list-item]
    assert "straggler" in {f.name for f in ConfigSummary.__dataclass_fields__.values()}


@pytest.mark.distributed
@pytest.mark.slow
def test_bench_on_two_ranks_measures_and_prints_the_straggler_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = two_rank_sweep(tmp_path, capsys, "--max-tokens", "64")
    for config in data["configs"]:
        assert config["status"] == "ok", config["error"]
        figure = config["straggler"]
        assert figure is not None, config["label"]
        # the slowest of two ranks is at least their mean and at most twice it
        assert 1.0 <= figure["low"] <= figure["median"] <= figure["high"] <= 2.0
    (folder,) = tmp_path.iterdir()
    report = (folder / "report.md").read_text(encoding="utf-8")
    assert "Stragglers (DDP): the slowest rank's window time over the ranks' mean" in report
    assert "- tokens<=64: " in report


@pytest.mark.slow
def test_bench_on_one_process_has_no_straggler_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.cli.test_bench_cli import FAST, sweep

    data = sweep(["--global-batch", "4", "--configs", "2x2", "--out-dir", str(tmp_path), *FAST], capsys)
    assert all(c["straggler"] is None for c in data["configs"])
