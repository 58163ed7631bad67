"""``verify`` and ``bench`` on a routing workload make the choice ``train`` makes
(gradaccum.workloads.balance): the default follows the model's config, ``--balance`` overrides it,
the line that says which is printed, bench's workers measure it and its results record it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradaccum.cli.main import main
from tests.cli.test_bench_cli import FAST

ROUTING = "tests.helpers.moe_workloads:routing_mixtral"
QUIET = "tests.helpers.moe_workloads:quiet_mixtral"


def _out(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    return " ".join((captured.out + captured.err).split())


def test_verify_says_the_balance_and_checks_the_exact_term(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["verify", "--workload", ROUTING, "--trace-steps", "0"])
    out = _out(capsys)
    assert code == 0, out
    assert "load balance: exact, coefficient 0.05 (router_aux_loss_coef): by default" in out
    assert "from the full batch's objective (tolerance 1e-10) PASS" in out


def test_verify_on_a_model_that_does_not_ask_says_off(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["verify", "--workload", QUIET, "--trace-steps", "0"])
    out = _out(capsys)
    assert code == 0, out
    assert "load balance: off, no balancing term" in out


def test_verify_with_balance_off_checks_no_term(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["verify", "--workload", ROUTING, "--balance", "off", "--trace-steps", "0"])
    out = _out(capsys)
    assert code == 0, out
    assert "load balance: off, no balancing term (coefficient 0.05 unused): --balance off" in out
    assert "from the full batch's objective (tolerance" not in out


@pytest.mark.slow
def test_bench_measures_and_records_the_balance(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "--workload", QUIET, "--balance", "lagged", "--global-batch", "4", "--configs", "2x2"]
    code = main([*args, "--out-dir", str(tmp_path / "a"), *FAST])
    out = _out(capsys)
    assert code == 0, out
    assert "load balance: lagged, coefficient 0.05 (router_aux_loss_coef): --balance lagged" in out
    (folder,) = (tmp_path / "a").iterdir()
    data = json.loads((folder / "results.json").read_text())
    assert data["spec"]["balance"] == "lagged"
    assert data["configs"][0]["status"] == "ok", data["configs"][0]["error"]
