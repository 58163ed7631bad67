"""Token balance against cost balance on DDP: the ranks' measured window times and the step time.

Every window is a global batch of long-tailed rows (a few of 512..1,024 tokens, many of 16..96),
cut by ``gradaccum.split_by_tokens`` within a token budget on every rank, once balanced by the
ranks' valid tokens (the default) and once by ``cost=transformer_cost(d_model, layers)``; both arms
step the same windows on the same DDP model (gloo, one thread per rank), alternating which goes
first. Each rank's window time runs from a barrier before the step to its last gradient bucket
handed to the all-reduce (the counting comm hook's clock): its own work, before it waits for the
others. Printed per arm: the planned rank-cost imbalance (max / mean by the formula), the measured
straggler (the slowest rank's window time over the ranks' mean, median of the windows), the step
time (the slowest rank's ``Accumulator.step``, median), the micro-batches over both ranks and the
token positions computed (rows x longest row of every micro-batch, padding included; mean). Runs
are repeated in fresh process groups for the spread.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/cost_balance.py --runs 3
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import gradaccum
from gradaccum.distributed.comm import count_allreduces
from gradaccum.examples.gpt import GPTConfig, TinyGPT
from gradaccum.tokens import transformer_cost
from gradaccum.tokens.split import plan_batch

VOCAB, D_MODEL, LAYERS, LONGEST = 64, 64, 2, 1024


def window(seed: int, rows: int, long_rows: int) -> dict[str, torch.Tensor]:
    """One global batch: ``long_rows`` rows of 512..1,024 tokens, the rest of 16..96, right-padded."""
    r = random.Random(seed)
    lengths = [r.randint(512, LONGEST) for _ in range(long_rows)]
    lengths += [r.randint(16, 96) for _ in range(rows - long_rows)]
    r.shuffle(lengths)
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(LONGEST) < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(1, VOCAB, (rows, LONGEST), generator=g) * mask
    return {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask}


def loss_fn(model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    # causal: right padding is seen only by later, unlabelled positions
    logits = model(mb["input_ids"])
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), mb["labels"][:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )


def count_fn(mb: dict[str, torch.Tensor]) -> int:
    return int((mb["labels"][:, 1:] != -100).sum())


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=VOCAB, block_size=LONGEST, n_layer=LAYERS, d_model=D_MODEL)
        model = DistributedDataParallel(TinyGPT(cfg))
        counter = count_allreduces(model)
        acc = gradaccum.Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        cost = transformer_cost(D_MODEL, LAYERS)
        arms: dict[str, Any] = {"tokens": None, "cost": cost}
        out: dict[str, list[tuple[float, float, float, int, int]]] = {name: [] for name in arms}
        for w in range(args.warmup + args.windows):
            batch = window(1000 * args.seed + w, args.rows, args.long_rows)
            order = list(arms) if w % 2 == 0 else list(reversed(arms))
            for name in order:
                mbs = gradaccum.split_by_tokens(
                    batch, args.max_tokens, rank=rank, world=world, cost=arms[name]
                )
                plan = plan_batch(batch, args.max_tokens, world=world, cost=arms[name])
                planned, computed = plan.cost_imbalance(cost), sum(plan.rank_computed_tokens)
                dist.barrier()
                counter.reset()
                start = time.perf_counter()
                acc.step(mbs, loss_fn, count_fn)
                step_ms = (time.perf_counter() - start) * 1e3
                own_ms = (counter.last_call_s - start) * 1e3
                if w >= args.warmup:
                    out[name].append((own_ms, step_ms, planned, len(mbs), computed))
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    figures = {}
    for name in got[0]:
        windows = len(got[0][name])
        stragglers, steps = [], []
        for i in range(windows):
            own = [got[r][name][i][0] for r in range(args.world)]
            stragglers.append(max(own) / statistics.fmean(own))
            steps.append(max(got[r][name][i][1] for r in range(args.world)))
        figures[name] = {
            "planned": statistics.median(got[0][name][i][2] for i in range(windows)),
            "straggler": statistics.median(stragglers),
            "step_ms": statistics.median(steps),
            "micro_batches": statistics.fmean(sum(got[r][name][i][3] for r in got) for i in range(windows)),
            "computed": statistics.fmean(got[0][name][i][4] for i in range(windows)),
        }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--windows", type=int, default=8, help="measured windows per arm and run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rows", type=int, default=32, help="rows per window (global batch)")
    parser.add_argument("--long-rows", type=int, default=2, help="rows of 512..1,024 tokens per window")
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(
        f"torch {torch.__version__}, {args.world} gloo ranks x 1 thread; TinyGPT d_model {D_MODEL}, "
        f"{LAYERS} layers; windows of {args.rows} rows ({args.long_rows} of 512..1024 tokens, the rest "
        f"16..96), max_tokens {args.max_tokens}; {args.windows} measured windows per arm and run, "
        f"arms alternating first"
    )
    print(
        "run  arm     planned cost max/mean  measured straggler max/mean  step ms  micro-batches  positions"
    )
    runs = []
    for run in range(args.runs):
        args.seed = run
        figures = one_run(args)
        runs.append(figures)
        for name, f in figures.items():
            print(
                f"{run:>3}  {name:<6}  {f['planned']:>22.3f}  {f['straggler']:>27.3f}  {f['step_ms']:>7.1f}  "
                f"{f['micro_batches']:>13.1f}  {f['computed']:>9,.0f}"
            )
    print("over runs: median (min..max)")
    for name in runs[0]:
        for key in ("planned", "straggler", "step_ms"):
            values = [r[name][key] for r in runs]
            low, high = min(values), max(values)
            print(f"  {name:<6} {key:<9} {statistics.median(values):8.3f} ({low:.3f}..{high:.3f})")
    ratio = [r["cost"]["step_ms"] / r["tokens"]["step_ms"] for r in runs]
    print(f"  step time cost / tokens, per run: {', '.join(f'{x:.3f}' for x in ratio)}")


if __name__ == "__main__":
    main()
