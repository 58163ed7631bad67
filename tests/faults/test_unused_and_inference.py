"""Items 9 and 10: parameters that only some micro-batches use, frozen parameters, and inference
inside a window, under real DDP on two gloo ranks.

What the user must set: DDP(find_unused_parameters=True) whenever a trainable parameter can be
missing from a window's last micro-batch on any rank. DDP then averages every parameter that any
micro-batch on any rank used (it tracks use across no_sync micro-batches). Without it, the
Accumulator checks the last micro-batch's graph before the synchronizing backward and refuses the
window on every rank, naming the parameters; DDP alone would hang or step on unaveraged gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum import Accumulator
from tests.faults.common import F64_RTOL, Outcome, grads, ok_values, params, rel_err, same, scenario_outcomes

pytestmark = pytest.mark.distributed


class Routed(nn.Module):
    """A trunk, two heads chosen per micro-batch, an unused spare, and a frozen projection."""

    def __init__(self, spare: bool = True) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.trunk = nn.Linear(4, 8)
            self.head_a = nn.Linear(8, 2)
            self.head_b = nn.Linear(8, 2)
            self.frozen = nn.Linear(4, 8)
            if spare:
                self.spare = nn.Linear(8, 2)  # trainable, never used by any micro-batch
        self.frozen.requires_grad_(False)
        self.double()

    def forward(self, x: torch.Tensor, route: str) -> torch.Tensor:
        h = torch.tanh(self.trunk(x) + self.frozen(x))
        if route == "ab":
            return self.head_a(h) + self.head_b(h)
        return (self.head_a if route == "a" else self.head_b)(h)


def _mb(rank: int, j: int, route: str) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(100 * rank + j)
    return {
        "x": torch.randn(3, 4, generator=gen, dtype=torch.float64),
        "y": torch.randn(3, 2, generator=gen, dtype=torch.float64),
        "route": route,
    }


def _loss(model: nn.Module, mb: dict[str, Any]) -> torch.Tensor:
    return ((model(mb["x"], mb["route"]) - mb["y"]) ** 2).sum()


def _count(mb: dict[str, Any]) -> int:
    return mb["x"].shape[0]


# rank 0 uses head_b only in a middle micro-batch; rank 1 never uses head_b
ROUTES = {0: ["a", "b", "a"], 1: ["a", "a"]}


def _window(rank: int, routes: dict[int, list[str]] = ROUTES) -> list[dict[str, Any]]:
    return [_mb(rank, j, route) for j, route in enumerate(routes[rank])]


def _reference() -> dict[str, torch.Tensor]:
    """One process, every micro-batch of both ranks, summed loss over the global count."""
    model = Routed()
    window = _window(0) + _window(1)
    n = sum(_count(mb) for mb in window)
    (sum(_loss(model, mb) for mb in window) / n).backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _routed_step(
    rank: int, find_unused: bool, routes: dict[int, list[str]] = ROUTES, spare: bool = True
) -> dict[str, Any]:
    ddp = DDP(Routed(spare), find_unused_parameters=find_unused)
    acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
    before = params(ddp)
    try:
        acc.step(_window(rank, routes), _loss, _count)
        error = None
    except Exception as exc:
        error = (type(exc).__name__, str(exc))
    out: dict[str, Any] = {"error": error, "grads": grads(ddp), "unchanged": same(before, params(ddp))}
    if error is not None and not spare:
        # After the refusal, the next window's first micro-batch synchronizes (DDP had prepared a
        # reduction on every rank), so under find_unused_parameters=False it too must reach every
        # parameter: [b, ab] is refused, saying why; [ab, ab] steps, identically on both ranks.
        try:
            acc.step([_mb(rank, 9, "b"), _mb(rank, 8, "ab")], _loss, _count)
        except Exception as exc:
            out["resync refusal"] = (type(exc).__name__, str(exc))
        out["then"] = acc.step([_mb(rank, 9, "ab"), _mb(rank, 8, "ab")], _loss, _count).applied
        out["params"] = params(ddp)
    return out


def _inference_inside(rank: int) -> dict[str, Any]:
    """Eval-mode, no-grad forwards between micro-batches (as an evaluation hook would) on every rank."""
    ddp = DDP(Routed(), find_unused_parameters=True)
    acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
    probe = _mb(rank, 50, "a")
    evals = []

    def loss_fn(model: nn.Module, mb: dict[str, Any]) -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            evals.append(model(probe["x"], "b").sum().item())  # through the DDP wrapper
        with torch.inference_mode():
            evals.append(model.module(probe["x"], "a").sum().item())  # and around it
            if rank == 0:  # one rank alone must go around the wrapper, or DDP's bookkeeping splits
                evals.append(model.module(probe["x"], "ab").sum().item())
        model.train()
        return _loss(model, mb)

    acc.step(_window(rank), loss_fn, _count)
    return {"grads": grads(ddp), "evals": len(evals), "training": ddp.training}


SCENARIOS = {
    "find_unused_parameters=True": lambda r, w: _routed_step(r, True),
    "find_unused_parameters=False": lambda r, w: _routed_step(r, False, spare=False),
    "find_unused_parameters=False, a parameter no micro-batch uses": lambda r, w: _routed_step(
        r, False, {0: ["b", "ab"], 1: ["a", "ab"]}
    ),
    "inference inside a window": lambda r, w: _inference_inside(r),
}


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, Outcome]]:
    return scenario_outcomes(__name__)


def test_item9_partly_used_parameters_get_the_full_batch_gradient_with_find_unused(
    outcomes: list[dict[str, Outcome]],
) -> None:
    r0, r1 = ok_values(outcomes, "find_unused_parameters=True")
    want = _reference()
    assert sorted(want) == [
        "head_a.bias",
        "head_a.weight",
        "head_b.bias",
        "head_b.weight",
        "trunk.bias",
        "trunk.weight",
    ]
    for got in (r0, r1):
        assert got["error"] is None
        trained = {k: v for k, v in got["grads"].items() if v is not None}
        # head_b: used on rank 0 only, and only in a deferred micro-batch, still averaged over both
        assert sorted(trained) == sorted(want) and rel_err(trained, want) < F64_RTOL
        assert got["grads"]["frozen.weight"] is None and got["grads"]["frozen.bias"] is None
        assert got["grads"]["spare.weight"] is None  # unused by every micro-batch on every rank
    # one all-reduce result on both ranks: identical, not merely close
    assert all(torch.equal(v, r1["grads"][k]) for k, v in r0["grads"].items() if v is not None)


def test_item9_without_find_unused_the_window_is_refused_on_every_rank_naming_the_parameters(
    outcomes: list[dict[str, Outcome]],
) -> None:
    r0, r1 = ok_values(outcomes, "find_unused_parameters=False")
    for rank, got in enumerate((r0, r1)):
        kind, message = got["error"]
        assert kind == "UnusedParameterError", message
        assert "find_unused_parameters=True" in message
        # both ranks' last micro-batch takes head_a only; rank 0 used head_b earlier, rank 1 never
        assert "rank 0: module.head_b.weight, module.head_b.bias (2 missed)" in message
        assert "rank 1: module.head_b.weight, module.head_b.bias (2 missed)" in message
        assert "frozen" not in message  # frozen parameters are not DDP's concern
        assert got["unchanged"] and all(g is None for g in got["grads"].values()), rank
        kind, message = got["resync refusal"]
        assert (
            kind == "UnusedParameterError"
            and "micro-batch 0 (it synchronizes because the previous" in message
        )
        assert got["then"] is True
    assert same(r0["params"], r1["params"])


def test_item9_without_find_unused_a_parameter_that_nothing_uses_is_named(
    outcomes: list[dict[str, Outcome]],
) -> None:
    # spare is trainable and used nowhere: DDP would wait for its gradient forever
    for got in ok_values(outcomes, "find_unused_parameters=False, a parameter no micro-batch uses"):
        kind, message = got["error"]
        assert (
            kind == "UnusedParameterError" and "module.spare.weight, module.spare.bias (2 missed)" in message
        )
        assert "head_a" not in message and "head_b" not in message


def test_item10_inference_inside_a_window_leaves_accumulated_gradients_intact(
    outcomes: list[dict[str, Outcome]],
) -> None:
    want = _reference()
    for rank, got in enumerate(ok_values(outcomes, "inference inside a window")):
        trained = {k: v for k, v in got["grads"].items() if v is not None}
        assert rel_err(trained, want) < F64_RTOL and sorted(trained) == sorted(want)
        assert got["evals"] == [3 * 3, 2 * 2][rank]  # micro-batches x probes (rank 0 has a third)
        assert got["training"]
