"""The Workload contract where a user looks: the workloads page's complete example runs from the
command line, and every field's documentation shows in ``help(gradaccum.Workload)``."""

from __future__ import annotations

import dataclasses
import pydoc
import re
import sys
from pathlib import Path

import pytest

import gradaccum
from gradaccum.cli.main import main
from gradaccum.fielddocs import field_docs

WORKLOADS = Path(__file__).resolve().parents[2] / "docs" / "workloads.md"


def _example() -> str:
    text = WORKLOADS.read_text(encoding="utf-8")
    section = text[text.index("## Your own") : text.index("## From a model folder")]
    start = section.index("A complete workload")
    (code,) = re.findall(r"```python\n(.*?)```", section[start:], flags=re.S)[:1]
    return code


def test_the_workloads_page_example_verifies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "my_workload.py").write_text(_example(), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_workload", raising=False)
    code = main(["verify", "--workload", "my_workload:build", "--sizes", "1,3,4", "--trace-steps", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verify tiny-lm" in out and "tokens counted per micro-batch" in out and "verdict: PASS" in out


def test_help_shows_every_field_of_workload() -> None:
    text = pydoc.render_doc(gradaccum.Workload, renderer=pydoc.plaintext)
    assert "loss_fn(model, micro_batch) returns the loss **summed**" in re.sub(r"\s+", " ", text).replace(
        "``", ""
    )
    for field in dataclasses.fields(gradaccum.Workload):
        assert f"{field.name} (" in text, field.name
        first_words = " ".join(field_docs(gradaccum.Workload)[field.name].split()[:4])
        assert first_words in re.sub(r"\s+", " ", text), field.name
