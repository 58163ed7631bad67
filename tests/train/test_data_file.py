"""A data file's lines that give no document (blank, or a ``.jsonl`` object with empty text) are
counted and named (:class:`gradaccum.workloads.data.DataFile`), so that nothing is dropped unsaid."""

from __future__ import annotations

import json
from pathlib import Path

from gradaccum.workloads.data import read_data_file, read_documents


def test_blank_and_empty_lines_are_counted_and_named(tmp_path: Path) -> None:
    lines = [json.dumps({"text": t}) for t in ("a b", "c", "", "d e f")]
    lines[2] = json.dumps({"text": "  "})  # line 3: empty text
    lines.insert(1, "")  # line 2: blank
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    data = read_data_file(path)
    assert (data.documents, data.lines, data.skipped) == (["a b", "c", "d e f"], 5, (2, 4))
    assert data.documents == read_documents(path)
    summary = data.summary(untokenized=1)
    assert summary["summary"] == (
        "data: docs.jsonl, 3 documents from 5 lines; skipped 2 lines with no text (lines 2, 4); left out 1 "
        "document the tokenizer turns into no tokens"
    )
    assert (summary["documents"], summary["skipped_lines"]) == (2, [2, 4])


def test_a_file_without_gaps_says_none_skipped_and_many_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "docs.txt"
    path.write_text("one\ntwo\n", encoding="utf-8")
    assert (
        read_data_file(path).summary()["summary"] == "data: docs.txt, 2 documents from 2 lines, none skipped"
    )
    path.write_text("x\n" + "\n" * 7 + "y\n", encoding="utf-8")
    assert read_data_file(path).summary()["summary"] == (
        "data: docs.txt, 2 documents from 9 lines; skipped 7 lines with no text "
        "(lines 2, 3, 4, 5, 6 and 2 more)"
    )
