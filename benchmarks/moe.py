"""MoE load balancing: what each mode costs per update, and what it does to a short training run.

Cost: the library's step on a tiny transformers Mixtral (float32, eager experts), one window of k
micro-batches per update, timed side by side in paired rounds (``paired.py``): the step without a
balance (cross-entropy only), then with ``LoadBalance`` in ``micro-batch``, ``lagged`` and ``exact``
mode, each as a ratio to the first. ``exact`` runs a no-grad routing pass over the window before
its forwards, so its ratio is bounded by about 1 + (forward / (forward + backward)).

Quality: the same tiny Mixtral trained from scratch on sequences drawn from a few "topics" (each
topic its own token distribution), the micro-batches of a window each holding one topic, as
sorted or length-grouped data does: the regime where per-micro-batch statistics differ most from
the window's. Three seeds per mode; printed: the held-out cross-entropy (nats per token) and the
expert-load imbalance, the coefficient of variation (std/mean) of each layer's per-expert routed
token counts on the held-out set, averaged over the layers.

    .venv/bin/python benchmarks/moe.py [--rounds 20] [--steps 60] [--threads 1]
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from options import parse_counts
from paired import paired_ratios

from gradaccum import Accumulator
from gradaccum.moe import LoadBalance

MODES = ("micro-batch", "lagged", "exact")
VOCAB, SEQ, ROWS, K, TOPICS = 64, 32, 4, 4, 4
Batch = dict[str, torch.Tensor]


def _model(seed: int, *, layers: int = 2, coef: float = 0.05) -> nn.Module:
    import transformers as tf

    config = tf.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
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
    return F.cross_entropy(logits.reshape(-1, VOCAB), mb["input_ids"][:, 1:].reshape(-1), reduction="sum")


def _tokens(mb: Batch) -> int:
    return int(mb["input_ids"].shape[0]) * (SEQ - 1)


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


def _step_runner(mode: str | None, window: list[Batch]) -> Callable[[], object]:
    model = _model(0)
    balance = None if mode is None else LoadBalance.from_model(model, mode=mode)  # type: ignore[arg-type]
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=1e-4), balance=balance)
    return lambda: acc.step(window, _ce, _tokens)


def cost(rounds: int) -> dict[str, float]:
    window = Topics(0).window()
    runners: dict[str, Callable[[], object]] = {"no balance": _step_runner(None, window)}
    for mode in MODES:
        runners[mode] = _step_runner(mode, window)
    return paired_ratios(runners, "no balance", rounds)


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
        f"torch {torch.__version__}, {args.threads} thread(s); tiny Mixtral (2 layers, 8 experts, top-2, "
        f"width 32), k={K} micro-batches of {ROWS}x{SEQ} tokens"
    )
    ratios = cost(args.rounds)
    cells = "   ".join(f"{mode} {ratio:.2f}x" for mode, ratio in ratios.items())
    print(f"step time over the step without a balance (median of {args.rounds} paired rounds): {cells}")
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
