from __future__ import annotations

import pytest

from gradaccum.cli.main import main


def test_plan_prints_the_seeds_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "micro_batch 4 x dp 8 x accum_steps 8 = 256" in out
    assert "B vs A: global batch, tokens and update cadence held fixed" in out
    assert "updates 100 -> 800" in out


def test_plan_bad_input_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "4x0x2"]) == 2
    assert "plan 4x0x2: DP must be at least 1, got 0" in capsys.readouterr().err
    assert main(["plan", "four"]) == 2
    assert "MICROxDPxACCUM" in capsys.readouterr().err


def test_unknown_command_exits_2() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["no-such-command"])
    assert exc.value.code == 2
