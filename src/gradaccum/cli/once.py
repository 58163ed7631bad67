"""One error message per torchrun job, not one per rank.

Every rank of a torchrun job runs the same command, so bad input is refused on every rank alike and
a failure the ranks agreed on names the failing rank in every rank's message: printed by each, the
same lines would come once per rank. Rank 0 prints its message and leaves its text in torchrun's
own store (``MASTER_ADDR``/``MASTER_PORT``, as :mod:`gradaccum.cli.train_launch` uses it to find a
lost rank); another rank with a message expected to be the same waits up to :data:`WAIT_S` for that
text and prints its own only when it differs or never came (rank 0 died, or hangs). The wait also
keeps the other ranks alive until rank 0 has printed: torchrun stops every worker as soon as one
exits with an error, and would otherwise cut rank 0 off before its message.

This module imports only the standard library at import time (see :mod:`gradaccum.cli.main`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from datetime import timedelta
from typing import Any

__all__ = ["WAIT_S", "say_once", "torchrun_rank"]

WAIT_S = 10.0
"""How long a rank other than 0 waits for rank 0's message before printing its own."""


def torchrun_rank() -> int:
    """This process's rank when torchrun launched it (``RANK``), else 0."""
    return int(os.environ.get("RANK", "0"))


def say_once(text: str, *, alike: bool) -> None:
    """Print ``text`` on stderr, once per job under torchrun. ``alike``: every rank is expected to
    print the same text (bad input, an agreed failure); otherwise every rank prints its own."""
    rank, world = torchrun_rank(), int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        print(text, file=sys.stderr)
        return
    if rank == 0:
        print(text, file=sys.stderr, flush=True)
        store = _store()
        if store is not None:  # torchrun's store may be gone already: the message is out anyway
            with contextlib.suppress(Exception):
                store.set(_key(), text)
        return
    if alike and _rank_zero_said() == text:
        return
    print(text, file=sys.stderr)


def _key() -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"gradaccum/said/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _store() -> Any:
    """A client of torchrun's store, or None when there is none to reach."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (addr and port):
        return None
    try:
        import torch.distributed as dist

        return dist.TCPStore(
            addr, int(port), is_master=False, timeout=timedelta(seconds=WAIT_S), wait_for_workers=False
        )
    except Exception:  # no store to ask: each rank says what it has
        return None


def _rank_zero_said() -> str | None:
    """Rank 0's message, waited for up to :data:`WAIT_S`; None when it did not come."""
    store = _store()
    if store is None:
        return None
    try:
        store.wait([_key()], timedelta(seconds=WAIT_S))
        return bytes(store.get(_key())).decode()
    except Exception:  # not within the wait: rank 0 stopped before it could say it
        return None
