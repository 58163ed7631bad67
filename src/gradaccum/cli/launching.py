"""Before and around a measurement: refuse what cannot fit in memory, resolve the device and the
data-parallel size, and launch runs in local worker processes or one per torchrun rank. torch is
imported inside the functions that need it."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gradaccum.cli.console import progress_bar
from gradaccum.cli.heartbeat import progress_stage
from gradaccum.errors import BenchError, PlanError
from gradaccum.plan import BatchPlan

if TYPE_CHECKING:
    from gradaccum.bench.runner import Launch
    from gradaccum.cli.heartbeat import Heartbeat

__all__ = [
    "Launching",
    "available_memory_bytes",
    "finish_launching",
    "make_launching",
    "measuring",
    "refuse_what_cannot_fit",
    "resolve_device",
    "resolve_dp",
    "torchrun_leader",
    "torchrun_world",
]

# -- memory up front -----------------------------------------------------------------------------


def available_memory_bytes(device: str) -> int | None:
    """Memory this machine can still give: free CUDA memory on a GPU, ``MemAvailable`` on a Linux
    host (the CLI reads the machine; core code never does). ``None`` when it cannot tell."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def refuse_what_cannot_fit(
    workload: Any, plans: Sequence[BatchPlan], precision: str, device: str, *, check: bool
) -> None:
    """Estimate each plan from one example of ``workload`` (see :mod:`gradaccum.bench.estimate`) and
    refuse, before any work starts, a plan whose estimate exceeds what the machine has free."""
    from gradaccum.bench.estimate import estimate, probe

    available = available_memory_bytes(device)
    if available is None:
        return
    figures = probe(workload, precision=precision, device=device)
    for plan in plans:
        guess = estimate(figures, plan, check=check)
        if guess.total_bytes > available:
            where = "this GPU has" if device.startswith("cuda") else "this machine has"
            raise PlanError(
                f"plan {plan.label()} ({plan.equation()}) needs {guess.describe()}, but {where} "
                f"{_fmt_bytes(available)} free. Use a smaller --global-batch or micro-batch (activation "
                "checkpointing shrinks the activation term, sharding the persistent one)."
            )


def _fmt_bytes(value: float) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


# -- launching measurements ----------------------------------------------------------------------


def resolve_device(name: str, dp: int) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; refuses what cannot run."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda") and not re.fullmatch(r"cuda:\d+", name):
        raise BenchError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise BenchError(f"--device {name} was asked for but torch sees no CUDA device; use --device cpu")
    if name.startswith("cuda:") and dp > 1:
        raise BenchError(
            f"--device {name} names one GPU but dp={dp} ranks each need their own; use --device cuda "
            "(rank r runs on cuda:LOCAL_RANK)"
        )
    return name


@dataclass(frozen=True)
class Launching:
    """Where runs go: a local process group per run, or one worker per torchrun rank."""

    launch: Launch
    dp: int
    rank: int
    joined: bool

    @property
    def leader(self) -> bool:
        """The rank that prints and writes the run folder."""
        return self.rank == 0


def torchrun_leader() -> bool:
    """Whether this process prints: rank 0 under torchrun, always otherwise."""
    return int(os.environ.get("RANK", "0")) == 0


def torchrun_world() -> int:
    """Ranks launched by torchrun (``WORLD_SIZE``), 1 when not launched by it."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_dp(requested: int | None) -> int:
    world = torchrun_world()
    if world > 1 and requested is not None and requested != world:
        raise PlanError(
            f"--dp {requested} but torchrun launched {world} ranks; under torchrun every rank is a "
            f"data-parallel replica, so --dp must be {world} (or left out)"
        )
    dp = requested if requested is not None else world
    if dp < 1:
        raise PlanError(f"--dp must be a positive integer, got {dp}")
    return dp


def make_launching(dp: int, timeout_s: float) -> Launching:
    """Runs in fresh local worker processes, or under torchrun one worker per launched rank."""
    from gradaccum.bench.runner import TORCHRUN_VARIABLES, run_isolated, run_joined

    # a worker forms its own process group: it must not inherit a launcher's rendezvous settings
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    if torchrun_world() <= 1:
        return Launching(lambda spec, r: run_isolated(spec, r, timeout_s=timeout_s, env=env), dp, 0, False)
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://")  # for coordination only
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    def launch(spec: Any, r: int) -> Any:
        return run_joined(spec, r, master_addr=master, local_rank=local_rank, timeout_s=timeout_s, env=env)

    return Launching(launch, dp, dist.get_rank(), True)


def finish_launching(launching: Launching) -> None:
    """Tear down the coordination group that :func:`make_launching` set up under torchrun."""
    if launching.joined:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def measuring(launching: Launching, *, progress: bool, beat: Heartbeat) -> Iterator[Callable[[Any], None]]:
    """Around the runs of a measurement: one ``on_progress`` callback that draws the progress bar
    (on the leader, with ``progress``) and names each run in ``beat``; afterwards, even on an error,
    :func:`finish_launching`."""
    try:
        with progress_bar(progress and launching.leader) as bar:
            yield progress_stage(beat, bar)
    finally:
        finish_launching(launching)
