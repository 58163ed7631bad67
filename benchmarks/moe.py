"""MoE load balancing: what each mode costs per update, and what it does to a short training run.

Cost: the library's step on a transformers Mixtral (float32, eager experts), one window of k
micro-batches per update, timed side by side in paired rounds (``paired.py``): the step without a
balance (cross-entropy only), then with ``LoadBalance`` in ``micro-batch``, ``lagged`` and ``exact``
mode, each as a ratio to the first, and exact and micro-batch mode over lagged mode. Two models:
the tiny one of the quality runs, and one with a realistic vocabulary (32,000 tokens, width 64, 4
layers, 8 experts top-2, k=4 micro-batches of 4x64 tokens), where the LM head and the loss are
most of a forward. ``exact`` runs a no-grad routing pass over the window before its forwards,
each forward ending at the last router, so its cost over lagged mode is about the share of a
forward up to the last router in a forward and backward.

Quality: the same tiny Mixtral trained from scratch on sequences drawn from a few "topics" (each
topic its own token distribution), the micro-batches of a window each holding one topic, as
sorted or length-grouped data does: the regime where per-micro-batch statistics differ most from
the window's. Three seeds per mode; printed: the held-out cross-entropy (nats per token) and the
expert-load imbalance, the coefficient of variation (std/mean) of each layer's per-expert routed
token counts on the held-out set, averaged over the layers.

    .venv/bin/python benchmarks/moe.py [--rounds 20] [--steps 60] [--threads 1]

``--steps 0`` skips the quality runs (the cost tables only).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from options import parse_counts
from paired import paired_times

from gradaccum import Accumulator
from gradaccum.moe import LoadBalance

MODES = ("micro-batch", "lagged", "exact")
VOCAB, SEQ, ROWS, K, TOPICS = 64, 32, 4, 4, 4
LARGE_VOCAB, LARGE_SEQ, LARGE_WIDTH, LARGE_LAYERS = 32_000, 64, 64, 4
"""The realistic-vocabulary Mixtral of the second cost table (k=K micro-batches of ROWS rows)."""
Batch = dict[str, torch.Tensor]


def _model(
    seed: int,
    *,
    layers: int = 2,
    coef: float = 0.05,
    vocab: int = VOCAB,
    width: int = 32,
    seq: int = SEQ,
) -> nn.Module:
    import transformers as tf

    config = tf.MixtralConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        num_local_experts=8,
        num_experts_per_tok=2,
        router_aux_loss_coef=coef,
        experts_implementation="eager",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return tf.MixtralForCausalLM(config)


def _ce(model: nn.Module, mb: Batch) -> torch.Tensor:
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits[:, :-1]
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), mb["input_ids"][:, 1:].reshape(-1), reduction="sum"
    )


def _tokens(mb: Batch) -> int:
    return int(mb["input_ids"].shape[0]) * (int(mb["input_ids"].shape[1]) - 1)


class Topics:
    """Sequences from a few topics: each topic a Markov chain over the vocabulary of its own."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(1000 + seed)
        self.gen = gen
        # each topic favours its own quarter of the vocabulary, with a sharp next-token table
        self.tables = []
        for t in range(TOPICS):
            logits = torch.randn(VOCAB, VOCAB, generator=gen) * 2.0
            own = slice(t * VOCAB // TOPICS, (t + 1) * VOCAB // TOPICS)
            logits[:, own] += 3.0
            self.tables.append(torch.softmax(logits, -1))

    def batch(self, topic: int, rows: int) -> Batch:
        ids = torch.zeros(rows, SEQ, dtype=torch.long)
        ids[:, 0] = torch.randint(0, VOCAB, (rows,), generator=self.gen)
        for pos in range(1, SEQ):
            ids[:, pos] = torch.multinomial(
                self.tables[topic][ids[:, pos - 1]], 1, generator=self.gen
            ).squeeze(1)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def window(self) -> list[Batch]:
        """k micro-batches, each of one topic (a different one each)."""
        order = torch.randperm(TOPICS, generator=self.gen)[:K]
        return [self.batch(int(t), ROWS) for t in order]


def _step_runner(
    mode: str | None, window: list[Batch], build: Callable[[], nn.Module]
) -> Callable[[], object]:
    model = build()
    balance = None if mode is None else LoadBalance.from_model(model, mode=mode)  # type: ignore[arg-type]
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=1e-4), balance=balance)
    return lambda: acc.step(window, _ce, _tokens)


def _large_window() -> list[Batch]:
    """K micro-batches of ROWS x LARGE_SEQ tokens drawn uniformly from the large vocabulary."""
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, LARGE_VOCAB, (ROWS, LARGE_SEQ), generator=gen) for _ in range(K)]
    return [{"input_ids": x, "attention_mask": torch.ones_like(x)} for x in ids]


def cost(rounds: int, *, large: bool) -> dict[str, float]:
    """Each mode's step time over the step without a balance, and exact and micro-batch mode's
    over lagged mode's, medians of ``rounds`` paired rounds (every runner once per round)."""
    if large:
        window = _large_window()

        def build() -> nn.Module:
            return _model(0, layers=LARGE_LAYERS, vocab=LARGE_VOCAB, width=LARGE_WIDTH, seq=LARGE_SEQ)
    else:
        window = Topics(0).window()

        def build() -> nn.Module:
            return _model(0)

    runners: dict[str, Callable[[], object]] = {"no balance": _step_runner(None, window, build)}
    for mode in MODES:
        runners[mode] = _step_runner(mode, window, build)
    took = paired_times(runners, rounds)
    ratios = {mode: statistics.median(t[mode] / t["no balance"] for t in took) for mode in MODES}
    for mode in ("exact", "micro-batch"):
        ratios[f"{mode} / lagged"] = statistics.median(t[mode] / t["lagged"] for t in took)
    return ratios


def _held_out(model: nn.Module, data: list[Batch]) -> tuple[float, float]:
    """Cross-entropy per token, and the mean over layers of the per-expert load's std/mean."""
    gates = [layer.mlp.gate for layer in model.model.layers]
    counts = [torch.zeros(8) for _ in gates]
    handles = []
    for i, gate in enumerate(gates):

        def hook(mod: nn.Module, args: Any, out: Any, i: int = i) -> None:
            chosen = torch.topk(torch.softmax(out[0].float(), -1), 2, -1).indices
            counts[i] += torch.bincount(chosen.reshape(-1), minlength=8).float()

        handles.append(gate.register_forward_hook(hook))
    with torch.no_grad():
        total = sum(float(_ce(model, mb)) for mb in data)
    for handle in handles:
        handle.remove()
    cv = statistics.mean(float(c.std(unbiased=False) / c.mean()) for c in counts)
    return total / sum(_tokens(mb) for mb in data), cv


def quality(mode: str, seed: int, steps: int) -> tuple[float, float]:
    model = _model(seed)
    data = Topics(seed)
    acc = Accumulator(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        balance=LoadBalance.from_model(model, mode=mode),
    )
    for _ in range(steps):
        acc.step(data.window(), _ce, _tokens)
    held_out = [data.batch(t, 8) for t in range(TOPICS)]
    return _held_out(model, held_out)


def main() -> None:
    args = parse_counts(__doc__, rounds=20, steps=60)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), float32; "
        f"step time, medians of {args.rounds} paired rounds"
    )
    for large, label in (
        (
            False,
            f"tiny Mixtral (vocab {VOCAB}, width 32, 2 layers, 8 experts, top-2), "
            f"k={K} x {ROWS}x{SEQ} tokens",
        ),
        (
            True,
            f"Mixtral (vocab {LARGE_VOCAB:,}, width {LARGE_WIDTH}, {LARGE_LAYERS} layers, 8 experts, top-2), "
            f"k={K} x {ROWS}x{LARGE_SEQ} tokens",
        ),
    ):
        ratios = cost(args.rounds, large=large)
        over_none = "   ".join(f"{mode} {ratios[mode]:.3f}x" for mode in MODES)
        over_lagged = "   ".join(f"{m} {ratios[f'{m} / lagged']:.3f}x" for m in ("exact", "micro-batch"))
        print(f"{label}\n  over no balance: {over_none}\n  over lagged:     {over_lagged}")
    if args.steps == 0:
        return
    print(f"quality after {args.steps} updates (AdamW 3e-3, coef 0.05), 3 seeds: held-out CE, load CV")
    for mode in MODES:
        runs = [quality(mode, seed, args.steps) for seed in range(3)]
        ce = [r[0] for r in runs]
        cv = [r[1] for r in runs]
        print(
            f"  {mode:<12} CE {statistics.mean(ce):.4f} (+-{statistics.stdev(ce):.4f})   "
            f"load CV {statistics.mean(cv):.3f} (+-{statistics.stdev(cv):.3f})   "
            f"per seed CE {', '.join(f'{x:.4f}' for x in ce)}; CV {', '.join(f'{x:.3f}' for x in cv)}"
        )


if __name__ == "__main__":
    main()
