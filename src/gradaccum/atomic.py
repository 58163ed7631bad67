"""Files that readers never see half-written: write to a temporary file beside the target, flush it
to disk, and rename it into place (``os.replace`` is atomic on one filesystem)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

__all__ = ["atomic_save", "atomic_write", "atomic_write_text"]


def atomic_write(
    path: str | os.PathLike[str], write: Callable[[IO[bytes]], object], *, mode: int = 0o644
) -> None:
    """Call ``write(handle)`` on a temporary file and rename it to ``path``; on any failure (a full
    disk, an interrupt) the temporary file is removed and ``path`` keeps its previous content."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        os.chmod(tmp, mode)  # mkstemp makes it owner-only; records are meant to be read
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """``text`` (UTF-8) into ``path``, atomically."""
    atomic_write(path, lambda handle: handle.write(text.encode("utf-8")))


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj)`` into ``path``, atomically."""
    atomic_write(path, lambda handle: torch.save(obj, handle))
