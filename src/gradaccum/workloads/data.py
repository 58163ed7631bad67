"""Documents from a local data file: ``.txt`` (one per non-empty line) or ``.jsonl`` (one object
per line, its text in ``text_field``). Every problem is a :class:`WorkloadError` naming the file,
the line and the fix."""

from __future__ import annotations

import json
from pathlib import Path

from gradaccum.errors import WorkloadError

__all__ = ["SUFFIXES", "read_documents"]

SUFFIXES = (".txt", ".jsonl")


def read_documents(path: str | Path, *, text_field: str = "text") -> list[str]:
    """The documents of ``path``, in file order, empty ones left out."""
    file = Path(path)
    if not file.is_file():
        what = "is a folder" if file.is_dir() else "does not exist"
        raise WorkloadError(f"data file {str(file)!r} {what}; --data takes a local .txt or .jsonl file")
    suffix = file.suffix.lower()
    if suffix not in SUFFIXES:
        raise WorkloadError(
            f"data file {str(file)!r} ends in {suffix or 'no suffix'!r}; --data reads .txt (one document "
            "per line) or .jsonl (one JSON object per line, its text in --text-field)"
        )
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"cannot read data file {str(file)!r} as UTF-8 text: {exc}") from exc
    lines = text.splitlines()
    if suffix == ".txt":
        documents = [line.strip() for line in lines if line.strip()]
    else:
        documents = [_jsonl_text(file, number, line, text_field) for number, line in enumerate(lines, 1)]
        documents = [d for d in documents if d]
    if not documents:
        raise WorkloadError(f"data file {str(file)!r} holds no non-empty document")
    return documents


def _jsonl_text(file: Path, number: int, line: str, field: str) -> str:
    if not line.strip():
        return ""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WorkloadError(
            f"{file}:{number} is not valid JSON ({exc.msg}); a .jsonl file holds one object per line"
        ) from None
    if not isinstance(record, dict):
        raise WorkloadError(
            f"{file}:{number} is a JSON {type(record).__name__}, not an object with a {field!r} field"
        )
    if field not in record:
        keys = ", ".join(sorted(record)) or "none"
        raise WorkloadError(
            f"{file}:{number} has no field {field!r} (its fields: {keys}); name the text field with "
            "--text-field"
        )
    value = record[field]
    if not isinstance(value, str):
        kind = type(value).__name__
        article = "an" if kind[:1] in "aeiou" else "a"
        raise WorkloadError(f"{file}:{number}: field {field!r} holds {article} {kind}, not text")
    return value.strip()
