"""Run a function on N real ``torch.distributed`` processes (gloo, 127.0.0.1) and collect outcomes.

Each rank's return value or formatted exception comes back to the test; a rank that does not
finish within ``timeout_s`` is killed and reported, so a hang fails the test instead of stalling CI.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

PG_TIMEOUT_S = 30


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    ok: bool
    value: Any = None
    error: str = ""
    error_type: str = ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world: int,
    port: int,
    pg_timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    queue: Any,
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["GRADACCUM_TEST_RANK"] = str(rank)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        value = fn(rank, world, *args)
        # plain pickle copies tensor data; the queue's default reducers would share memory by file
        # descriptor, which breaks once this process exits
        queue.put(pickle.dumps(RankOutcome(rank, True, value)))
    except BaseException as exc:  # report everything, including SystemExit from a CLI
        queue.put(pickle.dumps(RankOutcome(rank, False, None, traceback.format_exc(), type(exc).__name__)))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world: int = 2,
    timeout_s: float = 90,
    pg_timeout_s: float = PG_TIMEOUT_S,
) -> list[RankOutcome]:
    """``fn(rank, world, *args)`` on ``world`` processes; one outcome per rank, in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, pg_timeout_s, fn, args, queue), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, RankOutcome] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout_s
    while len(outcomes) < world and time.monotonic() < deadline:
        try:
            item = pickle.loads(queue.get(timeout=0.5))
            outcomes[item.rank] = item
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    for r in range(world):
        if r not in outcomes:
            code = procs[r].exitcode
            outcomes[r] = RankOutcome(
                r,
                False,
                None,
                f"rank {r} did not finish within {timeout_s}s (exit code {code}): hang or crash",
                "Hang",
            )
    return [outcomes[r] for r in range(world)]


def values(outcomes: list[RankOutcome]) -> list[Any]:
    """Every rank's return value; fails with all ranks' tracebacks if any rank failed."""
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise AssertionError("\n".join(f"--- rank {o.rank} ({o.error_type}) ---\n{o.error}" for o in failed))
    return [o.value for o in outcomes]
