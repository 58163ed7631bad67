"""The equivalence check on the user's parallelized model, on its mesh.

Run on every rank of a mesh (under ``torchrun``), from the same initial weights:

1. the accumulated update: each data rank's share of the verification batch in micro-batches,
   through ``Accumulator(..., mesh=mesh)``;
2. the same mesh with one micro-batch per rank holding its whole share (no accumulation): what
   the parallelization alone gives;
3. one process's full-batch update, built from the gathered state dict of the parallelized model
   (so it starts from exactly the weights the mesh holds) and run on every rank alike.

The check passes when (1) equals both (2) and (3) to the float64 tolerance. (1) against (2)
isolates accumulation; (2) against (3) isolates the parallelization (a wrong reduction factor, a
TP plan that drops a bias). Data ranks are the mesh's ``dp_replicate`` x ``dp_shard`` ranks; TP
ranks see the same rows. Context and pipeline parallelism need the workload to cut sequences or
build stages, so a mesh with ``cp`` or ``pp`` > 1 is refused here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from gradaccum.batch import batch_size, cast, split
from gradaccum.check.controls import randomness_off
from gradaccum.check.workload import Workload
from gradaccum.errors import ConfigError
from gradaccum.fielddocs import document_fields
from gradaccum.mesh.layout import MeshLayout
from gradaccum.step.accumulator import Accumulator

__all__ = ["MESH_TOLERANCE", "MeshReport", "verify_on_mesh"]

MESH_TOLERANCE = 1e-10
"""Relative L2 error of the update allowed in float64: the three runs differ only in summation
order (a few hundred terms of ~1e-16), while any wrong factor is an error of order 1."""

Parallelize = Callable[[nn.Module, Any], nn.Module]
"""``parallelize(model, mesh)``: applies TP/FSDP2/DDP and returns the module to step."""


@document_fields
@dataclass(frozen=True, kw_only=True, slots=True)
class MeshReport:
    """What :func:`verify_on_mesh` measured (the same on every rank)."""

    mesh: str
    """The mesh, in its own dimension names."""
    micro_batches: int
    """Micro-batches per data rank in the accumulated run."""
    global_count: int
    """The window's N (every data rank's units)."""
    accumulated_vs_one_pass: float
    """Relative L2 error of the accumulated update against one micro-batch per rank."""
    accumulated_vs_single_process: float
    """Relative L2 error of the accumulated update against one process's full-batch update."""
    tolerance: float
    """The bound both errors must stay under."""
    examples_per_rank: int | None = None
    """Examples of the verification batch each data rank holds (its share of the window)."""

    @property
    def passed(self) -> bool:
        return max(self.accumulated_vs_one_pass, self.accumulated_vs_single_process) <= self.tolerance

    @property
    def weakness(self) -> str | None:
        """Why a pass proves less than it seems, or None. With one micro-batch per data rank the
        accumulated run and the one-pass run are the same run: nothing was accumulated, and only
        the parallelization was checked against one process."""
        if self.micro_batches > 1:
            return None
        share = self.examples_per_rank
        if share is not None and share > 1:
            smaller = max(d for d in range(1, share) if share % d == 0)
            fix = f"use --micro-batch {smaller} (it divides the {share} examples each data rank holds)"
        else:
            fix = "use fewer data ranks, so that each holds several micro-batches"
        return (
            "one micro-batch per data rank: nothing was accumulated, so the check compared the "
            f"parallelization alone against one process; {fix}"
        )


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered (DTensors by ``full_tensor``), named as in the unwrapped model."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("module.", "").replace("_orig_mod.", "")] = full.detach().clone()
    return out


def _update_error(
    got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], start: Mapping[str, torch.Tensor]
) -> float:
    num = sum(float(((got[k] - want[k]) ** 2).sum()) for k in want) ** 0.5
    den = sum(float(((want[k] - start[k]) ** 2).sum()) for k in want) ** 0.5
    return num / den if den > 0 else num


def verify_on_mesh(
    workload: Workload,
    mesh: Any,
    *,
    parallelize: Parallelize | None = None,
    micro_batch: int | None = None,
    mesh_dims: Mapping[str, str] | None = None,
) -> MeshReport:
    """Check the accumulated step on ``mesh`` against the two references (see the module doc).

    Call it on every rank of the mesh. ``parallelize`` defaults to ``workload.parallelize``.
    """
    parallelize = parallelize if parallelize is not None else workload.parallelize
    if parallelize is None:
        raise ConfigError(
            f"workload {workload.name!r} declares no parallelize(model, mesh): verify on a mesh needs "
            "to know how the model is tensor-parallelized and sharded. Add parallelize= to the Workload."
        )
    layout = MeshLayout.read(mesh, mesh_dims)
    if layout.sizes["cp"] > 1 or layout.pp > 1:
        raise ConfigError(
            f"verify on a mesh supports data and tensor parallel dimensions; this mesh has "
            f"{layout.describe()}. Context parallelism cuts sequences and pipeline parallelism builds "
            "stages in ways only the workload knows: check those with Accumulator(mesh=) or "
            "PipelineAccumulator directly (tests/mesh shows how)."
        )
    micro = micro_batch if micro_batch is not None else workload.micro_batch
    batch = cast(workload.make_batch(workload.batch_size, 0), torch.float64)
    data_ranks = layout.sizes["dp_replicate"] * layout.sizes["dp_shard"]
    index = layout.coordinate["dp_replicate"] * layout.sizes["dp_shard"] + layout.coordinate["dp_shard"]
    rows = batch_size(batch)
    if rows % (data_ranks * micro):
        raise ConfigError(
            f"the verification batch of {rows} examples does not split into {data_ranks} data ranks x "
            f"micro-batches of {micro}: FSDP needs the same number of micro-batches on every rank. "
            f"Use a micro-batch that divides {rows // data_ranks if rows >= data_ranks else rows}."
        )
    share = rows // data_ranks
    local = split(batch, sizes=[share] * data_ranks)[index]

    def run(window: list[Any]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
        with torch.random.fork_rng(devices=[]):
            model = workload.build_model().to(torch.float64)
            stepped = parallelize(model, mesh)
        start = _full(stepped)
        optimizer = workload.optimizer_factory(stepped.parameters())
        with randomness_off(stepped):
            result = Accumulator(stepped, optimizer, mesh=mesh, mesh_dims=mesh_dims).step(
                window, workload.loss_fn, workload.count_fn
            )
        return _full(stepped), start, result.global_count

    accumulated, start, n = run(split(local, micro_batch=micro))
    one_pass, _, _ = run([local])
    # one process, the whole batch, from the gathered starting weights
    single = workload.build_model().to(torch.float64)
    single.load_state_dict({**single.state_dict(), **copy.deepcopy(start)})
    optimizer = workload.optimizer_factory(single.parameters())
    with randomness_off(single):  # written out: under torchrun an Accumulator would see the ranks
        count = float(torch.as_tensor(workload.count_fn(batch)))
        (workload.loss_fn(single, batch) / count).backward()
        optimizer.step()
    reference = {name: p.detach().clone() for name, p in single.named_parameters()}
    return MeshReport(
        mesh=layout.describe(),
        micro_batches=share // micro,
        global_count=n,
        accumulated_vs_one_pass=_update_error(accumulated, one_pass, start),
        accumulated_vs_single_process=_update_error(accumulated, reference, start),
        tolerance=MESH_TOLERANCE,
        examples_per_rank=share,
    )
