"""``Accumulator(..., mesh=)`` on 4 gloo processes: FSDP2 x TP, data x context parallel, HSDP.

Every layout steps once over uneven tokens and must equal one SGD step on the whole batch on one
process, in float64: only the order of summation differs (dozens of terms, ~1e-16 each), so 1e-10
relative to the update leaves six orders of margin and still catches any wrong factor (a factor
of 2 in N is an error of 1.0). All scenarios run in one launch of 4 processes (module fixture).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.launcher import run_ranks, values
from tests.mesh import models

pytestmark = pytest.mark.distributed

EXACT = 1e-10
CLIP = 0.05  # far below the reference gradient's norm (~1-3): clipping bites
TP_ROWS = [(0, 3), (3, 8)]  # uneven examples per data rank
TP_SIZES = [[2, 1], [3, 2]]  # FSDP2 needs equal micro-batch counts; their sizes may differ
HSDP_ROWS = [(0, 2), (2, 5), (5, 7), (7, 10)]
HSDP_SIZES = [[1, 1], [2, 1], [1, 1], [2, 1]]


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    # foreach=False: the parameters are DTensors on two meshes (2-D under TP, 1-D elsewhere)
    return torch.optim.SGD(model.parameters(), lr=models.LR, foreach=False)


def _fsdp_tp(variant: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    import gradaccum

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = models.TinyTransformer()
    models.tensor_parallel(model, mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    if variant == "sum":  # torchtitan's setting: the reduce-scatter sums instead of averaging
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
    clip = CLIP if variant in ("clip", "post clip") else None
    scaling = "post" if variant.startswith("post") else "pre"
    acc = gradaccum.Accumulator(
        model, _sgd(model), mesh=mesh, max_grad_norm=clip, track_grad_norm=True, scaling=scaling
    )
    d = mesh.get_coordinate()[0]
    local = models.rows(models.batch(8), *TP_ROWS[d])
    result = acc.step(gradaccum.split(local, sizes=TP_SIZES[d]), models.loss_fn, models.count_fn)
    return {
        "params": models.params(model),
        "global": result.global_count,
        "loss": result.loss,
        "norm": result.grad_norm,
    }


def _dp_cp() -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradaccum

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "cp"))
    d, c = mesh.get_coordinate()
    out: dict[str, Any] = {}
    # the exact step: uneven rows per data rank; data rank 1's second halves hold no valid target
    model = DDP(models.PositionLM())  # DDP averages over all 4 ranks (dp x cp)
    acc = gradaccum.Accumulator(model, _sgd(model), mesh=mesh)
    data = models.batch(8, empty_tail_rows=tuple(range(3, 8)))
    local = models.positions(models.rows(data, *TP_ROWS[d]), c, 2)
    result = acc.step(gradaccum.split(local, sizes=TP_SIZES[d]), models.loss_fn, models.count_fn)
    out["exact"] = models.params(model.module)
    out["local"], out["global"] = result.local_count, result.global_count
    # the negative control, a hand-written step on the same mesh whose N sums over dp only; on
    # data whose CP halves hold equal counts it is off by exactly their ratio, 2
    control = DDP(models.PositionLM())
    optimizer = _sgd(control)
    local = models.positions(models.rows(_full(models.batch(8)), *TP_ROWS[d]), c, 2)
    count = torch.tensor(float(models.count_fn(local)), dtype=torch.float64)
    dist.all_reduce(count, group=mesh["dp_replicate"].get_group())
    (models.loss_fn(control, local) * 4 / count).backward()
    optimizer.step()
    out["control"] = models.params(control.module)
    return out


def _fsdp_flattened_cp(clip: float | None = None) -> dict[str, Any]:
    """torchtitan's FSDP x CP: fully_shard over dp_shard and cp flattened into dp_shard_cp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gradaccum

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    model = models.PositionLM()
    fully_shard(model, mesh=mesh["dp_shard", "cp"]._flatten("dp_shard_cp"))
    acc = gradaccum.Accumulator(model, _sgd(model), mesh=mesh, max_grad_norm=clip)
    d, c = mesh.get_coordinate()
    data = models.batch(8, empty_tail_rows=tuple(range(3, 8)))
    local = models.positions(models.rows(data, *TP_ROWS[d]), c, 2)
    result = acc.step(gradaccum.split(local, sizes=TP_SIZES[d]), models.loss_fn, models.count_fn)
    return {"params": models.params(model), "local": result.local_count, "global": result.global_count}


def _full(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {"ids": data["ids"], "labels": torch.randint(0, models.VOCAB, data["labels"].shape, generator=gen)}


def _hsdp(policy: str, scaling: str = "pre", clip: float | None = None) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gradaccum
    from gradaccum.distributed.comm import count_fsdp2_comms

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = models.TinyTransformer()
    units = [*model.blocks, model]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    comms = count_fsdp2_comms(units)
    acc = gradaccum.Accumulator(
        model, _sgd(model), mesh=mesh, sync_policy=policy, scaling=scaling, max_grad_norm=clip
    )
    rank = dist.get_rank()
    local = models.rows(models.batch(10), *HSDP_ROWS[rank])
    window = gradaccum.split(local, sizes=HSDP_SIZES[rank])
    all_reduces: dict[int, int] = {}
    original = dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        size = dist.get_world_size(group)
        all_reduces[size] = all_reduces.get(size, 0) + 1
        return original(tensor, *args, **kwargs)

    assert comms is not None
    comms.reset()
    dist.all_reduce = counted  # type: ignore[assignment]
    try:
        acc.step(window, models.loss_fn, models.count_fn)
    finally:
        dist.all_reduce = original
    return {
        "params": models.params(model),
        "reduce_scatters": comms.reduce_scatter_calls,
        "replica_all_reduces": all_reduces.get(2, 0),
        "step_all_reduces": all_reduces.get(4, 0),
    }


def _refusals() -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gradaccum

    out: dict[str, str] = {}

    def refused(key: str, build: Any) -> None:
        try:
            build()
            out[key] = "accepted"
        except gradaccum.ConfigError as exc:
            out[key] = str(exc)

    flat = init_device_mesh("cpu", (4,))
    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    plain = models.TinyTransformer()
    fully_shard(plain, mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",)))
    refused("unnamed", lambda: gradaccum.Accumulator(plain, _sgd(plain), mesh=flat))
    refused(
        "twice",
        lambda: gradaccum.Accumulator(plain, _sgd(plain), mesh=named, mesh_dims={"dp_shard": "tp"}),
    )
    refused("unknown", lambda: gradaccum.Accumulator(plain, _sgd(plain), mesh=named, mesh_dims={"fsdp": "x"}))
    refused("other mesh", lambda: gradaccum.Accumulator(plain, _sgd(plain), mesh=named))
    # TP ranks that counted different windows: refused on every rank, naming ranks and counts
    model = models.TinyTransformer()
    models.tensor_parallel(model, named["tp"])
    fully_shard(model, mesh=named["dp_shard"])
    acc = gradaccum.Accumulator(model, _sgd(model), mesh=named)
    d, t = named.get_coordinate()
    local = models.rows(models.batch(8), *TP_ROWS[d])
    if t == 1:
        local["labels"][0, 0] = models.IGNORE  # one target fewer on this TP rank
    refused(
        "tp counts",
        lambda: acc.step(gradaccum.split(local, sizes=TP_SIZES[d]), models.loss_fn, models.count_fn),
    )
    return out


def _mesh_rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant in ("average", "sum", "clip", "post", "post clip"):
        out[f"tp {variant}"] = _fsdp_tp(variant)
    out["cp"] = _dp_cp()
    out["cp flattened"] = _fsdp_flattened_cp()
    out["cp flattened clip"] = _fsdp_flattened_cp(CLIP)
    for policy in ("defer", "defer_replicate", "every"):
        out[f"hsdp {policy}"] = _hsdp(policy)
    out["hsdp post"] = _hsdp("defer", "post")
    out["hsdp clip"] = _hsdp("defer_replicate", clip=CLIP)
    out["refusals"] = _refusals()
    out["verify"] = _verify()
    return out


def _verify() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    from gradaccum.check.mesh import verify_on_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    return verify_on_mesh(models.workload(), mesh)


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return values(run_ranks(_mesh_rank, world=4, timeout_s=420))


@pytest.mark.parametrize("variant", ["average", "sum", "post"])
def test_fsdp2_x_tensor_parallel_equals_the_full_batch(ranks: list[dict[str, Any]], variant: str) -> None:
    want, start = models.reference_update(models.TinyTransformer(), models.batch(8))
    n = models.count_fn(models.batch(8))
    for r in ranks:
        got = r[f"tp {variant}"]
        assert got["global"] == n  # summed over dp_shard, not over tp
        assert models.update_error(got["params"], want, start) < EXACT


def test_clipping_by_the_norm_over_every_shard_and_mesh(ranks: list[dict[str, Any]]) -> None:
    model = models.TinyTransformer()
    model.zero_grad()
    data = models.batch(8)
    (models.loss_fn(model, data) / models.count_fn(data)).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    assert norm > 10 * CLIP  # the clip bites
    want, start = models.reference_update(models.TinyTransformer(), data, max_grad_norm=CLIP)
    for r in ranks:
        for variant in ("clip", "post clip"):
            got = r[f"tp {variant}"]
            assert abs(got["norm"] - norm) < 1e-10 * norm, variant
            assert models.update_error(got["params"], want, start) < EXACT, variant


@pytest.mark.parametrize(
    ("key", "model", "data"),
    [
        ("hsdp clip", models.TinyTransformer, models.batch(10)),
        ("cp flattened clip", models.PositionLM, models.batch(8, empty_tail_rows=tuple(range(3, 8)))),
    ],
)
def test_a_clip_that_bites_on_hsdp_and_on_fsdp_x_cp(
    ranks: list[dict[str, Any]], key: str, model: Any, data: dict[str, torch.Tensor]
) -> None:
    reference = model()
    (models.loss_fn(reference, data) / models.count_fn(data)).backward()
    assert torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item() > 10 * CLIP
    want, start = models.reference_update(model(), data, max_grad_norm=CLIP)
    for r in ranks:
        assert models.update_error(r[key]["params"], want, start) < EXACT


def test_data_x_context_parallel_with_an_empty_half(ranks: list[dict[str, Any]]) -> None:
    data = models.batch(8, empty_tail_rows=tuple(range(3, 8)))
    want, start = models.reference_update(models.PositionLM(), data)
    assert ranks[3]["cp"]["local"] == 0  # dp 1, cp 1: the second halves of rows 3..7 hold no target
    for r in ranks:
        assert r["cp"]["global"] == models.count_fn(data)
        assert models.update_error(r["cp"]["exact"], want, start) < EXACT


def test_fsdp2_over_dp_shard_and_cp_flattened_as_torchtitan_does(ranks: list[dict[str, Any]]) -> None:
    """FSDP2's reduce-scatter averages over the 4 ranks of dp_shard_cp; N sums over both."""
    data = models.batch(8, empty_tail_rows=tuple(range(3, 8)))
    want, start = models.reference_update(models.PositionLM(), data)
    assert ranks[3]["cp flattened"]["local"] == 0
    for r in ranks:
        got = r["cp flattened"]
        assert got["global"] == models.count_fn(data)
        assert models.update_error(got["params"], want, start) < EXACT


def test_summing_the_count_over_dp_only_is_off_by_the_cp_ratio(ranks: list[dict[str, Any]]) -> None:
    want, start = models.reference_update(models.PositionLM(), _full(models.batch(8)))
    for r in ranks:
        # the CP halves hold equal counts, so N over dp only is half of N: the update doubles
        assert abs(models.update_ratio(r["cp"]["control"], want, start) - 2.0) < 1e-9


# per update with 3 FSDP units and 2 micro-batches: reduce-scatters, all-reduces over replicas
DECLARED = {"defer": (3, 3), "defer_replicate": (6, 3), "every": (6, 6)}


@pytest.mark.parametrize("policy", sorted(DECLARED))
def test_hsdp_sync_policies_are_exact_with_their_declared_collectives(
    ranks: list[dict[str, Any]], policy: str
) -> None:
    want, start = models.reference_update(models.TinyTransformer(), models.batch(10))
    for r in ranks:
        got = r[f"hsdp {policy}"]
        assert models.update_error(got["params"], want, start) < EXACT
        assert (got["reduce_scatters"], got["replica_all_reduces"]) == DECLARED[policy]
        assert got["step_all_reduces"] == 2  # the step's own: the counts, the end of the window


def test_post_scaling_on_hsdp_is_exact_with_the_same_gradient_collectives(
    ranks: list[dict[str, Any]],
) -> None:
    want, start = models.reference_update(models.TinyTransformer(), models.batch(10))
    for r in ranks:
        got = r["hsdp post"]
        assert models.update_error(got["params"], want, start) < EXACT
        assert (got["reduce_scatters"], got["replica_all_reduces"]) == DECLARED["defer"]
        # the step's own: the declared lengths (FSDP all-gathers in every forward), the meeting
        # before the synchronizing backward (N, loss, failures), the norm's squares after it
        assert got["step_all_reduces"] == 3


def test_bad_meshes_and_disagreeing_tp_counts_are_refused_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        refusals = r["refusals"]
        assert "not named" in refusals["unnamed"]
        assert "names dimension 'tp' twice" in refusals["twice"]
        assert "unknown role 'fsdp'" in refusals["unknown"]
        assert "not part of the mesh given to the accumulator" in refusals["other mesh"]
        assert "counted different windows" in refusals["tp counts"]
        assert "rank 0:" in refusals["tp counts"] and "rank 1:" in refusals["tp counts"]


def test_verify_on_the_users_parallelized_model(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        report = r["verify"]
        assert report.passed, report
        assert report.mesh == "dp_shard=2 x tp=2" and report.micro_batches == 2
        assert report.global_count == models.count_fn(models.batch(8, 3))


@pytest.mark.timeout(300)
def test_verify_mesh_from_the_cli_under_torchrun() -> None:
    import subprocess
    import sys

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    command += [
        "-m",
        "gradaccum",
        "verify",
        "--workload",
        "tests.mesh.models:workload",
        "--mesh",
        "dp_shard=2,tp=2",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verify --mesh dp_shard=2 x tp=2" in proc.stdout and "PASS" in proc.stdout


def test_verify_mesh_without_torchrun_says_how_to_launch_it(capsys: pytest.CaptureFixture[str]) -> None:
    from gradaccum.cli.main import main

    assert main(["verify", "--workload", "tests.mesh.models:workload", "--mesh", "dp_shard=2,tp=2"]) == 2
    assert "torchrun --nproc-per-node 4" in capsys.readouterr().err
