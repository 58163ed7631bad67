"""``FaultTolerantAccumulator``'s protocol against a scripted stand-in for torchft's Manager.

In one process, no torchft needed: the stand-in plays a quorum of W groups whose other members' sums
it adds itself (their shares computed here from the same model), and can fail a step's commit. What
the lighthouse tests (test_torchft.py) show with real processes, these pin down in milliseconds: the
shares cover the global batch, a step whose commit failed is tried again on the same rows and applied
once, what a group accumulated in the broken try is kept and only a lost group's rows recomputed, a
step that keeps failing ends in a SyncError, and bad settings are refused by name.
Tolerances: float64 sums regrouped over shares and micro-batches, a few ulps (1e-15 bound 1e-12).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn as nn

from gradaccum.errors import ConfigError, SyncError
from gradaccum.integrations.torchft import FaultTolerantAccumulator, share_bounds
from tests.integrations import torchft_worker as worker


class _Done:
    def wait(self) -> bool:
        return True


class ScriptedManager:
    """Quorums of W groups, this one rank 0; the others' parts of each sum come from ``peers``."""

    def __init__(self, participants: int, commits: list[bool]) -> None:
        self.participants, self.commits = participants, list(commits)
        self.step, self.peers = 0, list[Any]()
        self.fns: dict[str, Any] = {}
        self.quorums = 0

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        self.fns[key] = (load, save)

    def start_quorum(self) -> None:
        self.quorums += 1
        self.sums = iter(self.peers.pop(0)) if self.peers else iter(())

    def num_participants(self) -> int:
        return self.participants

    def participating_rank(self) -> int:
        return 0

    def is_participating(self) -> bool:
        return not self.healing_during_step

    healing_during_step = False

    def current_step(self) -> int:
        return self.step

    def errored(self) -> None:
        return None

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any) -> _Done:
        tensor += next(self.sums, torch.zeros_like(tensor))  # the other groups' parts, in order
        return _Done()

    def should_commit(self) -> bool:
        ok = self.commits.pop(0) if self.commits else True
        self.step += ok
        return ok


def _peer_sums(step: int, participants: int, *, holding: bool) -> list[torch.Tensor]:
    """What groups 1..W-1 add to group 0's sums at ``step``: the rows they hold (``holding``: their
    shares, from a try that broke) and their count, then their gradient and loss sums."""
    model, _ = worker.build()
    batch = worker.global_batch(step)
    rows = worker.GLOBAL_BATCH
    parts = [share_bounds(rows, participants, r) for r in range(1, participants)]
    count = sum(int(batch["mask"][a:b].sum()) for a, b in parts)
    total = worker.count_fn(batch)
    loss = sum(worker.loss_fn(model, {k: v[a:b] for k, v in batch.items()}) for a, b in parts)
    assert isinstance(loss, torch.Tensor)
    (loss / total).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    cover = torch.zeros(rows + 1, dtype=torch.float64)
    if holding:
        for a, b in parts:
            cover[a:b] = 1.0
        cover[rows] = float(count)
    return [cover, grads, loss.detach().reshape(1)]


def _counting(calls: list[int]) -> Any:
    def loss_fn(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        calls.append(len(mb["x"]))
        return worker.loss_fn(model, mb)

    return loss_fn


def test_a_step_whose_commit_failed_is_redone_on_the_same_rows_and_applied_once() -> None:
    model, optimizer = worker.build()
    manager = ScriptedManager(participants=3, commits=[False, True])
    # try 1: nobody holds anything; try 2: the others kept their shares, so this group keeps its own
    manager.peers = [_peer_sums(0, 3, holding=False), _peer_sums(0, 3, holding=True)]
    acc = FaultTolerantAccumulator(model, optimizer, manager, micro_batch=2)  # type: ignore[arg-type]
    asked: list[int] = []
    calls: list[int] = []

    def batch(step: int) -> dict[str, torch.Tensor]:
        asked.append(step)
        return worker.global_batch(step)

    result = acc.step(batch, _counting(calls), worker.count_fn)
    assert asked == [0, 0] and acc.attempts == 2 and manager.quorums == 2  # tried again on step 0
    assert calls == [2, 2]  # rows 0-3 in two micro-batches in try 1; nothing left to do in try 2
    assert result.applied and result.step == 1 and acc.participants == 3
    assert result.local_count == int(worker.global_batch(0)["mask"][:4].sum()) and result.micro_batches == 0
    assert result.global_count == worker.count_fn(worker.global_batch(0))
    want = worker.reference(1)  # one update, not two: the broken try's sums were not applied
    got = [p.detach() for p in model.parameters()]
    assert max(float((p - w).abs().max()) for p, w in zip(got, want, strict=True)) <= 1e-12
    assert "gradaccum" in manager.fns  # what a healing peer is sent


def test_the_rows_of_a_lost_group_are_recomputed_by_the_survivor_and_its_own_kept() -> None:
    model, optimizer = worker.build()
    manager = ScriptedManager(participants=2, commits=[False, True])
    # try 1: two groups, rows 0-5 here; the other dies; try 2: this group alone, holding rows 0-5
    manager.peers = [_peer_sums(0, 2, holding=False), []]
    acc = FaultTolerantAccumulator(model, optimizer, manager, micro_batch=2)  # type: ignore[arg-type]
    calls: list[int] = []
    real_start = manager.start_quorum

    def start_quorum() -> None:
        real_start()
        if manager.quorums == 2:
            manager.participants = 1

    manager.start_quorum = start_quorum  # type: ignore[method-assign]
    result = acc.step(worker.global_batch, _counting(calls), worker.count_fn)
    assert calls == [2, 2, 2, 2, 2, 2]  # rows 0-5 in try 1, then only the lost rows 6-11 in try 2
    assert result.applied and acc.attempts == 2 and acc.participants == 1 and result.micro_batches == 3
    assert result.local_count == result.global_count == worker.count_fn(worker.global_batch(0))
    got = [p.detach() for p in model.parameters()]
    want = worker.reference(1)
    assert max(float((p - w).abs().max()) for p, w in zip(got, want, strict=True)) <= 1e-12


def test_a_step_that_never_commits_ends_in_a_sync_error() -> None:
    model, optimizer = worker.build()
    manager = ScriptedManager(participants=1, commits=[False] * 3)
    acc = FaultTolerantAccumulator(model, optimizer, manager, micro_batch=4, max_attempts=3)  # type: ignore[arg-type]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(SyncError, match="max_attempts=3"):
        acc.step(worker.global_batch, worker.loss_fn, worker.count_fn)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_a_non_finite_loss_skips_the_update_and_uses_up_the_step() -> None:
    model, optimizer = worker.build()
    manager = ScriptedManager(participants=1, commits=[])
    acc = FaultTolerantAccumulator(model, optimizer, manager, micro_batch=4)  # type: ignore[arg-type]
    before = [p.detach().clone() for p in model.parameters()]

    def nan_loss(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return worker.loss_fn(model, mb) * float("nan")

    result = acc.step(worker.global_batch, nan_loss, worker.count_fn)
    assert not result.applied and result.skip_reason is not None and "non-finite" in result.skip_reason
    assert result.step == 1 and acc.current_step == 1  # torchft committed it: the next batch is step 1's
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_a_manager_that_heals_during_the_step_is_refused() -> None:
    model, optimizer = worker.build()
    manager = ScriptedManager(participants=2, commits=[])
    manager.healing_during_step = True  # torchft's use_async_quorum=True, while this group heals
    acc = FaultTolerantAccumulator(model, optimizer, manager, micro_batch=4)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="use_async_quorum=False"):
        acc.step(worker.global_batch, worker.loss_fn, worker.count_fn)


def test_shares_cover_the_global_batch_once() -> None:
    for rows in (1, 5, 12):
        for participants in (1, 2, 3, 7):
            bounds = [share_bounds(rows, participants, r) for r in range(participants)]
            assert bounds[0][0] == 0 and bounds[-1][1] == rows
            assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    with pytest.raises(ConfigError, match="participant rank 2 of 2"):
        share_bounds(12, 2, 2)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"micro_batch": 0}, "micro_batch=0"),
        ({"micro_batch": 2, "max_attempts": 0}, "max_attempts=0"),
        ({"micro_batch": 2, "max_grad_norm": -1.0}, "max_grad_norm=-1.0"),
    ],
)
def test_bad_settings_are_refused_by_name(settings: dict[str, Any], match: str) -> None:
    model, optimizer = worker.build()
    with pytest.raises(ConfigError, match=match):
        FaultTolerantAccumulator(model, optimizer, ScriptedManager(1, []), **settings)  # type: ignore[arg-type]


def test_a_ddp_wrapped_model_is_refused() -> None:
    ddp = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    _, optimizer = worker.build()
    with pytest.raises(ConfigError, match="DistributedDataParallel"):
        FaultTolerantAccumulator(ddp, optimizer, ScriptedManager(1, []), micro_batch=2)  # type: ignore[arg-type]
