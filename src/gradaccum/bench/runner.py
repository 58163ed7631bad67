"""Start the worker processes of one configuration and collect their record.

:func:`run_isolated` starts ``dp`` fresh workers on this host (one per rank, each with its own
process group for this configuration alone). :func:`run_joined` is for a job already launched by
torchrun: each launched rank starts its own worker, and the workers form a new group of the same
size. Either way no configuration shares a process with another, so peaks never leak across them.
A rank that fails (a CUDA OOM, a crash) makes the others wait in a collective; they are killed at
once rather than left to time out.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar, overload

from gradaccum.bench.spec import RESULT_PREFIX, MeasureSpec, PairedRecord, PairedSpec, RunRecord, RunStatus
from gradaccum.distributed import dist

__all__ = ["TORCHRUN_VARIABLES", "Launch", "free_port", "run_isolated", "run_joined"]

Launch = Callable[[Any, int], Any]
"""``launch(spec, run_index)``: measure one run somewhere and return its record: a
:class:`RunRecord` for a :class:`MeasureSpec`, a :class:`PairedRecord` for a :class:`PairedSpec`."""

POLL_S = 0.05
TORCHRUN_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)
"""What torchrun sets for its ranks; a worker forms its own group, so it must not inherit them."""
STOPPED = "the worker was stopped because another rank failed"
# what a rank reports when a peer died under it: a consequence, not the cause (gloo, NCCL)
PEER_FAILED = (
    "Connection closed by peer",
    "Connection reset by peer",
    "caused by a remote worker crashing",
    "remote process exited",
)


def free_port() -> int:
    """A TCP port nothing listens on right now (for a configuration's process group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


Record = TypeVar("Record", RunRecord, PairedRecord, RunRecord | PairedRecord)
Spec = MeasureSpec | PairedSpec


def _rank_device(spec: Spec, local_rank: int) -> str:
    if spec.dp > 1 and spec.device == "cuda":
        return f"cuda:{local_rank}"
    return spec.device


def _job(spec: Spec, run_index: int, rank: int, init_method: str, timeout_s: float, local_rank: int) -> str:
    device = _rank_device(spec, local_rank)
    if isinstance(spec, PairedSpec):
        placed: dict[str, Any] = spec.to_dict()
        for arm in ("baseline", "candidate"):
            placed[arm] = {**placed[arm], "device": device}
        job: dict[str, Any] = {"kind": "paired", "spec": placed, "run_index": run_index}
    else:
        job = {"kind": "measure", "spec": {**spec.to_dict(), "device": device}, "run_index": run_index}
    if spec.dp > 1:
        job.update(
            rank=rank,
            world=spec.dp,
            init_method=init_method,
            backend="nccl" if device.startswith("cuda") else "gloo",
            pg_timeout_s=timeout_s,
        )
    return json.dumps(job)


def _failed(spec: Spec, status: RunStatus, error: str, run_index: int) -> RunRecord | PairedRecord:
    if isinstance(spec, PairedSpec):
        return PairedRecord(spec=spec, status=status, error=error, run_index=run_index)
    return RunRecord(spec=spec, status=status, error=error, run_index=run_index)


def _record_from(
    stdout: str, stderr: str, code: int | None, spec: Spec, run_index: int, *, stopped: bool = False
) -> RunRecord | PairedRecord:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            data = json.loads(line[len(RESULT_PREFIX) :])
            # the worker's record, with the spec as given here and this run's index
            if isinstance(spec, PairedSpec):
                return dataclasses.replace(PairedRecord.from_dict(data), spec=spec, run_index=run_index)
            return dataclasses.replace(RunRecord.from_dict(data), spec=spec, run_index=run_index)
    tail = "\n".join(stderr.strip().splitlines()[-6:])
    why = f"the worker exited with code {code} without a result"
    if stopped:
        why = STOPPED
    elif code is not None and code < 0:
        why += f" (killed by signal {-code}{': likely out of host memory' if code == -9 else ''})"
    return _failed(spec, "failed", f"{why}\n{tail}".strip(), run_index)


def _run_workers(
    spec: Spec,
    run_index: int,
    ranks: list[tuple[int, int]],
    init_method: str,
    timeout_s: float,
    python: str,
    env: Mapping[str, str] | None,
) -> list[RunRecord | PairedRecord]:
    """Start one worker per (rank, local_rank), wait, and return their records in that order."""
    with tempfile.TemporaryDirectory(prefix="gradaccum-worker-") as tmp:
        procs: list[tuple[subprocess.Popen[bytes], Path, Path]] = []
        for rank, local_rank in ranks:
            out, err = Path(tmp, f"out{rank}"), Path(tmp, f"err{rank}")
            with out.open("wb") as out_f, err.open("wb") as err_f:
                proc = subprocess.Popen(
                    [python, "-m", "gradaccum.bench.worker"],
                    stdin=subprocess.PIPE,
                    stdout=out_f,
                    stderr=err_f,
                    env=None if env is None else dict(env),
                )
            assert proc.stdin is not None
            proc.stdin.write(_job(spec, run_index, rank, init_method, timeout_s, local_rank).encode())
            proc.stdin.close()
            procs.append((proc, out, err))
        deadline = time.monotonic() + timeout_s
        timed_out = False
        stopped: set[int] = set()
        while any(p.poll() is None for p, _, _ in procs):
            if any(p.poll() not in (None, 0) for p, _, _ in procs):
                break  # one rank failed: the others would wait for it in a collective forever
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(POLL_S)
        for i, (p, _, _) in enumerate(procs):
            if p.poll() is None:
                p.kill()
                stopped.add(i)
            p.wait()
        records: list[RunRecord | PairedRecord] = []
        for i, (p, out, err) in enumerate(procs):
            stdout = out.read_text(errors="replace")
            stderr = err.read_text(errors="replace")
            record = _record_from(stdout, stderr, p.returncode, spec, run_index, stopped=i in stopped)
            if timed_out and not record.ok:
                record = _failed(
                    spec,
                    "timeout",
                    f"the run did not finish within {timeout_s:g} s and was killed",
                    run_index,
                )
            records.append(record)
        return records


def _first_problem(records: list[Record]) -> Record:
    """The record that speaks for the group: the rank that failed, not the bystanders stopped for it
    or the ranks whose collective broke because it died (which of them exits first is a race)."""

    def bystander(record: Record) -> bool:
        error = record.error or ""
        return error.startswith(STOPPED) or any(marker in error for marker in PEER_FAILED)

    for status in ("oom", "failed", "timeout"):
        for record in records:
            if record.status == status and not bystander(record):
                return record
    for record in records:
        if not record.ok:
            return record
    return records[0]


@overload
def run_isolated(
    spec: MeasureSpec,
    run_index: int = 0,
    *,
    timeout_s: float = ...,
    python: str = ...,
    env: Mapping[str, str] | None = ...,
) -> RunRecord: ...
@overload
def run_isolated(
    spec: PairedSpec,
    run_index: int = 0,
    *,
    timeout_s: float = ...,
    python: str = ...,
    env: Mapping[str, str] | None = ...,
) -> PairedRecord: ...
def run_isolated(
    spec: Spec,
    run_index: int = 0,
    *,
    timeout_s: float = 600.0,
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
) -> RunRecord | PairedRecord:
    """Measure one run in ``spec.dp`` fresh worker processes on this host (ranks 0..dp-1): one
    configuration (a :class:`MeasureSpec`) or a paired run of two (a :class:`PairedSpec`).

    ``env`` replaces the workers' environment (``None``: inherit this process's).
    """
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ranks = [(r, r) for r in range(spec.dp)]
    return _first_problem(_run_workers(spec, run_index, ranks, init_method, timeout_s, python, env))


@overload
def run_joined(
    spec: MeasureSpec,
    run_index: int = 0,
    *,
    master_addr: str,
    local_rank: int,
    timeout_s: float = ...,
    python: str = ...,
    env: Mapping[str, str] | None = ...,
) -> RunRecord: ...
@overload
def run_joined(
    spec: PairedSpec,
    run_index: int = 0,
    *,
    master_addr: str,
    local_rank: int,
    timeout_s: float = ...,
    python: str = ...,
    env: Mapping[str, str] | None = ...,
) -> PairedRecord: ...
def run_joined(
    spec: Spec,
    run_index: int = 0,
    *,
    master_addr: str,
    local_rank: int,
    timeout_s: float = 600.0,
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
) -> RunRecord | PairedRecord:
    """Under an initialized process group (torchrun): this rank starts its own worker.

    Rank 0 picks a port on ``master_addr`` for the configuration's own group and every rank learns
    it; the records are gathered so that every rank returns the group's record. A collective: all
    ranks call it with the same spec. Pass an ``env`` without torchrun's variables (see
    ``TORCHRUN_VARIABLES``): with ``TORCHELASTIC_USE_AGENT_STORE`` set, the worker's group would
    join the launcher's store instead of its own.
    """
    port = dist.all_gather_objects(free_port() if dist.rank() == 0 else None)[0]
    init_method = f"tcp://{master_addr}:{port}"
    mine = _run_workers(spec, run_index, [(dist.rank(), local_rank)], init_method, timeout_s, python, env)[0]
    parse = PairedRecord.from_dict if isinstance(spec, PairedSpec) else RunRecord.from_dict
    everyone: list[Any] = [parse(d) for d in dist.all_gather_objects(mine.to_dict())]
    return _first_problem(everyone)
