"""Exact accumulation across torchft replica groups: one global batch per step, shared by the quorum.

One process per replica group, each under its own ``torchrun``, with a lighthouse running::

    torchft_lighthouse --bind 127.0.0.1:29510 --min_replicas 2 --join_timeout_ms 1000 &
    export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510
    REPLICA_GROUP_ID=0 torchrun --standalone --nproc-per-node 1 docs/examples/torchft_accumulate.py &
    REPLICA_GROUP_ID=1 torchrun --standalone --nproc-per-node 1 docs/examples/torchft_accumulate.py

Each step's 12 rows (a quarter of them masked out, so the groups' shares count unevenly) are cut
among the groups in the quorum; at the end each group checks its parameters against one process
that took every whole batch itself, and exits 1 if they differ by more than float64 regrouping.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.nn as nn
from torchft import Manager
from torchft.process_group import ProcessGroupGloo

from gradaccum.integrations.torchft import FaultTolerantAccumulator

STEPS, ROWS = 6, 12


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same start on every group
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s whole batch, the same rows on every group (here: drawn from the step)."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(ROWS, 4, generator=g).double(), torch.randn(ROWS, 2, generator=g).double()
    return {"x": x, "y": y, "mask": torch.rand(ROWS, generator=g) > 0.25}


def loss_fn(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """The squared error summed over the micro-batch's unmasked rows (a sum, not a mean)."""
    return (((model(mb["x"]) - mb["y"]) ** 2).sum(dim=1) * mb["mask"]).sum()


def count_fn(mb: dict[str, torch.Tensor]) -> int:
    return int(mb["mask"].sum())


def main() -> int:
    group = os.environ["REPLICA_GROUP_ID"]
    manager = Manager(  # the store, rank and world size come from torchrun's environment
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=None,  # FaultTolerantAccumulator registers its own
        state_dict=None,
        min_replica_size=1,
        use_async_quorum=False,
        replica_id=f"group{group}",
        hostname="127.0.0.1",
        timeout=timedelta(seconds=10),
    )
    model, optimizer = build()
    acc = FaultTolerantAccumulator(model, optimizer, manager, micro_batch=2)
    while acc.current_step < STEPS:
        result = acc.step(global_batch, loss_fn, count_fn)
        print(f"group {group} step {result.step}: {acc.participants} groups, "
              f"{result.local_count} of {result.global_count} rows here")  # fmt: skip
    manager.shutdown(wait=False)

    reference, ref_optimizer = build()  # one process, every whole batch
    for step in range(STEPS):
        ref_optimizer.zero_grad()
        batch = global_batch(step)
        (loss_fn(reference, batch) / count_fn(batch)).backward()
        ref_optimizer.step()
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    diff = max(float((p - q).detach().abs().max()) for p, q in pairs)
    print(f"group {group}: max |param - one-process reference| = {diff:.1e}", flush=True)
    return 0 if diff <= 1e-10 else 1  # float64 regrouping: a few ulps per step


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # torchft's server threads would otherwise keep the process alive
