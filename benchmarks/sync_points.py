"""Small collectives and host reads per optimizer update: one process, two-process DDP, the cache.

Counted with ``gradaccum.distributed.comm.count_sync_points`` around ``step`` alone, after two
warm-up updates: every ``torch.distributed`` collective issued from Python (DDP's gradient
all-reduces run inside its C++ reducer and are not counted) and every read of a tensor's value on
the host (``item``, ``tolist``, ``bool``/``float``/``int`` of a tensor), each a point where the CPU
waits for the device. Also timed: what turning the agreement off saves per update.

    .venv/bin/python benchmarks/sync_points.py [--updates 20]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum import AccumConfig, Accumulator, CachedAccumulator, split
from gradaccum.distributed.comm import count_sync_points
from gradaccum.examples import build_tiny_gpt, contrastive, gpt_loss
from gradaccum.examples.gpt import sample_sequences
from gradaccum.loss import count_tokens

count = count_tokens("labels", shift=False)


def _window(rank: int, world: int) -> list[Any]:
    batch = sample_sequences(8, seed=1, max_len=24, min_len=12)
    per = 8 // world
    local = {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}
    return split(local, micro_batch=1)


def _measure(step: Any, updates: int) -> tuple[float, float, dict[str, int], float]:
    for _ in range(2):
        step()
    with count_sync_points() as points:
        step()
    times = []
    for _ in range(updates):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    names = {k: v for k, v in points.by_name.items()}
    return points.collectives, points.host_reads, names, statistics.median(times) * 1e3


def _rows(rank: int, world: int, updates: int) -> list[tuple[str, Any]]:
    rows = []
    window = _window(rank, world)
    for label, config in (
        ("agreement on (default)", AccumConfig()),
        ("agreement off", AccumConfig(agree_on_failure=False)),
    ):
        model = build_tiny_gpt(0)
        if world > 1:
            model = DDP(model)
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config)
        rows.append(
            (f"Accumulator, {label}", _measure(lambda acc=acc: acc.step(window, gpt_loss, count), updates))
        )
    # post-scaling, fed an iterator: the count travels in the one meeting before the synchronizing
    # backward; with a fused optimizer the update is decided on the device. The GPT's causal mask is a
    # constant buffer; DDP's default broadcast of it in each window's first forward makes post-scaling
    # meet once more before that forward (a rank with nothing to read must not leave it waiting)
    for label, make_opt, broadcast in (
        ("post, SGD", lambda p: torch.optim.SGD(p, lr=0.1), False),
        ("post, fused AdamW", lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True), False),
        ("post, fused AdamW, buffers bcast", lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True), True),
    ):
        if world == 1 and broadcast:
            continue
        model = build_tiny_gpt(0)
        if world > 1:
            model = DDP(model, broadcast_buffers=broadcast)
        acc = Accumulator(model, make_opt(model.parameters()), scaling="post")
        rows.append((label, _measure(lambda acc=acc: acc.step(iter(window), gpt_loss, count), updates)))
    work = contrastive()
    model = work.build_model()
    if world > 1:
        model = DDP(model)
    cached = CachedAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    pairs = work.make_batch(8, 3)
    per = 8 // world
    local = (
        tuple(t[rank * per : (rank + 1) * per] for t in pairs)
        if isinstance(pairs, tuple)
        else {k: v[rank * per : (rank + 1) * per] for k, v in pairs.items()}
    )
    encode, rep_loss = work.extras["encode_fn"], work.extras["rep_loss_fn"]
    cwindow = split(local, micro_batch=2)
    rows.append(
        (
            "CachedAccumulator",
            _measure(lambda: cached.step(cwindow, encode, lambda r: rep_loss(r) / 8), updates),
        )
    )
    return rows


def _rank(rank: int, world: int, port: int, updates: int, queue: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = _rows(rank, world, updates)
        if rank == 0:
            queue.put(rows)
    finally:
        dist.destroy_process_group()


def _print(title: str, rows: list[tuple[str, Any]]) -> None:
    print(title)
    for label, (collectives, reads, names, ms) in rows:
        detail = ", ".join(f"{k} {v}" for k, v in sorted(names.items()))
        print(f"  {label:34s} collectives {collectives}  host reads {reads}  ({detail}); {ms:.2f} ms/update")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _print("one process", _rows(0, 1, args.updates))
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args.updates, queue)) for r in range(2)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    _print("two-process DDP (gloo), rank 0", rows)


if __name__ == "__main__":
    main()
