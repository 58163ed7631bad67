"""``gradaccum train``'s accumulation settings, from one declaration (gradaccum.train.settings):
``--balance`` on a routing model (its default follows the model's config), ``--accum-dtype``,
``--batchnorm-stats``; each said at start, recorded in the run card, replayed by ``--runcard`` and
refused beside it; a bad value exits 2 naming the flag. And the banner's parameter dtype.

Exactness of the balance through the command: one SGD(lr=1) window of the tiny float64 Mixtral
(tests/helpers/moe_workloads.py), no clipping, against the full batch's objective written by hand in
tests/helpers/moe.py (cross-entropy over N plus coef * E * sum_i f_i P_i over the whole batch).
Tolerance 1e-10: every operation is float64 (CausalLMLoss keeps a float64 model's logits), so each
rounds at ~1e-16 and the update sums a few hundred terms per parameter (observed ~1e-15); the
balancing term left out (``--balance off``) is ~1e-2 away.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gradaccum.cli.main import main
from gradaccum.train.data import train_seed
from gradaccum.train.settings import RUN_SETTINGS
from tests.helpers import moe as h
from tests.helpers import moe_workloads as w
from tests.train.common import one_thread

ROUTING = "tests.helpers.moe_workloads:routing_mixtral"
QUIET = "tests.helpers.moe_workloads:quiet_mixtral"
# one window of 8 rows in 4 micro-batches of 2, SGD at lr 1, no clipping, flat schedule
ONE_SGD_WINDOW = [
    *("--global-batch", "8", "--micro-batch", "2", "--steps", "1", "--precision", "float64"),
    *("--optimizer", "sgd", "--lr", "1", "--schedule", "constant", "--warmup", "0", "--max-grad-norm", "0"),
]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


def _train(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["train", *argv])
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())


def _card(run_dir: Path) -> dict:
    return json.loads((run_dir / "runcard.json").read_text())


def _update(run_dir: Path) -> list[torch.Tensor]:
    final = run_dir / "checkpoints" / "step-00000001" / "state.pt"
    state = torch.load(final, weights_only=True)["model"]
    start = w.routing_mixtral().build_model()
    return [state[name] - p.detach() for name, p in start.named_parameters()]


def _want() -> list[torch.Tensor]:
    return h.reference_update(
        w.routing_mixtral().build_model(), w.sequences(8, train_seed(0, 0)), coef=w.COEF
    )


def test_a_model_that_asks_for_its_balancing_loss_trains_with_the_exact_term_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text = _train(["--workload", ROUTING, *ONE_SGD_WINDOW, "--run-dir", str(tmp_path / "r")], capsys)
    assert code == 0, text
    assert "load balance: exact, coefficient 0.05 (router_aux_loss_coef): by default" in text
    assert _card(tmp_path / "r")["balance"] == {"mode": "exact", "coef": 0.05}
    assert h.rel_l2(_update(tmp_path / "r"), _want()) < 1e-10


def test_balance_off_is_said_recorded_and_leaves_the_term_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--workload", ROUTING, "--balance", "off", *ONE_SGD_WINDOW, "--run-dir", str(tmp_path / "r")]
    code, text = _train(argv, capsys)
    assert code == 0, text
    assert "load balance: off, no balancing term (coefficient 0.05 unused): --balance off" in text
    assert _card(tmp_path / "r")["balance"] == {"mode": "off", "coef": 0.05}
    assert h.rel_l2(_update(tmp_path / "r"), _want()) > 1e-3


def test_a_model_that_does_not_ask_trains_without_the_term_and_says_it_is_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text = _train(["--workload", QUIET, *ONE_SGD_WINDOW, "--run-dir", str(tmp_path / "r")], capsys)
    assert code == 0, text
    assert "load balance: off, no balancing term" in text
    assert "does not ask for its balancing loss" in text
    assert _card(tmp_path / "r")["balance"] == {"mode": "off", "coef": 0.05}


def test_a_balance_mode_is_recorded_replayed_and_refused_beside_the_card(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = tmp_path / "first"
    code, text = _train(
        ["--workload", QUIET, "--balance", "lagged", *ONE_SGD_WINDOW, "--run-dir", str(first)], capsys
    )
    assert code == 0, text
    assert "load balance: lagged, coefficient 0.05 (router_aux_loss_coef): --balance lagged" in text
    card = first / "runcard.json"
    code, text = _train(
        ["--runcard", str(card), "--steps", "1", "--run-dir", str(tmp_path / "again")], capsys
    )
    assert code == 0, text
    assert "from run card: load balance lagged, coefficient 0.05" in text
    assert "load balance: lagged" in text
    assert _card(tmp_path / "again")["balance"] == {"mode": "lagged", "coef": 0.05}
    code, text = _train(
        ["--runcard", str(card), "--balance", "exact", "--run-dir", str(tmp_path / "x")], capsys
    )
    assert code == 2
    assert "--balance exact (the card has lagged, coefficient 0.05)" in text


def test_a_balance_mode_on_a_dense_model_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text = _train(["--balance", "exact", "--steps", "1", "--run-dir", str(tmp_path / "r")], capsys)
    assert code == 2
    assert "--balance exact: the model has no mixture-of-experts routers" in text


@pytest.mark.parametrize("setting", RUN_SETTINGS, ids=lambda s: s.name)
def test_a_bad_value_exits_2_naming_the_flag(
    setting: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flag = setting.flag  # type: ignore[attr-defined]
    with pytest.raises(SystemExit) as exit_:
        main(["train", flag, "bogus", "--run-dir", str(tmp_path / "r")])
    assert exit_.value.code == 2
    assert f"argument {flag}: invalid choice: 'bogus'" in capsys.readouterr().err


def test_accum_dtype_is_recorded_replayed_and_refused_beside_the_card(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--workload", "tests.helpers.moe_workloads:bf16_gpt", "--accum-dtype", "float32", "--steps", "1"]
    code, text = _train([*argv, "--run-dir", str(tmp_path / "r")], capsys)
    assert code == 0, text
    assert "precision float32 (compute), parameters bfloat16" in text
    card = tmp_path / "r" / "runcard.json"
    assert _card(tmp_path / "r")["accum"]["accum_dtype"] == "float32"
    code, text = _train(
        ["--runcard", str(card), "--steps", "1", "--run-dir", str(tmp_path / "again")], capsys
    )
    assert code == 0, text
    assert "accum_dtype float32" in text  # the card's accumulation settings, said at start
    assert _card(tmp_path / "again")["accum"]["accum_dtype"] == "float32"
    code, text = _train(
        ["--runcard", str(card), "--accum-dtype", "float64", "--run-dir", str(tmp_path / "x")], capsys
    )
    assert code == 2
    assert "--accum-dtype float64 (the card has float32)" in text


def test_batchnorm_stats_is_recorded_and_replayed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "gradaccum.examples:bn_cnn", "--batchnorm-stats", "window", "--steps", "1"]
    code, text = _train(
        [*argv, "--global-batch", "8", "--micro-batch", "4", "--run-dir", str(tmp_path / "r")], capsys
    )
    assert code == 0, text
    assert _card(tmp_path / "r")["accum"]["batchnorm_stats"] == "window"
    card = tmp_path / "r" / "runcard.json"
    code, text = _train(
        ["--runcard", str(card), "--steps", "1", "--run-dir", str(tmp_path / "again")], capsys
    )
    assert code == 0, text
    assert "batchnorm_stats window" in text
    assert _card(tmp_path / "again")["accum"]["batchnorm_stats"] == "window"


def test_a_balance_with_post_scaling_exits_2_naming_both_ways_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--workload", ROUTING, "--scaling", "post", "--steps", "1", "--run-dir", str(tmp_path / "r")]
    code, text = _train(argv, capsys)
    assert code == 2
    assert "use --scaling pre, or --balance off" in text


def test_a_lagged_balance_resumes_bitwise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the lagged mode carries the previous window's counts: a resumed run must pick them up
    common = ["--workload", ROUTING, "--balance", "lagged", "--global-batch", "8", "--micro-batch", "2"]
    common += ["--precision", "float64", "--schedule", "constant", "--warmup", "0"]
    code, text = _train([*common, "--steps", "3", "--run-dir", str(tmp_path / "straight")], capsys)
    assert code == 0, text
    code, text = _train([*common, "--steps", "2", "--run-dir", str(tmp_path / "cut")], capsys)
    assert code == 0, text
    code, text = _train(
        [*common, "--steps", "3", "--run-dir", str(tmp_path / "cut"), "--resume", "auto"], capsys
    )
    assert code == 0, text

    def last(run: str) -> dict:
        folder = tmp_path / run / "checkpoints" / "step-00000003" / "state.pt"
        return torch.load(folder, weights_only=True)["model"]

    straight, resumed = last("straight"), last("cut")
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)
