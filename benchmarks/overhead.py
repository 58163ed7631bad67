"""Overhead of ``Accumulator.step`` against a minimal hand-written exact loop, and of the peers' loops.

One process, CPU, the bundled tiny GPT (AdamW), at three sizes: k=4 micro-batches of 2 sequences x
24 tokens, k=4 of 8 x 64, and k=64 micro-batches of one 24-token sequence (the per-micro-batch cost
of the loop must not grow with k). Each round times every implementation once, back to back, in an
order that rotates from round to round, and takes each one's ratio to the hand loop of the *same*
round (a paired ratio: a load spike hits both sides of a pair alike); gradaccum's arms and the
hand loops step one shared model and optimizer, so only the code around the update differs. A
run's figure is the median paired ratio over its rounds; the table shows the median over runs and
their spread (min..max).
Target: ``Accumulator`` <= 1.02x at every size with the non-finite check on; ``scaling="post"``
<= 1.01x at 2x24; the default step <= 1.01x at 2x24. The "pre by hand" and "post by hand" rows
are the two steps' features written by hand with no engine around them: those rows' floors on
the machine that runs it.

Where accelerate and lightning are installed, ``Accelerator.accumulate()`` (its documented loop,
mean loss / k) and Fabric's ``no_backward_sync`` loop are timed in the same rounds.

    .venv/bin/python benchmarks/overhead.py [--runs 5] [--rounds 30] [--sizes 3] [--threads 1]

``--sizes 1`` times the first size only (k=4 x 2x24, the row the fixed cost shows in).
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable
from typing import Any

import torch
from options import parse_counts
from paired import paired_ratios

from gradaccum import Accumulator, split
from gradaccum.examples import build_tiny_gpt, gpt_loss
from gradaccum.examples.gpt import sample_sequences
from gradaccum.loss import count_tokens, summed_cross_entropy

count = count_tokens("labels", shift=False)
SIZES = ((4, 2, 24), (4, 8, 64), (64, 1, 24))
"""(k micro-batches, sequences per micro-batch, tokens per sequence)."""


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def hand_loop(model: torch.nn.Module, opt: torch.optim.Optimizer, window: list[Any]) -> None:
    """The minimal exact loop a careful user writes by hand: count, zero once, sum/N, step."""
    n = torch.stack([count(mb) for mb in window]).sum()
    opt.zero_grad(set_to_none=True)
    for mb in window:
        (gpt_loss(model, mb) / n).backward()
    opt.step()


def post_by_hand(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[list[Any]], None]:
    """Post-scaling's features written by hand for this one case (one process, tensor counts,
    AdamW): each micro-batch backpropagates c * its summed loss, c a power of two from the last
    window's N; then one multiply by 1/(N c), GradScaler's fused non-finite check, one host read of
    the summed loss, N and the flag, and the step only when they are finite. What the "post" row
    would cost with no engine around it: the floor of that row on this machine."""
    params = list(model.parameters())
    one = torch.ones(1)
    last_n = [0.0]

    def run(window: list[Any]) -> None:
        opt.zero_grad(set_to_none=True)
        c = 2.0 ** -round(math.log2(max(1.0, last_n[0]))) if last_n[0] else 1.0
        scale = torch.tensor(c)
        counts, losses = [], []
        for mb in window:
            counts.append(count(mb))
            loss = gpt_loss(model, mb)
            losses.append(loss.detach())
            (loss * scale).backward()
        n = torch.stack(counts).sum(dtype=torch.float64)
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, torch.reciprocal(n.clamp(min=1)).mul_(1 / c).float())
        found = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
        total = torch.stack(losses).sum(dtype=torch.float64)
        loss_sum, n_host, flag = torch.stack([total, n, found[0]]).tolist()
        last_n[0] = n_host
        if math.isfinite(loss_sum) and n_host and not flag:
            opt.step()

    return run


def _mean_loss(model: torch.nn.Module, mb: Any) -> torch.Tensor:
    logits = model(mb["input_ids"])
    return summed_cross_entropy(logits, mb["labels"], shift=False) / count(mb)


def _peers(window: list[Any]) -> dict[str, Callable[[], object]]:
    """Accelerate's and Fabric's documented accumulation loops, where they are installed."""
    runners: dict[str, Callable[[], object]] = {}
    k = len(window)
    with contextlib.suppress(ImportError):
        from accelerate import Accelerator

        accelerator = Accelerator(gradient_accumulation_steps=k, cpu=True)
        model = build_tiny_gpt(0)
        model, opt = accelerator.prepare(model, _optimizer(model))

        def accelerate_loop() -> None:
            for mb in window:
                with accelerator.accumulate(model):
                    accelerator.backward(_mean_loss(model, mb))
                    opt.step()
                    opt.zero_grad()

        runners["accelerate"] = accelerate_loop
    with contextlib.suppress(ImportError):
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=1)
        model = build_tiny_gpt(0)
        fmodel, fopt = fabric.setup(model, _optimizer(model))

        def fabric_loop() -> None:
            for i, mb in enumerate(window):
                last = i == k - 1
                with fabric.no_backward_sync(fmodel, enabled=not last):
                    fabric.backward(_mean_loss(fmodel, mb) / k)
            fopt.step()
            fopt.zero_grad()

        runners["fabric"] = fabric_loop
    return runners


def pre_by_hand(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[list[Any]], None]:
    """Pre-scaling's default features written by hand for this one case (one process, CPU tensor
    counts): the counts read on the host (a negative one is refused), W/N in float64 filled once in
    the loss's dtype and handed to autograd as each loss's gradient (the same bits as backpropagating
    the product), each micro-batch's summed loss kept for the report, GradScaler's fused non-finite
    check, one host read, and the step only when everything is finite. What the "gradaccum" row
    would cost with no engine around it: that row's floor on this machine."""
    params = list(model.parameters())
    one = torch.ones(1)

    def run(window: list[Any]) -> None:
        counts = torch.stack([count(mb) for mb in window]).tolist()
        if min(counts) < 0:
            raise ValueError("a negative count")
        n = sum(counts)
        opt.zero_grad(set_to_none=True)
        scale = torch.full((), 1.0 / max(n, 1), dtype=torch.float32)
        losses = []
        for mb in window:
            loss = gpt_loss(model, mb)
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


def _runners(window: list[Any]) -> dict[str, Callable[[], object]]:
    """Every gradaccum arm and both hand loops step one model with one optimizer, so that they
    differ in the code around the update only: with a model each, the A/A pair of two identical
    hand loops drifted 1-2 % apart from run to run (where each model's tensors happened to lie in
    memory), as much as the differences measured here."""
    runners: dict[str, Callable[[], object]] = {}
    model = build_tiny_gpt(0)
    opt = _optimizer(model)
    runners["hand"] = lambda: hand_loop(model, opt, window)
    runners["hand copy"] = lambda: hand_loop(model, opt, window)  # the noise floor
    for name, kwargs in (
        ("gradaccum", {}),
        ("no check", {"skip_nonfinite": False}),
        ("post", {"scaling": "post"}),
    ):
        acc = Accumulator(model, opt, **kwargs)
        runners[name] = lambda acc=acc: acc.step(window, gpt_loss, count)
    # post-scaling fed an iterator (it reads one micro-batch ahead)
    acc = Accumulator(model, opt, scaling="post")
    runners["post iter"] = lambda acc=acc: acc.step(iter(window), gpt_loss, count)
    pre_floor, post_floor = pre_by_hand(model, opt), post_by_hand(model, opt)
    runners["pre by hand"] = lambda: pre_floor(window)
    runners["post by hand"] = lambda: post_floor(window)
    runners.update(_peers(window))
    return runners


def _fused_runners(window: list[Any]) -> dict[str, Callable[[], object]]:
    """Post-scaling with its decision on the device: fused AdamW against a hand loop with the same."""
    hand = build_tiny_gpt(0)
    hand_opt = torch.optim.AdamW(hand.parameters(), lr=1e-3, fused=True)
    model = build_tiny_gpt(0)
    acc = Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), scaling="post")
    return {
        "hand fused": lambda: hand_loop(hand, hand_opt, window),
        "post fused": lambda: acc.step(window, gpt_loss, count),
    }


def one_run(window: list[Any], rounds: int) -> dict[str, float]:
    """Median over rounds of each implementation's time divided by the same round's hand loop
    (the fused pair: by the same round's fused hand loop)."""
    return {
        **paired_ratios(_runners(window), "hand", rounds),
        **paired_ratios(_fused_runners(window), "hand fused", rounds),
    }


def main() -> None:
    args = parse_counts(__doc__, runs=5, rounds=30, sizes=len(SIZES))
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {args.runs} runs of {args.rounds} "
        "rounds; paired ratio to the hand-written exact loop, median over runs (min..max)"
    )
    print(
        "gradaccum = Accumulator as shipped (non-finite check on); no check = skip_nonfinite=False; "
        "hand copy = a second hand loop (what an A/A pair measures); post = scaling='post' on the "
        "list, post iter = on iter(window); post by hand = post-scaling's features written by hand "
        "(no engine: the post row's floor), pre by hand likewise for the gradaccum row; "
        "post fused = scaling='post' with AdamW(fused=True) "
        "(the update decided on the device), paired with a hand loop with the same fused AdamW"
    )
    for k, micro, seq_len in SIZES[: max(1, args.sizes)]:
        batch = sample_sequences(micro * k, seed=0, max_len=seq_len, min_len=seq_len // 2)
        window = split(batch, micro_batch=micro)
        runs = [one_run(window, args.rounds) for _ in range(args.runs)]
        cells = []
        for name in runs[0]:
            values = sorted(r[name] for r in runs)
            cells.append(f"{name} {statistics.median(values):.3f}x ({values[0]:.3f}..{values[-1]:.3f})")
        print(f"k={k:>2} x {micro}x{seq_len} tokens: " + "   ".join(cells))


if __name__ == "__main__":
    main()
