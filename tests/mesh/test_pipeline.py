"""``PipelineAccumulator`` on a pp=2 x dp=2 mesh of 4 gloo processes: GPipe, 1F1B, Interleaved1F1B.

Each data rank holds 8 one-row micro-batches of uneven valid tokens; every layout must equal one
SGD step on all 16 rows on one process (float64: only the summation order differs, ~1e-16; 1e-10
leaves six orders of margin and still sees any factor, e.g. PyTorch's own ``scale_grads`` 1/8).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers.launcher import run_ranks, values
from tests.mesh import models

pytestmark = pytest.mark.distributed

EXACT = 1e-10
K = 8  # micro-batches per data rank
CLIP = 0.05
SEEDS = (11, 12)  # one window's data per seed
PARTS = ("embed", "l0", "l1", "l2", "l3", "head")
STAGES = {
    2: [("embed", "l0", "l1"), ("l2", "l3", "head")],
    4: [("embed", "l0"), ("l1",), ("l2",), ("l3", "head")],
}


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(models.DIM, models.DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


def full_model() -> nn.ModuleDict:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        parts = nn.ModuleDict(
            {
                "embed": nn.Embedding(models.VOCAB, models.DIM),
                **{f"l{i}": Layer() for i in range(4)},
                "head": nn.Linear(models.DIM, models.VOCAB),
            }
        )
    return parts.to(torch.float64)


class Stage(nn.Module):
    """Some consecutive parts of the full model, under their full-model names."""

    def __init__(self, parts: nn.ModuleDict, names: tuple[str, ...]) -> None:
        super().__init__()
        self.parts = nn.ModuleDict({n: copy.deepcopy(parts[n]) for n in names})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self.parts.values():
            x = module(x)
        return x


def run_full(parts: nn.ModuleDict, ids: torch.Tensor) -> torch.Tensor:
    x = ids
    for name in PARTS:
        x = parts[name](x)
    return x


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        output.reshape(-1, models.VOCAB), target.reshape(-1), ignore_index=models.IGNORE, reduction="sum"
    )


def count_fn(target: torch.Tensor) -> int:
    return int((target != models.IGNORE).sum())


def _named(stage: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in stage.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.split("parts.", 1)[-1].replace("module.", "")] = full.detach().clone()
    return out


def build_stages(schedule: str, wrap: str) -> tuple[Any, int, list[Any], list[nn.Parameter]]:
    """The pp=2 x data=2 mesh, this rank's data coordinate, its stages wrapped in DDP or FSDP2
    over the data dimension, and their parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.nn.parallel import DistributedDataParallel as DDP

    data_dim = "dp_shard" if wrap == "fsdp2" else "dp_replicate"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", data_dim))
    p, d = mesh.get_coordinate()
    layout = STAGES[4 if schedule == "Interleaved1F1B" else 2]
    mine = [i for i in range(len(layout)) if i % 2 == p]  # stage i lives on pp rank i mod 2
    parts = full_model()
    stages, params = [], []
    for i in mine:
        module: nn.Module = Stage(parts, layout[i])
        if wrap == "fsdp2":
            fully_shard(module, mesh=mesh[data_dim])
        else:
            module = DDP(module, process_group=mesh[data_dim].get_group())
        params += list(module.parameters())
        stages.append(
            PipelineStage(module, i, len(layout), torch.device("cpu"), group=mesh["pp"].get_group())
        )
    return mesh, d, stages, params


def _pipeline(
    schedule: str, wrap: str, clip: float | None, built_for: int | None = None, windows: int = 1
) -> dict[str, Any]:
    import gradaccum
    from gradaccum.pipeline import PipelineAccumulator

    mesh, d, stages, params = build_stages(schedule, wrap)
    optimizer = torch.optim.SGD(params, lr=models.LR, foreach=False)
    config = gradaccum.AccumConfig(max_grad_norm=clip)
    given: Any = schedule
    if built_for is not None:  # the caller's own schedule object, for another window length
        from torch.distributed.pipelining import Schedule1F1B

        given = Schedule1F1B(stages[0], n_microbatches=built_for, loss_fn=loss_fn, scale_grads=False)
    try:
        acc = PipelineAccumulator(stages, optimizer, loss_fn, schedule=given, mesh=mesh, config=config)
    except gradaccum.ConfigError as exc:
        return {"refused": str(exc)}
    for seed in SEEDS[:windows]:
        data = models.batch(2 * K, seed=seed)
        rows = models.rows(data, d * K, (d + 1) * K)
        window = [(rows["ids"][j : j + 1], rows["labels"][j : j + 1]) for j in range(K)]
        try:
            result = acc.step(window, count_fn)
        except gradaccum.ConfigError as exc:
            return {"refused": str(exc)}
    out: dict[str, Any] = {"global": result.global_count, "loss": result.loss}
    for stage in stages:
        out.update(_named(stage.submod))
    return out


def _ddp_over_the_world() -> str:
    """Stages of equal shapes let DDP over every rank build, and average one stage with another."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradaccum
    from gradaccum.pipeline import PipelineAccumulator

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_replicate"))
    p = mesh.get_coordinate()[0]
    module = DDP(Stage(full_model(), (f"l{p}",)))  # the default group: all 4 ranks
    stage = PipelineStage(module, p, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    try:
        PipelineAccumulator([stage], torch.optim.SGD(module.parameters(), lr=0.1), loss_fn, mesh=mesh)
    except gradaccum.ConfigError as exc:
        return str(exc)
    return "accepted"


def _pipeline_rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for schedule in ("GPipe", "1F1B", "Interleaved1F1B"):
        out[schedule] = _pipeline(schedule, "fsdp2", None)
    out["1F1B clip"] = _pipeline("1F1B", "fsdp2", CLIP)
    # DDP's reducer runs a second window too: two windows each
    out["ddp 1F1B"] = _pipeline("1F1B", "ddp", None, windows=2)
    out["ddp Interleaved1F1B"] = _pipeline("Interleaved1F1B", "ddp", None, windows=2)
    out["ddp GPipe"] = _pipeline("GPipe", "ddp", None)  # refused: torch's reducer asserts
    out["ddp world"] = _ddp_over_the_world()
    out["mismatch"] = _pipeline("1F1B", "fsdp2", None, built_for=4)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return values(run_ranks(_pipeline_rank, world=4, timeout_s=420))


def reference(
    clip: float | None = None, windows: int = 1
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    parts = full_model()
    start = {n: p.detach().clone() for n, p in parts.named_parameters()}
    for seed in SEEDS[:windows]:
        parts.zero_grad(set_to_none=True)
        data = models.batch(2 * K, seed=seed)
        loss = loss_fn(run_full(parts, data["ids"]), data["labels"]) / count_fn(data["labels"])
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(parts.parameters(), clip)
        with torch.no_grad():
            for p in parts.parameters():
                p -= models.LR * p.grad
    return {n: p.detach().clone() for n, p in parts.named_parameters()}, start


def _merged(ranks: list[dict[str, Any]], key: str, data_index: int) -> dict[str, torch.Tensor]:
    """Both stages' parameters as seen by the ranks of one data index (pp=0 and pp=1)."""
    merged: dict[str, torch.Tensor] = {}
    for rank in (data_index, 2 + data_index):
        merged.update({n: v for n, v in ranks[rank][key].items() if isinstance(v, torch.Tensor)})
    return merged


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "1F1B clip"])
def test_pipeline_schedules_equal_the_full_batch(ranks: list[dict[str, Any]], schedule: str) -> None:
    want, start = reference(CLIP if "clip" in schedule else None)
    data = models.batch(2 * K, seed=11)
    for r in ranks:
        assert r[schedule]["global"] == count_fn(data["labels"])
    for d in (0, 1):
        got = _merged(ranks, schedule, d)
        assert sorted(got) == sorted(want)
        assert models.update_error(got, want, start) < EXACT


def test_a_schedule_for_another_window_length_is_refused_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert "n_microbatches=4 but the window holds 8" in r["mismatch"]["refused"]


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_ddp_stages_are_exact_over_two_windows(ranks: list[dict[str, Any]], schedule: str) -> None:
    """DDP over the data ranks, averaging: F = 2; the reducer's second window as exact as its first."""
    want, start = reference(windows=2)
    for d in (0, 1):
        got = _merged(ranks, f"ddp {schedule}", d)
        assert sorted(got) == sorted(want)
        assert models.update_error(got, want, start) < EXACT


def test_ddp_stages_under_gpipe_are_refused_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert "Use schedule='1F1B' or 'Interleaved1F1B' with DDP" in r["ddp GPipe"]["refused"]
        assert "reduces over ranks [0, 1, 2, 3], but this rank's data-parallel ranks" in r["ddp world"]
