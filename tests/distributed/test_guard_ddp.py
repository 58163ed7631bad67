"""gradaccum.guard under real DDP (gloo, two processes): the synchronization rules fire on seeded
broken loops and stay silent on correct ones, and the guard's inferred all-reduce count matches what
a counting comm hook saw (one bucket per synchronized backward for this small model).

All scenarios run in one spawn (spawning is the slow part); each rank reports, per scenario, its
findings as (code, line) and the comm hook's count, and the tests below judge them.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from gradaccum.hazards.sanitizer import GuardError, guard
from gradaccum.step.accumulator import Accumulator
from tests.helpers.ddp import wrap
from tests.helpers.launcher import run_ranks, values

pytestmark = pytest.mark.distributed

K = 3
WINDOWS = 2


def _line(tag: str) -> int:
    for number, text in enumerate(Path(__file__).read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"# BUG:{tag}"):
            return number
    raise LookupError(tag)


def _model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K * WINDOWS micro-batches of 3 examples with 3, 2, 1 valid labels: unequal counts per window."""
    gen = torch.Generator().manual_seed(10 + rank)
    out = []
    for j in range(K * WINDOWS):
        x = torch.randn(3, 4, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (3,), generator=gen)
        y[: j % 3] = -100
        out.append((x, y))
    return out


def _loop(ddp: Any, opt: torch.optim.Optimizer, data: list, style: str) -> None:
    """A hand-written DDP loop; ``correct`` is exact (sum * W/N) and syncs once per window."""
    for w in range(WINDOWS):
        window = data[w * K : (w + 1) * K]
        total = torch.tensor(float(sum(int((y != -100).sum()) for _, y in window)), dtype=torch.float64)
        dist.all_reduce(total)
        scale = dist.get_world_size() / total
        opt.zero_grad()
        for j, (x, y) in enumerate(window):
            defer = ddp.no_sync() if j < K - 1 else contextlib.nullcontext()
            if style in ("correct", "mean"):
                with defer:
                    if style == "mean":
                        loss = F.cross_entropy(ddp(x), y) / K
                    else:
                        loss = F.cross_entropy(ddp(x), y, reduction="sum") * scale
                    loss.backward()  # BUG:mean-of-means
            elif style == "backward-only":
                loss = F.cross_entropy(ddp(x), y, reduction="sum") * scale
                with defer:
                    loss.backward()  # BUG:no-sync-backward-only
            elif style == "every-micro-batch":
                (F.cross_entropy(ddp(x), y, reduction="sum") * scale).backward()  # BUG:sync-per-micro-batch
            elif style == "never":
                with ddp.no_sync():
                    (F.cross_entropy(ddp(x), y, reduction="sum") * scale).backward()
        opt.step()  # BUG:unsynced-step


def _accumulator(ddp: Any, opt: torch.optim.Optimizer, data: list) -> None:
    acc = Accumulator(ddp, opt, max_grad_norm=1.0)

    def loss_fn(m: nn.Module, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(mb[0]), mb[1], reduction="sum")

    for w in range(WINDOWS):
        acc.step(data[w * K : (w + 1) * K], loss_fn, lambda mb: (mb[1] != -100).sum())


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    data = _data(rank)
    out: dict[str, Any] = {}
    for style in ("correct", "mean", "backward-only", "every-micro-batch", "never", "accumulator", "bare"):
        ddp, counter = wrap(_model())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        if style == "bare":  # the correct loop without a guard: the numerical reference
            _loop(ddp, opt, data, "correct")
            out[style] = {"params": [p.detach().clone() for p in ddp.parameters()]}
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with guard(ddp, opt, K, mode="warn") as g:
                if style == "accumulator":
                    _accumulator(ddp, opt, data)
                else:
                    _loop(ddp, opt, data, style)
        out[style] = {
            "found": [(f.code, f.lineno) for f in g.findings],
            "warned": sum(w.category.__name__ == "GuardWarning" for w in caught),
            "allreduces": counter.calls,
            "synced": g.synced_backward_passes,
            "backwards": g.backward_passes,
            "params": [p.detach().clone() for p in ddp.parameters()],
        }
    # raise mode: both ranks stop at the same misuse, after its backward, so neither hangs
    ddp, _ = wrap(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    try:
        with guard(ddp, opt, K):
            _loop(ddp, opt, data, "backward-only")
        out["raised"] = None
    except GuardError as exc:
        out["raised"] = (exc.finding.code, exc.finding.lineno, exc.finding.window)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return values(run_ranks(_scenarios, timeout_s=120))


def test_correct_ddp_loops_are_silent_and_sync_once_per_window(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        for style in ("correct", "accumulator"):
            s = r[style]
            assert s["found"] == [] and s["warned"] == 0, (style, s["found"])
            assert s["synced"] == s["allreduces"] == WINDOWS, style  # one bucket per synced backward
            assert s["backwards"] == K * WINDOWS


def test_guard_leaves_ddp_numbers_unchanged(ranks: list[dict[str, Any]]) -> None:
    # the same operations in the same order with and without the guard: bitwise equal by construction
    for r in ranks:
        assert all(
            torch.equal(a, b) for a, b in zip(r["correct"]["params"], r["bare"]["params"], strict=True)
        )


def test_no_sync_around_backward_only_is_caught_and_really_synced(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        s = r["backward-only"]
        # the first K-1 backwards of each window ran in no_sync with a forward outside it
        # backward-only misuse K-1 times; the second of them is also the window's second sync
        expected = [("no-sync-backward-only", _line("no-sync-backward-only"))] * (K - 1)
        expected.append(("sync-per-micro-batch", _line("no-sync-backward-only")))
        assert s["found"] == expected * WINDOWS
        # warn mode: a line repeating one mistake warns once per window (every finding is recorded)
        assert s["warned"] == len(set(expected)) * WINDOWS
        # the premise, measured: every backward all-reduced despite no_sync
        assert s["allreduces"] == s["synced"] == K * WINDOWS
        assert r["raised"] == ("no-sync-backward-only", _line("no-sync-backward-only"), 0)


def test_sync_per_micro_batch_and_unsynced_step(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        every, never = r["every-micro-batch"], r["never"]
        assert every["found"] == [("sync-per-micro-batch", _line("sync-per-micro-batch"))] * WINDOWS
        assert every["allreduces"] == every["synced"] == K * WINDOWS
        assert never["found"] == [("unsynced-step", _line("unsynced-step"))] * WINDOWS
        assert never["allreduces"] == never["synced"] == 0


def test_mean_of_means_under_ddp(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        s = r["mean"]
        assert s["found"] == [("mean-of-means", _line("mean-of-means"))] * WINDOWS
        assert s["allreduces"] == WINDOWS
