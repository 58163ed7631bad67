"""docs/design/seams.md prints the table tests/seams/table.py lists, with its counts."""

from __future__ import annotations

from pathlib import Path

from tests.seams.table import FEATURES, INPUTS, cells, counts, render

ROOT = Path(__file__).resolve().parents[2]


def test_the_design_record_prints_the_generated_table() -> None:
    text = (ROOT / "docs/design/seams.md").read_text()
    between = text.split("<!-- seams:begin -->\n", 1)[1].split("\n<!-- seams:end -->", 1)[0]
    assert between == render(cells())


def test_every_pair_and_every_input_is_one_cell() -> None:
    table = cells()
    n = len(FEATURES)
    assert len(table) == n * (n + 1) // 2 + n * len(INPUTS)
    assert len({(c.row, c.col) for c in table}) == len(table)
    assert sum(counts(table).values()) == len(table)
    for cell in table:
        assert cell.outcome in ("exact", "refused", "n/a", "open")
        assert (cell.outcome == "exact") == (cell.note == ""), cell


def test_every_refusal_is_listed_in_the_user_docs() -> None:
    docs = (ROOT / "docs/troubleshooting.md").read_text()
    for cell in cells():
        if cell.outcome == "refused":
            error, setting = cell.note.split(": ", 1)
            assert f"`{error}`" in docs and f"`{setting.split(' ')[0]}" in docs, cell
