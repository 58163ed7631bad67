"""Item 8: an exception on one rank surfaces there, and every other rank stops with a message that
names the failing rank, within milliseconds instead of the process-group timeout; the process
group and the DDP wrapper stay usable.

Rank 0 holds 6 examples in 3 micro-batches and rank 1 holds 4 in 2, so the ranks reach their
synchronizing backward after different numbers of forwards, the case where a hang would occur.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum import Accumulator, split
from gradaccum.batch import take
from tests.faults.common import (
    AGREED_WITHIN_S,
    F64_RTOL,
    Trip,
    ddp_mlp,
    grads,
    params,
    rel_err,
    scenario_outcomes,
)
from tests.helpers import models
from tests.helpers.launcher import run_ranks
from tests.helpers.reference import full_batch_grads

pytestmark = pytest.mark.distributed

BOUNDS = [0, 6, 10]
SIZES = {0: [2, 2, 2], 1: [2, 2]}
Injection = Callable[[int, Any, list[Any]], tuple[Any, Any, Any]]


def _global() -> dict[str, torch.Tensor]:
    return models.mlp_batch(10, seed=5)


def _local(rank: int) -> dict[str, torch.Tensor]:
    return take(_global(), BOUNDS[rank], BOUNDS[rank + 1])


class _Boom(RuntimeError):
    pass


def _fault_then_recover(rank: int, inject: Injection, *, defer: bool = True, sizes=SIZES) -> dict[str, Any]:
    """One faulty step, then a clean one from the same weights on the same Accumulator."""
    ddp = ddp_mlp()
    acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), defer_sync=defer)
    before = params(ddp)
    window = split(_local(rank), sizes=sizes[rank])
    faulty_window, loss_fn, count_fn = inject(rank, ddp, window)
    start = time.monotonic()
    error: tuple[str, str] | None = None
    try:
        acc.step(faulty_window, loss_fn, count_fn)
    except Exception as exc:
        error = (type(exc).__name__, str(exc))
    seconds = time.monotonic() - start
    cleared = all(p.grad is None for p in ddp.parameters())
    unchanged = all(torch.equal(before[n], p) for n, p in params(ddp).items())
    counters = (acc.steps_applied, acc.steps_skipped, acc.consecutive_skips)
    for module in ddp.module.modules():  # remove the injected hooks
        module._forward_hooks.clear()
    for p in ddp.parameters():
        p._backward_hooks = None
    result = acc.step(window, models.mlp_loss, models.count_rows)
    return {
        "error": error,
        "seconds": seconds,
        "cleared": cleared,
        "unchanged": unchanged,
        "counters": counters,
        "recovered": result.applied,
        "grads": grads(ddp),  # SGD leaves the accumulated gradient in .grad
    }


def _forward_fault(fault_rank: int, call: int) -> Injection:
    def inject(rank: int, ddp: DDP, window: list[Any]) -> tuple[Any, Any, Any]:
        if rank == fault_rank:
            ddp.module[0].register_forward_hook(Trip(lambda: _Boom("injected fault"), {call}))
        return window, models.mlp_loss, models.count_rows

    return inject


def _deferred_backward_fault(rank: int, ddp: DDP, window: list[Any]) -> tuple[Any, Any, Any]:
    if rank == 0:

        def explode(grad: torch.Tensor) -> torch.Tensor:
            raise _Boom("injected fault in backward")

        ddp.module[2].weight.register_hook(explode)
    return window, models.mlp_loss, models.count_rows


def _count_fault(rank: int, ddp: DDP, window: list[Any]) -> tuple[Any, Any, Any]:
    calls = {"n": 0}

    def count(mb: Any) -> Any:
        calls["n"] += 1
        if rank == 1 and calls["n"] == 2:
            raise KeyError("labels")
        return models.count_rows(mb)

    return window, models.mlp_loss, count


def _window_fault(rank: int, ddp: DDP, window: list[Any]) -> tuple[Any, Any, Any]:
    def broken() -> Iterator[Any]:
        yield window[0]
        raise OSError("data loader lost its file")

    return (broken() if rank == 0 else window), models.mlp_loss, models.count_rows


def _both_fail(rank: int, ddp: DDP, window: list[Any]) -> tuple[Any, Any, Any]:
    ddp.module[0].register_forward_hook(Trip(lambda: _Boom(f"fault on rank {rank}"), {rank + 1}))
    return window, models.mlp_loss, models.count_rows


SCENARIOS = {
    "forward, first micro-batch, rank 0": lambda r, w: _fault_then_recover(r, _forward_fault(0, 1)),
    "forward, middle micro-batch, rank 0": lambda r, w: _fault_then_recover(r, _forward_fault(0, 2)),
    "forward, last micro-batch, rank 1": lambda r, w: _fault_then_recover(r, _forward_fault(1, 2)),
    "deferred backward, rank 0": lambda r, w: _fault_then_recover(r, _deferred_backward_fault),
    "count_fn, rank 1": lambda r, w: _fault_then_recover(r, _count_fault),
    "reading the window, rank 0": lambda r, w: _fault_then_recover(r, _window_fault),
    "both ranks": lambda r, w: _fault_then_recover(r, _both_fail),
    "forward without deferral, rank 0": lambda r, w: _fault_then_recover(
        r, _forward_fault(0, 2), defer=False, sizes={0: [3, 3], 1: [2, 2]}
    ),
}


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, Any]]:
    return scenario_outcomes(__name__)


def _reference() -> dict[str, torch.Tensor]:
    return full_batch_grads(models.mlp(), _global(), models.mlp_loss, models.count_rows)


# (scenario, failing rank, what the failing rank raises, what the other rank's message must say)
CASES = [
    (
        "forward, first micro-batch, rank 0",
        0,
        "_Boom",
        "rank 0 failed in forward of micro-batch 0: _Boom: injected",
    ),
    ("forward, middle micro-batch, rank 0", 0, "_Boom", "rank 0 failed in forward of micro-batch 1: _Boom"),
    ("forward, last micro-batch, rank 1", 1, "_Boom", "rank 1 failed in forward of micro-batch 1: _Boom"),
    ("deferred backward, rank 0", 0, "_Boom", "rank 0 failed in backward of micro-batch 0: _Boom"),
    ("count_fn, rank 1", 1, "KeyError", "rank 1 failed in count_fn of micro-batch 1: KeyError: 'labels'"),
    ("reading the window, rank 0", 0, "OSError", "rank 0 failed in reading the window: OSError: data loader"),
    ("forward without deferral, rank 0", 0, "_Boom", "rank 0 failed in forward of micro-batch 1: _Boom"),
]


@pytest.mark.parametrize(("name", "failing", "raised", "told"), CASES, ids=[c[0] for c in CASES])
def test_failure_on_one_rank_stops_every_rank_with_its_name(
    outcomes: list[dict[str, Any]], name: str, failing: int, raised: str, told: str
) -> None:
    want = _reference()
    for rank in (0, 1):
        outcome = outcomes[rank][name]
        assert outcome.ok, outcome.message
        got = outcome.value
        assert got["error"] is not None, f"rank {rank} did not fail"
        error_type, message = got["error"]
        if rank == failing:
            assert error_type == raised, message  # the original exception surfaces on its rank
        else:
            assert error_type == "RankFailedError", message
            assert told in message, message
            assert "no update" in message
        assert got["seconds"] < AGREED_WITHIN_S, (
            f"rank {rank} took {got['seconds']:.1f}s: a timeout, not agreement"
        )
        assert got["cleared"], "the partial window's gradients must be discarded"
        assert got["unchanged"], "no update may be applied"
        # the next step on the same Accumulator and DDP wrapper is exact: nothing was left half-done
        assert got["counters"] == (0, 0, 0), "a failed window is neither applied nor skipped"
        assert got["recovered"]
        assert rel_err(got["grads"], want) < F64_RTOL


def test_two_failing_ranks_each_raise_their_own_error(outcomes: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        got = outcomes[rank]["both ranks"].value
        assert got["error"] == ("_Boom", f"fault on rank {rank}")
        assert got["seconds"] < AGREED_WITHIN_S and got["cleared"] and got["unchanged"]
        assert rel_err(got["grads"], _reference()) < F64_RTOL


# -- past the agreement point: the synchronizing backward ------------------------------------


def _sync_backward_fault(rank: int, world: int, linger_s: float) -> dict[str, Any]:
    """Rank 0 raises inside its synchronizing backward, then exits (or lingers without exiting)."""
    ddp = ddp_mlp(bucket_cap_mb=1e-4)  # several buckets: rank 1 is mid-reduction when rank 0 stops
    acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
    window = split(_local(rank), sizes=SIZES[rank])
    if rank == 0:
        backwards = {"n": 0}

        def explode(grad: torch.Tensor) -> torch.Tensor:
            backwards["n"] += 1
            if backwards["n"] == len(window):  # the last micro-batch's backward synchronizes
                raise _Boom("injected fault in the synchronizing backward")
            return grad

        ddp.module[2].bias.register_hook(explode)
    start = time.monotonic()
    try:
        acc.step(window, models.mlp_loss, models.count_rows)
        error = None
    except Exception as exc:
        error = (type(exc).__name__, str(exc))
    seconds = time.monotonic() - start
    if rank == 0 and linger_s:
        time.sleep(linger_s)  # alive but not taking part: rank 1 must not wait past its timeout
    return {"error": error, "seconds": seconds}


def test_failure_in_the_synchronizing_backward_fails_the_other_rank_when_the_peer_exits() -> None:
    r0, r1 = (o.value for o in run_ranks(_sync_backward_fault, 0.0, timeout_s=60))
    assert r0["error"][0] == "_Boom"
    assert r1["error"][0] == "CollectiveError", r1["error"]
    assert "synchronizing backward" in r1["error"][1] and "Another rank stopped" in r1["error"][1]
    assert r1["seconds"] < AGREED_WITHIN_S  # the closed connection is seen at once


# A short process-group timeout keeps this test quick; the path is the same at 30 s.
LINGER_PG_TIMEOUT_S = 6


def test_failure_in_the_synchronizing_backward_fails_the_other_rank_at_the_timeout() -> None:
    outcomes = run_ranks(
        _sync_backward_fault, LINGER_PG_TIMEOUT_S + 2.0, pg_timeout_s=LINGER_PG_TIMEOUT_S, timeout_s=60
    )
    r0, r1 = (o.value for o in outcomes)
    assert r0["error"][0] == "_Boom"
    assert r1["error"][0] == "CollectiveError", r1["error"]
    assert "synchronizing backward" in r1["error"][1]
    # the process-group timeout bounds the wait: not a hang
    assert LINGER_PG_TIMEOUT_S - 1 < r1["seconds"] < LINGER_PG_TIMEOUT_S + 5, r1["seconds"]


# -- DDP with module buffers: the tiny GPT's causal mask ---------------------------------------

GPT_BOUNDS, GPT_SIZES = [0, 5, 8], {0: [2, 2, 1], 1: [2, 1]}


def _gpt_fault(rank: int, world: int, broadcast_buffers: bool) -> dict[str, Any]:
    """Rank 1 fails inside its synchronizing forward; then the same wrapper tries a clean step."""
    ddp = DDP(models.gpt(), broadcast_buffers=broadcast_buffers)
    acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
    window = split(
        take(models.gpt_batch(8, seed=11), GPT_BOUNDS[rank], GPT_BOUNDS[rank + 1]), sizes=GPT_SIZES[rank]
    )
    trip = Trip(lambda: _Boom("injected fault"), {len(window)}) if rank == 1 else None
    handle = ddp.module.blocks[1].register_forward_hook(trip) if trip else None
    errors: list[tuple[str, str]] = []
    try:
        acc.step(window, models.gpt_loss, models.tokens)
    except Exception as exc:
        errors.append((type(exc).__name__, str(exc)))
    if handle is not None:
        handle.remove()
    try:
        acc.step(window, models.gpt_loss, models.tokens)
    except Exception as exc:
        errors.append((type(exc).__name__, str(exc)))
    return {"errors": errors, "grads": grads(ddp), "cleared": all(p.grad is None for p in ddp.parameters())}


GPT_SCENARIOS = {
    "broadcast_buffers=True": lambda r, w: _gpt_fault(r, w, True),
    "broadcast_buffers=False": lambda r, w: _gpt_fault(r, w, False),
}


@pytest.fixture(scope="module")
def gpt_outcomes() -> list[dict[str, Any]]:
    return scenario_outcomes(__name__, "GPT_SCENARIOS")


def test_module_buffers_failure_is_agreed_and_a_broadcast_mismatch_is_refused_not_crashed(
    gpt_outcomes: list[dict[str, Any]],
) -> None:
    """DDP broadcasts buffers in the forward after a synchronizing one; a forward that failed midway
    leaves that different across ranks. The next step is refused on every rank with the fix, rather
    than letting the broadcast meet another collective (gloo aborts the process on that)."""
    r0, r1 = (o["broadcast_buffers=True"] for o in gpt_outcomes)
    assert r0.ok and r1.ok, (r0.message, r1.message)
    (t0, m0), second0 = r0.value["errors"]
    (t1, _), second1 = r1.value["errors"]
    assert (t0, t1) == ("RankFailedError", "_Boom") and "rank 1 failed in forward of micro-batch 1" in m0
    for rank, (kind, text) in enumerate((second0, second1)):
        assert kind == "SyncError", (rank, text)
        assert "1 of 2 ranks would broadcast" in text and "broadcast_buffers=False" in text
    assert r0.value["cleared"] and r1.value["cleared"]


def test_module_buffers_without_broadcast_recover_exactly(gpt_outcomes: list[dict[str, Any]]) -> None:
    want = full_batch_grads(models.gpt(), models.gpt_batch(8, seed=11), models.gpt_loss, models.tokens)
    for rank in (0, 1):
        outcome = gpt_outcomes[rank]["broadcast_buffers=False"]
        assert outcome.ok, outcome.message
        assert [kind for kind, _ in outcome.value["errors"]] == ["RankFailedError" if rank == 0 else "_Boom"]
        assert rel_err(outcome.value["grads"], want) < F64_RTOL
