"""Collectives, bytes and host reads per optimizer update on a 4-rank mesh (gloo, CPU), per layout,
per sync policy and per mesh dimension, beside a hand-written exact loop where one exists.

Counted around one update after a warm-up update, with ``gradaccum.bench.mesh.MeshCommCounter``
(which ``gradaccum bench --mesh`` uses too): every ``torch.distributed`` collective issued from
Python and FSDP2's all-gathers and reduce-scatters (its public custom-collective hooks), labelled by
the mesh dimension their group spans (``world`` = the step's own, over every rank), with their
payload; host reads (``item``, ``tolist``, ...) with ``count_sync_points``; for HSDP, the gradient
bytes held when the last micro-batch starts (``gradient_bytes_held``). Tensor parallelism's activation
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
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.mesh import models

WINDOW_SIZES = [[1, 1], [2, 1], [1, 1], [2, 1]]
ROWS = [(0, 2), (2, 5), (5, 7), (7, 10)]


def _measure(update: Any, counter: Any) -> dict[str, Any]:
    from gradaccum.distributed.comm import count_sync_points

    update()  # warm-up: FSDP2's lazy initialization
    with counter.counting() as comms, count_sync_points() as points:
        update()
    row: dict[str, Any] = {"host reads": points.host_reads}
    for collective, dim in sorted(comms.calls, key=lambda key: (key[1], key[0])):
        key = (collective, dim)
        row[f"{collective} over {dim}"] = (comms.calls[key], comms.bytes[key])
    return row


def _fsdp_model(mesh: Any, tp: bool, counter: Any) -> Any:
    from torch.distributed.fsdp import fully_shard

    model = models.TinyTransformer()
    shard_mesh = mesh["dp_shard"] if tp else mesh
    if tp:
        models.tensor_parallel(model, mesh["tp"])
    for unit in [*model.blocks, model]:
        fully_shard(unit, mesh=shard_mesh)
    counter.watch(model)
    return model


class _Held:
    """The step's observer: gradient bytes held when the window's last micro-batch starts."""

    def __init__(self, model: Any, last: int) -> None:
        self.model, self.last, self.held = model, last, 0

    def __call__(self, event: str, index: int) -> None:
        from gradaccum.bench.mesh import gradient_bytes_held

        if event == "micro_start" and index == self.last:
            self.held = gradient_bytes_held(self.model)


def _rank(rank: int, world: int, port: int, queue: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import gradaccum
    from gradaccum.bench.mesh import MeshCommCounter

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows: dict[str, Any] = {}
    data = models.batch(10)
    window = gradaccum.split(models.rows(data, *ROWS[rank]), sizes=WINDOW_SIZES[rank])

    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    counter = MeshCommCounter(hsdp)
    for policy in ("defer", "defer_replicate", "every"):
        model = _fsdp_model(hsdp, tp=False, counter=counter)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
        held = _Held(model, len(window) - 1)
        acc = gradaccum.Accumulator(model, optimizer, mesh=hsdp, sync_policy=policy, observer=held)
        step = functools.partial(acc.step, window, models.loss_fn, models.count_fn)
        rows[f"HSDP 2x2 {policy}"] = _measure(step, counter)
        rows[f"HSDP 2x2 {policy}"]["gradient bytes held before the last micro-batch"] = held.held

    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    counter = MeshCommCounter(tp_mesh)
    d = tp_mesh.get_coordinate()[0]
    tp_window = gradaccum.split(models.rows(data, 5 * d, 5 * d + 5), sizes=[3, 2])
    model = _fsdp_model(tp_mesh, tp=True, counter=counter)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    acc = gradaccum.Accumulator(model, optimizer, mesh=tp_mesh)
    rows["FSDP2 dp_shard=2 x tp=2, gradaccum"] = _measure(
        lambda: acc.step(tp_window, models.loss_fn, models.count_fn), counter
    )
    hand_model = _fsdp_model(tp_mesh, tp=True, counter=counter)
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

    rows["FSDP2 dp_shard=2 x tp=2, hand loop"] = _measure(hand_loop, counter)
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
    print("per optimizer update, rank 0 (calls, bytes); 3 FSDP2 units, 2 micro-batches per rank;")
    print("host reads include count_fn's int() of each micro-batch (2), the step's own are the rest")
    for layout, row in results[0].items():
        print(f"\n{layout}")
        for key, value in row.items():
            print(f"  {key:<50} {value}")


if __name__ == "__main__":
    main()
