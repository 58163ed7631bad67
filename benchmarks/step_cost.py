"""What the step adds to an update, in microseconds, on a model too small to hide it.

``overhead.py`` shows ratios on the bundled GPT, where the model's own work (~10 ms an update at
k=4 x 2x24 tokens on this CPU) dwarfs the step's and the run-to-run spread (+-5 %) hides a 1 %
difference. Here the model is one linear layer, so each update's time is almost all framework:
the paired difference to the hand-written exact loop *is* the step's fixed cost (counting, the
verdict, the ledger, post-scaling's constant and its one gradient multiply). The "post floor" row
is those same features written by hand (a dozen lines, one process, int counts): what the step
could cost at best, printed beside what it does cost. The script times the
bundled GPT's hand-loop update at overhead.py's smallest size too, and prints the fixed cost as a
ratio to it: the overhead there, without the +-5 % spread of timing two GPT updates. Last, the
same paired differences on that GPT itself (its counts are tensors, so post-scaling's c and
W/(N c) take device ops there), with "post by hand" beside them: overhead.py's floor of its
"post" row.

    .venv/bin/python benchmarks/step_cost.py [--rounds 400] [--threads 1]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from options import parse_counts
from paired import paired_differences

from gradaccum import Accumulator

ARMS: dict[str, dict[str, Any]] = {
    "pre": {},
    "post": {"scaling": "post"},
    "pre, no check": {"skip_nonfinite": False},
    "post, no check": {"scaling": "post", "skip_nonfinite": False},
}


def _model() -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Linear(8, 1)


def _loss(model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((model(mb["x"]) - mb["y"]) ** 2).sum()


def _count(mb: dict[str, torch.Tensor]) -> int:
    return int(mb["y"].shape[0])


def runners(window: list[dict[str, torch.Tensor]]) -> dict[str, Callable[[], object]]:
    hand_model = _model()
    hand_opt = torch.optim.SGD(hand_model.parameters(), lr=1e-3)

    def hand() -> None:
        n = sum(_count(mb) for mb in window)
        hand_opt.zero_grad(set_to_none=True)
        for mb in window:
            (_loss(hand_model, mb) / n).backward()
        hand_opt.step()

    out: dict[str, Callable[[], object]] = {"hand": hand}
    for name, settings in ARMS.items():
        model = _model()
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=1e-3), **settings)
        out[name] = lambda acc=acc: acc.step(window, _loss, _count)
    out["post floor"] = _post_floor(window)
    return out


def _post_floor(window: list[dict[str, torch.Tensor]]) -> Callable[[], None]:
    """Post-scaling's features written by hand, and nothing else: the floor the step could reach
    on one process. Each micro-batch backpropagates c * its summed loss (c a power of two from the
    first count, on the host); then one multiply by 1/(N c), the fused non-finite check, one host
    read of the summed loss and the flag, and the step only when both are finite."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    found_inf, one = torch.zeros(()), torch.ones(())

    def floor() -> None:
        optimizer.zero_grad(set_to_none=True)
        n, losses, c = 0, [], 0.0
        for mb in window:
            n_j = _count(mb)
            n += n_j
            c = c or 2.0 ** -round(math.log2(max(1, n_j * len(window))))
            loss = _loss(model, mb)
            losses.append(loss.detach())
            (loss * c).backward()
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, 1.0 / (n * c))
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, one)
        loss_sum, flag = torch.stack([torch.stack(losses).sum(), found_inf]).tolist()
        if math.isfinite(loss_sum) and flag == 0:
            optimizer.step()

    return floor


def _gpt_hand_update_seconds(rounds: int) -> float:
    """Median time of the hand-written exact loop on the bundled GPT at k=4 x 2x24 tokens (the
    size overhead.py's first row times), for reading the fixed cost as a ratio."""
    import statistics
    import time

    from overhead import _optimizer, hand_loop

    from gradaccum import split
    from gradaccum.examples import build_tiny_gpt
    from gradaccum.examples.gpt import sample_sequences

    window = split(sample_sequences(8, seed=0, max_len=24, min_len=12), micro_batch=2)
    model = build_tiny_gpt(0)
    optimizer = _optimizer(model)
    times = []
    for r in range(rounds + 3):
        start = time.perf_counter()
        hand_loop(model, optimizer, window)
        if r >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gpt_extra_seconds(rounds: int) -> dict[str, float]:
    """The step's extra time over the hand loop on the bundled GPT at k=4 x 2x24 tokens (overhead.py's
    first size; tensor counts, AdamW), paired, beside post-scaling written by hand (the floor of
    the "post" row there: the same updates, bit for bit, with no engine around them)."""
    from overhead import _optimizer, count, hand_loop, post_by_hand

    from gradaccum import split
    from gradaccum.examples import build_tiny_gpt, gpt_loss
    from gradaccum.examples.gpt import sample_sequences

    window = split(sample_sequences(8, seed=0, max_len=24, min_len=12), micro_batch=2)
    hand_model, floor_model = build_tiny_gpt(0), build_tiny_gpt(0)
    hand_opt, floor = _optimizer(hand_model), post_by_hand(floor_model, _optimizer(floor_model))
    runners: dict[str, Callable[[], object]] = {"hand": lambda: hand_loop(hand_model, hand_opt, window)}
    for name, settings in (("pre", {}), ("post", {"scaling": "post"})):
        model = build_tiny_gpt(0)
        acc = Accumulator(model, _optimizer(model), **settings)
        runners[name] = lambda acc=acc: acc.step(window, gpt_loss, count)
    runners["post by hand"] = lambda: floor(window)
    return paired_differences(runners, "hand", rounds)


def main() -> None:
    args = parse_counts(__doc__, rounds=400)
    gen = torch.Generator().manual_seed(0)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} paired rounds; "
        "median extra time per update over the hand-written exact loop (SGD, Linear(8, 1))"
    )
    gpt_update = _gpt_hand_update_seconds(args.rounds // 4)
    print(f"the bundled GPT's hand-loop update at k=4 x 2x24 tokens takes {gpt_update * 1e3:.1f} ms here")
    for k in (4, 64):
        window = [
            {"x": torch.randn(2, 8, generator=gen), "y": torch.randn(2, 1, generator=gen)} for _ in range(k)
        ]
        extra = paired_differences(runners(window), "hand", args.rounds)
        cells = "   ".join(f"{name} +{seconds * 1e6:.0f} us" for name, seconds in extra.items())
        print(f"k={k:>2}: {cells}")
        if k == 4:
            implied = "   ".join(f"{name} {1 + s / gpt_update:.4f}x" for name, s in extra.items())
            print(f"      as a ratio to that GPT update: {implied}")
    gpt = _gpt_extra_seconds(args.rounds // 2)
    cells = "   ".join(f"{name} +{s * 1e6:.0f} us ({1 + s / gpt_update:.4f}x)" for name, s in gpt.items())
    print(f"the GPT at k=4 x 2x24 tokens, over its hand loop: {cells}")


if __name__ == "__main__":
    main()
