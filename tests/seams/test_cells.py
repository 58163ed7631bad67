"""Run every ``exact`` and ``refused`` cell of tests/seams/table.py that the single-process harness
composes (see scenario.py for the model and the objective by hand).

Tolerances: float64 cells 1e-10 relL2 on each window's update (the same sums in another order:
rounding ~1e-16 per term over a few hundred terms, and SGD(lr=1)'s p - g rounds at |p| * 1e-16, a
few 1e-15 of |g| here). BatchNorm's running statistics 1e-12 absolute, as in
tests/equivalence/test_batchnorm_window.py. ``accum_dtype`` runs a bfloat16 model: its forward and
backward round at up to u = 2^-8 = 3.9e-3 per operation (8 significant bits) over about a dozen
operations, errors that grow like sqrt(12) u = 1.4e-2 when the roundings are independent (12 u =
4.7e-2 if every one fell the same way), and SGD(lr=1)'s stored p - g rounds at |p - g| u on top
(|p| and |g| are of one order here). Its update is held to 5e-2 of the float64 objective's,
3.5 times the independent estimate and 3 times the 1.5e-2 to 1.7e-2 measured; the exactness this
cell can prove is the dtype path: every micro-batch after a window's first finds the float32 sum in .grad
(a bf16 accumulation would leave .grad in bfloat16). Skipped windows and resume: bitwise.

Gradient caching (one process, dict micro-batches) is also held bitwise to the same objective
without the cache: an Accumulator whose loss_fn sums the squares of the same representations per
micro-batch. The replay repeats the first pass's forward on the same kernels, so R is the first
pass's to the bit; the cached G = dL/dR = (1/N)(2R) is the float64 product the uncached backward
forms at R, and d<R, G>/dR = G exactly; from R down, the same operations on the same tensors, and
the replays add into .grad in micro-batch order. So with ``accum_dtype`` on a bfloat16 model the
cache adds no rounding to that of ``accum_dtype`` alone (its tolerance above), and a cache that
summed the replays in bfloat16 fails the bitwise check.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

from gradaccum import Accumulator, CachedAccumulator, split_by_tokens
from gradaccum.errors import GradAccumError
from gradaccum.moe import LoadBalance
from tests.seams import scenario as s
from tests.seams.table import MOE, RUN, cells

EXACT, BN_EXACT, BF16 = 1e-10, 1e-12, 5e-2


def _features(row: str, col: str) -> set[str]:
    return {row, col} & set(RUN)


def _windows(feats: set[str], given: str) -> list[list[dict[str, torch.Tensor]]]:
    out = []
    for index, seed in enumerate((1, 2)):
        batch = s.global_batch(8, seed)
        if "token-budget" in feats:
            out.append(split_by_tokens(batch, 3 * s.T))
        elif given == "short-window" and index == 1:
            out.append([batch])
        else:
            out.append([{k: v[a:b] for k, v in batch.items()} for a, b in ((0, 3), (3, 5), (5, 8))])
    return out


class Run:
    """One cell's accumulator over its windows, checked against the reference window by window."""

    def __init__(self, feats: set[str], given: str, ddp: bool = False, compiled: bool = False) -> None:
        self.feats, self.given, self.ddp, self.compiled = feats, given, ddp, compiled
        self.mode = next((f.removeprefix("moe-") for f in feats if f in MOE), None)
        self.bf16 = "accum_dtype" in feats
        self.model = s.build("batchnorm-window" in feats, torch.bfloat16 if self.bf16 else torch.float64)
        self.acc = self.accumulator(self.model)
        self.calls = 0
        self.widths: list[torch.dtype] = []
        self.total: int | None = None
        """The window's count over every rank, for the cached objective under DDP."""

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if "batchnorm-window" in self.feats:
            out["batchnorm_stats"] = "window"
        if self.bf16:
            out["accum_dtype"] = "float32"
        if "post-scaling" in self.feats:
            out["scaling"] = "post"
        return out

    def accumulator(self, model: torch.nn.Module) -> Any:
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        net: torch.nn.Module = model
        if self.ddp:  # top-2 of 4 experts leaves some unused in a micro-batch; buffers are the step's
            from torch.nn.parallel import DistributedDataParallel

            net = DistributedDataParallel(model, find_unused_parameters=True, broadcast_buffers=False)
        if self.compiled:  # aot_eager: dynamo's graphs and AOT autograd without a C++ toolchain
            net = torch.compile(net, backend="aot_eager")
        balance = None
        if self.mode is not None:
            mask = (lambda mb: mb[2]) if self.given == "tuple" else None  # a tuple has no names
            balance = LoadBalance(
                routers=[model.router],
                num_experts=s.E,
                top_k=s.TOP_K,
                coef=s.COEF,
                mode=self.mode,
                mask_fn=mask,
            )
        if "gradient-cache" in self.feats:
            extra = {} if balance is None else {"balance": balance}
            return CachedAccumulator(net, opt, **extra, **self.settings())
        return Accumulator(net, opt, balance=balance, **self.settings())

    def _forward(self) -> None:
        if self.bf16 and torch.is_grad_enabled():  # a training forward (or a replay), not a pass without one
            if self.calls > 0:  # the float32 sum of the earlier micro-batches
                self.widths.append(self.model.lin.weight.grad.dtype)
            self.calls += 1

    def loss_fn(self, model: torch.nn.Module, mb: Any) -> torch.Tensor:
        self._forward()
        if self.given == "loss_fn-compiled":
            return _compiled(s.loss_via_model)(model, mb)
        if self.given == "loss_fn-submodules":
            return s.loss_via_submodules(getattr(model, "module", model), mb)
        return s.loss_via_model(model, mb)

    def step(self, acc: Any, window: list[dict[str, torch.Tensor]], nan: bool = False) -> Any:
        mbs = [s.wrap(mb, self.given) for mb in window]
        if nan:
            mbs = [s.wrap({**mb, "y": mb["y"] * math.nan}, self.given) for mb in window]
        self.calls = 0
        if "gradient-cache" in self.feats:
            n = self.total or sum(int(mb["attention_mask"].sum()) for mb in window)
            compiled = self.given == "loss_fn-compiled"  # the encoder and the objective compiled
            rows, objective = (_compiled(_rows), _compiled(_objective)) if compiled else (_rows, _objective)

            def encode(m: torch.nn.Module, mb: Any) -> torch.Tensor:
                self._forward()
                return rows(m, mb)

            return acc.step(mbs, encode, lambda reps: objective(reps, n), count_fn=s.count)
        return acc.step(mbs, self.loss_fn, s.count)

    def checked(self, windows: list[list[dict[str, torch.Tensor]]]) -> list[float]:
        errors, carried = [], None
        for window in windows:
            ref = s.reference(self.model, window, self.mode, carried)
            before = [p.detach().clone() for p in self.model.parameters()]
            assert self.step(self.acc, window).applied
            update = [
                p.detach().double() - b.double() for p, b in zip(self.model.parameters(), before, strict=True)
            ]
            err = s.rel_l2(update, [-g for g in ref.grads])
            errors.append(err)
            assert err <= (BF16 if self.bf16 else EXACT), (self.feats, self.given, err)
            if ref.bn_mean is not None:
                tol = BF16 if self.bf16 else BN_EXACT
                assert (self.model.bn.running_mean.double() - ref.bn_mean).abs().max() <= tol
                assert (self.model.bn.running_var.double() - ref.bn_var).abs().max() <= tol
                assert int(self.model.bn.num_batches_tracked) == len(errors)
            carried = (ref.counts, ref.rows)
        if self.bf16:
            assert self.widths and all(d == torch.float32 for d in self.widths), self.widths
        return errors


def _rows(model: torch.nn.Module, mb: Any) -> torch.Tensor:
    """The cached objective's representations: the masked residuals, one row per position."""
    x, y, mask = s.fields(mb)
    return ((model(x.to(next(model.parameters()).dtype)) - y) * mask[..., None]).reshape(-1, 2)


def _objective(reps: torch.Tensor, n: int) -> torch.Tensor:
    """The cached objective: the masked squared error summed over the window, over N."""
    return reps.pow(2).sum() / n


_COMPILED: dict[Any, Any] = {}


def _compiled(fn: Any) -> Any:
    """``fn`` under ``torch.compile`` (aot_eager), compiled once per process."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, backend="aot_eager")
    return _COMPILED[fn]


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run_cell(row: str, col: str, compiled: bool = False) -> list[float]:
    feats = _features(row, col)
    given = col if col not in RUN and col != "compile" else "dict"
    windows = _windows(feats, given)
    run = Run(feats, given, compiled=compiled)
    errors = run.checked(windows)
    straight = _state(run.model)
    if "gradient-cache" in feats and given == "dict" and not compiled:
        # the same objective without the cache, its loss summed per micro-batch: bitwise (below)
        plain = Run(feats - {"gradient-cache"}, given)
        for window in windows:
            plain.acc.step(window, lambda m, mb: _rows(m, mb).pow(2).sum(), s.count)
        assert _equal(_state(plain.model), straight)
    if given == "skipped-window":  # a skipped window leaves every state as it was: bitwise
        other = Run(feats, given, compiled=compiled)
        other.step(other.acc, windows[0])
        assert other.step(other.acc, windows[1], nan=True).skipped
        other.step(other.acc, windows[1])
        assert _equal(_state(other.model), straight)
    if given == "resume":  # rebuilt from the saved states after the first window: bitwise
        first = Run(feats, given, compiled=compiled)
        first.step(first.acc, windows[0])
        saved = copy.deepcopy((first.model.state_dict(), first.acc.state_dict()))
        opt_state = copy.deepcopy(first.acc._engine.optimizer.state_dict())
        resumed = Run(feats, given, compiled=compiled)
        resumed.model.load_state_dict(saved[0])
        resumed.acc = resumed.accumulator(resumed.model)
        resumed.acc.load_state_dict(saved[1])
        resumed.acc._engine.optimizer.load_state_dict(opt_state)
        resumed.step(resumed.acc, windows[1])
        assert _equal(_state(resumed.model), straight)
    return errors


EXACT_CELLS = [c for c in cells() if c.outcome == "exact" and c.row in RUN and (c.col in RUN or c.col in
               ("dict", "BatchEncoding", "tuple", "dataclass", "loss_fn-submodules", "skipped-window",
                "short-window", "resume"))]  # fmt: skip
REFUSED_CELLS = [c for c in cells() if c.outcome == "refused" and c.row in RUN and c.col in RUN]
# split_by_tokens's refusals; DDP's loss_fn refusal runs on two ranks, tests/distributed/test_ddp_forward.py
# (the external step's refusals run in test_deepspeed_cells.py)
REFUSED_INPUTS = [c for c in cells() if c.outcome == "refused" and c.col not in RUN and c.row != "ddp"
                  and "external-step" not in (c.row, c.col)]  # fmt: skip


KNOWN: dict[tuple[str, str], str] = {}
"""Cells that fail on this code, with what is wrong; strict, so a fix that lands fails them until
the entry is removed."""


def _exact_param(cell: Any) -> Any:
    reason = KNOWN.get((cell.row, cell.col))
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(cell, id=f"{cell.row}-x-{cell.col}", marks=marks)


@pytest.mark.parametrize("cell", [_exact_param(c) for c in EXACT_CELLS])
def test_exact(cell: Any) -> None:
    run_cell(cell.row, cell.col)


@pytest.mark.parametrize("cell", REFUSED_CELLS, ids=lambda c: f"{c.row}-x-{c.col}")
def test_refused_at_construction(cell: Any) -> None:
    error, setting = cell.note.split(": ")
    with pytest.raises(GradAccumError) as caught:
        Run(_features(cell.row, cell.col), "dict")
    assert type(caught.value).__name__ == error
    assert setting in str(caught.value)


@pytest.mark.parametrize("cell", REFUSED_INPUTS, ids=lambda c: f"{c.row}-x-{c.col}")
def test_refused_input(cell: Any) -> None:
    error, setting = cell.note.split(": ")
    with pytest.raises(GradAccumError) as caught:
        split_by_tokens(s.wrap(s.global_batch(8, 1), cell.col), 3 * s.T)
    assert type(caught.value).__name__ == error
    assert setting.split(" ")[0] in str(caught.value)
