"""Gradient error vs k for bf16 parameters: bf16 ``.grad``, ``accum_dtype="float32"``, a Kahan sum.

A transformers GPT-2 (2 layers, n_embd 64, built from a config) in bfloat16, 256 padded sequences
(so that k = 256 is one sequence per micro-batch), the global batch the same for every k. Each
figure is relL2 of the gradient the optimizer sees against the float64 full-batch gradient on the
same bf16 weights (:func:`gradaccum.check.accumulation.accumulation_errors`, the library's own
step), and its ratio to the k = 1 error. Rows:

- ``bf16 .grad``: ``accum_dtype=None``, torch's default (the sum rounded to bf16 k times);
- ``float32``: ``accum_dtype="float32"`` (the sum in float32, rounded once);
- ``kahan bf16``: written here by hand, not a library mode: each micro-batch's bf16 gradient added
  into a bf16 sum with a bf16 Kahan compensation (also 4 bytes per parameter);
- ``ddp bf16 .grad`` / ``ddp float32``: two gloo ranks, k/2 micro-batches each, same global batch.

Then the cost at k = 16, one process: the step's time with float32 against bf16 ``.grad`` (paired
ratio, median of rounds), the gradient bytes held while accumulating, and the bytes DDP's
synchronizing all-reduce carries per window.

    PYTHONPATH=src .venv/bin/python benchmarks/precision.py [--sequences 256] [--rounds 15]
"""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from paired import paired_ratios
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum import Accumulator, split
from gradaccum.batch import cast, take
from gradaccum.check.accumulation import GradientProbe, accumulation_errors

KS = (1, 4, 16, 64, 256)
VOCAB, LENGTH = 128, 32


def gpt2(seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=LENGTH, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).to(torch.float64)


def sequences(n: int, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, LENGTH + 1, (n,), generator=gen)
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=gen)
    mask = torch.arange(LENGTH)[None] < lengths[:, None]
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": ids.masked_fill(~mask, -100)}


def loss_fn(model: torch.nn.Module, mb: dict[str, Any]) -> torch.Tensor:
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits[:, :-1]
    logits = logits.float() if logits.dtype == torch.bfloat16 else logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), mb["labels"][:, 1:].reshape(-1), reduction="sum")


def count_fn(mb: dict[str, Any]) -> torch.Tensor:
    return (mb["labels"][:, 1:] != -100).sum()


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1).double() for g in grads])


def reference(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    wide = copy.deepcopy(model).to(torch.float64)
    (loss_fn(wide, batch) / count_fn(batch)).backward()
    return _flat([p.grad for p in wide.parameters()])


def kahan_error(low: torch.nn.Module, batch: dict[str, Any], k: int, full: torch.Tensor) -> float:
    """Kahan-compensated bf16 accumulation, by hand: sum and compensation both bf16."""
    params = list(low.parameters())
    n = count_fn(batch).double()
    total = [torch.zeros_like(p) for p in params]
    carry = [torch.zeros_like(p) for p in params]
    for mb in split(batch, batch["input_ids"].shape[0] // k):
        loss = loss_fn(low, mb)
        grads = torch.autograd.grad(loss * (1.0 / n).to(loss.dtype), params)
        for s, c, g in zip(total, carry, grads, strict=True):
            y = g - c
            t = s + y
            c.copy_((t - s) - y)
            s.copy_(t)
    return float(torch.linalg.vector_norm(_flat(total) - full) / torch.linalg.vector_norm(full))


def _rank(rank: int, world: int, port: int, n: int, out: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    batch = cast(take(sequences(n), rank * n // world, (rank + 1) * n // world), torch.bfloat16)
    rows: dict[tuple[str | None, int], Any] = {}
    for accum_dtype in (None, "float32"):
        for k in KS[1:]:
            ddp = DDP(gpt2().to(torch.bfloat16))
            probe = GradientProbe(ddp.parameters())
            acc = Accumulator(ddp, probe, accum_dtype=accum_dtype)
            acc.step(split(batch, n // k), loss_fn, count_fn)
            wide = acc._engine.update.wide
            # plain lists: a tensor would travel as a shared-memory handle this process closes
            rows[(accum_dtype, k)] = (
                _flat(probe.seen).tolist(),
                None if wide is None else wide.reduced_bytes,
            )
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def ddp_rows(n: int) -> dict[tuple[str | None, int], Any]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, n, out)) for r in range(2)]
    for p in procs:
        p.start()
    rows = out.get(timeout=1800)
    for p in procs:
        p.join()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    n = args.sequences
    batch, model = sequences(n), gpt2()
    low = model.to(torch.bfloat16)
    full = reference(low, batch)
    found = accumulation_errors(low, batch, loss_fn, count_fn, accum_steps=KS)
    errors = {(r.accum_dtype, r.accum_steps): r.rel_l2 for r in found}
    kahan = {k: kahan_error(copy.deepcopy(low), cast(batch, torch.bfloat16), k, full) for k in KS}
    ddp = ddp_rows(n)

    def rel(values: list[float]) -> float:
        flat = torch.tensor(values, dtype=torch.float64)
        return float(torch.linalg.vector_norm(flat - full) / torch.linalg.vector_norm(full))

    base = errors[(None, 1)]
    rows = {
        "bf16 .grad": [errors[(None, k)] for k in KS],
        "float32": [errors[("float32", k)] for k in KS],
        "kahan bf16": [kahan[k] for k in KS],
        "ddp bf16 .grad": [base] + [rel(ddp[(None, k)][0]) for k in KS[1:]],
        "ddp float32": [base] + [rel(ddp[("float32", k)][0]) for k in KS[1:]],
    }
    print(f"GPT-2 2x64 in bf16, {n} sequences; relL2 vs float64 full batch (x the k=1 error {base:.3g})")
    print("| accumulation | " + " | ".join(f"k={k}" for k in KS) + " |")
    print("|---" * (len(KS) + 1) + "|")
    for name, values in rows.items():
        print(f"| {name} | " + " | ".join(f"{v:.3g} (x{v / base:.2f})" for v in values) + " |")
    print("(ddp: 2 ranks, k/2 micro-batches each; its k=1 column is the one-process k=1 error)")

    # cost at k = 16, one process
    k = 16
    window = split(cast(batch, torch.bfloat16), n // k)
    steps = {}
    for name, accum_dtype in (("bf16 .grad", None), ("float32", "float32")):
        trial = copy.deepcopy(low)
        acc = Accumulator(trial, torch.optim.SGD(trial.parameters(), lr=0.0), accum_dtype=accum_dtype)
        steps[name] = lambda acc=acc: acc.step(window, loss_fn, count_fn)
    ratio = paired_ratios(steps, "bf16 .grad", args.rounds)["float32"]
    params = sum(p.numel() for p in low.parameters())
    sent = {name: ddp[(dt, k)][1] for name, dt in (("bf16", None), ("float32", "float32"))}
    print(f"\ncost at k={k}: step time float32 / bf16 .grad = {ratio:.3f} (median of {args.rounds} rounds)")
    print(f"gradient bytes while accumulating: bf16 .grad {2 * params} B, float32 {4 * params} B "
          f"({params} parameters; the rounding briefly holds both: {6 * params} B)")  # fmt: skip
    print(f"DDP synchronizing all-reduce per window: bf16 {2 * params} B (DDP's own buckets), "
          f"float32 {sent['float32']} B (the hook's)")  # fmt: skip


if __name__ == "__main__":
    main()
