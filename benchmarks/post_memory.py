"""What a window holds at once: pre-scaling (the window as a list) against post-scaling fed a lazy
iterator, at k = 4, 64 and 1024 micro-batches of the bundled GPT.

Pre-scaling counts every micro-batch before the first backward, so the whole window is alive
during the step: its input bytes grow with k. Post-scaling reads one micro-batch ahead of the one
it runs (none with ``length=``), so what it holds does not depend on k. Measured from the tensors
themselves (any device): every tensor the iterator builds is tracked with ``weakref.finalize``, and
the peak of the bytes alive at once during ``step`` is reported (the activations are freed after
each micro-batch's backward in both modes, so they do not grow with k either). On CUDA the
allocator's peak (``max_memory_allocated``, above the bytes allocated before the step) is printed
beside them.

    .venv/bin/python benchmarks/post_memory.py [--ks 4 64 1024] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from gradaccum import Accumulator
from gradaccum.examples import build_tiny_gpt, gpt_loss
from gradaccum.examples.gpt import sample_sequences
from gradaccum.loss import count_tokens

count = count_tokens("labels", shift=False)
SEQUENCES, TOKENS = 2, 24  # each micro-batch: 2 sequences x 24 tokens


class Alive:
    """Bytes of the tracked tensors alive now, and the most alive at once."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.numel() * tensor.element_size()
        self.now += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(tensor, self._free, size)
        return tensor

    def _free(self, size: int) -> None:
        self.now -= size


def lazy_window(k: int, alive: Alive, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """k micro-batches, each built when asked (as a streaming loader would)."""
    for j in range(k):
        mb = sample_sequences(SEQUENCES, seed=j, max_len=TOKENS, min_len=TOKENS // 2)
        yield {key: alive.track(value.to(device)) for key, value in mb.items()}


def measure(k: int, scaling: str, device: torch.device) -> tuple[int, int | None]:
    """(peak window bytes alive during the step, the CUDA allocator's peak above the start, or None)."""
    model = build_tiny_gpt(0).to(device)
    acc = Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-3), scaling=scaling)
    acc.step(lazy_window(2, Alive(), device), gpt_loss, count)  # optimizer state exists from here on
    alive = Alive()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    window: Any = lazy_window(k, alive, device)
    if scaling == "pre":
        window = list(window)  # what pre-scaling needs in hand
    acc.step(window, gpt_loss, count)
    del window
    if cuda:
        torch.cuda.synchronize()
        return alive.peak, torch.cuda.max_memory_allocated() - start
    return alive.peak, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 64, 1024])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {device}; micro-batches of {SEQUENCES} x {TOKENS} tokens")
    print(
        "peak bytes of the window's micro-batches alive at once during one step "
        "(on CUDA also the allocator's peak)"
    )
    for k in args.ks:
        cells = []
        for scaling in ("pre", "post"):
            window_bytes, allocator = measure(k, scaling, device)
            extra = "" if allocator is None else f", allocator peak {allocator / 2**20:.2f} MiB"
            cells.append(f"{scaling} {window_bytes / 1024:8.1f} KiB{extra}")
        print(f"k={k:>5}: " + "   ".join(cells))


if __name__ == "__main__":
    main()
