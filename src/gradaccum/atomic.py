"""Files that readers never see half-written: write to a temporary file beside the target, flush it
to disk, and rename it into place (``os.replace`` is atomic on one filesystem).

:func:`atomic_save` also returns the size and SHA-256 of the bytes it wrote, hashed as they are
written; :func:`write_manifest` records such digests for a folder of files, and
:func:`check_manifest` says whether the files on disk still match them. A folder whose manifest is
written last, after every file it lists, is complete exactly when its manifest verifies.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

__all__ = [
    "MANIFEST_FILE",
    "FileDigest",
    "atomic_save",
    "atomic_write",
    "atomic_write_text",
    "check_manifest",
    "file_digest",
    "is_temporary",
    "write_manifest",
]

MANIFEST_FILE = "manifest.json"
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class FileDigest:
    """What a file holds: its size and the SHA-256 of its bytes."""

    bytes: int
    """Size in bytes."""
    sha256: str
    """Hex digest of the content."""


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through it, and remembers the
    operating system's error (``torch.save`` reports a failed write as an unrelated RuntimeError)."""

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.hash = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            written = self.handle.write(view)
        except OSError as exc:
            self.error = exc
            raise
        self.hash.update(view)
        self.size += len(view)
        return written if written is not None else len(view)

    def flush(self) -> None:
        self.handle.flush()

    def digest(self) -> FileDigest:
        return FileDigest(bytes=self.size, sha256=self.hash.hexdigest())


def is_temporary(name: str, target: str) -> bool:
    """Whether ``name`` is a temporary file that :func:`atomic_write` makes for ``target``."""
    return name.startswith(f".{target}.")


def atomic_write(
    path: str | os.PathLike[str], write: Callable[[IO[bytes]], object], *, mode: int = 0o644
) -> FileDigest:
    """Call ``write(handle)`` on a temporary file and rename it to ``path``; on any failure (a full
    disk, an interrupt) the temporary file is removed and ``path`` keeps its previous content.

    Returns the size and SHA-256 of what ``write`` wrote; a file on disk of another size means the
    write did not reach it (checked before the rename). An operating-system error met while writing
    (no space left, a file-size limit) is raised as that ``OSError`` even when the writer wrapped it.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        os.chmod(tmp, mode)  # mkstemp makes it owner-only; records are meant to be read
        with os.fdopen(fd, "wb") as handle:
            writer = _HashingWriter(handle)
            try:
                write(writer)  # type: ignore[arg-type]
                handle.flush()
                os.fsync(handle.fileno())
            except Exception as exc:
                if writer.error is not None and writer.error is not exc:
                    raise writer.error from exc
                raise
        digest = writer.digest()
        on_disk = os.stat(tmp).st_size
        if on_disk != digest.bytes:
            raise OSError(f"{target}: wrote {digest.bytes} bytes but the file holds {on_disk}")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return digest


def atomic_write_text(path: str | os.PathLike[str], text: str) -> FileDigest:
    """``text`` (UTF-8) into ``path``, atomically."""
    return atomic_write(path, lambda handle: handle.write(text.encode("utf-8")))


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> FileDigest:
    """``torch.save(obj)`` into ``path``, atomically; returns the size and SHA-256 written."""
    return atomic_write(path, lambda handle: torch.save(obj, handle))


def file_digest(path: str | os.PathLike[str]) -> FileDigest:
    """Size and SHA-256 of the file at ``path``, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileDigest(bytes=size, sha256=digest.hexdigest())


def write_manifest(folder: str | os.PathLike[str], files: Mapping[str, FileDigest], **meta: Any) -> None:
    """``folder/manifest.json`` listing ``files`` (names relative to ``folder``) with their sizes and
    checksums, and ``meta`` (JSON values). Write it after every file it lists."""
    data = {
        **meta,
        "files": {name: {"bytes": d.bytes, "sha256": d.sha256} for name, d in sorted(files.items())},
    }
    atomic_write_text(Path(folder) / MANIFEST_FILE, json.dumps(data, indent=2, sort_keys=True) + "\n")


def check_manifest(folder: str | os.PathLike[str], *, checksums: bool = True) -> tuple[dict[str, Any], str]:
    """The manifest of ``folder`` and the first problem found (``""`` when every listed file is there
    with its recorded size and, with ``checksums``, its recorded SHA-256)."""
    folder = Path(folder)
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return {}, f"it has no {MANIFEST_FILE} (written last, so the checkpoint was never completed)"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return {}, f"its {MANIFEST_FILE} cannot be read ({exc})"
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not files:
        return {}, f"its {MANIFEST_FILE} lists no files"
    for name, want in sorted(files.items()):
        file = folder / name
        if not isinstance(want, dict) or not {"bytes", "sha256"} <= want.keys():
            return data, f"its {MANIFEST_FILE} entry for {name} has no size and checksum"
        if not file.is_file():
            return data, f"{name} is missing"
        size = file.stat().st_size
        if size != want["bytes"]:
            return data, f"{name} holds {size:,} bytes, the manifest says {want['bytes']:,} (truncated?)"
        if checksums:
            got = file_digest(file).sha256
            if got != want["sha256"]:
                return data, f"{name} does not match its checksum in the manifest (corrupted on disk)"
    return data, ""
