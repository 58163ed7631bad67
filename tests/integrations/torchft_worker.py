"""One torchft replica group of tests/integrations/test_torchft.py: ``python torchft_worker.py OUT STEPS``.

It reads torchft's environment (``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID``), starts the group's own
store on 127.0.0.1, builds a float64 model and a ``FaultTolerantAccumulator`` over a Manager, and
steps ``STEPS`` global batches of 12 rows (uneven counts: rows masked out), printing one line per
step (``step S participants W attempts A``) and saving its final parameters to ``OUT/group<G>.pt``.
A test steers the timing (never the arithmetic) by a file ``OUT/control-group<G>``: ``stall S`` makes
the group hang in its first forward of step S (the step's first collective done), where the test kills it;
``hold S`` makes it wait after step S while the file exists, so that a restarted peer can join before
it finishes. The model, data, loss and the one-process reference live here too.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn as nn

GLOBAL_BATCH = 12
MICRO_BATCH = 2
LR = 0.1
MOMENTUM = 0.9


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same float64 model on every group (seed 3) and SGD with momentum (state to heal)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(torch.float64)
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s 12 rows, the same on every group; about one row in four is masked out."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 4, generator=g, dtype=torch.float64)
    y = torch.randn(GLOBAL_BATCH, 2, generator=g, dtype=torch.float64)
    mask = torch.rand(GLOBAL_BATCH, generator=g) > 0.25
    return {"x": x, "y": y, "mask": mask}


def loss_fn(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """Squared error summed over the micro-batch's unmasked rows."""
    err = ((model(mb["x"]) - mb["y"]) ** 2).sum(dim=1)
    return (err * mb["mask"].to(err.dtype)).sum()


def count_fn(mb: dict[str, torch.Tensor]) -> int:
    return int(mb["mask"].sum())


def reference(steps: int) -> list[torch.Tensor]:
    """One process, the whole global batch each step: summed loss / its count, one SGD step."""
    model, optimizer = build()
    for step in range(steps):
        batch = global_batch(step)
        optimizer.zero_grad()
        (loss_fn(model, batch) / max(count_fn(batch), 1)).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _order(control: Path, verb: str) -> int | None:
    """The step of a ``verb S`` line in the control file, or ``None``."""
    try:
        words = control.read_text().split()
    except FileNotFoundError:
        return None
    return int(words[1]) if len(words) == 2 and words[0] == verb else None


def main(out: Path, steps: int) -> None:
    from torch.distributed import TCPStore
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo

    from gradaccum.integrations.torchft import FaultTolerantAccumulator

    group = int(os.environ["REPLICA_GROUP_ID"])
    control = out / f"control-group{group}"
    timeout = timedelta(seconds=10)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        use_async_quorum=False,
        replica_id=f"group{group}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        hostname="127.0.0.1",
        timeout=timeout,
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timeout,
    )
    print("TORCHFT READY", flush=True)  # the Manager is up and heartbeating to the lighthouse
    model, optimizer = build()
    acc = FaultTolerantAccumulator(model, optimizer, manager, micro_batch=MICRO_BATCH)

    def steered_loss(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        if _order(control, "stall") == acc.current_step + 1:
            print(f"stalled in step {acc.current_step + 1}", flush=True)
            time.sleep(120)  # killed here
        return loss_fn(model, mb)

    try:
        while acc.current_step < steps:
            result = acc.step(global_batch, steered_loss, count_fn)
            line = f"step {result.step} participants {acc.participants} attempts {acc.attempts}"
            counts = f"count {result.local_count}/{result.global_count} micro-batches {result.micro_batches}"
            print(f"{line} {counts}", flush=True)
            deadline = time.monotonic() + 60
            while _order(control, "hold") == result.step and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        manager.shutdown(wait=False)
    torch.save([p.detach() for p in model.parameters()], out / f"group{group}.pt")
    print("done", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(Path(sys.argv[1]), int(sys.argv[2]))
    sys.stdout.flush()
    os._exit(0)  # torchft's server threads may outlive main; the result is saved
