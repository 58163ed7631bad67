"""The default step against the hand-written exact loop on a transformers GPT-2 fed tuples.

``step_pair.py`` times the bundled TinyGPT on dict micro-batches whose labels are already aligned
(an unshifted count). This is the path a user of transformers takes: ``GPT2LMHeadModel`` (2
layers, n_embd 64, vocab 128, built from a config), micro-batches as ``(input_ids,
attention_mask, labels)`` tuples with the labels equal to the inputs, ``loss_fn`` the summed
shifted cross-entropy of the model's ``.logits``, ``count_fn = count_tokens(2, shift=True)``,
``Accumulator`` with its defaults. The hand loop is the exact loop an expert writes on the same
tuples: the shifted targets of every micro-batch counted first, one sum, zero_grad once, each
micro-batch's summed loss / N backpropagated, one AdamW step. One process, CPU, k = 4
micro-batches of 2 sequences x 24 tokens, one shared model and optimizer; the two arms alternate
with nothing between them, the order swapped every round; then the same for ``pre by hand`` (the
default step's features written by hand on the same tuples, no engine: its floor). Each run prints
the median paired ratio and difference over its rounds; the last line gives the median over runs
and their spread.

    .venv/bin/python benchmarks/step_pair_gpt2.py [--runs 3] [--rounds 80] [--threads 1]
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from options import parse_counts
from paired import each_against

from gradaccum import Accumulator
from gradaccum.loss import count_tokens, summed_cross_entropy

VOCAB, K, ROWS, LENGTH = 128, 4, 2, 24
Tuple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def build_gpt2(seed: int) -> torch.nn.Module:
    """GPT-2 of 2 layers, 64 channels, vocab 128, from a config (nothing downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def window_of_tuples(seed: int) -> list[Tuple]:
    """k micro-batches of (input_ids, attention_mask, labels), rows right-padded to 24 tokens,
    the labels the inputs with padding at the ignore index."""
    gen = torch.Generator().manual_seed(seed)
    window = []
    for _ in range(K):
        ids = torch.randint(1, VOCAB, (ROWS, LENGTH), generator=gen)
        lengths = torch.randint(LENGTH // 2, LENGTH + 1, (ROWS, 1), generator=gen)
        mask = (torch.arange(LENGTH) < lengths).long()
        labels = ids.masked_fill(mask == 0, -100)
        window.append((ids * mask, mask, labels))
    return window


def loss_fn(model: torch.nn.Module, mb: Tuple) -> torch.Tensor:
    ids, mask, labels = mb
    return summed_cross_entropy(model(input_ids=ids, attention_mask=mask).logits, labels, shift=True)


def hand_loop(model: torch.nn.Module, opt: torch.optim.Optimizer, window: list[Tuple]) -> None:
    """The exact loop by hand: N over the shifted targets first, zero once, summed loss / N, step."""
    n = torch.stack([(labels[:, 1:] != -100).sum() for _, _, labels in window]).sum()
    opt.zero_grad(set_to_none=True)
    for ids, mask, labels in window:
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
        )
        (loss / n).backward()
    opt.step()


def pre_by_hand(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[list[Tuple]], None]:
    """The default step's features written by hand on the same tuples, no engine (its floor): the
    counts read on the host (a negative one refused), W/N handed to autograd as each loss's
    gradient, each summed loss kept for the report, GradScaler's fused non-finite check, one host
    read, and the step only when everything is finite."""
    params = list(model.parameters())
    one = torch.ones(1)

    def run(window: list[Tuple]) -> None:
        counts = torch.stack([(labels[:, 1:] != -100).sum() for _, _, labels in window]).tolist()
        if min(counts) < 0:
            raise ValueError("a negative count")
        n = sum(counts)
        opt.zero_grad(set_to_none=True)
        scale = torch.full((), 1.0 / max(n, 1), dtype=torch.float32)
        losses = []
        for ids, mask, labels in window:
            logits = model(input_ids=ids, attention_mask=mask).logits
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, VOCAB),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
                reduction="sum",
            )
            losses.append(loss.detach())
            torch.autograd.backward(loss, scale)
        found = torch.zeros(())
        torch._amp_foreach_non_finite_check_and_unscale_(
            [p.grad for p in params if p.grad is not None], found, one
        )
        *summed, flag = torch.stack([*losses, found]).tolist()
        if math.isfinite(math.fsum(summed)) and n and not flag:
            opt.step()

    return run


def one_run(rounds: int) -> dict[str, tuple[float, float, float]]:
    """Per arm: (median ratio, median difference in us, the hand loop's median in ms), each arm
    timed against the hand loop in a pair of its own."""
    model = build_gpt2(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = Accumulator(model, opt)
    window = window_of_tuples(1)
    count_fn = count_tokens(2, shift=True)
    floor = pre_by_hand(model, opt)
    arms: dict[str, Callable[[], object]] = {
        "gradaccum": lambda: acc.step(window, loss_fn, count_fn),
        "pre by hand": lambda: floor(window),
    }
    return each_against(lambda: hand_loop(model, opt, window), arms, rounds)


def main() -> None:
    args = parse_counts(__doc__, runs=3, rounds=80)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {args.runs} runs of {args.rounds} rounds, "
        f"GPT-2 k={K} x {ROWS}x{LENGTH} tuples"
    )
    runs = []
    for r in range(args.runs):
        got = one_run(args.rounds)
        runs.append(got)
        cells = "   ".join(
            f"{name} {ratio:.4f}x ({diff:+.0f} us; hand {hand_ms:.2f} ms)"
            for name, (ratio, diff, hand_ms) in got.items()
        )
        print(f"run {r + 1}: {cells}")
    cells = []
    for name in runs[0]:
        ratios = [run[name][0] for run in runs]
        cells.append(f"{name} {statistics.median(ratios):.4f}x ({min(ratios):.4f}..{max(ratios):.4f})")
    print("median over runs: " + "   ".join(cells))


if __name__ == "__main__":
    main()
