"""Documents from a local data file: ``.txt`` (one per non-empty line) or ``.jsonl`` (one object
per line, its text in ``text_field``). Every problem is a :class:`WorkloadError` naming the file,
the line and the fix."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradaccum.errors import WorkloadError

__all__ = ["SUFFIXES", "DataFile", "read_data_file", "read_documents"]

SUFFIXES = (".txt", ".jsonl")
_SHOWN_LINES = 5
"""Skipped lines named by number in the summary; the rest are counted."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataFile:
    """A data file's documents, and the lines that gave none (so nothing is dropped unsaid)."""

    name: str
    """The file's name."""
    documents: list[str]
    """The documents, in file order."""
    lines: int
    """Lines in the file."""
    skipped: tuple[int, ...]
    """The numbers (from 1) of the lines skipped: blank, or a ``.jsonl`` object with empty text."""

    def summary(self, untokenized: int = 0) -> dict[str, Any]:
        """The file in figures and one line of words (``summary``), JSON values only; ``untokenized``:
        documents the tokenizer turned into no tokens (left out as well)."""
        documents, lines = count_of(len(self.documents), "document"), count_of(self.lines, "line")
        words = f"data: {self.name}, {documents} from {lines}"
        skipped = len(self.skipped)
        if skipped:
            shown = ", ".join(map(str, self.skipped[:_SHOWN_LINES]))
            more = f" and {skipped - _SHOWN_LINES:,} more" if skipped > _SHOWN_LINES else ""
            which = "line" if skipped == 1 else "lines"
            words += f"; skipped {count_of(skipped, 'line')} with no text ({which} {shown}{more})"
        if untokenized:
            words += f"; left out {count_of(untokenized, 'document')} the tokenizer turns into no tokens"
        if not self.skipped and not untokenized:
            words += ", none skipped"
        return {
            "file": self.name,
            "lines": self.lines,
            "documents": len(self.documents) - untokenized,
            "skipped_lines": list(self.skipped),
            "untokenized_documents": untokenized,
            "summary": words,
        }


def count_of(n: int, word: str) -> str:
    return f"{n:,} {word if n == 1 else word + 's'}"


def read_documents(path: str | Path, *, text_field: str = "text") -> list[str]:
    """The documents of ``path``, in file order, empty ones left out."""
    return read_data_file(path, text_field=text_field).documents


def read_data_file(path: str | Path, *, text_field: str = "text") -> DataFile:
    """The documents of ``path``, in file order, and the numbers of the lines left out (blank, or
    an object whose text is empty)."""
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
        texts = [line.strip() for line in lines]
    else:
        texts = [_jsonl_text(file, number, line, text_field) for number, line in enumerate(lines, 1)]
    documents = [d for d in texts if d]
    if not documents:
        raise WorkloadError(f"data file {str(file)!r} holds no non-empty document")
    skipped = tuple(number for number, d in enumerate(texts, 1) if not d)
    return DataFile(name=file.name, documents=documents, lines=len(lines), skipped=skipped)


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
