"""Shared pieces of the fault tests: scenario bundles on two real gloo ranks, and the tiny models.

Spawning two ranks costs seconds, so each test module runs its independent scenarios in one pair
of processes (a module-scoped fixture) and each test asserts on one scenario's outcome. A scenario
that fails as designed leaves the process group usable, which is itself under test: the next
scenario would hang or fail otherwise. The launcher kills ranks that outlive ``timeout_s`` and
pytest-timeout bounds each test, so a hang fails the test instead of stalling CI.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.helpers import models
from tests.helpers.launcher import PG_TIMEOUT_S, run_ranks, values

# An agreed failure costs two small collectives; it arrives in milliseconds. 10 s leaves room for a
# loaded CI machine and is still far below the 30 s process-group timeout that a hang would reach.
AGREED_WITHIN_S = 10.0
assert AGREED_WITHIN_S < PG_TIMEOUT_S

# float64 gradients of the same examples summed in a different order (micro-batches, ranks) differ
# by a few ulps, ~1e-16 relative; 1e-12 is loose for that and far below any real scaling error.
F64_RTOL = 1e-12

Scenario = Callable[[int, int], Any]


@dataclass(frozen=True)
class Outcome:
    """One scenario on one rank: its value, or the exception it raised, and how long it took."""

    ok: bool
    value: Any
    error_type: str
    error_bases: tuple[str, ...]
    message: str
    seconds: float


def run_all(scenarios: dict[str, Scenario], rank: int, world: int) -> dict[str, Outcome]:
    """Run every scenario in order on this rank, recording each one's result or exception."""
    out: dict[str, Outcome] = {}
    for name, fn in scenarios.items():
        start = time.monotonic()
        try:
            value = fn(rank, world)
            out[name] = Outcome(True, value, "", (), "", time.monotonic() - start)
        except Exception as exc:
            bases = tuple(c.__name__ for c in type(exc).__mro__)
            out[name] = Outcome(False, None, type(exc).__name__, bases, str(exc), time.monotonic() - start)
    return out


def bundle(fn: Callable[..., Any], *args: Any, timeout_s: float = 150) -> list[dict[str, Outcome]]:
    """Every rank's outcomes of ``fn`` (a module-level ``run_all`` wrapper) on two gloo ranks."""
    return values(run_ranks(fn, *args, timeout_s=timeout_s))


def _run_table(rank: int, world: int, module: str, table: str) -> dict[str, Outcome]:
    return run_all(getattr(importlib.import_module(module), table), rank, world)


def scenario_outcomes(module: str, table: str = "SCENARIOS") -> list[dict[str, Outcome]]:
    """Every rank's outcomes of the scenarios dict ``table`` of test module ``module``, in one pair of
    gloo ranks. The ranks import the table by name: its lambdas cannot be pickled to them."""
    return bundle(_run_table, module, table)


def ddp_mlp(seed: int = 0, **kwargs: Any) -> DDP:
    """The float64 MLP of tests.helpers.models in DDP (no buffers, so nothing broadcasts in forward)."""
    return DDP(models.mlp(seed), **kwargs)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    inner = model.module if isinstance(model, DDP) else model
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in inner.named_parameters()}


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    inner = model.module if isinstance(model, DDP) else model
    return {n: p.detach().clone() for n, p in inner.named_parameters()}


def copy_params(dst: torch.nn.Module, src: dict[str, torch.Tensor]) -> None:
    inner = dst.module if isinstance(dst, DDP) else dst
    with torch.no_grad():
        for n, p in inner.named_parameters():
            p.copy_(src[n])


def rel_err(got: dict[str, Any], want: dict[str, torch.Tensor]) -> float:
    """Largest relative L2 error over parameters; a missing gradient counts as infinitely wrong."""
    worst = 0.0
    for name, w in want.items():
        g = got.get(name)
        if g is None:
            return float("inf")
        worst = max(worst, (g - w).norm().item() / max(w.norm().item(), 1e-30))
    return worst


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bitwise equality: for tensors that went through identical operations (a skipped update)."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Trip:
    """A forward hook that raises ``error`` on chosen calls: a fault injected into the model."""

    def __init__(
        self,
        error: Callable[[], Exception],
        calls: set[int] | None = None,
        when: Callable[[Any], bool] | None = None,
    ) -> None:
        self.error = error
        self.calls = calls
        self.when = when
        self.count = 0

    def __call__(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        self.count += 1
        hit = (self.calls is None or self.count in self.calls) and (self.when is None or self.when(inputs))
        if hit:
            raise self.error()


def ok_values(outcomes: list[dict[str, Outcome]], name: str) -> list[Any]:
    """Both ranks' values of scenario ``name``; each rank must have finished it in time without error."""
    for rank in (0, 1):
        o = outcomes[rank][name]
        assert o.ok and o.seconds < AGREED_WITHIN_S, o.message
    return [outcomes[rank][name].value for rank in (0, 1)]
