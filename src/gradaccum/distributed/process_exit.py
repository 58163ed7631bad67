"""How a process that held a ``torch.distributed`` group ends: without interpreter finalization.

torch 2.13's DDP keeps its process group alive after ``destroy_process_group`` (its reducer holds a
reference from C++), so gloo's worker threads outlive ``main``. A worker still releasing the last
collective's work (``AsyncAllgatherWork``, say, from ``all_gather_object``) while Python finalizes
must take the GIL to drop a tensor's Python object; during finalization that ends the thread with
``pthread_exit``, whose forced unwind through C++ calls ``std::terminate``: SIGABRT, "terminate
called without an active exception", exit -6 after a run that finished and wrote everything. It hit
about one two-process ``gradaccum train`` in fifteen on this machine (a core dump shows the stack).
torch's own fix (an ``atexit`` destroy, pytorch#179291) was abandoned, and a barrier before the
destroy only narrows the race. Skipping finalization removes it, and loses nothing: the ``atexit``
handlers still run first (a logger's flush, an experiment tracker's ``finish``), while the
interpreter is whole; the standard streams are flushed; every file is closed by its ``with``.
What is skipped is the teardown of modules and objects, where the race is.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import NoReturn

__all__ = ["exit_process"]


def exit_process(code: int, *, held_process_group: bool) -> NoReturn:
    """End the process with ``code``; when it held a process group, run the ``atexit`` handlers,
    flush stdio and ``os._exit`` (module docstring), else exit normally."""
    if not held_process_group:
        raise SystemExit(code)
    atexit._run_exitfuncs()  # what a normal exit runs first; they report their own errors
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
