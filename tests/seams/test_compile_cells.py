"""The ``compile`` cells of tests/seams/table.py: the cell's scenario with its model under
``torch.compile`` (aot_eager: dynamo's graphs and AOT autograd, no C++ toolchain here), held to
the same float64 objective as test_cells.py with the same tolerances (compiled float64 kernels sum
in another order: rounding only). The ``loss_fn-compiled`` cells compile the ``loss_fn`` instead
(under gradient caching the encoder and the objective over the representations), one compiled
function for every cell; the ``ddp`` one runs in test_ddp_cells.py's launch.

Dynamo keeps the graphs it traced per code object and does not guard module hooks, so a cell
whose step registers other hooks than the previous cell's (the routers', BatchNorm's window,
accum_dtype's) starts from ``torch.compiler.reset()``: a graph traced by an earlier cell, before
this cell's step registered its hooks, would run without them. The cells that hook alike share the
graphs (compiling is most of this file's time). What the step does about a graph traced without
the routers' hooks is the last test here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradaccum.errors import ConfigError
from tests.seams.table import MOE, cells
from tests.seams.test_cells import Run, _features, _windows, run_cell

COMPILE_CELLS = [
    c
    for c in cells()
    if ("compile" in (c.row, c.col) or c.col == "loss_fn-compiled")
    and not {"ddp", "external-step"} & {c.row, c.col}
    and c.outcome == "exact"
]


_traced: list[tuple[bool, ...]] = []
"""The hooks of the cell whose graphs dynamo holds."""


@pytest.mark.parametrize("cell", COMPILE_CELLS, ids=lambda c: f"{c.row}-x-{c.col}")
def test_compiled_cell(cell: Any) -> None:
    feats = _features(cell.row, cell.col)
    hooks = (bool(feats & set(MOE)), "batchnorm-window" in feats, "accum_dtype" in feats)
    if _traced[-1:] != [hooks]:
        torch.compiler.reset()
        _traced.append(hooks)
    row, col = (cell.col, cell.row) if cell.row == "compile" else (cell.row, cell.col)
    if col == "loss_fn-compiled":  # the loss compiled, the model as it is
        run_cell(row, col, compiled=row == "compile")
    else:
        run_cell(row, col, compiled=True)


@pytest.mark.parametrize(
    ("mode", "compiled"), [("moe-lagged", "model"), ("moe-micro-batch", "model"), ("moe-lagged", "loss_fn")]
)
def test_a_graph_traced_before_the_router_hooks_is_refused(mode: str, compiled: str) -> None:
    """A graph traced without the routers' hooks (here: another instance of the model class,
    compiled and run first, or run first through the compiled ``loss_fn``) would drop the
    balancing term silently (relL2 0.095 without the check, either way); the step refuses the
    window by name, before any update."""
    torch.compiler.reset()
    given = "loss_fn-compiled" if compiled == "loss_fn" else "dict"
    plain = Run(set(), given, compiled=compiled == "model")
    plain.step(plain.acc, _windows(set(), given)[0])
    run = Run({mode}, given, compiled=compiled == "model")
    before = [p.detach().clone() for p in run.model.parameters()]
    with pytest.raises(ConfigError, match=r"LoadBalance.routers \[0\]"):
        run.step(run.acc, _windows({mode}, given)[0])
    assert all(torch.equal(p, b) for p, b in zip(run.model.parameters(), before, strict=True))
    torch.compiler.reset()
    _traced.clear()
