"""Micro-batches by a token budget against fixed micro-batches, at the same global batch and budget.

Two workloads: the bundled tiny GPT (rows of 4..32 characters, uniform) and an ``hf:`` workload, a
2-layer Llama built here from a config (no download) on documents of skewed lengths (8..512 words,
median ~51; one word is one token). For each, the same windows are stepped by
``gradaccum.Accumulator`` in two arms:

* fixed: ``budget // longest`` rows per micro-batch (the most that fit the budget at the longest
  length), in the order drawn, each trimmed to its own longest row;
* tokens: ``gradaccum.split_by_tokens(window, budget)``.

Printed per workload: padding (of the computed token positions), micro-batches per window, valid
tokens/s of each arm and their ratio (paired: both arms step the same window in each round, the
order alternating), and the largest difference of the two arms' parameters after one float64
update (the split does not change the update). Then the straggler time on 2 ranks: two processes,
each stepping its own micro-batches of the same windows (rank r's shard of fixed micro-batches, or
rank r's of ``split_by_tokens(..., rank=r, world=2)``) on one thread, started together at a barrier;
the straggler time is the slower rank's time minus the faster's, which is what the faster one
waits at DDP's synchronizing backward. No process group is made, so nothing but the work is timed.

    .venv/bin/python benchmarks/tokens.py [--rounds 6] [--threads 1] [--workloads gpt,hf]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import gradaccum
from gradaccum.batch import batch_size, split, take, trim_length
from gradaccum.examples import tiny_gpt
from gradaccum.tokens.balance import TokenPlan, assign, cut, plan_tokens
from gradaccum.workloads.base import Workload

_VOCABULARY = """the a cat dog sat ran on under mat box far near home away birds fly high low red blue green
old new small big quick slow jumps sleeps eats reads writes sings tree river hill road"""
WORDS = tuple(_VOCABULARY.split())


@dataclass(frozen=True)
class Setting:
    name: str
    global_batch: int
    budget: int
    longest: int
    """The longest row the workload can hold: the fixed arm's rows = budget // longest."""


def hf_folder(root: Path, n_docs: int = 900) -> tuple[str, Workload]:
    """A Llama of width 64 from a config, a word-level tokenizer and a .txt of skewed documents."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    from gradaccum.workloads.hf import hf_workload
    from gradaccum.workloads.spec import HFSpec

    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", pad_token="[PAD]")
    tokenizer.save_pretrained(root)
    LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    ).save_pretrained(root)
    rng = random.Random(0)
    lines = []
    for _ in range(n_docs):
        words = min(512, max(8, round(math.exp(rng.gauss(math.log(51), 1.0)))))
        lines.append(" ".join(rng.choice(WORDS) for _ in range(words)))
    data = root / "skewed.txt"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    spec = HFSpec(model_dir=str(root), data=str(data), seq_len=512)
    return spec.to_spec(), hf_workload(spec, batch_size=256)


def _marks(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if "attention_mask" in batch:
        return batch["attention_mask"] != 0
    return batch["labels"] != -100


def _trimmed(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    positions = torch.arange(1, _marks(batch).shape[1] + 1)
    return trim_length(batch, int((positions * _marks(batch)).amax()))


def arm(batch: Any, setting: Setting, name: str, rank: int = 0, world: int = 1) -> list[Any]:
    """This rank's micro-batches of the window ``batch`` in arm ``name``."""
    if name == "tokens":
        return gradaccum.split_by_tokens(batch, setting.budget, rank=rank, world=world)
    rows = batch_size(batch) // world
    mine = take(batch, rank * rows, (rank + 1) * rows)
    return [_trimmed(mb) for mb in split(mine, micro_batch=setting.budget // setting.longest)]


def shape(micro_batches: list[Any]) -> tuple[int, int]:
    """(valid tokens, computed token positions)."""
    valid = sum(int(_marks(mb).sum()) for mb in micro_batches)
    return valid, sum(mb["input_ids"].numel() for mb in micro_batches)


def stepper(workload: Workload, dtype: torch.dtype = torch.float32) -> Callable[[list[Any]], object]:
    model = workload.build_model().to(dtype)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    return lambda window: acc.step(window, workload.loss_fn, workload.count_fn)


def same_update(workload: Workload, batch: Any, setting: Setting) -> float:
    """The largest parameter difference between the two arms after one float64 update."""
    params = []
    for name in ("fixed", "tokens"):
        model = workload.build_model().double()
        acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
        acc.step(arm(batch, setting, name), workload.loss_fn, workload.count_fn)
        params.append([p.detach().clone() for p in model.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*params, strict=True))


def throughput(workload: Workload, setting: Setting, rounds: int) -> None:
    steps = {name: stepper(workload) for name in ("fixed", "tokens")}
    took: dict[str, list[float]] = {"fixed": [], "tokens": []}
    shapes: dict[str, list[tuple[int, int, int]]] = {"fixed": [], "tokens": []}
    batches = [workload.make_batch(setting.global_batch, seed) for seed in range(1, rounds + 2)]
    for r, batch in enumerate(batches):
        order = ("fixed", "tokens") if r % 2 else ("tokens", "fixed")
        for name in order:
            window = arm(batch, setting, name)
            start = time.perf_counter()
            steps[name](window)
            if r:  # the first round warms up
                took[name].append(time.perf_counter() - start)
                shapes[name].append((*shape(window), len(window)))
    print(f"\n{setting.name}: global batch {setting.global_batch} rows, budget {setting.budget} tokens")
    print(f"  {'arm':<7}{'padding':>9}{'micro-batches':>15}{'valid tok/s':>13}")
    rates = {}
    for name in ("fixed", "tokens"):
        valid = sum(s[0] for s in shapes[name])
        computed = sum(s[1] for s in shapes[name])
        rates[name] = [s[0] / t for s, t in zip(shapes[name], took[name], strict=True)]
        count = statistics.mean(s[2] for s in shapes[name])
        print(
            f"  {name:<7}{1 - valid / computed:>9.1%}{count:>15.1f}{statistics.median(rates[name]):>13,.0f}"
        )
    ratio = statistics.median(t / f for t, f in zip(rates["tokens"], rates["fixed"], strict=True))
    print(f"  tokens / fixed throughput (median of {rounds} paired windows): {ratio:.2f}x")
    diff = same_update(workload, batches[0], setting)
    print(f"  same update (float64, one step): max |fixed - tokens| = {diff:.1e}")


def _rank(rank: int, spec: str, setting: Setting, rounds: int, barrier: Any, queue: Any) -> None:
    torch.set_num_threads(1)
    workload = _load(spec)
    steps = {name: stepper(workload) for name in ("fixed", "tokens")}
    out: dict[str, list[tuple[float, int]]] = {"fixed": [], "tokens": []}
    for r in range(rounds + 1):
        batch = workload.make_batch(setting.global_batch, r + 1)
        for name in ("fixed", "tokens") if r % 2 else ("tokens", "fixed"):
            window = arm(batch, setting, name, rank, 2)
            barrier.wait()
            start = time.perf_counter()
            steps[name](window)
            if r:
                out[name].append((time.perf_counter() - start, shape(window)[0]))
    queue.put((rank, out))


def straggler(spec: str, setting: Setting, rounds: int) -> None:
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, spec, setting, rounds, barrier, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    print(f"  2 ranks, one thread each ({rounds} windows): slowest rank minus fastest, per window")
    for name in ("fixed", "tokens"):
        pairs = list(zip(results[0][name], results[1][name], strict=True))
        gap = [abs(a[0] - b[0]) * 1e3 for a, b in pairs]
        slow = [max(a[0], b[0]) * 1e3 for a, b in pairs]
        tokens = [abs(a[1] - b[1]) / ((a[1] + b[1]) / 2) for a, b in pairs]
        print(
            f"  {name:<7} straggler {statistics.median(gap):7.1f} ms of a {statistics.median(slow):7.1f} ms "
            f"window; ranks' valid tokens differ by {statistics.mean(tokens):.1%}"
        )


def _load(spec: str) -> Workload:
    if spec == "gpt":
        return tiny_gpt()
    from gradaccum.workloads.hf import hf_workload
    from gradaccum.workloads.spec import HFSpec

    return hf_workload(HFSpec.parse(spec), batch_size=256)


def issue_window() -> None:
    """The plan alone on 256 log-normal lengths (median 51, 8..512), budget 2,048, 4 ranks."""
    g = torch.Generator().manual_seed(1)
    draws = torch.exp(torch.randn(256, generator=g) + math.log(51.0)).round().clamp(8, 512)
    lengths = [int(n) for n in draws.tolist()]
    fewest = -(-sum(lengths) // 2048)
    total = sum(lengths)
    print(f"\n256 skewed lengths, {total:,} valid tokens, budget 2048 (>= {fewest} micro-batches), 4 ranks")
    computed = sum(4 * max(lengths[i : i + 4]) for i in range(0, 256, 4))
    name = "fixed, 4 rows each, dataset order"
    print(f"  {name:<40}{64:>4} micro-batches, padding {1 - total / computed:6.1%}")
    micro_batches = cut(lengths, 2048)
    sets = assign([sum(lengths[i] for i in mb) for mb in micro_batches], 4)
    kk = TokenPlan(
        ranks=tuple(tuple(tuple(micro_batches[m]) for m in s) for s in sets),
        lengths=tuple(lengths),
        valid=tuple(lengths),
        max_tokens=2048,
    )
    rows = {
        "sorted cut + largest differencing only": kk,
        "split_by_tokens": plan_tokens(lengths, 2048, world=4),
        "split_by_tokens(equal_count=True)": plan_tokens(lengths, 2048, world=4, equal_count=True),
    }
    for name, plan in rows.items():
        counts = "/".join(str(len(r)) for r in plan.ranks)
        print(
            f"  {name:<40}{plan.micro_batches:>4} micro-batches ({counts}), padding "
            f"{plan.padding_fraction:6.1%}, ranks' valid tokens within {plan.imbalance:.1%} of their mean"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workloads", default="gpt,hf")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} measured windows per arm")
    chosen = args.workloads.split(",")
    issue_window()
    if "gpt" in chosen:
        gpt = Setting("bundled tiny GPT (rows of 4..32 tokens)", 64, 256, 32)
        throughput(tiny_gpt(), gpt, args.rounds)
        straggler("gpt", gpt, args.rounds)
    if "hf" in chosen:
        with tempfile.TemporaryDirectory() as root:
            spec, workload = hf_folder(Path(root))
            hf = Setting("hf: Llama 2x64 on skewed documents (8..512 tokens)", 256, 2048, 512)
            throughput(workload, hf, args.rounds)
            straggler(spec, hf, args.rounds)


if __name__ == "__main__":
    main()
