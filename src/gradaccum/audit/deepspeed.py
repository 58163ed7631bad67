"""DeepSpeed's rows of ``gradaccum audit``: its engine's own accumulation, and gradaccum's
``prepare_accumulator`` on the same engine configuration, on one window.

Each row builds a DeepSpeed engine (ZeRO stage 0, ``gradient_accumulation_steps`` = the window's k,
``gradient_clipping`` 0) around a float32 copy of the model and a recording optimizer, on the device
DeepSpeed's accelerator names:

* **its own accumulation**, as DeepSpeed documents it: ``loss = mean loss of the micro-batch``,
  ``engine.backward(loss)`` (which divides it by ``gradient_accumulation_steps``), ``engine.step()``
  per micro-batch; the optimizer steps on the k-th;
* **gradaccum on the engine**: :func:`gradaccum.integrations.deepspeed.prepare_accumulator`, each
  micro-batch's summed loss over the window's N, the boundary set on the last.

The division is the same at every ZeRO stage (``engine.backward`` scales the loss before any
reduction), so stage 0, whose gradients are whole in ``p.grad``, shows it. Float32: DeepSpeed
0.19.8 reduces no float64 gradient (``split_half_float_double_sparse``), so these rows carry float32
rounding (~1e-7 of the update) where the float64 rows carry ~1e-16.

Both rows run in one child process (forked; spawned where CUDA is initialized): an engine needs
``torch.distributed`` (a one-rank group on an
in-memory store there, with the ``LOCAL_RANK`` DeepSpeed's argument check reads), and DeepSpeed keeps
its process groups and communication backend in module globals for the life of the process. The
caller's process is left with no group, no DeepSpeed state and its environment as it was.
"""

from __future__ import annotations

import copy
import io
import multiprocessing
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from gradaccum.audit.measure import RecordingOptimizer
from gradaccum.batch import Batch, batch_size, cast
from gradaccum.step.accumulator import CountFn, LossFn

__all__ = ["NotRun", "deepspeed_gradients"]

TIMEOUT_S = 600.0
"""How long the child may take: importing DeepSpeed and building its CPU communication op the
first time on a machine (~35 s on 2 cores) and two engines."""


class NotRun(RuntimeError):
    """A DeepSpeed row could not run here; the message says why."""


def _engine(model: nn.Module, optimizer: Any, k: int, rows: int) -> Any:
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": rows,
        "gradient_accumulation_steps": k,
        "gradient_clipping": 0.0,  # 0.19.8 clips at 1.0 by default: the audit compares gradients
        "zero_optimization": {"stage": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _engine_loop(engine: Any, window: list[Batch], loss_fn: LossFn, count_fn: CountFn) -> None:
    for mb in window:
        engine.backward(loss_fn(engine, mb) / count_fn(mb))  # divided by k inside
        engine.step()


def _exact(engine: Any, window: list[Batch], loss_fn: LossFn, count_fn: CountFn) -> None:
    from gradaccum.integrations.deepspeed import prepare_accumulator

    prepare_accumulator(engine).step(window, loss_fn, count_fn)


_LOOPS: dict[str, Callable[[Any, list[Batch], LossFn, CountFn], None]] = {
    "loop": _engine_loop,
    "exact": _exact,
}


def _row(model: nn.Module, micro: Sequence[Batch], loss_fn: LossFn, count_fn: CountFn, loop: str) -> Any:
    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().device_name(0))
    model = copy.deepcopy(model).to(device=device, dtype=torch.float32)
    window = [cast(mb, torch.float32, device) for mb in micro]
    recording = RecordingOptimizer(list(model.parameters()))
    engine = _engine(model, recording, len(window), max(batch_size(mb) for mb in window))
    _LOOPS[loop](engine, window, loss_fn, count_fn)
    if len(recording.received) != 1:
        return f"DeepSpeed stepped the optimizer {len(recording.received)} times in one window"
    return [g.to(device="cpu", dtype=torch.float64) for g in recording.received[0]]


def _child(conn: Any, payload: tuple[Any, ...] | bytes) -> None:
    """Both rows in this process's own one-rank group; each row's gradients or its error text."""
    import logging
    import os

    out: dict[str, Any] = {}
    try:
        # a forked child cannot use the OpenMP thread pool its parent started (GNU OpenMP hangs):
        # one thread runs every op inline, and these are small
        torch.set_num_threads(1)
        devnull = os.open(os.devnull, os.O_WRONLY)  # DeepSpeed's banners would land in the caller's table
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")  # this child's own environment
        import torch.distributed as dist
        from deepspeed.accelerator import get_accelerator
        from deepspeed.utils import logger

        logger.setLevel(logging.ERROR)  # its configuration is logged at INFO on every engine
        backend = get_accelerator().communication_backend_name()
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        model, micro, loss_fn, count_fn = pickle.loads(payload) if isinstance(payload, bytes) else payload
        for loop in _LOOPS:
            try:
                out[loop] = _row(model, micro, loss_fn, count_fn, loop)
            except Exception as exc:  # one row's failure is that row's result
                out[loop] = f"{type(exc).__name__}: {exc}"
        dist.destroy_process_group()
    except Exception as exc:
        out = {loop: f"{type(exc).__name__}: {exc}" for loop in _LOOPS}
    # bytes, not tensors: torch's reductions would send a tensor as a handle into this process's
    # shared memory, gone when it exits
    buffer = io.BytesIO()
    torch.save(out, buffer)
    conn.send_bytes(buffer.getvalue())
    conn.close()


def deepspeed_gradients(
    model: nn.Module, micro: Sequence[Batch], loss_fn: LossFn, count_fn: CountFn
) -> dict[str, list[torch.Tensor] | NotRun]:
    """``{"loop": ..., "exact": ...}``: the gradient each row's engine handed its optimizer (float64
    copies of float32), or why it did not run.

    The child is forked where it can be (it inherits the model and functions as they are); a
    process that has initialized CUDA cannot fork one that uses it, and spawns it instead, which
    needs the model, window and functions to pickle."""
    payload: tuple[Any, ...] | bytes = (model, list(micro), loss_fn, count_fn)
    method = "spawn" if torch.cuda.is_initialized() else "fork"
    if method not in multiprocessing.get_all_start_methods():
        method = "spawn"
    if method == "spawn":
        try:
            payload = pickle.dumps(payload)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            why = NotRun(
                f"DeepSpeed runs in a spawned process here, and the model, window, loss_fn and count_fn "
                f"must pickle to reach it: {exc} (define loss_fn and count_fn at module level)"
            )
            return {loop: why for loop in _LOOPS}
    context: Any = multiprocessing.get_context(method)
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, payload), daemon=True)
    child.start()
    send.close()
    out = None
    try:
        if receive.poll(TIMEOUT_S):
            out = torch.load(io.BytesIO(receive.recv_bytes()), weights_only=True)
    except (EOFError, OSError):  # it died before sending
        pass
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    if out is None:
        why = NotRun(
            f"the DeepSpeed child process returned nothing (exit code {child.exitcode}; "
            f"it may take {TIMEOUT_S:.0f} s)"
        )
        return {loop: why for loop in _LOOPS}
    return {loop: value if isinstance(value, list) else NotRun(value) for loop, value in out.items()}
