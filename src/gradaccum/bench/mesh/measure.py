"""Run each HSDP sync policy on a workload's parallelized model and count what one update costs.

Called on every rank of the mesh (under ``torchrun``). Per policy: a fresh model from the same
seed, ``workload.parallelize(model, mesh)``, ``Accumulator(..., mesh=mesh, sync_policy=policy)``,
one warm-up update (FSDP2's lazy initialization), then one counted update of k micro-batches of the
workload's micro-batch per data rank. The gradient memory is read at the start of the last
micro-batch (the step's ``micro_start`` event), after k - 1 backwards: what the policy holds
between micro-batches. The figures are this rank's, the gradient memory the largest over ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from gradaccum.batch import split
from gradaccum.bench.mesh.advice import PolicyAdvice, advise_policy
from gradaccum.bench.mesh.counting import MeshCommCounter, fsdp_units, gradient_bytes_held
from gradaccum.bench.mesh.model import PolicyBench, Traffic, held_model, policy_model
from gradaccum.check.workload import Workload
from gradaccum.errors import ConfigError, WorkloadError
from gradaccum.fielddocs import document_fields
from gradaccum.mesh.layout import DATA_ROLES, MeshLayout
from gradaccum.step.accumulator import Accumulator

__all__ = ["MeshBench", "PolicyBench", "bench_mesh"]


@document_fields
@dataclass(frozen=True, kw_only=True, slots=True)
class MeshBench:
    """``bench --mesh``: every sync policy the mesh allows, and the advice."""

    mesh: str
    """The mesh, in its own dimension names."""
    world: int
    """Ranks in the mesh."""
    accum_steps: int
    """k: micro-batches per update on every data rank."""
    micro_batch: int
    """Examples per micro-batch."""
    fsdp_units: int
    """U: FSDP2 units that own parameters (one reduce-scatter each per reduction)."""
    grad_bytes: int
    """G: gradient bytes one rank computes per micro-batch for them, before FSDP2 shards them."""
    policies: tuple[PolicyBench, ...]
    """One entry per policy, in the order defer, defer_replicate, every."""
    advice: PolicyAdvice
    """The policy for the memory budget, or the trade-off without one."""


class _Probe:
    """The step's observer: reads the gradient bytes held when micro-batch ``at`` starts."""

    def __init__(self, model: nn.Module, at: int) -> None:
        self.model, self.at = model, at
        self.armed = False
        self.held: int | None = None

    def __call__(self, event: str, index: int) -> None:
        if self.armed and event == "micro_start" and index == self.at:
            self.held = gradient_bytes_held(self.model)


def _owning_units(model: nn.Module) -> tuple[int, list[nn.Parameter]]:
    """Units that own parameters (a nested unit owns its own), and every parameter they own."""
    claimed: dict[int, nn.Parameter] = {}
    owning = 0
    for unit in fsdp_units(model):  # innermost first: a nested unit claims its parameters first
        own = [p for p in unit.parameters() if id(p) not in claimed]
        claimed.update((id(p), p) for p in own)
        owning += bool(own)
    return owning, list(claimed.values())


def _unsharded_bytes(params: list[nn.Parameter], data_names: set[str]) -> int:
    """G: each parameter's bytes divided by the model-parallel dimensions that split it (TP), not
    by the data dimensions (FSDP2's shards, which the reduce-scatter fills)."""
    total = 0
    for p in params:
        numel = p.numel()
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            names = mesh.mesh_dim_names or ()
            for i, placement in enumerate(p.placements):  # type: ignore[attr-defined]
                if not placement.is_replicate() and (i >= len(names) or names[i] not in data_names):
                    numel //= mesh.size(i)
        total += numel * p.element_size()
    return total


def bench_mesh(
    workload: Workload,
    mesh: Any,
    *,
    accum_steps: int,
    memory_budget_bytes: int | None = None,
    parallelize: Any = None,
    mesh_dims: Mapping[str, str] | None = None,
    seed: int = 0,
) -> MeshBench:
    """Measure every sync policy the mesh allows (see the module doc); call on every rank."""
    parallelize = parallelize if parallelize is not None else workload.parallelize
    if parallelize is None:
        raise ConfigError(
            f"workload {workload.name!r} declares no parallelize(model, mesh): bench on a mesh needs to "
            "know how the model is sharded. Add parallelize= to the Workload."
        )
    if accum_steps < 2:
        raise ConfigError(f"bench on a mesh needs at least 2 micro-batches per update, got {accum_steps}")
    layout = MeshLayout.read(mesh, mesh_dims)
    if layout.sizes["cp"] > 1 or layout.pp > 1:
        raise ConfigError(
            f"bench on a mesh measures the sync policies of FSDP2 over data and tensor parallel "
            f"dimensions; this mesh has {layout.describe()}. Leave out cp and pp."
        )
    shard, replicate = layout.sizes["dp_shard"], layout.sizes["dp_replicate"]
    policies = ["defer", "defer_replicate", "every"] if replicate > 1 else ["defer", "every"]
    data_names = {layout.names[r] for r in DATA_ROLES if r in layout.names}
    micro = workload.micro_batch
    data_ranks = replicate * shard
    index = layout.coordinate["dp_replicate"] * shard + layout.coordinate["dp_shard"]
    batch = workload.make_batch(micro * accum_steps * data_ranks, seed)
    window = split(split(batch, sizes=[micro * accum_steps] * data_ranks)[index], micro_batch=micro)
    counter = MeshCommCounter(mesh)
    results = []
    units = grad_bytes = 0
    for policy in policies:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = workload.build_model()
            try:
                model = parallelize(model, mesh)
            except Exception as exc:  # every rank raises alike: exit 2, never a traceback or hang
                raise WorkloadError(
                    f"the parallelize(model, mesh) of workload {workload.name!r} failed on the mesh "
                    f"{layout.describe()}: {type(exc).__name__}: {exc}. Give a mesh whose dimensions it "
                    "uses, or make it handle this one."
                ) from exc
        if not counter.watch(model):
            raise ConfigError(
                f"the parallelize of workload {workload.name!r} returned a model without FSDP2 units: bench "
                "--mesh measures FSDP2's sync policies (fully_shard over dp_shard, or dp_replicate x "
                "dp_shard for HSDP)"
            )
        units, owned = _owning_units(model)
        grad_bytes = _unsharded_bytes(owned, data_names)
        probe = _Probe(model, accum_steps - 1)
        optimizer = workload.optimizer_factory(model.parameters())
        acc = Accumulator(
            model, optimizer, mesh=mesh, mesh_dims=mesh_dims, sync_policy=policy, observer=probe
        )
        acc.step(window, workload.loss_fn, workload.count_fn)  # warm-up: FSDP2's lazy init
        probe.armed = True
        with counter.counting() as comms:
            acc.step(window, workload.loss_fn, workload.count_fn)
        most = torch.tensor(probe.held or 0, dtype=torch.int64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        measured = tuple(
            Traffic(collective=c, dimension=d, calls=comms.calls[(c, d)], bytes=comms.bytes[(c, d)])
            for c, d in sorted(comms.calls, key=lambda key: (key[1], key[0]))
        )
        results.append(
            PolicyBench(
                policy=policy,
                measured=measured,
                modelled=policy_model(
                    policy,
                    accum_steps=accum_steps,
                    grad_bytes=grad_bytes,
                    units=units,
                    shard=shard,
                    replicate=replicate,
                    shard_dim=layout.names.get("dp_shard", "dp_shard"),
                    replicate_dim=layout.names.get("dp_replicate", "dp_replicate"),
                ),
                grad_bytes_held=int(most.item()),
                grad_bytes_held_model=held_model(policy, grad_bytes=grad_bytes, shard=shard),
            )
        )
    return MeshBench(
        mesh=layout.describe(),
        world=layout.world,
        accum_steps=accum_steps,
        micro_batch=micro,
        fsdp_units=units,
        grad_bytes=grad_bytes,
        policies=tuple(results),
        advice=advise_policy(results, memory_budget_bytes),
    )
