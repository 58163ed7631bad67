"""The ``ddp`` cells of tests/seams/table.py: every one in one two-process gloo launch.

Each rank runs every cell's scenario (tests/seams/test_cells.py's ``Run`` with its model under
DistributedDataParallel) on its share of each window: rank 0 the first micro-batches, rank 1 the
rest (uneven counts and sizes on purpose), and returns each window's update. The test holds rank
0's update to the float64 objective of the whole window on one process (scenario.py), and both
ranks' parameters to each other bitwise (DDP averages one gradient). Tolerances as in
test_cells.py, plus DDP's averaging of two float64 gradients (one rounding, ~1e-16). The
``compile`` cell compiles the DDP wrapper (aot_eager), the order DDP's documentation recommends.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.launcher import run_ranks
from tests.seams import scenario as s
from tests.seams.table import RUN, cells
from tests.seams.test_cells import BF16, BN_EXACT, EXACT, Run, _equal, _features, _state, _windows

pytestmark = pytest.mark.distributed

DDP_CELLS = [c for c in cells() if "ddp" in (c.row, c.col) and c.outcome == "exact"]


def _given(cell: Any) -> str:
    other = cell.col if cell.row == "ddp" else cell.row
    return other if other not in RUN and other not in ("ddp", "compile") else "dict"


def _global_windows(feats: set[str], given: str) -> list[list[dict[str, torch.Tensor]]]:
    windows = _windows(feats, given if given != "short-window" else "dict")
    if given == "short-window":  # one micro-batch on each rank
        batch = s.global_batch(8, 2)
        windows[1] = [{k: v[a:b] for k, v in batch.items()} for a, b in ((0, 5), (5, 8))]
    return windows


def _share(window: list[Any], rank: int) -> list[Any]:
    cut = (len(window) + 1) // 2
    return window[:cut] if rank == 0 else window[cut:]


def _cell(rank: int, feats: set[str], given: str, compiled: bool) -> dict[str, Any]:
    windows = _global_windows(feats, given)
    run = Run(feats, given, ddp=True, compiled=compiled)
    updates, afters, stats = [], [], []
    for window in windows:
        before = [p.detach().clone() for p in run.model.parameters()]
        run.total = sum(int(mb["attention_mask"].sum()) for mb in window)
        assert run.step(run.acc, _share(window, rank)).applied
        after = [p.detach().clone() for p in run.model.parameters()]
        updates.append([a.double() - b.double() for a, b in zip(after, before, strict=True)])
        afters.append(after)
        if run.model.bn is not None:
            bn = run.model.bn
            stats.append((bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked)))
    out: dict[str, Any] = {
        "updates": updates,
        "afters": afters,
        "stats": stats,
        "widths": run.widths,
        "state": _state(run.model),
    }
    if given == "skipped-window":
        other = Run(feats, given, ddp=True)
        other.step(other.acc, _share(windows[0], rank))
        out["skipped"] = other.step(other.acc, _share(windows[1], rank), nan=True).skipped
        other.step(other.acc, _share(windows[1], rank))
        out["bitwise"] = _equal(_state(other.model), out["state"])
    if given == "resume":
        first = Run(feats, given, ddp=True)
        first.step(first.acc, _share(windows[0], rank))
        saved = (first.model.state_dict(), first.acc.state_dict(), first.acc._engine.optimizer.state_dict())
        resumed = Run(feats, given, ddp=True)
        resumed.model.load_state_dict(saved[0])
        resumed.acc = resumed.accumulator(resumed.model)
        resumed.acc.load_state_dict(saved[1])
        resumed.acc._engine.optimizer.load_state_dict(saved[2])
        resumed.step(resumed.acc, _share(windows[1], rank))
        out["bitwise"] = _equal(_state(resumed.model), out["state"])
    return out


def _ranks(rank: int, world: int, specs: list[tuple[str, str]]) -> dict[tuple[str, str], Any]:
    import traceback

    import torch.distributed as dist

    out: dict[tuple[str, str], Any] = {}
    for row, col in specs:
        key = (row, col)
        cell = next(c for c in DDP_CELLS if (c.row, c.col) == key)
        try:
            out[key] = _cell(rank, _features(row, col), _given(cell), "compile" in key)
        except Exception:  # the test reports it per cell; the ranks meet before the next one
            out[key] = traceback.format_exc()
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[Any]:
    specs = [(c.row, c.col) for c in DDP_CELLS]
    return run_ranks(_ranks, specs, timeout_s=240)


@pytest.mark.parametrize("cell", DDP_CELLS, ids=lambda c: f"{c.row}-x-{c.col}")
def test_ddp_cell(cell: Any, ranks: list[Any]) -> None:
    assert all(o.ok for o in ranks), [o.error for o in ranks]
    key = (cell.row, cell.col)
    got = [o.value[key] for o in ranks]
    for g in got:
        assert not isinstance(g, str), g
    feats, given = _features(cell.row, cell.col), _given(cell)
    run = Run(feats, given)  # the same initial model on one process
    bf16 = "accum_dtype" in feats
    tol = BF16 if bf16 else EXACT
    carried = None
    for index, window in enumerate(_global_windows(feats, given)):
        ref = s.reference(run.model, window, run.mode, carried)
        err = s.rel_l2(got[0]["updates"][index], [-g for g in ref.grads])
        assert err <= tol, (key, index, err)
        with torch.no_grad():
            for p, a in zip(run.model.parameters(), got[0]["afters"][index], strict=True):
                p.copy_(a)
        if ref.bn_mean is not None:
            mean, var, tracked = got[0]["stats"][index]
            bn_tol = BF16 if bf16 else BN_EXACT
            assert (mean.double() - ref.bn_mean).abs().max() <= bn_tol, key
            assert (var.double() - ref.bn_var).abs().max() <= bn_tol, key
            assert tracked == index + 1
            run.model.bn.running_mean.copy_(mean)
            run.model.bn.running_var.copy_(var)
        carried = (ref.counts, ref.rows)
    assert _equal(got[0]["state"], got[1]["state"]), key
    if bf16:
        assert got[0]["widths"] and all(d == torch.float32 for d in got[0]["widths"])
    if given == "skipped-window":
        assert all(g["skipped"] and g["bitwise"] for g in got), key
    if given == "resume":
        assert all(g["bitwise"] for g in got), key
