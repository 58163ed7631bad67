"""The command line the benchmark scripts share: their own counts, and the torch thread count."""

from __future__ import annotations

import argparse

import torch


def parse_counts(doc: str, **defaults: int) -> argparse.Namespace:
    """Parse ``--NAME N`` for each of ``defaults`` (``_`` written ``-``) and ``--threads N`` (1), the
    first line of ``doc`` the description; torch then runs on that many threads."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args
