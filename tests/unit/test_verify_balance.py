"""``verify`` on a mixture-of-experts workload: the balancing term is checked against the full
batch's objective, and the report says how far ``lagged`` and ``micro-batch`` are from ``exact``.

Tolerances: float64, one SGD(lr=1) update of a tiny Mixtral; ``exact`` sums the same terms as the
full batch in another order (~1e-16 relative per operation), asserted below the check's own 1e-10.
The other modes follow other objectives: asserted more than 1e-3 away.
"""

from __future__ import annotations

import pytest

from gradaccum.check.balance import verify_balance
from gradaccum.cli.main import main
from gradaccum.workloads.base import Workload
from tests.helpers import moe as h


def tiny_mixtral() -> Workload:
    """A workload of a routing Mixtral (its loss_fn the summed cross-entropy only)."""

    def make_batch(n: int, seed: int) -> h.Batch:
        return h.pad(h.sequences([3 + (5 * i) % 7 for i in range(n)], seed=seed))

    return Workload(
        name="tiny_mixtral",
        build_model=lambda: h.tiny_moe("mixtral", layers=1),
        make_batch=make_batch,
        loss_fn=h.ce_sum,
        count_fn=h.tokens,
        batch_size=6,
        micro_batch=2,
    )


def dense() -> Workload:
    from gradaccum.examples import tiny_gpt

    return tiny_gpt()


def test_exact_balance_equals_the_full_batch_and_the_other_modes_are_measured() -> None:
    report = verify_balance(tiny_mixtral(), sizes=[1, 3, 2])
    assert report is not None and report.sizes == (1, 3, 2)
    assert report.passed and report.errors["exact"] < 1e-10
    assert report.from_exact["lagged"] > 1e-3 and report.from_exact["micro-batch"] > 1e-3
    assert "from exact: lagged" in report.summary()


def test_a_dense_workload_has_no_balance_check() -> None:
    assert verify_balance(dense()) is None


def test_the_cli_prints_the_balance_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["verify", "--workload", "tests.unit.test_verify_balance:tiny_mixtral", "--trace-steps", "0"])
    out = capsys.readouterr().out
    assert "load balance: exact" in out and "PASS" in out and "micro-batch" in out
    assert code == 0
