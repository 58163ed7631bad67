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


def test_plan_with_a_mesh_names_which_dimensions_multiply_the_batch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", "2x8x4", "--mesh", "dp_replicate=2,dp_shard=4,cp=2,tp=2,pp=2"]) == 0
    out = capsys.readouterr().out
    assert "= 64 ranks" in out and "dp = dp_replicate x dp_shard = 8" in out
    assert "global_batch = micro_batch 2 x dp 8 x accum_steps 4 = 64" in out
    assert main(["plan", "2x4x4", "--mesh", "dp_shard=2,tp=2"]) == 2
    assert "write the plan as MICROx2xACCUM" in capsys.readouterr().err
    assert main(["plan", "2x2x4", "--mesh", "fsdp=2"]) == 2
    assert "play no known role" in capsys.readouterr().err
