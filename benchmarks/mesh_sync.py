"""Collectives, bytes and host reads per optimizer update on a 4-rank mesh (gloo, CPU), per layout,
per sync policy and per mesh dimension, beside a hand-written exact loop where one exists.

Counted around one update after a warm-up update: every ``torch.distributed`` collective issued
from Python, labelled by the mesh dimension its group spans (``world`` = the step's own, over every
rank), with its payload; FSDP2's reduce-scatters through its public custom-collective hook; host
reads (``item``, ``tolist``, ...) with ``count_sync_points``. Tensor parallelism's activation
collectives run through functional collectives inside DTensor and are not counted here (they do
not depend on accumulation); DDP's gradient all-reduce runs in its C++ reducer (counted by a
comm hook where DDP is used).

    .venv/bin/python benchmarks/mesh_sync.py
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import sys
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.mesh import models

WINDOW_SIZES = [[1, 1], [2, 1], [1, 1], [2, 1]]
ROWS = [(0, 2), (2, 5), (5, 7), (7, 10)]


class Counter:
    """dist.all_reduce / all_gather calls and bytes by the mesh dimension their group spans."""

    def __init__(self, dims: dict[frozenset[int], str]) -> None:
        self.dims = dims
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def label(self, name: str, group: Any) -> str:
        ranks = frozenset(dist.get_process_group_ranks(group)) if group is not None else None
        where = "world" if ranks is None or len(ranks) == dist.get_world_size() else self.dims.get(ranks, "?")
        return f"{name} over {where}"

    def wrap(self, name: str) -> Any:
        original = getattr(dist, name)

        def counted(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group", args[1] if len(args) > 1 and name == "all_reduce" else None)
            key = self.label(name, group)
            self.calls[key] += 1
            if isinstance(tensor, torch.Tensor):
                self.bytes[key] += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)

        return original, counted


def _dims(mesh: Any) -> dict[frozenset[int], str]:
    out = {}
    for name in mesh.mesh_dim_names:
        out[frozenset(dist.get_process_group_ranks(mesh[name].get_group()))] = name
    return out


def _measure(update: Any, mesh: Any, comms: Any) -> dict[str, Any]:
    from gradaccum.distributed.comm import count_sync_points

    update()  # warm-up
    counter = Counter(_dims(mesh))
    saved = {}
    for name in ("all_reduce", "all_gather_into_tensor"):
        original, counted = counter.wrap(name)
        saved[name] = original
        setattr(dist, name, counted)
    if comms is not None:
        comms.reset()
    try:
        with count_sync_points() as points:
            update()
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
    row: dict[str, Any] = {"host reads": points.host_reads}
    row.update({k: (counter.calls[k], counter.bytes[k]) for k in sorted(counter.calls)})
    if comms is not None:
        row["reduce_scatter over data dims"] = (comms.reduce_scatter_calls, comms.reduce_scatter_bytes)
    return row


def _fsdp_model(mesh: Any, tp: bool) -> tuple[Any, Any]:
    from torch.distributed.fsdp import fully_shard

    from gradaccum.distributed.comm import count_fsdp2_comms

    model = models.TinyTransformer()
    shard_mesh = mesh["dp_shard"] if tp else mesh
    if tp:
        models.tensor_parallel(model, mesh["tp"])
    units = [*model.blocks, model]
    for unit in units:
        fully_shard(unit, mesh=shard_mesh)
    return model, count_fsdp2_comms(units)


def _rank(rank: int, world: int, port: int, queue: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import gradaccum

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows: dict[str, Any] = {}
    data = models.batch(10)
    window = gradaccum.split(models.rows(data, *ROWS[rank]), sizes=WINDOW_SIZES[rank])

    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    for policy in ("defer", "defer_replicate", "every"):
        model, comms = _fsdp_model(hsdp, tp=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
        acc = gradaccum.Accumulator(model, optimizer, mesh=hsdp, sync_policy=policy)
        step = functools.partial(acc.step, window, models.loss_fn, models.count_fn)
        rows[f"HSDP 2x2 {policy}"] = _measure(step, hsdp, comms)

    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    d = tp_mesh.get_coordinate()[0]
    tp_window = gradaccum.split(models.rows(data, 5 * d, 5 * d + 5), sizes=[3, 2])
    model, comms = _fsdp_model(tp_mesh, tp=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    acc = gradaccum.Accumulator(model, optimizer, mesh=tp_mesh)
    rows["FSDP2 dp_shard=2 x tp=2, gradaccum"] = _measure(
        lambda: acc.step(tp_window, models.loss_fn, models.count_fn), tp_mesh, comms
    )
    hand_model, hand_comms = _fsdp_model(tp_mesh, tp=True)
    hand_optimizer = torch.optim.SGD(hand_model.parameters(), lr=0.1, foreach=False)
    group = tp_mesh["dp_shard"].get_group()

    def hand_loop() -> None:
        # the exact loop by hand: N over dp_shard (TP ranks hold the same tokens), FSDP2 averages
        # over dp_shard (x2), sync off but for the last micro-batch; no finiteness check, no norm
        n = torch.tensor(float(sum(models.count_fn(mb) for mb in tp_window)), dtype=torch.float64)
        dist.all_reduce(n, group=group)
        hand_optimizer.zero_grad(set_to_none=True)
        for i, mb in enumerate(tp_window):
            hand_model.set_requires_gradient_sync(i == len(tp_window) - 1)
            (models.loss_fn(hand_model, mb) * (2.0 / n)).backward()
        hand_optimizer.step()

    rows["FSDP2 dp_shard=2 x tp=2, hand loop"] = _measure(hand_loop, tp_mesh, hand_comms)
    queue.put((rank, rows))
    dist.destroy_process_group()


def main() -> None:
    from tests.helpers.launcher import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 4, port, queue)) for r in range(4)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    print("per optimizer update, rank 0 (calls, bytes); 3 FSDP2 units, 2 micro-batches per rank")
    for layout, row in results[0].items():
        print(f"\n{layout}")
        for key, value in row.items():
            print(f"  {key:<42} {value}")


if __name__ == "__main__":
    main()
