"""``python -m gradaccum.bench.worker``: measure one configuration in a fresh process.

Reads one JSON job on stdin, writes one JSON :class:`RunRecord` as the last line of stdout, and
exits. A fresh process per configuration (and per rank) means one configuration's allocations never
inflate another's peak: the process's peak RSS *is* this configuration's CPU peak. The job::

    {"kind": "measure" | "paired", "spec": {...MeasureSpec or PairedSpec...}, "run_index": 0,
     "rank": 0, "world": 1, "init_method": "tcp://127.0.0.1:29500", "backend": "gloo",
     "pg_timeout_s": 120}

``rank``/``world``/``init_method`` are present only for a data-parallel measurement; every rank's
worker initializes its own process group for this one configuration.
"""

from __future__ import annotations

import json
import sys
import traceback
from datetime import timedelta
from typing import Any, NoReturn

import torch

from gradaccum.bench.measure import measure_paired_safely, measure_safely
from gradaccum.bench.spec import RESULT_PREFIX, MeasureSpec, PairedRecord, PairedSpec, RunRecord
from gradaccum.check.workload import load_workload
from gradaccum.distributed.process_exit import exit_process

__all__ = ["main", "run_job"]


def run_job(job: dict[str, Any]) -> RunRecord | PairedRecord:
    """Set up this process (threads, process group), measure, and tear the group down."""
    paired = job.get("kind") == "paired"
    spec: MeasureSpec | PairedSpec = (
        PairedSpec.from_dict(job["spec"]) if paired else MeasureSpec.from_dict(job["spec"])
    )
    run_index = int(job.get("run_index", 0))
    threads = spec.baseline.threads if isinstance(spec, PairedSpec) else spec.threads
    if threads is not None:
        torch.set_num_threads(threads)
    device = torch.device(spec.device)
    if device.type == "cuda" and device.index is not None:
        # NCCL and all_gather_object work on the current device: one GPU per rank, set before the group
        torch.cuda.set_device(device)
    world = int(job.get("world", 1))
    pg = None
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group(
            job.get("backend", "gloo"),
            init_method=job["init_method"],
            rank=int(job["rank"]),
            world_size=world,
            timeout=timedelta(seconds=float(job.get("pg_timeout_s", 120))),
        )
        pg = dist
    try:
        workload_spec = spec.baseline.workload if isinstance(spec, PairedSpec) else spec.workload
        workload = load_workload(workload_spec)
        if isinstance(spec, PairedSpec):
            return measure_paired_safely(workload, spec, run_index=run_index)
        return measure_safely(workload, spec, fresh_process=True, run_index=run_index)
    finally:
        if pg is not None and pg.is_initialized():
            pg.destroy_process_group()


def _failed(job: dict[str, Any], exc: BaseException) -> RunRecord | PairedRecord:
    tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:]).strip()
    error = f"{type(exc).__name__}: {exc}\n{tail}"
    run_index = int(job.get("run_index", 0))
    if job.get("kind") == "paired":
        return PairedRecord(
            spec=PairedSpec.from_dict(job["spec"]), status="failed", error=error, run_index=run_index
        )
    return RunRecord(
        spec=MeasureSpec.from_dict(job["spec"]), status="failed", error=error, run_index=run_index
    )


def main() -> NoReturn:
    """Run the job on stdin, print its record, exit 0 if it measured (1 if not); a worker that held a
    process group exits without finalization (:mod:`gradaccum.distributed.process_exit`)."""
    job: dict[str, Any] = {}
    try:
        job = json.loads(sys.stdin.read())
        record = run_job(job)
    except Exception as exc:
        if "spec" not in job:
            raise
        record = _failed(job, exc)
    sys.stdout.write(RESULT_PREFIX + json.dumps(record.to_dict()) + "\n")
    sys.stdout.flush()
    exit_process(0 if record.ok else 1, held_process_group=int(job.get("world", 1)) > 1)


if __name__ == "__main__":
    main()
