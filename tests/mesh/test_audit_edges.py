"""Edges of the mesh and pipeline steps: each ends exact on every rank, or refused on every rank by a
gradaccum error before any parameter changes; never a silent factor, torch's error from inside a
schedule, or a hang (every launch under a timeout).

Float64 throughout: an accepted layout must equal one SGD step on the whole batch on one process
within 1e-10 relative to the update (only the summation order differs, ~1e-16 per term), which still
sees the factors these edges used to produce (0.25 relative error, a ratio of 2.0).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.launcher import run_ranks, values
from tests.mesh import models
from tests.mesh.test_pipeline import build_stages, count_fn, full_model, loss_fn

pytestmark = pytest.mark.distributed

EXACT = 1e-10
ROWS = [(0, 3), (3, 8)]
SIZES = [[2, 1], [3, 2]]


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=models.LR, foreach=False)


def _outcome(build_and_step: Any, model: torch.nn.Module) -> dict[str, Any]:
    """The parameters after the step, or the error raised and whether the parameters moved."""
    before = models.params(model)
    try:
        build_and_step()
    except Exception as exc:  # a gradaccum error is the refusal; any other fails the test that reads it
        after = models.params(model)
        moved = any(not torch.equal(before[k], after[k]) for k in before)
        return {"refused": f"{type(exc).__name__}: {exc}", "moved": moved}
    return {"params": models.params(model)}


def _fsdp_divide_factor(where: str) -> dict[str, Any]:
    """Blocks and root fully_shard-ed over 4 ranks; a divide factor set on the root module only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gradaccum

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    model = models.TinyTransformer()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # 1.0 (a sum) on the root only leaves the blocks averaging over 4; 4.0 is what they divide by
    model.set_gradient_divide_factor(1.0 if where == "root sums" else 4.0)  # type: ignore[operator]
    rank = mesh.get_coordinate()[0]
    local = models.rows(models.batch(8), 2 * rank, 2 * rank + 2)

    def run() -> None:
        acc = gradaccum.Accumulator(model, _sgd(model), mesh=mesh)
        acc.step(gradaccum.split(local, sizes=[1, 1]), models.loss_fn, models.count_fn)

    return _outcome(run, model)


def _ddp_on_a_tp_mesh(group: str) -> dict[str, Any]:
    """Mesh (dp_replicate=2, tp=2), a replicated model under DDP, TP ranks fed the same tokens."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradaccum

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "tp"))
    d = mesh.get_coordinate()[0]
    pg = mesh["dp_replicate"].get_group() if group == "data" else None
    model = DDP(models.PositionLM(), process_group=pg)
    local = models.rows(models.batch(8), *ROWS[d])

    def run() -> None:
        acc = gradaccum.Accumulator(model, _sgd(model), mesh=mesh)
        acc.step(gradaccum.split(local, sizes=SIZES[d]), models.loss_fn, models.count_fn)

    return _outcome(run, model.module)


def _pipeline(schedule: str, lengths: tuple[int, int], wrap: str = "ddp") -> dict[str, Any]:
    """pp=2 x data=2; data replica d holds ``lengths[d]`` one-row micro-batches."""
    from gradaccum.pipeline import PipelineAccumulator

    mesh, d, stages, params = build_stages(schedule, wrap)
    holder = torch.nn.ModuleList([s.submod for s in stages])
    data = models.batch(sum(lengths), seed=11)
    start = sum(lengths[:d])
    window = [(data["ids"][j : j + 1], data["labels"][j : j + 1]) for j in range(start, start + lengths[d])]

    def run() -> None:
        acc = PipelineAccumulator(stages, _sgd_params(params), loss_fn, schedule=schedule, mesh=mesh)
        acc.step(window, count_fn)

    return _outcome(run, holder)


def _sgd_params(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=models.LR, foreach=False)


def _edges_rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for where in ("root sums", "root averages"):
        out[f"fsdp {where}"] = _fsdp_divide_factor(where)
    for group in ("world", "data"):
        out[f"tp ddp {group}"] = _ddp_on_a_tp_mesh(group)
    out["1F1B k=1"] = _pipeline("1F1B", (1, 1))
    out["Interleaved1F1B k=5"] = _pipeline("Interleaved1F1B", (5, 5))
    out["Interleaved1F1B k=6"] = _pipeline("Interleaved1F1B", (6, 6), wrap="fsdp2")
    return out


def _uneven_rank(rank: int, world: int) -> dict[str, Any]:
    return {"uneven": _pipeline("1F1B", (3, 2))}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return values(run_ranks(_edges_rank, world=4, timeout_s=300))


def assert_refused_everywhere(ranks: list[dict[str, Any]], key: str, error: str, *phrases: str) -> None:
    """Every rank refused scenario ``key`` with ``error`` naming each of ``phrases``, and no
    parameter moved."""
    for r in ranks:
        got = r[key]
        assert got["refused"].startswith(error), got
        for phrase in phrases:
            assert phrase in got["refused"], got["refused"]
        assert not got["moved"]


def test_fsdp2_divide_factor_on_the_root_only_is_refused_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """torch's set_gradient_divide_factor is not recursive: the blocks still average over 4 while
    the root sums. One scale cannot serve both (it was 0.25 off, block parameters at half)."""
    phrases = ("blocks.0, blocks.1: divides by 4.0", "<root>: divides by 1.0")
    assert_refused_everywhere(ranks, "fsdp root sums", "ConfigError", *phrases)


def test_fsdp2_factor_on_the_root_equal_to_the_blocks_is_exact(ranks: list[dict[str, Any]]) -> None:
    data = models.batch(8)
    want, start = models.reference_update(models.TinyTransformer(), data)
    for r in ranks:
        assert models.update_error(r["fsdp root averages"]["params"], want, start) < EXACT


def test_ddp_over_the_world_on_a_tp_mesh_is_refused_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """DDP over all 4 ranks averages each data rank's gradient twice (its TP copies): ratio 2.0."""
    assert_refused_everywhere(ranks, "tp ddp world", "ConfigError", "reduces over ranks [0, 1, 2, 3]")


def test_ddp_over_the_data_ranks_on_a_tp_mesh_is_exact(ranks: list[dict[str, Any]]) -> None:
    data = models.batch(8)
    want, start = models.reference_update(models.PositionLM(), data)
    for r in ranks:
        assert models.update_error(r["tp ddp data"]["params"], want, start) < EXACT


@pytest.mark.parametrize(
    ("key", "rule"),
    [
        ("1F1B k=1", "this window holds 1 for 2 stages"),
        ("Interleaved1F1B k=5", "k=5: 2 rounds, 5 % 2 = 1"),
    ],
)
def test_short_pipeline_windows_are_refused_before_the_schedule(
    ranks: list[dict[str, Any]], key: str, rule: str
) -> None:
    """torch's schedules refuse these lengths with their own ValueError; the step names the rule
    and the numbers first, on every rank, with the parameters untouched."""
    assert_refused_everywhere(ranks, key, "ConfigError", rule)


def test_a_length_the_interleaved_schedule_runs_is_exact(ranks: list[dict[str, Any]]) -> None:
    parts = full_model()
    start = {n: p.detach().clone() for n, p in parts.named_parameters()}
    data = models.batch(12, seed=11)
    x = data["ids"]
    for name in ("embed", "l0", "l1", "l2", "l3", "head"):
        x = parts[name](x)
    (loss_fn(x, data["labels"]) / count_fn(data["labels"])).backward()
    with torch.no_grad():
        for p in parts.parameters():
            p -= models.LR * p.grad
    want = {n: p.detach().clone() for n, p in parts.named_parameters()}
    for d in (0, 1):
        got: dict[str, torch.Tensor] = {}
        for rank in (d, 2 + d):  # pp 0 and pp 1 of data index d
            params = ranks[rank]["Interleaved1F1B k=6"]["params"]
            got.update({n.split("parts.", 1)[-1]: v for n, v in params.items()})
        assert sorted(got) == sorted(want)
        assert models.update_error(got, want, start) < EXACT


def test_pipeline_replicas_with_different_window_lengths_are_refused_not_hung() -> None:
    """DDP stages, replicas of 3 and 2 micro-batches: it hung (one rank in DDP's bucket rebuild,
    the others in p2p). The count all-reduce compares the lengths; every rank refuses, naming them."""
    outcomes = values(run_ranks(_uneven_rank, world=4, timeout_s=150))
    assert_refused_everywhere(outcomes, "uneven", "WindowError", "rank 0: 3, rank 1: 2, rank 2: 3, rank 3: 2")
